"""The memory model's settings for long-context GRPO (docs/distributed.md, "Long context"): 8k and 32k completions.

    python bench/long_context_memory.py --json bench/results/long_context_memory.json   # ~5 minutes on 2 CPU cores

For two Llama-architecture configs built offline with the sizes of Qwen2.5-1.5B and Llama-3.1-8B (no weights are
loaded or allocated), `toolkit.core.memory.estimate_step_memory` gives the peak tensor memory per GPU of one
steady-state GRPO step: a micro-batch of one completion of L tokens after a 512-token prompt (the group of 8
spans micro-batches, as long-context recipes run), bf16 weights and Adam state ("full") or LoRA r=16 adapters on
every linear layer of bf16 weights, no reference model (GRPO's default, beta = 0; beta > 0 adds a frozen copy of
the weights to "full", nothing to LoRA, whose reference is the base with adapters off), generation one row
at a time in the trainer's process (a `toolkit vllm-serve` server keeps its own cache elsewhere). Each cell is one
setting of the ladder `toolkit estimate --gpu_gib` climbs: activation checkpointing; + activation offloading;
+ sequence parallelism over 2, 4 or 8 ranks (those dividing the heads). The last two columns name the first
setting of the ladder that fits a 24 GB and an 80 GB card with 10% kept for kernel workspaces and fragmentation
(22.0 / 79.1 GiB as cards report them). Weights are not sharded here: with FSDP2 each rank holds 1/N of the
weights, gradients and Adam state besides. Not measured on a GPU (none lent); the memory model is checked
against measured CPU peaks within 3% (tests/trainers/test_memory_model.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance  # noqa: E402
from memory_table import config  # noqa: E402  (the same offline configs as the memory table)

MODELS = {  # name: (hidden, layers, heads, kv heads, MLP, vocabulary, tied head)
    "1.5B (Qwen2.5-1.5B sizes)": (1536, 28, 12, 2, 8960, 151936, True),
    "8B (Llama-3.1-8B sizes)": (4096, 32, 32, 8, 14336, 128256, False),
}
LENGTHS = (8192, 32768)
MODES = {"full, bf16": dict(dtype="bfloat16", bf16=True), "LoRA r=16": dict(dtype="bfloat16", bf16=True, lora_r=16)}
CARDS = {"24 GB": 22.0, "80 GB": 79.1}


def ladder(heads: int) -> list[tuple[str, dict]]:
    steps = [("checkpointing", dict(activation_checkpointing=True)),
             ("+ offloading", dict(activation_checkpointing=True, activation_offloading=True))]
    steps += [(f"+ SP {sp}", dict(activation_checkpointing=True, activation_offloading=True, sequence_parallel_size=sp))
              for sp in (2, 4, 8) if heads % sp == 0]
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers.utils import logging as hf_logging

    from toolkit.core.memory import estimate_step_memory

    hf_logging.set_verbosity_error()  # checkpointing's use_cache notice would land inside the table

    started = time.perf_counter()
    cells = []
    names = [name for name, _ in ladder(32)]
    print("| model | mode | L | " + " | ".join(names) + " | fits 24 GB with | fits 80 GB with |")
    print("|---|---|---|" + "---|" * (len(names) + 2))
    for name, dims in MODELS.items():
        cfg = config(dims)
        for mode, kw in MODES.items():
            for length in LENGTHS:
                peaks = {}
                for setting, extra in ladder(dims[2]):
                    est = estimate_step_memory(cfg, "grpo", batch_size=1, num_generations=8, prompt_len=512,
                                               completion_len=length, reference_model=False, generation_rows=1,
                                               **kw, **extra)
                    peaks[setting] = est.peak / 2**30
                    cells.append({"model": name, "mode": mode, "length": length, "setting": setting,
                                  "peak_gib": peaks[setting], "activations_gib": est.activations / 2**30,
                                  "pinned_host_gib": est.details["offloaded_bytes"] / 2**30,
                                  "weights_gib": est.weights / 2**30, "optimizer_gib": est.optimizer / 2**30})
                first = {card: next((s for s, p in peaks.items() if p * 1.1 <= cap), "none")
                         for card, cap in CARDS.items()}
                row = [f"{peaks[s]:.1f}" if s in peaks else "-" for s in names]
                print(f"| {name} | {mode} | {length // 1024}k | " + " | ".join(row) + f" | {first['24 GB']} | "
                      f"{first['80 GB']} |", flush=True)
    host = max(c["pinned_host_gib"] for c in cells)
    print(f"\nCells: peak GiB per GPU of one GRPO step. Offloading holds up to {host:.1f} GiB of pinned host memory "
          f"per rank in these cells (before the host allocator's rounding). {len(cells)} estimates in "
          f"{time.perf_counter() - started:.0f} s.")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"lengths": LENGTHS, "cards_gib": CARDS, "cells": cells, "provenance": provenance()}, fh,
                      indent=2)


if __name__ == "__main__":
    main()
