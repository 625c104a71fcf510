"""Benchmark: the experimental trainers against TRL's, on the embedded SmolLM2-135M-Instruct, one run.

    python bench/experimental_vs_trl.py                # about 15 minutes on 2 CPU cores
    python bench/experimental_vs_trl.py --steps 3      # quicker, noisier

Rows: reward modelling (toolkit.experimental.reward.RewardTrainer against trl.RewardTrainer), SimPO
(toolkit.experimental.cpo.CPOTrainer, loss_type="simpo", cpo_alpha=0, against trl.experimental.cpo
CPOTrainer with the same settings) and KTO (toolkit.experimental.kto.KTOTrainer against trl.KTOTrainer,
loss_type="kto", beta 0.1, both unpairing the same pairs into desirable/undesirable rows, each with a
frozen reference copy; TRL samples KTO rows in order, its default, ours shuffled) and ORPO
(toolkit.experimental.orpo.ORPOTrainer against trl.experimental.orpo.ORPOTrainer, beta 0.1, no reference
on either side). Same model, same plain-text preference rows (prompt + chosen +
rejected, sequences of mixed length up to 512 tokens), same batch size, max_length, optimizer and
learning rate; TRL at its defaults otherwise. Each trainer runs in its own process (peak RSS is per
process). Printed: seconds per step over the steps after the first, peak RSS, and the ratios ours/TRL.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_args, run_each, step_timer  # noqa: E402

SETTINGS = dict(batch_size=4, max_length=512, rows=64, lr=1e-6, beta=2.0, simpo_gamma=0.5)
_WORDS = ("the model learns to prefer the better answer and a reward model learns to score it while long "
          "answers make every forward more expensive").split()
KINDS = ("reward-toolkit", "reward-trl", "simpo-toolkit", "simpo-trl", "kto-toolkit", "kto-trl", "orpo-toolkit",
         "orpo-trl")


def make_rows(n: int, seed: int = 0) -> list[dict]:
    """Prompts of 32-128 words and answers of 32-200 words: prompt + answer between ~60 and ~500 tokens."""
    rng = random.Random(seed)

    def text(k):
        return " ".join(rng.choice(_WORDS) for _ in range(k))

    return [{"prompt": text(rng.randint(32, 128)) + "\n", "chosen": text(rng.randint(32, 200)),
             "rejected": text(rng.randint(32, 200))} for _ in range(n)]


def worker(kind: str, steps: int) -> dict:
    import torch

    os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")
    from toolkit import embedded_model_path

    torch.manual_seed(0)
    path = str(embedded_model_path())
    s = SETTINGS
    rows = make_rows(s["rows"])
    common = dict(output_dir=f"/tmp/bench-exp-{kind}", max_steps=steps, per_device_train_batch_size=s["batch_size"],
                  learning_rate=s["lr"], max_length=s["max_length"], logging_steps=1, save_strategy="no",
                  report_to="none", seed=0, disable_tqdm=True, optim="adamw_torch_fused")
    simpo = dict(loss_type="simpo", cpo_alpha=0.0, beta=s["beta"], simpo_gamma=s["simpo_gamma"])
    timer = step_timer()
    if kind == "reward-toolkit":
        from toolkit.experimental.reward import RewardConfig, RewardTrainer

        trainer = RewardTrainer(path, RewardConfig(**common), train_dataset=rows, callbacks=[timer])
    elif kind == "simpo-toolkit":
        from toolkit.experimental.cpo import CPOConfig, CPOTrainer

        trainer = CPOTrainer(path, CPOConfig(**common, **simpo), train_dataset=rows, callbacks=[timer])
    elif kind == "kto-toolkit":
        from toolkit.experimental.kto import KTOConfig, KTOTrainer

        trainer = KTOTrainer(path, args=KTOConfig(**common, loss_type="kto", beta=0.1), train_dataset=rows,
                             callbacks=[timer])
    elif kind == "orpo-toolkit":
        from toolkit.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(path, args=ORPOConfig(**common, beta=0.1), train_dataset=rows, callbacks=[timer])
    else:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(path)
        if kind == "reward-trl":
            from trl import RewardConfig as TRLConfig
            from trl import RewardTrainer as TRLTrainer

            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
            model.config.pad_token_id = tok.pad_token_id
            trainer = TRLTrainer(model=model, args=TRLConfig(**common, use_cpu=True, bf16=False),
                                 train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[timer])
        elif kind == "kto-trl":
            from trl import KTOConfig as TRLConfig
            from trl import KTOTrainer as TRLTrainer

            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            trainer = TRLTrainer(model=model, args=TRLConfig(**common, loss_type="kto", beta=0.1, use_cpu=True,
                                                             bf16=False),
                                 train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[timer])
        elif kind == "orpo-trl":
            from trl.experimental.orpo import ORPOConfig as TRLConfig
            from trl.experimental.orpo import ORPOTrainer as TRLTrainer

            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            trainer = TRLTrainer(model=model, args=TRLConfig(**common, beta=0.1, use_cpu=True, bf16=False),
                                 train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[timer])
        else:
            from trl.experimental.cpo import CPOConfig as TRLConfig
            from trl.experimental.cpo import CPOTrainer as TRLTrainer

            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            trainer = TRLTrainer(model=model, args=TRLConfig(**common, **simpo, use_cpu=True, bf16=False),
                                 train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[timer])
    trainer.train()
    ends = timer.ends
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"kind": kind, "sec_per_step": (ends[-1] - ends[0]) / max(len(ends) - 1, 1),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "first_loss": losses[0]}


def main() -> None:
    import subprocess

    args = bench_args(__doc__, worker, default_steps=4)
    results = run_each(__file__, KINDS, args.steps,
                       lambda r: f"{r['sec_per_step']:.1f} s/step, peak RSS {r['peak_rss_mb']:.0f} MB, "
                                 f"first loss {r['first_loss']:.4f}")
    s = SETTINGS
    print(f"\nSmolLM2-135M-Instruct, batch {s['batch_size']} pairs, max_length {s['max_length']}, {args.steps} steps "
          "(first excluded from timing)")
    print("| trainer | ours s/step | TRL s/step | speed ratio (ours/TRL) | ours peak RSS MB | TRL peak RSS MB | "
          "memory ratio (ours/TRL) |")
    print("|---|---|---|---|---|---|---|")
    for name in ("reward", "simpo", "kto", "orpo"):
        o, t = results[f"{name}-toolkit"], results[f"{name}-trl"]
        print(f"| {name} | {o['sec_per_step']:.1f} | {t['sec_per_step']:.1f} | "
              f"{o['sec_per_step'] / t['sec_per_step']:.2f} | {o['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | "
              f"{o['peak_rss_mb'] / t['peak_rss_mb']:.2f} |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "settings": s, "steps": args.steps, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
