"""Each core trainer for a few steps on a CUDA device, in bf16: the GPU paths the CPU tests reach only by reading.

    python scripts/gpu_check.py --model DIR --out gpu_check.json              # a CUDA machine
    python scripts/gpu_check.py --model DIR --random-init --out gpu_check.json  # DIR holds only config + tokenizer
    python scripts/gpu_check.py --model DIR --random-init --tiny --device cpu   # tries the script itself on a CPU

Not part of the test suite: CI has no GPU. Every check runs in its own process with a time limit, so one that
hangs or crashes is reported and the others still run. A check passes only on what it measured:

- numerics: `chunked_token_logps` on the GPU (bf16 hidden states, fp32 LM head) against the same on the CPU in
  fp32, values and gradients; `group_advantages` on GPU tensors equals the CPU result.
- attention: `toolkit_varlen`'s padded path (what a GPU runs) against its per-segment loop on the GPU, for packed
  examples and the shared-prompt layout, grouped-query heads, in float32 and bfloat16: outputs and gradients.
- generation: our TransformersBackend's greedy tokens equal `model.generate`'s greedy tokens on the GPU (fp32).
- sft, dpo, ppo, grpo, async_grpo, grpo_lora: a few optimizer steps with bf16=True; every logged loss finite,
  the trained weights on the GPU and changed, the models a trainer builds for itself (reference, critic) on the
  GPU too; SFT's loss falls over its steps.
- sft_resume: 4 steps straight against 2 steps, a checkpoint, and a resumed run to step 4: the largest weight
  difference is printed, and passes under 1e-3 (a GPU's kernels need not be bitwise deterministic).
- decode: the decode loop checking the host every step against every 8 (the GPU default): the same greedy ids;
  seconds of each. Then the static decoder (static_decode: CUDA graphs) against the loop keeping every row: the
  same ids in float32, and the seconds of each in float32 and bfloat16.
- gpu_defaults: configs left unset resolve to bf16 and TF32 on a bf16 card; a trainer logs the one start-up line,
  activation checkpointing chosen by the memory model.
- memory_model: SFT and GRPO steps, `torch.cuda.max_memory_allocated` over step 2 against the memory model's
  estimate for the same shapes (within 15%; the ratio is printed).
- async_grpo also reports the device its rollout worker decoded on.

Results carry the commit that ran: `git rev-parse HEAD` where the tree is a checkout, else $TOOLKIT_COMMIT (a
copied tree without .git: set it when starting the run), else "unknown".

`--random-init` builds the model from DIR's config with random weights (seed 0): a machine that cannot carry the
checkpoint can still run every path, but learning is then only "the loss falls", not "the task is learned".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHECKS = ("numerics", "attention", "generation", "decode", "gpu_defaults", "memory_model", "sft", "sft_resume", "dpo",
          "ppo", "grpo", "grpo_lora", "async_grpo")


def build_model_dir(model: str, random_init: bool, tiny: bool) -> str:
    if not random_init:
        return model
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = f"/tmp/gpu-check-model{'-tiny' if tiny else ''}"
    if not os.path.exists(os.path.join(out, "config.json")):
        config = AutoConfig.from_pretrained(model)
        if tiny:  # for trying the script on a CPU: the same architecture and vocabulary, two small layers
            config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16))
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
        AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


def length_reward(prompts, completions, completion_ids=None, **kw):
    """Varies within a group whatever a random model writes: the completion's length in characters, mod 7."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t) % 7) for t in texts]


