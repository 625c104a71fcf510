"""Benchmark: peak *tensor* memory of one training step, ours against TRL, GRPO / SFT / DPO / PPO, both in bf16.

    python bench/memory_vs_trl.py                     # SmolLM2-135M and a random 0.5B-class model: ~30 min
    python bench/memory_vs_trl.py --models smollm2    # the embedded model only: ~8 min
    python bench/memory_vs_trl.py --device cuda --models smollm2 --trainers grpo,sft,dpo   # on a GPU

The number a GPU user needs is the peak of live tensor bytes in a step (what `torch.cuda.max_memory_allocated`
reports), not a process's RSS. It is measured here on CPU with `toolkit.core.memory.PeakAllocatorMemory`: torch's
CPU allocator keeps a running total of the bytes it hands out while the profiler records memory; the peak of that
total over the window, plus the tensors alive when the window opens (weights, optimizer state, a reference
model), is the step's peak. The window is optimizer step 2 (from the end of step 1 to the end of step 2: batch
preparation — generation for GRPO and PPO —, forward, backward and the optimizer step), so Adam's state exists
and the number is the steady state. Step 3 runs unprofiled: its seconds are the speed ratio printed beside (one
step, one run: a rough figure; the speed benchmarks are bench/*_vs_trl.py). Beside ours, the memory model's
estimate for the same step's shapes (`toolkit.core.memory.estimate_step_memory`, fake tensors, nothing allocated).

Both sides in bf16 mixed precision (`bf16=True`: TRL's default; float32 weights and optimizer, bf16 autocast),
each at its defaults otherwise (TRL turns activation checkpointing on in its SFT/GRPO configs; ours chooses per
trainer), at equal work: the same rows through forward and backward (ours with the GRPO filters off, like
bench/grpo_vs_trl.py), the same batch sizes, lengths, learning rate and loss family.

Models: the embedded SmolLM2-135M-Instruct, and a randomly initialised 0.5B-class Llama config (SmolLM2's
tokenizer, hidden 1024, 24 layers, 16 heads / 4 KV heads, MLP 4096: 0.43B parameters) built offline into /tmp.
PPO runs on the 135M model only: TRL's PPO holds a separate value model with its own gradients and Adam state, and
at 0.43B its step does not fit beside ours in this machine's 24 GB.

`grpo-checkpointing` is ours with activation checkpointing on (TRL's GRPO default; ours leaves it off for
micro-batches this short, trading memory for speed), against the same TRL run.

Targets (issue 56): GRPO <= 0.6x TRL's peak tensor memory, SFT / DPO / PPO <= 0.8x.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, run_in_subprocess, step_timer  # noqa: E402

RANDOM_DIR = "/tmp/toolkit-bench-random-0.5b"
MODELS = ("smollm2", "random-0.5b")
TRAINERS = ("grpo", "grpo-checkpointing", "sft", "dpo", "ppo")
TARGET = {"grpo": 0.6, "grpo-checkpointing": 0.6, "sft": 0.8, "dpo": 0.8, "ppo": 0.8}
# per model: the work of one step (smaller for the 0.5B model so that a step takes a minute, not ten)
SIZES = {
    "smollm2": dict(grpo_prompts=4, grpo_gens=8, grpo_len=32, sft_batch=4, sft_len=512, dpo_batch=4, dpo_len=512,
                    ppo_rollout=16),
    "random-0.5b": dict(grpo_prompts=2, grpo_gens=8, grpo_len=32, sft_batch=2, sft_len=512, dpo_batch=2,
                        dpo_len=512, ppo_rollout=8),
}


def build_random_model(path: str = RANDOM_DIR) -> str:
    """A 0.43B-parameter Llama with random weights and SmolLM2's tokenizer, saved once (no download)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from toolkit import embedded_model_path

    tok = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                      num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    tmp = path + ".partial"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def _words(rng, k: int) -> str:
    words = ("the model learns to prefer the better answer while the reference keeps it close to where it started "
             "and long answers make the vocabulary projection expensive").split()
    return " ".join(rng.choice(words) for _ in range(k))


