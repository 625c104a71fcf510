"""Benchmark: our GRPOTrainer against TRL's GRPOTrainer (its default transformers generation), one run.

    python bench/grpo_vs_trl.py              # about 6 minutes on 2 CPU cores
    python bench/grpo_vs_trl.py --steps 6    # more steps, less noise

Same model (the embedded SmolLM2-135M-Instruct), same prompts (generated arithmetic, conversational),
same num_generations (8), prompts per step (4), max completion length (16), temperature (0.7),
learning rate, loss (dapo), no KL, same reward (numeric match). Each trainer runs in its own process
(peak RSS is per process). Printed: seconds per step over the steps after the first, the split
into generation and training where the trainer reports it, peak RSS, the tokens each side generated
(completions/mean_length x completions, summed over every step; both trainers log it), and the ratios.

A third run, `toolkit-bf16-generation`, is ours with `generation_backend_kwargs={"dtype": "bfloat16"}`: the
same training in float32, decoding on a bfloat16 copy of the weights (a decode step streams every weight, and
this is where our step's time goes). It is not the same numerics as TRL's float32 generation, which has no such
setting on its transformers path, so it is its own row, with the sampler-trainer log-prob gap it brings (the
gap the sampler correction, importance_sampling_cap 2, corrects). It pays only where the CPU computes bfloat16
natively (AMX / AVX-512 BF16); the row prints the CPU flags.

Two more runs put both sides in bfloat16 mixed precision, which is TRL's own default (`bf16=True` unless fp16 is
set; the first two runs set bf16=False on TRL so that both train in float32): `trl-bf16` is TRL with bf16=True,
`toolkit-bf16` ours with bf16=True (autocast over the forward, float32 weights and optimizer) and the bfloat16
generation copy. Both pass `use_cpu=True`, which transformers asks for before it allows bf16 on a CPU.
"""

from __future__ import annotations

import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_args, provenance, run_each, step_timer  # noqa: E402

SETTINGS = dict(prompts_per_step=4, num_generations=8, max_completion_length=16, temperature=0.7, lr=1e-5)