def _common(device: str, out: str, steps: int) -> dict:
    return dict(output_dir=out, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none", seed=0,
                disable_tqdm=True, bf16=device == "cuda", use_cpu=device == "cpu")


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _snapshot(model) -> dict:
    return {n: p.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def _trained(trainer, before: dict, device: str) -> dict:
    """Where the weights are and how far they moved; raises if they are not on `device` or did not move."""
    params = dict(trainer.model.named_parameters())
    devices = sorted({p.device.type for p in params.values()})
    moved = max((params[n].detach().float().cpu() - b).abs().max().item() for n, b in before.items())
    losses = _losses(trainer)
    if devices != [device]:
        raise AssertionError(f"trained weights on {devices}, expected [{device!r}]")
    if not losses or not all(math.isfinite(x) for x in losses):
        raise AssertionError(f"losses not all finite: {losses}")
    if not moved > 0:
        raise AssertionError("no trained weight changed")
    return {"losses": losses, "max_weight_change": moved, "param_devices": devices}


def _peak(device: str) -> dict:
    import torch

    return {"peak_gpu_mb": round(torch.cuda.max_memory_allocated() / 2**20)} if device == "cuda" else {}


def check(name: str, path: str, device: str, out: str) -> dict:
    import torch

    from toolkit.core.tasks import arithmetic

    torch.manual_seed(0)
    if name == "numerics":
        from toolkit.core.numerics import chunked_token_logps, group_advantages

        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(300, 64, generator=g)
        weight = torch.randn(1000, 64, generator=g) * 0.1
        targets = torch.randint(0, 1000, (300,), generator=g)
        results = {}
        for key, dev, dtype in (("ref", "cpu", torch.float32), ("dev", device, torch.bfloat16)):
            h = hidden.to(dev, dtype).requires_grad_(True)
            w = weight.to(dev).clone().requires_grad_(True)
            lp = chunked_token_logps(h, w, targets.to(dev), chunk_size=128)
            lp.sum().backward()
            results[key] = (lp.detach().float().cpu().clone(), w.grad.float().cpu().clone())
        (lp_c, gw_c), (lp_d, gw_d) = results["ref"], results["dev"]
        # bf16 rounds the hidden states (8 bits of mantissa); the fp32 head keeps the error at that rounding's size
        lp_err = (lp_c - lp_d).abs().max().item()
        grad_err = ((gw_c - gw_d).norm() / gw_c.norm()).item()
        rewards = torch.randn(32, generator=g)
        a_cpu = group_advantages(rewards, 8)[0]
        a_dev = group_advantages(rewards.to(device), 8)[0].cpu()
        adv_err = (a_cpu - a_dev).abs().max().item()
        if not (lp_err < 0.1 and grad_err < 0.02 and adv_err < 1e-5):
            raise AssertionError(f"GPU numerics off: logp {lp_err}, head grad rel {grad_err}, advantages {adv_err}")
        return {"logp_max_abs_err_bf16_vs_fp32": lp_err, "head_grad_rel_err": grad_err, "advantage_max_err": adv_err}

    if name == "attention":
        from toolkit.core import attention

        g = torch.Generator().manual_seed(0)
        lengths = [1, 3, 40, 2, 90, 7, 7, 1, 300, 5, attention._ALONE_KEYS + 1]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        groups, pos = [], 6
        for prompt, completions in ((9, (1, 30, 4, 200)), (3, (7, attention._ALONE_KEYS, 2))):
            p0, pos = pos, pos + prompt
            spans = [(pos + sum(completions[:i]), pos + sum(completions[:i + 1])) for i in range(len(completions))]
            pos += sum(completions)
            groups.append((p0, p0 + prompt, spans))
        layouts = {"packed_examples": ({"cu_seq_lens_q": cu.to(device)}, int(cu[-1])),
                   "shared_prompt": ({"toolkit_shared_prefix": groups, "toolkit_shared_context": (0, 6)}, pos)}
        errors = {}
        for layout, (kwargs, T) in layouts.items():
            for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
                base = [torch.randn(1, h, T, 64, generator=g).to(device, dtype) for h in (8, 2, 2)]
                weights = torch.randn(1, T, 8, 64, generator=g).to(device, dtype)
                results = []
                for padded in (False, True):
                    attention._batched_segments = lambda t, padded=padded: padded
                    q, k, v = (t.clone().requires_grad_(True) for t in base)
                    out, _ = attention.varlen_sdpa(None, q, k, v, None, **kwargs)
                    (out.float() * weights.float()).sum().backward()
                    results.append([x.detach().float().cpu() for x in (out, q.grad, k.grad, v.grad)])
                err = max(((a - b).abs().max() / (b.abs().max() + 1e-6)).item() for a, b in zip(*results))
                if not (err < tol and all(torch.isfinite(x).all() for x in results[1])):
                    raise AssertionError(f"{layout} {dtype}: padded path off the loop by {err} (relative)")
                errors[f"{layout}_{str(dtype).split('.')[-1]}"] = err
        return {"max_relative_err_padded_vs_loop": errors}

    if name == "generation":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from toolkit.core.generation import SamplingParams, TransformersBackend

        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
        prompts = [tok(r["prompt"][0]["content"])["input_ids"] for r in arithmetic(6, seed=1, kind="prompt_only")]
        backend = TransformersBackend(model, pad_token_id=tok.pad_token_id or 0)
        ours = [g[0] for g in backend.generate(prompts, SamplingParams(max_tokens=12, top_k=1), n=1, seed=0)]
        ours = [list(o.token_ids) for o in ours]
        theirs = []
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 pad_token_id=tok.pad_token_id or 0)
            theirs.append(gen[0, len(p):].tolist())
        same = sum(a == b[:len(a)] for a, b in zip(ours, theirs))
        if same != len(prompts):
            raise AssertionError(f"greedy tokens differ from model.generate on {len(prompts) - same} of "
                                 f"{len(prompts)} prompts: {ours} vs {theirs}")
        return {"prompts_equal": same}

    if name == "decode":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from toolkit.core.generation import SamplingParams, TransformersBackend

        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
        prompts = [tok(r["prompt"][0]["content"])["input_ids"] for r in arithmetic(16, seed=2, kind="prompt_only")]
        params = SamplingParams(max_tokens=64, top_k=1, stop_token_ids=(tok.eos_token_id,))
        out, seconds = {}, {}
        for every in (1, None):  # None: the device's default (8 on a GPU)
            backend = TransformersBackend(model, pad_token_id=tok.pad_token_id or 0)
            backend.host_check_every = every
            backend.generate(prompts, params, n=4, seed=0)  # warm-up
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            groups = backend.generate(prompts, params, n=4, seed=0)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds[str(every)] = round(time.perf_counter() - t, 3)
            out[str(every)] = [[c.token_ids for c in g] for g in groups]
        if out["1"] != out["None"]:
            raise AssertionError("decoding ids differ between checking every step and every 8")
        # the static decoder (a CUDA graph per batch) against the loop with every row kept, as the static one keeps
        # them: in float32 the ids must be equal; in bfloat16 the seconds are compared (a longer, masked key axis
        # may round a near-tie the other way, so the share of equal completions is printed, not required)
        static: dict[str, object] = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = model.to(dtype)
            ids, secs = {}, {}
            for mode in ("loop", "static"):
                backend = TransformersBackend(model, pad_token_id=tok.pad_token_id or 0, static_decode=mode == "static")
                backend._compact_finished_rows = False
                backend.generate(prompts, params, n=4, seed=0)  # warm-up (and the first capture)
                if device == "cuda":
                    torch.cuda.synchronize()
                t = time.perf_counter()
                ids[mode] = [[c.token_ids for c in g] for g in backend.generate(prompts, params, n=4, seed=0)]
                if device == "cuda":
                    torch.cuda.synchronize()
                secs[mode] = round(time.perf_counter() - t, 3)
            equal = sum(a == b for ga, gb in zip(ids["loop"], ids["static"]) for a, b in zip(ga, gb))
            name_ = str(dtype).removeprefix("torch.")
            static[f"{name_}_equal_completions"] = f"{equal}/{4 * len(prompts)}"
            static[f"{name_}_seconds_loop_kept_rows"], static[f"{name_}_seconds_static"] = secs["loop"], secs["static"]
            if dtype == torch.float32 and equal != 4 * len(prompts):
                raise AssertionError(f"static decoding ids differ from the loop's in float32: {static}")
        return {"seconds_check_every_step": seconds["1"], "seconds_check_default": seconds["None"],
                "tokens": sum(len(c) for g in out["1"] for c in g), "static_decode": static}

    if name == "gpu_defaults":
        import logging

        from toolkit import GRPOConfig, SFTConfig, SFTTrainer

        g = GRPOConfig(output_dir=f"{out}/defaults", report_to="none")
        cfg = SFTConfig(output_dir=f"{out}/defaults", report_to="none", max_steps=1)
        if device == "cuda" and torch.cuda.is_bf16_supported() and not (g.bf16 and cfg.bf16):
            raise AssertionError(f"bf16 left off on a bf16 card: GRPO {g.bf16}, SFT {cfg.bf16}")
        lines: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("toolkit").addHandler(handler)
        logging.getLogger("toolkit").setLevel(logging.INFO)
        SFTTrainer(path, cfg, train_dataset=arithmetic(16, seed=0))
        line = next((ln for ln in lines if ln.startswith("GPU defaults")), None)
        if device == "cuda" and (line is None or "memory model" not in line):
            raise AssertionError(f"no start-up line naming the memory model's choice: {lines[-5:]}")
        return {"grpo_bf16": g.bf16, "sft_bf16": cfg.bf16, "tf32": cfg.tf32, "start_up_line": line,
                "sft_checkpointing": cfg.activation_checkpointing}

    if name == "memory_model":
        from toolkit import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
        from toolkit.core.memory import PeakTensorMemoryCallback, estimate_step_memory

        ratios = {}
        for kind in ("sft", "grpo"):
            shapes: dict = {}
            meter = PeakTensorMemoryCallback(step=2)
            base = {**_common(device, f"{out}/mem-{kind}", 2), "learning_rate": 1e-5}
            if kind == "sft":
                class Rec(SFTTrainer):
                    def compute_loss(self, model, inputs, **kw):
                        if model.training and self.state.global_step == 1:
                            shapes["tokens"] = int(inputs["input_ids"].numel())
                            shapes["scored"] = int((inputs["labels"][:, 1:] != -100).sum())  # loss tokens
                        return super().compute_loss(model, inputs, **kw)

                cfg = SFTConfig(**base, per_device_train_batch_size=16, activation_checkpointing=False)
                t = Rec(path, cfg, train_dataset=arithmetic(64, seed=0), callbacks=[meter])
            else:
                class Rec(GRPOTrainer):
                    def compute_loss(self, model, inputs, **kw):
                        if model.training and self.state.global_step == 1:
                            shapes.update(tokens=int(inputs["input_ids"].numel()),
                                          scored=int(inputs["completion_mask"].sum()))
                        return super().compute_loss(model, inputs, **kw)

                cfg = GRPOConfig(**base, per_device_train_batch_size=32, num_generations=8, max_completion_length=64,
                                 beta=0.0, activation_checkpointing=False, zero_variance_filter=False,
                                 skip_steps_without_signal=False)
                t = Rec(path, [length_reward], cfg, train_dataset=arithmetic(64, seed=0, kind="prompt_only"),
                        callbacks=[meter])
            t.train()
            kw = ({"batch_size": 1, "seq_len": shapes["tokens"], "loss_tokens": shapes["scored"]} if kind == "sft" else
                  {"batch_size": 32, "num_generations": 8, "completion_len": round(shapes["scored"] / 32),
                   "prompt_len": round((shapes["tokens"] - shapes["scored"]) / 4)})
            est = estimate_step_memory(path, kind, bf16=bool(cfg.bf16), **kw)
            ratios[kind] = {"measured_mb": round(meter.peak_bytes / 2**20), "estimated_mb": round(est.peak / 2**20),
                            "ratio": est.peak / meter.peak_bytes}
            del t
            if device == "cuda":
                torch.cuda.empty_cache()
        off = {k: v["ratio"] for k, v in ratios.items() if not 0.85 <= v["ratio"] <= 1.15}
        if off:
            raise AssertionError(f"memory model off by more than 15%: {ratios}")
        return ratios

    if name in ("sft", "sft_resume"):
        from toolkit import SFTConfig, SFTTrainer

        rows = arithmetic(64, seed=0)

        def sft(steps, out_dir, resume=None, save=False):
            cfg = SFTConfig(**{**_common(device, out_dir, steps), "learning_rate": 5e-4, "lr_scheduler_type": "constant",
                               "per_device_train_batch_size": 8,
                               **({"save_strategy": "steps", "save_steps": 2} if save else {})})
            t = SFTTrainer(path, cfg, train_dataset=rows)
            before = _snapshot(t.model)
            t.train(resume_from_checkpoint=resume)
            return t, before

        if name == "sft":
            t, before = sft(8, f"{out}/sft")
            info = _trained(t, before, device)
            first, last = info["losses"][0], sum(info["losses"][-2:]) / 2
            if not last < first:
                raise AssertionError(f"SFT loss did not fall: {info['losses']}")
            return {**info, **_peak(device)}
        straight, _ = sft(4, f"{out}/sft-straight")
        sft(2, f"{out}/sft-resumed", save=True)
        resumed, _ = sft(4, f"{out}/sft-resumed", resume=f"{out}/sft-resumed/checkpoint-2", save=True)
        a, b = _snapshot(straight.model), _snapshot(resumed.model)
        diff = max((a[n] - b[n]).abs().max().item() for n in a)
        if not diff < 1e-3:
            raise AssertionError(f"resumed run differs from the straight one by {diff}")
        return {"max_weight_diff_resumed_vs_straight": diff, "bitwise_equal": diff == 0.0,
                "losses_straight": _losses(straight), "losses_resumed": _losses(resumed)}

    if name == "dpo":
        from toolkit import DPOConfig, DPOTrainer

        cfg = DPOConfig(**{**_common(device, f"{out}/dpo", 4), "learning_rate": 1e-5, "per_device_train_batch_size": 8})
        t = DPOTrainer(path, args=cfg, train_dataset=arithmetic(64, seed=0, kind="preference"))
        before = _snapshot(t.model)
        t.train()
        ref = getattr(t, "ref_model", None)
        ref_dev = sorted({p.device.type for p in ref.parameters()}) if ref is not None else "adapter-free policy"
        return {**_trained(t, before, device), "ref_devices": ref_dev, **_peak(device)}

    rows = arithmetic(64, seed=0, kind="prompt_only")
    if name == "ppo":
        from toolkit import PPOConfig, PPOTrainer

        cfg = PPOConfig(**{**_common(device, f"{out}/ppo", 3), "learning_rate": 1e-5, "per_device_train_batch_size": 8,
                           "max_completion_length": 24})
        t = PPOTrainer(path, [length_reward], cfg, train_dataset=rows)
        before = _snapshot(t.model)
        t.train()
        info = _trained(t, before, device)
        critic_dev = sorted({p.device.type for p in t.critic.parameters()})
        if critic_dev != [device]:
            raise AssertionError(f"critic on {critic_dev}")
        return {**info, "critic_devices": critic_dev, **_peak(device)}

    if name in ("grpo", "grpo_lora", "async_grpo"):
        from toolkit import AsyncGRPOConfig, AsyncGRPOTrainer, GRPOConfig, GRPOTrainer

        kw = dict(learning_rate=1e-5, per_device_train_batch_size=32, num_generations=4, max_completion_length=24,
                  beta=0.0, generation_backend_kwargs={"dtype": "bfloat16"} if device == "cuda" else {})
        peft_config = None
        if name == "grpo_lora":
            from peft import LoraConfig

            peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
            kw["learning_rate"] = 1e-3
        if name == "async_grpo":
            cfg = AsyncGRPOConfig(**{**_common(device, f"{out}/{name}", 3), **kw, "max_staleness": 1,
                                     "worker_threads": 4})
            t = AsyncGRPOTrainer(path, [length_reward], cfg, train_dataset=rows)
        else:
            cfg = GRPOConfig(**{**_common(device, f"{out}/{name}", 3), **kw})
            t = GRPOTrainer(path, [length_reward], cfg, train_dataset=rows, peft_config=peft_config)
        before = _snapshot(t.model)
        t.train()
        worker = {"worker_device": t.worker_device} if name == "async_grpo" else {}
        return {**_trained(t, before, device), **_peak(device), **worker}
    raise ValueError(f"unknown check {name!r}")


