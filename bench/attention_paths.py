"""toolkit_varlen's two paths on this machine: one sdpa call per packed segment (the CPU's path) against a few padded
calls (every other device's path), forward + backward of SmolLM2-135M over a packed shared-prompt micro-batch.

    python bench/attention_paths.py            # about 2 minutes on 2 cores

Not part of bench/run_all.py and not a comparison with TRL: it shows why the CPU keeps the loop. Prints the best of
two timings of each path, for float32 and bf16 autocast, at two micro-batch sizes. Random prompt and completion
tokens; completion lengths uniform in [max/2, max].
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance  # noqa: E402


def main() -> None:
    from transformers import AutoModelForCausalLM

    from toolkit.core import attention
    from toolkit.core.attention import use_varlen_attention
    from toolkit.core.models import embedded_model_path
    from toolkit.core.packing import completion_logps, group_by_prompt, pack_shared_prompts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(embedded_model_path()), dtype=torch.float32)
    use_varlen_attention(model)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n_prompts, group, prompt_len, max_len in ((4, 8, 40, 16), (8, 8, 40, 64)):
        prompts = [torch.randint(3, 40000, (prompt_len,), generator=g).tolist() for _ in range(n_prompts)]
        prompts = [p for p in prompts for _ in range(group)]
        completions = [torch.randint(3, 40000, (int(torch.randint(max_len // 2, max_len + 1, (1,), generator=g)),),
                                     generator=g).tolist() for _ in prompts]
        batch = pack_shared_prompts(prompts, completions, group_by_prompt(prompts))
        for bf16 in (False, True):
            times: dict[str, list[float]] = {}
            for path in ("loop", "padded", "loop", "padded"):
                attention._batched_segments = lambda t, path=path: path == "padded"
                model.zero_grad()
                started = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                    logps = completion_logps(model, batch)
                logps.sum().backward()
                times.setdefault(path, []).append(time.perf_counter() - started)
            row = {"prompts": n_prompts, "completions_per_prompt": group, "max_completion_tokens": max_len,
                   "bf16_autocast": bf16, "loop_s": min(times["loop"]), "padded_s": min(times["padded"])}
            rows.append(row)
            print(f"{n_prompts} x {group} completions of up to {max_len} tokens, bf16 autocast {bf16}: loop "
                  f"{row['loop_s']:.2f} s, padded {row['padded_s']:.2f} s (padded/loop "
                  f"{row['padded_s'] / row['loop_s']:.2f})", flush=True)
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention_paths.json")
    with open(out, "w") as f:
        json.dump({"rows": rows, "provenance": provenance()}, f, indent=2)


if __name__ == "__main__":
    main()
