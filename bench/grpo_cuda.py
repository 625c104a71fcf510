"""Benchmark on a CUDA device: our GRPOTrainer against TRL's GRPOTrainer, one run, both in bf16=True.

    python bench/grpo_cuda.py --model DIR              # a CUDA machine; DIR holds a causal LM and its tokenizer
    python bench/grpo_cuda.py --model DIR --steps 8
    python bench/grpo_cuda.py --model DIR --random-init --steps 2 --prompts-per-step 1 --max-completion-length 4
                                                       # tries the script out on a CPU in about a minute

Not part of bench/run_all.py: the project's own machines have no GPU. Run twice on a lent H200 (bench/results/gpu/,
whose README names the code each run was at); tried on a CPU with the third command above.

Both sides: bf16=True (TRL's default; ours autocasts the forward over float32 weights, and generates on its
bfloat16 copy), the same prompts (generated arithmetic, conversational), num_generations 8, 8 prompts per step,
max completion length 128, temperature 1.0, learning rate, loss (dapo), no KL, the same reward. TRL generates with
its default transformers path. Each trainer runs in its own process. Printed: seconds per step over the steps after
the first, peak GPU memory (torch.cuda.max_memory_allocated), the generated tokens of each side, and the ratio.

`--random-init`: build the model from DIR's config with random weights (seed 0) instead of loading its weights,
for a machine that cannot carry the checkpoint. A random model rarely samples its end-of-sequence token, so both
sides decode nearly every completion to the length limit: equal work, and the generated-token counts show it. The
reward (a function of the completion's character length) then still varies within a group, so no step is
skipped for want of signal on our side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, run_in_subprocess, step_timer  # noqa: E402

SETTINGS = dict(prompts_per_step=8, num_generations=8, max_completion_length=128, temperature=1.0, lr=1e-5)


def length_reward(prompts, completions, completion_ids=None, **kw):
    """A reward that varies within a group whatever the model writes: the completion's length in characters, mod 7."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t) % 7) for t in texts]


def _model_dir(model: str, random_init: bool) -> str:
    if not random_init:
        return model
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = "/tmp/bench-grpo-cuda-model"
    if not os.path.exists(os.path.join(out, "config.json")):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.float32)
        m.save_pretrained(out)
        AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return out


def worker(kind: str, steps: int, path: str) -> dict:
    import torch

    from toolkit.core.tasks import arithmetic

    torch.manual_seed(0)
    rows = arithmetic(128, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    s = SETTINGS
    common = dict(output_dir=f"/tmp/bench-grpo-cuda-{kind}", max_steps=steps, learning_rate=s["lr"], logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, disable_tqdm=True, bf16=True,
                  use_cpu=not torch.cuda.is_available(),  # only for trying the script out on a CPU
                  per_device_train_batch_size=s["prompts_per_step"] * s["num_generations"],
                  num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
                  temperature=s["temperature"], beta=0.0, loss_type="dapo")
    timer = step_timer()
    if kind in ("toolkit", "toolkit_ckpt"):
        from toolkit import GRPOConfig, GRPOTrainer

        # toolkit: activation checkpointing off (our GPU default at or under 4096 completion tokens a micro-batch);
        # toolkit_ckpt: on, as TRL's GRPOConfig has it and as our default is above 4096 (8 x 8 x 128 = 8192 here)
        config = GRPOConfig(**common, generation_backend_kwargs={"dtype": "bfloat16"},
                            gradient_checkpointing=kind == "toolkit_ckpt")
        trainer = GRPOTrainer(path, [length_reward], config, train_dataset=rows, callbacks=[timer])
    else:
        from datasets import Dataset
        from trl import GRPOConfig as TRLConfig
        from trl import GRPOTrainer as TRLTrainer

        rows = [{k: v for k, v in r.items() if k != "answer"} for r in rows]
        trainer = TRLTrainer(model=path, reward_funcs=length_reward, args=TRLConfig(**common),
                             train_dataset=Dataset.from_list(rows), callbacks=[timer])
    device = str(next(trainer.model.parameters()).device)
    trainer.train()
    ends = timer.ends
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"kind": kind, "device": device, "sec_per_step": (ends[-1] - ends[0]) / max(len(ends) - 1, 1),
            "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0,
            "generated_tokens": round(sum(lengths) * s["prompts_per_step"] * s["num_generations"]),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
            "torch_cuda": torch.version.cuda}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--random-init", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompts-per-step", type=int, default=SETTINGS["prompts_per_step"])
    ap.add_argument("--max-completion-length", type=int, default=SETTINGS["max_completion_length"])
    ap.add_argument("--worker", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    SETTINGS.update(prompts_per_step=args.prompts_per_step, max_completion_length=args.max_completion_length)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.steps, args.model)), flush=True)
        raise SystemExit(0)
    path = _model_dir(args.model, args.random_init)
    results = {}
    for kind in ("toolkit", "toolkit_ckpt", "trl"):
        started = time.perf_counter()
        results[kind] = run_in_subprocess(__file__, ["--model", path, "--steps", str(args.steps), "--worker", kind,
                                                     "--prompts-per-step", str(args.prompts_per_step),
                                                     "--max-completion-length", str(args.max_completion_length)])
        r = results[kind]
        print(f"{kind}: {r['sec_per_step']:.2f} s/step on {r['device']}, peak GPU memory {r['peak_gpu_mb']:.0f} MB, "
              f"{r['generated_tokens']} tokens ({time.perf_counter() - started:.0f} s)", flush=True)
    t = results["trl"]
    s = SETTINGS
    print(f"\nGRPO on {t['gpu']} (CUDA {t['torch_cuda']}), model {args.model}"
          f"{' with random weights (seed 0)' if args.random_init else ''}, {s['prompts_per_step']} prompts x "
          f"{s['num_generations']} completions per step, max {s['max_completion_length']} new tokens, bf16=True, "
          f"{args.steps} steps (first excluded from timing)")
    for kind, label in (("toolkit", "ours without activation checkpointing"),
                        ("toolkit_ckpt", "ours with activation checkpointing (as TRL's default; ours above 4096 "
                                         "completion tokens a micro-batch)")):
        o = results[kind]
        print(f"\n{label} against TRL (activation checkpointing on, its default)")
        print("| | ours | TRL | ratio (ours/TRL) |")
        print("|---|---|---|---|")
        print(f"| seconds per step | {o['sec_per_step']:.2f} | {t['sec_per_step']:.2f} | "
              f"{o['sec_per_step'] / t['sec_per_step']:.2f} (speed-up {t['sec_per_step'] / o['sec_per_step']:.2f}x) |")
        memory_ratio = f"{o['peak_gpu_mb'] / t['peak_gpu_mb']:.2f}" if t["peak_gpu_mb"] else "- (no GPU)"
        print(f"| peak GPU memory MB | {o['peak_gpu_mb']:.0f} | {t['peak_gpu_mb']:.0f} | {memory_ratio} |")
        print(f"| generated tokens (all {args.steps} steps) | {o['generated_tokens']} | {t['generated_tokens']} | "
              f"{o['generated_tokens'] / max(t['generated_tokens'], 1):.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": s, "steps": args.steps, "model": args.model, "random_init": args.random_init,
                       "results": results, "provenance": provenance()}, f, indent=2)


if __name__ == "__main__":
    main()
