"""Benchmark: our DPOTrainer against TRL's DPOTrainer on the embedded SmolLM2-135M-Instruct, one run.

    python bench/dpo_vs_trl.py              # about 15 minutes on 2 CPU cores
    python bench/dpo_vs_trl.py --steps 3    # quicker, noisier

Same model, same preference rows (plain text, prompt + chosen + rejected, sequences of mixed length
up to 1,024 tokens), same batch size, max_length, beta, optimizer and learning rate, a live
reference model on both sides. Each trainer runs in its own process (peak RSS is per process).
Printed: seconds per step over the steps after the first, peak RSS, and the ratios ours/TRL.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_args, provenance, run_each, step_timer  # noqa: E402

SETTINGS = dict(batch_size=4, max_length=1024, rows=64, beta=0.1, lr=1e-6)
_WORDS = ("the model learns to prefer the better answer while the reference keeps it close to where it started "
          "and long answers make the vocabulary projection expensive").split()


def make_rows(n: int, max_length: int, seed: int = 0) -> list[dict]:
    """Prompts of 32-256 words and answers of 32-380 words: prompt + answer between ~60 and ~1,000 tokens."""
    rng = random.Random(seed)

    def text(k):
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    return [{"prompt": text(rng.randint(32, 256)) + "\n", "chosen": text(rng.randint(32, 380)),
             "rejected": text(rng.randint(32, 380))} for _ in range(n)]


def worker(kind: str, steps: int) -> dict:
    import torch

    from toolkit import embedded_model_path

    torch.manual_seed(0)
    path = str(embedded_model_path())
    s = SETTINGS
    rows = make_rows(s["rows"], s["max_length"])
    common = dict(output_dir=f"/tmp/bench-dpo-{kind}", max_steps=steps, per_device_train_batch_size=s["batch_size"],
                  learning_rate=s["lr"], beta=s["beta"], max_length=s["max_length"], logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, disable_tqdm=True, optim="adamw_torch_fused")
    timer = step_timer()
    if kind == "toolkit":
        from toolkit import DPOConfig, DPOTrainer

        trainer = DPOTrainer(path, args=DPOConfig(**common), train_dataset=rows, callbacks=[timer])
    else:
        from datasets import Dataset
        from trl import DPOConfig as TRLConfig
        from trl import DPOTrainer as TRLTrainer

        trainer = TRLTrainer(model=path, args=TRLConfig(**common, use_cpu=True, bf16=False,
                                                        model_init_kwargs={"dtype": torch.float32}),
                             train_dataset=Dataset.from_list(rows), callbacks=[timer])
    trainer.train()
    ends = timer.ends
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"kind": kind, "sec_per_step": (ends[-1] - ends[0]) / max(len(ends) - 1, 1),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "first_loss": losses[0]}


def main() -> None:
    args = bench_args(__doc__, worker, default_steps=4)
    results = run_each(__file__, ("toolkit", "trl"), args.steps,
                       lambda r: f"{r['sec_per_step']:.1f} s/step, peak RSS {r['peak_rss_mb']:.0f} MB, "
                                 f"first loss {r['first_loss']:.4f}")
    o, t = results["toolkit"], results["trl"]
    s = SETTINGS
    print(f"\nDPO, SmolLM2-135M-Instruct, batch {s['batch_size']} pairs, max_length {s['max_length']}, live reference, "
          f"{args.steps} steps (first excluded from timing)")
    print("| | ours | TRL | ratio (ours/TRL) | target |")
    print("|---|---|---|---|---|")
    print(f"| seconds per step | {o['sec_per_step']:.1f} | {t['sec_per_step']:.1f} | "
          f"{o['sec_per_step'] / t['sec_per_step']:.2f} | <= 0.8 |")
    print(f"| peak RSS MB | {o['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | {o['peak_rss_mb'] / t['peak_rss_mb']:.2f} "
          "| <= 0.6 |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": s, "steps": args.steps, "results": results,
                       "provenance": provenance()}, f, indent=2)


if __name__ == "__main__":
    main()
