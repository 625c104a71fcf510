"""Decoding with finished rows dropped from the batch, against keeping them, and against transformers' generate.

    python bench/decode_batch.py --json bench/results/decode_batch.json      # about 5 minutes on 2 CPU cores

The embedded SmolLM2-135M-Instruct in float32, GRPO's shape: batches of 4 arithmetic chat prompts x 8 samples
(32 sequences), temperature 0.7, no top-k/top-p, stopping at the end-of-turn token, at two caps on new tokens
(16: the GRPO benchmark's, where most completions run to the cap; 64: where they end at their own lengths).
Three sides, each decoding the same batches with the same seeds, best of 2 repeats (each repeat uses the same
seeds, so the repeats do the same work and only their times differ):
- `dropped`: our TransformersBackend as it ships (a quarter of the batch finished -> those rows leave it);
- `kept`: the same backend keeping every row to the end (the loop before rows were dropped; same draws);
- `transformers`: `model.generate(do_sample=True, num_return_sequences=8)` on the left-padded prompts, what
  TRL's GRPOTrainer runs without vLLM (it keeps finished rows and samples with torch.multinomial).
The two loops of ours draw the same uniforms, so their tokens are equal up to the rounding of a smaller batch's
kernels (the script prints whether the token counts matched); transformers' draws differ, so its count is
printed beside its time and its tokens/s is the comparable figure. Times are whole `generate` calls, prefill
included: our side also prefills the chat template's shared start once and each prompt once for its 8 samples,
where `generate` prefills all 32 rows, so the ratio to transformers is not dropping's alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance  # noqa: E402

BATCHES, PROMPTS_PER_BATCH, SAMPLES, TEMPERATURE, REPEATS = 3, 4, 8, 0.7, 2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--caps", default="16,64", help="caps on new tokens, comma-separated")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import toolkit.core.generation as generation
    from toolkit import embedded_model_path
    from toolkit.core.tasks import arithmetic

    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = arithmetic(BATCHES * PROMPTS_PER_BATCH, seed=0)
    prompts = []
    for r in rows:
        ids = tok.apply_chat_template(r["prompt"], add_generation_prompt=True)
        prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
    batches = [prompts[i * PROMPTS_PER_BATCH:(i + 1) * PROMPTS_PER_BATCH] for i in range(BATCHES)]
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def ours(cap: int, drop: bool, repeat: int) -> tuple[float, int]:
        backend = generation.TransformersBackend(model, pad_token_id=tok.pad_token_id)
        backend._compact_finished_rows = drop
        params = generation.SamplingParams(max_tokens=cap, temperature=TEMPERATURE, stop_token_ids=(eos,))
        started, tokens = time.perf_counter(), 0
        for i, batch in enumerate(batches):
            groups = backend.generate(batch, params, n=SAMPLES, seed=i)
            tokens += sum(len(c.token_ids) for g in groups for c in g)
        return time.perf_counter() - started, tokens

    def reference(cap: int, repeat: int) -> tuple[float, int]:
        started, tokens = time.perf_counter(), 0
        for i, batch in enumerate(batches):
            torch.manual_seed(i)
            width = max(len(p) for p in batch)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=TEMPERATURE,
                                     top_k=0, top_p=1.0, max_new_tokens=cap, num_return_sequences=SAMPLES,
                                     eos_token_id=eos, pad_token_id=tok.pad_token_id)
            new = out[:, width:]
            # tokens up to and including the first end-of-turn (generate pads after it)
            ended = (new == eos).int().cumsum(-1)
            tokens += int(((ended == 0) | ((ended == 1) & (new == eos))).sum())
        return time.perf_counter() - started, tokens

    results: dict = {}
    for cap in [int(c) for c in args.caps.split(",")]:
        sides = {"dropped": lambda r, cap=cap: ours(cap, True, r), "kept": lambda r, cap=cap: ours(cap, False, r),
                 "transformers": lambda r, cap=cap: reference(cap, r)}
        runs: dict = {name: [] for name in sides}
        for repeat in range(REPEATS):  # interleaved, so a slower minute of the machine hits every side
            for name, run in sides.items():
                runs[name].append(run(repeat))
        cap_results = {}
        for name, times in runs.items():
            seconds = min(t for t, _ in times)
            tokens = times[0][1]  # the same seeds each repeat: the same work (recorded in repeats_did_the_same_work)
            cap_results[name] = {"seconds": round(seconds, 2), "generated_tokens": tokens,
                                 "tokens_per_s": round(tokens / seconds, 1), "all_seconds": [round(t, 2) for t, _ in times]}
        cap_results["repeats_did_the_same_work"] = {name: len({n for _, n in times}) == 1 for name, times in runs.items()}
        results[str(cap)] = cap_results
        d, k, t = cap_results["dropped"], cap_results["kept"], cap_results["transformers"]
        print(f"max {cap} new tokens, {BATCHES} batches of {PROMPTS_PER_BATCH} prompts x {SAMPLES} (best of {REPEATS}):",
              flush=True)
        print("| side | seconds | generated tokens | tokens/s |\n|---|---|---|---|")
        for name in sides:
            r = cap_results[name]
            print(f"| {name} | {r['seconds']:.2f} | {r['generated_tokens']} | {r['tokens_per_s']:.0f} |")
        print(f"dropping finished rows: {k['seconds'] / d['seconds']:.2f}x the speed of keeping them (same tokens: "
              f"{d['generated_tokens'] == k['generated_tokens']}); {d['tokens_per_s'] / t['tokens_per_s']:.2f}x "
              f"transformers generate's tokens/s\n", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": {"batches": BATCHES, "prompts_per_batch": PROMPTS_PER_BATCH, "samples": SAMPLES,
                                    "temperature": TEMPERATURE, "repeats": REPEATS},
                       "results": results, "provenance": provenance()}, f, indent=2)


if __name__ == "__main__":
    main()