def worker(spec: str) -> dict:
    import random

    import torch

    from toolkit import embedded_model_path
    from toolkit.core.memory import PeakTensorMemoryCallback

    trainer_kind, side, model_name = spec.split(":")
    checkpointing = trainer_kind.endswith("-checkpointing")  # ours with TRL's setting (activation checkpointing on)
    trainer_kind = trainer_kind.removesuffix("-checkpointing")
    shapes: dict = {}
    torch.manual_seed(0)
    path = str(embedded_model_path()) if model_name == "smollm2" else build_random_model()
    z = SIZES[model_name]
    rng = random.Random(0)
    meter, timer = PeakTensorMemoryCallback(step=2), step_timer()
    on_cpu = os.environ.get("MEMORY_BENCH_DEVICE", "cpu") == "cpu"
    common = dict(output_dir=f"/tmp/bench-mem-{spec.replace(':', '-')}", max_steps=3, logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, disable_tqdm=True, bf16=True, use_cpu=on_cpu)
    f32 = {"dtype": torch.float32}  # both load float32 master weights (TRL's default; bf16 is the autocast)
    ours = side == "toolkit"
    if trainer_kind == "grpo":
        from toolkit.core.rewards import numeric_match
        from toolkit.core.tasks import arithmetic

        rows = arithmetic(64, seed=0, max_value=20, max_terms=2, kind="prompt_only")
        g = dict(**common, learning_rate=1e-5, per_device_train_batch_size=z["grpo_prompts"] * z["grpo_gens"],
                 num_generations=z["grpo_gens"], max_completion_length=z["grpo_len"], temperature=0.7, beta=0.0,
                 loss_type="dapo")
        if ours:
            from toolkit import GRPOConfig, GRPOTrainer

            class Recording(GRPOTrainer):  # the measured step's shapes, for the memory model's estimate
                def compute_loss(self, model, inputs, **kw):
                    if model.training and self.state.global_step == 1:
                        shapes.update(tokens=int(inputs["input_ids"].numel()),
                                      scored=int(inputs["completion_mask"].sum()))
                    return super().compute_loss(model, inputs, **kw)

            extra = {"activation_checkpointing": True} if checkpointing else {}
            trainer = Recording(path, [numeric_match], GRPOConfig(**g, zero_variance_filter=False,
                                                                   skip_steps_without_signal=False, **extra),
                                train_dataset=rows, callbacks=[meter, timer])
        else:
            from datasets import Dataset
            from trl import GRPOConfig as C
            from trl import GRPOTrainer as T

            def reward(prompts, completions, completion_ids=None, **kw):
                return numeric_match(prompts, completions, completion_ids, answer=kw["answer"])

            trainer = T(model=path, reward_funcs=reward, args=C(**g, model_init_kwargs=f32),
                        train_dataset=Dataset.from_list(rows), callbacks=[meter, timer])
        rows_per_step = z["grpo_prompts"] * z["grpo_gens"]
    elif trainer_kind == "sft":
        rows = [{"text": _words(rng, rng.randint(z["sft_len"] // 3, z["sft_len"] * 3 // 4))} for _ in range(32)]
        s = dict(**common, learning_rate=1e-5, per_device_train_batch_size=z["sft_batch"], max_length=z["sft_len"])
        if ours:
            from toolkit import SFTConfig, SFTTrainer

            class Recording(SFTTrainer):
                def compute_loss(self, model, inputs, **kw):
                    if model.training and self.state.global_step == 1:
                        shapes.update(tokens=int(inputs["input_ids"].numel()))
                    return super().compute_loss(model, inputs, **kw)

            trainer = Recording(path, SFTConfig(**s), train_dataset=rows, callbacks=[meter, timer])
        else:
            from datasets import Dataset
            from trl import SFTConfig as C
            from trl import SFTTrainer as T

            trainer = T(model=path, args=C(**s, model_init_kwargs=f32, dataset_num_proc=None),
                        train_dataset=Dataset.from_list(rows), callbacks=[meter, timer])
        rows_per_step = z["sft_batch"]
    elif trainer_kind == "dpo":
        rows = [{"prompt": _words(rng, rng.randint(32, 128)) + "\n", "chosen": _words(rng, rng.randint(32, 200)),
                 "rejected": _words(rng, rng.randint(32, 200))} for _ in range(32)]
        d = dict(**common, learning_rate=1e-6, beta=0.1, per_device_train_batch_size=z["dpo_batch"],
                 max_length=z["dpo_len"])
        if ours:
            from toolkit import DPOConfig, DPOTrainer

            class Recording(DPOTrainer):
                def compute_sequence_logps(self, model, inputs):
                    if torch.is_grad_enabled() and self.state.global_step == 1:
                        batch = self._batch(inputs)
                        shapes.update(tokens=int(batch["input_ids"].numel()),
                                      scored=int(batch["completion_lengths"].sum()))
                    return super().compute_sequence_logps(model, inputs)

            trainer = Recording(path, args=DPOConfig(**d), train_dataset=rows, callbacks=[meter, timer])
        else:
            from datasets import Dataset
            from trl import DPOConfig as C
            from trl import DPOTrainer as T

            trainer = T(model=path, args=C(**d, model_init_kwargs=f32), train_dataset=Dataset.from_list(rows),
                        callbacks=[meter, timer])
        rows_per_step = z["dpo_batch"]
    else:  # ppo: TRL 1.8's (its last release with PPO), the separate-value-model layout both sides run here
        from toolkit.core.tasks import arithmetic

        rows = arithmetic(64, seed=0, max_value=20, max_terms=2, kind="prompt_only")
        n = z["ppo_rollout"]
        if ours:
            from toolkit import PPOConfig, PPOTrainer

            cfg = PPOConfig(**common, per_device_train_batch_size=n // 2, num_mini_batches=2, num_ppo_epochs=2,
                            max_completion_length=16, temperature=0.7, learning_rate=1e-5, beta=0.05)
            class Recording(PPOTrainer):
                def compute_loss(self, model, inputs, **kw):
                    if torch.is_grad_enabled() and self.state.global_step == 1 and "rows" not in shapes:
                        shapes.update(rows=int(inputs["input_ids"].shape[0]), length=int(inputs["input_ids"].shape[-1]),
                                      scored=int(inputs["mask"].sum()))
                    return super().compute_loss(model, inputs, **kw)

            trainer = Recording(path, [], cfg, train_dataset=rows, reward_model=path, callbacks=[meter, timer])
        else:
            from datasets import Dataset
            from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
            from trl.experimental.ppo import PPOConfig, PPOTrainer

            tok = AutoTokenizer.from_pretrained(path, padding_side="left")
            ids = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
                   for r in rows]
            ids = [i["input_ids"] if isinstance(i, dict) else list(i) for i in ids]
            args = PPOConfig(**{k: v for k, v in common.items() if k != "max_steps"},
                             per_device_train_batch_size=n, gradient_accumulation_steps=1, num_mini_batches=2,
                             num_ppo_epochs=2, total_episodes=n * 3, response_length=16, temperature=0.7,
                             learning_rate=1e-5, kl_coef=0.05, stop_token="eos", num_sample_generations=0,
                             local_rollout_forward_batch_size=n)
            trainer = PPOTrainer(args=args, processing_class=tok,
                                 model=AutoModelForCausalLM.from_pretrained(path, **f32),
                                 ref_model=AutoModelForCausalLM.from_pretrained(path, **f32),
                                 reward_model=AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **f32),
                                 value_model=AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **f32),
                                 train_dataset=Dataset.from_list([{"input_ids": i} for i in ids]),
                                 callbacks=[meter, timer])
        rows_per_step = n
    started = time.perf_counter()
    trainer.train()
    ends = timer.ends
    if meter.peak_bytes is None:
        raise SystemExit(f"{spec}: the measured window (step 2) never closed ({len(ends)} steps ran)")
    ckpt = getattr(trainer.args, "activation_checkpointing", None) or getattr(trainer.args, "gradient_checkpointing", None)
    estimate = _estimate(trainer_kind, path, shapes, z, bool(ckpt)) if ours else None
    return {"estimate_mib": estimate, "shapes": shapes, "spec": spec, "peak_mib": meter.peak_bytes / 2**20, "start_mib": meter.start_bytes / 2**20,
            "step3_s": ends[2] - ends[1] if len(ends) >= 3 else None, "train_s": time.perf_counter() - started,
            "rows_per_step": rows_per_step, "activation_checkpointing": bool(ckpt),
            "params_m": sum(p.numel() for p in trainer.model.parameters()) / 1e6}


def _estimate(trainer_kind: str, path: str, shapes: dict, z: dict, checkpointing: bool) -> float:
    """The memory model's peak (MiB) for the measured step's shapes (toolkit.core.memory.estimate_step_memory)."""
    from toolkit.core.memory import estimate_step_memory

    kw = dict(activation_checkpointing=checkpointing)
    if trainer_kind == "sft":
        kw.update(batch_size=1, seq_len=shapes["tokens"])
    elif trainer_kind == "dpo":
        b = z["dpo_batch"]
        kw.update(batch_size=b, completion_len=round(shapes["scored"] / (2 * b)),
                  prompt_len=round((shapes["tokens"] - shapes["scored"]) / b))
    elif trainer_kind == "grpo":
        b, g = z["grpo_prompts"] * z["grpo_gens"], z["grpo_gens"]
        kw.update(batch_size=b, num_generations=g, completion_len=round(shapes["scored"] / b),
                  prompt_len=round((shapes["tokens"] - shapes["scored"]) / (b // g)))
    else:
        c = round(shapes["scored"] / shapes["rows"])
        kw.update(batch_size=shapes["rows"], completion_len=c, prompt_len=shapes["length"] - c)
    return estimate_step_memory(path, trainer_kind, **kw).peak / 2**20


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--trainers", default=",".join(TRAINERS))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cuda: the same rows on a GPU (peak from torch.cuda.max_memory_allocated)")
    ap.add_argument("--worker", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker)), flush=True)
        return
    trl18 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "trl-1.8.0")
    os.environ["MEMORY_BENCH_DEVICE"] = args.device  # the workers inherit it
    models = [m for m in args.models.split(",") if m]
    trainers = [t for t in args.trainers.split(",") if t]
    if "random-0.5b" in models:
        print(f"building the random 0.5B-class model in {RANDOM_DIR} (once) ...", flush=True)
        build_random_model()
    results: dict[str, dict] = {}
    for model_name in models:
        for trainer_kind in trainers:
            if trainer_kind == "ppo" and model_name != "smollm2":
                continue
            for side in (("toolkit",) if trainer_kind.endswith("-checkpointing") else ("toolkit", "trl")):
                spec = f"{trainer_kind}:{side}:{model_name}"
                env = {}
                if trainer_kind == "ppo" and side == "trl":  # noqa: SIM102
                    if not os.path.exists(trl18):
                        if args.device != "cpu":  # a lent GPU machine without the private TRL 1.8 copy
                            print(f"skipping {spec}: {trl18} is missing", flush=True)
                            continue
                        raise SystemExit(f"{trl18} is missing: run scripts/setup.sh (TRL 1.8 is the PPO reference)")
                    env = {"PYTHONPATH": os.pathsep.join(p for p in (trl18, os.environ.get("PYTHONPATH")) if p),
                           "TRL_EXPERIMENTAL_SILENCE": "1"}
                print(f"running {spec} ...", flush=True)
                t0 = time.perf_counter()
                r = run_in_subprocess(__file__, ["--worker", spec], env=env)
                results[spec] = r
                est = f", memory model {r['estimate_mib']:.0f} MiB" if r.get("estimate_mib") else ""
                print(f"  peak tensor memory {r['peak_mib']:.0f} MiB (at the window's start {r['start_mib']:.0f}){est}, "
                      f"step 3 {r['step3_s']:.1f} s, checkpointing {r['activation_checkpointing']} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\nPeak tensor memory of optimizer step 2 (PeakAllocatorMemory, {args.device}), both sides bf16 mixed "
          "precision, equal work")
    print("| model | trainer | rows/step | ours MiB | TRL MiB | memory ours/TRL | target | step-3 s ours | TRL | "
          "speed-up (TRL/ours) | checkpointing ours / TRL | memory model (ours) MiB | model/measured |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios = {}
    for model_name in models:
        for trainer_kind in trainers:
            base = trainer_kind.removesuffix("-checkpointing")
            o, t = results.get(f"{trainer_kind}:toolkit:{model_name}"), results.get(f"{base}:trl:{model_name}")
            if not o or not t:
                continue
            ratio = o["peak_mib"] / t["peak_mib"]
            speed = t["step3_s"] / o["step3_s"] if o["step3_s"] and t["step3_s"] else None
            ratios[f"{trainer_kind}:{model_name}"] = {"memory": ratio, "speedup": speed,
                                                     "meets_target": ratio <= TARGET[trainer_kind]}
            print(f"| {model_name} ({o['params_m']:.0f}M) | {trainer_kind} | {o['rows_per_step']} | {o['peak_mib']:.0f} | "
                  f"{t['peak_mib']:.0f} | {ratio:.2f} | <= {TARGET[trainer_kind]} | {o['step3_s']:.1f} | "
                  f"{t['step3_s']:.1f} | {speed:.2f}x | {o['activation_checkpointing']} / {t['activation_checkpointing']} | "
                  f"{o['estimate_mib']:.0f} | {o['estimate_mib'] / o['peak_mib']:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": args.device, "sizes": SIZES, "targets": TARGET, "results": results, "ratios": ratios,
                       "provenance": provenance()}, fh, indent=2)


if __name__ == "__main__":
    main()