def worker(kind: str, steps: int) -> dict:
    import torch

    from toolkit import embedded_model_path
    from toolkit.core.rewards import numeric_match
    from toolkit.core.tasks import arithmetic

    torch.manual_seed(0)
    path = str(embedded_model_path())
    rows = arithmetic(64, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    s = SETTINGS
    common = dict(output_dir=f"/tmp/bench-grpo-{kind}", max_steps=steps, learning_rate=s["lr"], logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
                  per_device_train_batch_size=s["prompts_per_step"] * s["num_generations"],
                  num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
                  temperature=s["temperature"], beta=0.0, loss_type="dapo")
    timer = step_timer()
    if kind.startswith("toolkit"):
        from toolkit import GRPOConfig, GRPOTrainer

        extra = ({"generation_backend_kwargs": {"dtype": "bfloat16"}}
                 if kind in ("toolkit-bf16-generation", "toolkit-bf16") else {})
        if kind == "toolkit-bf16":
            extra.update(bf16=True, use_cpu=True)
        trainer = GRPOTrainer(path, [numeric_match], GRPOConfig(**common, **extra), train_dataset=rows,
                              callbacks=[timer])
    else:
        from datasets import Dataset
        from trl import GRPOConfig as TRLConfig
        from trl import GRPOTrainer as TRLTrainer

        def reward(prompts, completions, completion_ids=None, **kw):  # TRL passes extra kwargs
            return numeric_match(prompts, completions, completion_ids, answer=kw["answer"])

        trainer = TRLTrainer(model=path, reward_funcs=reward, processing_class=None,
                             args=TRLConfig(**common, use_cpu=True, bf16=kind == "trl-bf16",
                                            model_init_kwargs={"dtype": torch.float32}),
                             train_dataset=Dataset.from_list(rows), callbacks=[timer])
    trainer.train()
    ends = timer.ends
    per_step = (ends[-1] - ends[0]) / max(len(ends) - 1, 1)
    hist = [h for h in trainer.state.log_history if "loss" in h][1:]
    gen = [h.get("time/generation_s") for h in hist if h.get("time/generation_s") is not None]
    train = [h.get("time/train_s") for h in hist if h.get("time/train_s") is not None]
    gen_tps = [h.get("generation_tokens_per_s") for h in hist if h.get("generation_tokens_per_s") is not None]
    completions_per_step = s["prompts_per_step"] * s["num_generations"]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    rewards = [h.get("reward") for h in hist if h.get("reward") is not None]
    gaps = [h["sampler/logp_abs_diff_mean"] for h in hist if "sampler/logp_abs_diff_mean" in h]
    return {"kind": kind, "sec_per_step": per_step, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "generation_s_per_step": sum(gen) / len(gen) if gen else None,
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "train_s_per_step": sum(train) / len(train) if train else None,
            "generation_tokens_per_s": sum(gen_tps) / len(gen_tps) if gen_tps else None,
            "generated_tokens": round(sum(lengths) * completions_per_step), "steps_with_lengths": len(lengths),
            # ours leaves out the optimizer step of a round with no row in the loss (skip_steps_without_signal, on
            # by default); TRL runs it on zero gradients. Counted over the timed steps, so equal work is visible.
            "steps_without_signal_skipped": sum(1 for h in hist if h.get("update_skipped")),
            "sampler_logp_gap_mean": sum(gaps) / len(gaps) if gaps else None}


def main() -> None:
    args = bench_args(__doc__, worker, default_steps=4)
    results = run_each(__file__, ("toolkit", "trl", "toolkit-bf16-generation", "toolkit-bf16", "trl-bf16"), args.steps,
                       lambda r: f"{r['sec_per_step']:.1f} s/step, peak RSS {r['peak_rss_mb']:.0f} MB")
    o, t, b = results["toolkit"], results["trl"], results["toolkit-bf16-generation"]
    s = SETTINGS
    print(f"\nGRPO, SmolLM2-135M-Instruct, {s['prompts_per_step']} prompts x {s['num_generations']} completions per step, "
          f"max {s['max_completion_length']} new tokens, {args.steps} steps (first excluded from timing)")
    print("| | ours | TRL | ratio (ours/TRL) |")
    print("|---|---|---|---|")
    print(f"| seconds per step | {o['sec_per_step']:.1f} | {t['sec_per_step']:.1f} | "
          f"{o['sec_per_step'] / t['sec_per_step']:.2f} (speed-up {t['sec_per_step'] / o['sec_per_step']:.2f}x) |")
    print(f"| peak RSS MB | {o['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | {o['peak_rss_mb'] / t['peak_rss_mb']:.2f} |")
    print(f"| generated tokens (all {args.steps} steps) | {o['generated_tokens']} | {t['generated_tokens']} | "
          f"{o['generated_tokens'] / max(t['generated_tokens'], 1):.2f} |")
    print(f"| timed steps whose update was skipped (no row in the loss) | {o['steps_without_signal_skipped']} | "
          f"- (TRL steps on zero gradients) | |")
    if o["generation_s_per_step"] is not None:
        print(f"| ours: generation s/step | {o['generation_s_per_step']:.1f} | | |")
        print(f"| ours: training s/step | {o['train_s_per_step']:.1f} | | |")
        print(f"| ours: generation tokens/s | {o['generation_tokens_per_s']:.0f} | | |")
    flags = ", ".join(provenance().get("cpu_flags") or []) or "none of avx512f, avx512_bf16, amx_tile, avx2"
    print(f"\nOurs with bfloat16 generation (generation_backend_kwargs.dtype; training in float32; CPU: {flags})")
    print("| | ours, bf16 generation | TRL | ratio (ours/TRL) |")
    print("|---|---|---|---|")
    print(f"| seconds per step | {b['sec_per_step']:.1f} | {t['sec_per_step']:.1f} | "
          f"{b['sec_per_step'] / t['sec_per_step']:.2f} (speed-up {t['sec_per_step'] / b['sec_per_step']:.2f}x) |")
    print(f"| peak RSS MB | {b['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | {b['peak_rss_mb'] / t['peak_rss_mb']:.2f} |")
    print(f"| generated tokens (all {args.steps} steps) | {b['generated_tokens']} | {t['generated_tokens']} | "
          f"{b['generated_tokens'] / max(t['generated_tokens'], 1):.2f} |")
    if b["generation_s_per_step"] is not None:
        print(f"| ours: generation s/step (float32 generation: {o['generation_s_per_step']:.1f}) | "
              f"{b['generation_s_per_step']:.1f} | | |")
    if b["sampler_logp_gap_mean"] is not None and o["sampler_logp_gap_mean"] is not None:
        print(f"| ours: sampler-trainer log-prob gap, mean per token (float32 generation: "
              f"{o['sampler_logp_gap_mean']:.1e}) | {b['sampler_logp_gap_mean']:.1e} | | |")
    m, tb = results["toolkit-bf16"], results["trl-bf16"]
    print("\nBoth in bfloat16 mixed precision (bf16=True, TRL's default; ours also generating on its bfloat16 copy)")
    print("| | ours, bf16=True | TRL, bf16=True | ratio (ours/TRL) |")
    print("|---|---|---|---|")
    print(f"| seconds per step | {m['sec_per_step']:.1f} | {tb['sec_per_step']:.1f} | "
          f"{m['sec_per_step'] / tb['sec_per_step']:.2f} (speed-up {tb['sec_per_step'] / m['sec_per_step']:.2f}x) |")
    print(f"| peak RSS MB | {m['peak_rss_mb']:.0f} | {tb['peak_rss_mb']:.0f} | "
          f"{m['peak_rss_mb'] / tb['peak_rss_mb']:.2f} |")
    print(f"| generated tokens (all {args.steps} steps) | {m['generated_tokens']} | {tb['generated_tokens']} | "
          f"{m['generated_tokens'] / max(tb['generated_tokens'], 1):.2f} |")
    if m["generation_s_per_step"] is not None:
        print(f"| ours: generation s/step | {m['generation_s_per_step']:.1f} | | |")
        print(f"| ours: training s/step (float32 run: {o['train_s_per_step']:.1f}) | {m['train_s_per_step']:.1f} | | |")
    if m["sampler_logp_gap_mean"] is not None:
        print(f"| ours: sampler-trainer log-prob gap, mean per token | {m['sampler_logp_gap_mean']:.1e} | | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": s, "steps": args.steps, "results": results, "provenance": provenance()}, f,
                      indent=2)


if __name__ == "__main__":
    main()
