"""Benchmark: our SFTTrainer against TRL's SFTTrainer on the embedded SmolLM2-135M-Instruct, in one run.

    python bench/sft_vs_trl.py                 # about 9 minutes on 2 CPU cores
    python bench/sft_vs_trl.py --trl-no-gc     # also TRL with gradient checkpointing off (about 8 more)

Same model, same data (plain-text rows of mixed lengths), same batch size, max_length, optimizer,
learning rate and number of steps. Each configuration runs in its own process (peak RSS is per
process), one after another. Printed: real (non-padding) tokens/s over the steps after the first,
peak RSS, and the ratios ours/TRL with packing off and on. TRL runs at its own defaults (its
SFTConfig turns gradient checkpointing on; the row records what it ran with); --trl-no-gc adds
TRL without it (more memory; at this size its speed was within noise of the default's). The ceiling (what this machine's
matmul allows for this model) is bench/ceiling.py's; bench/run_all.py puts each row's fraction of
it in bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, run_in_subprocess, step_timer  # noqa: E402

DEFAULTS = dict(batch_size=4, max_length=1024, min_len=64, rows=96, lr=1e-5)


def make_rows(n: int, min_len: int, max_len: int, seed: int = 0) -> list[dict]:
    """Plain-text rows whose token lengths are spread between min_len and max_len (words ~ 1-2 tokens)."""
    rng = random.Random(seed)
    words = ("the model learns to add numbers and to stop when the answer is complete while the data "
             "comes in many different lengths so padding matters").split()
    rows = []
    for _ in range(n):
        n_words = rng.randint(min_len, max_len) * 3 // 4
        rows.append({"text": " ".join(rng.choice(words) for _ in range(n_words))})
    return rows


class TokenCounter:
    """Wraps a collator and records the real tokens of each batch it builds."""

    def __init__(self, collator):
        self.collator, self.counts = collator, []

    def __call__(self, examples):
        batch = self.collator(examples)
        if "attention_mask" in batch and batch["attention_mask"] is not None:
            self.counts.append(int(batch["attention_mask"].sum()))
        else:
            self.counts.append(int(batch["input_ids"].numel()))
        return batch


def worker(kind: str, packing: bool, steps: int, p: dict) -> dict:
    import torch

    torch.manual_seed(0)
    from toolkit import embedded_model_path

    path = str(embedded_model_path())
    rows = make_rows(p["rows"], p["min_len"], p["max_length"])
    common = dict(output_dir=f"/tmp/bench-sft-{kind}", max_steps=steps, per_device_train_batch_size=p["batch_size"],
                  learning_rate=p["lr"], logging_steps=1, save_strategy="no", report_to="none", seed=0,
                  disable_tqdm=True, dataloader_pin_memory=False, optim="adamw_torch_fused")
    timer = step_timer()
    gradient_checkpointing = None
    if kind == "toolkit":
        from toolkit import SFTConfig, SFTTrainer

        cfg = SFTConfig(**common, max_length=p["max_length"], packing=packing)
        trainer = SFTTrainer(path, cfg, train_dataset=rows, callbacks=[timer])
        counter = TokenCounter(trainer.data_collator)
        trainer.data_collator = counter
        trainer.train()
        ends, counts = timer.ends, counter.counts
        gradient_checkpointing = bool(getattr(cfg, "activation_checkpointing", None) or cfg.gradient_checkpointing)
    else:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import SFTConfig as TRLConfig
        from trl import SFTTrainer as TRLTrainer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path)
        # "trl": TRL's defaults (gradient checkpointing is whatever its SFTConfig sets); "trl_no_gc": switched off
        off = {"gradient_checkpointing": False} if kind == "trl_no_gc" else {}
        cfg = TRLConfig(**common, max_length=p["max_length"], packing=packing, use_cpu=True, bf16=False,
                        dataset_num_proc=None, **off)
        trainer = TRLTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
                             callbacks=[timer])
        counter = TokenCounter(trainer.data_collator)
        trainer.data_collator = counter
        trainer.train()
        ends, counts = timer.ends, counter.counts
        gradient_checkpointing = bool(cfg.gradient_checkpointing)
    # Steps after the first (warm-up): tokens of batches 2..N over the time from end of step 1 to end of step N.
    tokens = sum(counts[1:len(ends)])
    seconds = ends[-1] - ends[0]
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"kind": kind, "packing": packing, "tokens_per_s": tokens / seconds, "peak_rss_mb": peak_mb,
            "sec_per_step": seconds / max(len(ends) - 1, 1), "tokens_per_step": tokens / max(len(ends) - 1, 1),
            "gradient_checkpointing": gradient_checkpointing}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "PACKING"))
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--trl-no-gc", action="store_true",
                    help="also run TRL with gradient checkpointing off (not its default)")
    args = ap.parse_args()
    if args.worker:
        kind, packing = args.worker[0], args.worker[1] == "1"
        print("RESULT " + json.dumps(worker(kind, packing, args.steps, DEFAULTS)), flush=True)
        return
    results = []
    plan = [("toolkit", "0"), ("trl", "0"), ("toolkit", "1"), ("trl", "1")]
    if args.trl_no_gc:
        plan += [("trl_no_gc", "0"), ("trl_no_gc", "1")]
    for kind, packing in plan:
        t0 = time.perf_counter()
        print(f"running {kind} packing={packing} ...", flush=True)
        r = run_in_subprocess(__file__, ["--steps", str(args.steps), "--worker", kind, packing])
        r["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(f"  {r['tokens_per_s']:.0f} tokens/s, {r['sec_per_step']:.2f} s/step, peak RSS {r['peak_rss_mb']:.0f} MB, "
              f"gradient checkpointing {r['gradient_checkpointing']}", flush=True)
    by = {(r["kind"], r["packing"]): r for r in results}
    s = DEFAULTS
    print(f"\nSFT, SmolLM2-135M-Instruct, batch {s['batch_size']}, max_length {s['max_length']}, rows of {s['min_len']}-"
          f"{s['max_length']} tokens, {args.steps} steps (first excluded from timing)")
    print("| mode | reference | ours tokens/s | TRL tokens/s | speed ratio (ours/TRL) | ours peak RSS MB | TRL peak RSS MB "
          "| memory ratio (ours/TRL) |")
    print("|---|---|---|---|---|---|---|---|")
    for ref, label in (("trl", "TRL defaults"), ("trl_no_gc", "TRL, gradient checkpointing off (not its default)")):
        for packing in (False, True):
            if (ref, packing) not in by:
                continue
            o, t = by[("toolkit", packing)], by[(ref, packing)]
            print(f"| packing {'on' if packing else 'off'} | {label} (gradient checkpointing {t['gradient_checkpointing']}; "
                  f"ours {o['gradient_checkpointing']}) | {o['tokens_per_s']:.0f} | {t['tokens_per_s']:.0f} | "
                  f"{o['tokens_per_s'] / t['tokens_per_s']:.2f} | {o['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | "
                  f"{o['peak_rss_mb'] / t['peak_rss_mb']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": DEFAULTS, "steps": args.steps, "results": results, "provenance": provenance()}, f,
                      indent=2)


if __name__ == "__main__":
    main()