def commit() -> str:
    """The commit that is running: git's, else $TOOLKIT_COMMIT (a copied tree has no .git), else 'unknown'."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.strip()
    except OSError:
        pass
    return os.environ.get("TOOLKIT_COMMIT", "unknown")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--random-init", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="shrink the random model (only for trying the script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default=",".join(CHECKS))
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per check")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--workdir", default="/tmp/gpu-check")
    args = ap.parse_args()
    if args.worker:
        result = check(args.worker, args.model, args.device, args.workdir)
        print("RESULT " + json.dumps(result), flush=True)
        return
    import torch

    path = build_model_dir(args.model, args.random_init, args.tiny)
    env = {"device": args.device, "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
           "model": args.model, "random_init": args.random_init, "tiny": args.tiny, "commit": commit()}
    print(json.dumps(env), flush=True)
    results = {}
    for name in args.only.split(","):
        started = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--model", path, "--device", args.device, "--worker", name,
               "--workdir", args.workdir]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                  env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode == 0 and line:
                r = {"status": "passed", **json.loads(line[7:])}
            else:
                r = {"status": "failed", "error": (proc.stderr or proc.stdout)[-2500:]}
        except subprocess.TimeoutExpired:
            r = {"status": "timed out", "error": f"no result within {args.timeout:.0f} s"}
        except Exception:  # the harness itself: report, go on with the next check
            r = {"status": "failed", "error": traceback.format_exc()[-2500:]}
        r["seconds"] = round(time.perf_counter() - started, 1)
        results[name] = r
        summary = {k: v for k, v in r.items() if k not in ("error", "losses", "losses_straight", "losses_resumed")}
        print(f"{name}: {json.dumps(summary)}", flush=True)
        if r["status"] != "passed":
            print(r["error"], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"environment": env, "checks": results}, f, indent=2)
    failed = [n for n, r in results.items() if r["status"] != "passed"]
    print(f"{len(results) - len(failed)} of {len(results)} checks passed" + (f"; not: {failed}" if failed else ""))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
