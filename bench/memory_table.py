"""The memory model's table for docs/gpu.md: which model sizes and lengths fit 24, 40 and 80 GB cards.

    python bench/memory_table.py              # about 10 minutes on 2 CPU cores (fake tensors: nothing allocated)

For four Llama-architecture configs built offline with the sizes of Qwen2.5-0.5B, Qwen2.5-1.5B, Llama-3.2-3B and
Llama-3.1-8B (hidden size, layers, heads, KV heads, MLP width, vocabulary, tied head as theirs; no weights are
loaded or allocated), `toolkit.core.memory.estimate_step_memory` gives the peak tensor memory of one steady-state
step for SFT, DPO and GRPO at three lengths, in three modes:

- full, mixed: full fine-tuning, float32 master weights and Adam state, bf16 autocast (the GPU default);
- full, bf16: full fine-tuning with bf16 weights and Adam state (`model_dtype = "bfloat16"`);
- LoRA r=16: adapters on every linear layer of bf16 base weights.

Micro-batches: SFT one example of L tokens; DPO one pair (a 512-token prompt, chosen and rejected of L tokens);
GRPO 8 completions of L tokens sharing one 512-token prompt (the generation's KV cache counted). Activation
checkpointing on (the setting that fits the most; off costs more, `toolkit estimate` gives it). A cell is the
peak in GiB and the cards it fits with 10% kept for kernel workspaces and fragmentation (24 / 40 / 80 GB, in
GiB as cards report them: 22.0 / 37.5 / 79.1). Memory model checked against measured peaks within 3% on CPU
(tests/trainers/test_memory_model.py); on a GPU it is unmeasured until scripts/gpu_run.sh has run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance  # noqa: E402

MODELS = {  # name: (hidden, layers, heads, kv heads, MLP, vocabulary, tied head)
    "0.5B (Qwen2.5-0.5B sizes)": (896, 24, 14, 2, 4864, 151936, True),
    "1.5B (Qwen2.5-1.5B sizes)": (1536, 28, 12, 2, 8960, 151936, True),
    "3B (Llama-3.2-3B sizes)": (3072, 28, 24, 8, 8192, 128256, True),
    "8B (Llama-3.1-8B sizes)": (4096, 32, 32, 8, 14336, 128256, False),
}
LENGTHS = (1024, 4096, 16384)
MODES = {"full, mixed": dict(dtype="float32", bf16=True), "full, bf16": dict(dtype="bfloat16", bf16=True),
         "LoRA r=16": dict(dtype="bfloat16", bf16=True, lora_r=16)}
CARDS = {"24": 22.0, "40": 37.5, "80": 79.1}  # GiB a card of that many GB reports


def config(dims):
    from transformers import LlamaConfig

    h, layers, heads, kv, mlp, vocab, tied = dims
    return LlamaConfig(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       intermediate_size=mlp, vocab_size=vocab, tie_word_embeddings=tied,
                       max_position_embeddings=32768)


def shape(trainer: str, length: int) -> dict:
    if trainer == "sft":
        return dict(batch_size=1, seq_len=length)
    if trainer == "dpo":
        return dict(batch_size=1, prompt_len=512, completion_len=length)
    return dict(batch_size=8, num_generations=8, prompt_len=512, completion_len=length)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--models", default=None, help="comma-separated prefixes of the model names (default all)")
    args = ap.parse_args()
    from toolkit.core.memory import estimate_step_memory

    started = time.perf_counter()
    cells = []
    print("| model | trainer | mode | " + " | ".join(f"L = {n // 1024}k" for n in LENGTHS) + " |")
    print("|---|---|---|" + "---|" * len(LENGTHS))
    for name, dims in MODELS.items():
        if args.models and not any(name.startswith(p) for p in args.models.split(",")):
            continue
        cfg = config(dims)
        for trainer in ("sft", "dpo", "grpo"):
            for mode, kw in MODES.items():
                row = []
                for length in LENGTHS:
                    est = estimate_step_memory(cfg, trainer, activation_checkpointing=True, **kw,
                                               **shape(trainer, length))
                    gib = est.peak / 2**30
                    fits = [card for card, cap in CARDS.items() if gib * 1.1 <= cap]
                    cells.append({"model": name, "trainer": trainer, "mode": mode, "length": length, "peak_gib": gib,
                                  "weights_gib": est.weights / 2**30, "activations_gib": est.activations / 2**30,
                                  "kv_cache_gib": est.kv_cache / 2**30, "fits": fits})
                    row.append(f"{gib:.1f} ({'/'.join(fits) or 'none'})")
                print(f"| {name} | {trainer.upper()} | {mode} | " + " | ".join(row) + " |", flush=True)
    print(f"\nCells: peak GiB of one step (the cards, in GB, it fits with 10% to spare). {len(cells)} estimates in "
          f"{time.perf_counter() - started:.0f} s.")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"lengths": LENGTHS, "cards_gib": CARDS, "cells": cells, "provenance": provenance()}, fh,
                      indent=2)


if __name__ == "__main__":
    main()
