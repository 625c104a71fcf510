"""Benchmark: AsyncGRPOTrainer against our synchronous GRPOTrainer, same settings and samples, one run.

    python bench/async_grpo.py                 # about 10 minutes on 2 CPU cores
    python bench/async_grpo.py --steps 40      # longer, closer to the main job

Both train the embedded SmolLM2-135M-Instruct on the arithmetic task (4 prompts x 8 completions per
step, max 16 new tokens, temperature 0.7, lr 2e-5, dapo, numeric-match reward) for the same number
of steps, i.e. the same number of samples. Synchronous GRPO uses both cores (2 torch threads) for
generation and training in turn; async gives the rollout worker one thread and the trainer one
(max_staleness 1, so generation of step t+1 overlaps training on step t). Each run is its own
process. Printed: wall time (training only; model load and the held-out evaluation excluded),
samples per second, held-out greedy accuracy after training (64 problems), and for async the
idle fractions of both sides, which explain the ratio.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_args, run_each  # noqa: E402

SETTINGS = dict(prompts_per_step=4, num_generations=8, max_completion_length=16, temperature=0.7, lr=2e-5,
                max_staleness=1)


def worker(kind: str, steps: int) -> dict:
    import torch

    from toolkit.core.rewards import numeric_match
    from toolkit.core.tasks import arithmetic_splits, greedy_accuracy

    s = SETTINGS
    train, held_out = arithmetic_splits(256, 64, max_value=20, max_terms=2, kind="prompt_only")
    common = dict(output_dir=f"/tmp/bench-async-{kind}", max_steps=steps, learning_rate=s["lr"], logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
                  per_device_train_batch_size=s["prompts_per_step"] * s["num_generations"],
                  num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
                  temperature=s["temperature"], lr_scheduler_type="constant", loss_type="dapo")
    if kind == "sync":
        from toolkit import GRPOConfig, GRPOTrainer

        torch.set_num_threads(2)
        trainer = GRPOTrainer("smollm2-135m-instruct", [numeric_match], GRPOConfig(**common), train_dataset=train)
    else:
        from toolkit import AsyncGRPOConfig, AsyncGRPOTrainer

        trainer = AsyncGRPOTrainer("smollm2-135m-instruct", [numeric_match],
                                   AsyncGRPOConfig(**common, max_staleness=s["max_staleness"], worker_threads=1,
                                                   trainer_threads=1), train_dataset=train)
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    torch.set_num_threads(2)
    acc = greedy_accuracy(trainer.model, trainer.processing_class, held_out, max_new_tokens=s["max_completion_length"])
    hist = [h for h in trainer.state.log_history if "loss" in h]

    def mean(key):
        v = [h[key] for h in hist[1:] if key in h]
        return sum(v) / len(v) if v else None

    samples = steps * s["prompts_per_step"] * s["num_generations"]
    return {"kind": kind, "wall_s": wall, "samples": samples, "samples_per_s": samples / wall, "heldout_accuracy": acc,
            "final_reward": sum(h["reward"] for h in hist[-5:]) / len(hist[-5:]),
            "trainer_idle_fraction": mean("async/trainer_idle_fraction"),
            "generator_idle_fraction": mean("async/generator_idle_fraction"),
            "generation_s_per_step": mean("time/generation_s"), "train_s_per_step": mean("time/train_s"),
            "staleness_mean": mean("async/staleness")}


def main() -> None:
    args = bench_args(__doc__, worker, default_steps=20)
    results = run_each(__file__, ("sync", "async"), args.steps,
                       lambda r: f"{r['wall_s']:.0f} s, {r['samples_per_s']:.2f} samples/s, held-out accuracy "
                                 f"{r['heldout_accuracy']:.3f}", env={"HF_HUB_OFFLINE": "1"})
    sy, asy = results["sync"], results["async"]
    s = SETTINGS
    print(f"\nGRPO on SmolLM2-135M-Instruct, {args.steps} steps x {s['prompts_per_step']} prompts x "
          f"{s['num_generations']} completions (same samples both sides); async max_staleness={s['max_staleness']}")
    print("| | sync (2 threads) | async (1 + 1 threads) | ratio async/sync |")
    print("|---|---|---|---|")
    print(f"| wall seconds | {sy['wall_s']:.0f} | {asy['wall_s']:.0f} | {asy['wall_s'] / sy['wall_s']:.2f} |")
    print(f"| samples/s | {sy['samples_per_s']:.2f} | {asy['samples_per_s']:.2f} | "
          f"{asy['samples_per_s'] / sy['samples_per_s']:.2f}x |")
    print(f"| held-out accuracy | {sy['heldout_accuracy']:.3f} | {asy['heldout_accuracy']:.3f} | |")
    print(f"| mean reward, last 5 steps | {sy['final_reward']:.3f} | {asy['final_reward']:.3f} | |")
    print(f"| generation s/step | {sy['generation_s_per_step']:.1f} | {asy['generation_s_per_step']:.1f} | |")
    print(f"| train s/step | {sy['train_s_per_step']:.1f} | {asy['train_s_per_step']:.1f} | |")
    print(f"| async: trainer idle / generator idle | | {asy['trainer_idle_fraction']:.2f} / "
          f"{asy['generator_idle_fraction']:.2f} | |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": s, "steps": args.steps, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
