"""Benchmark: peak memory of per-token log-probs, chunked (ours) vs naive full logits, forward + backward.

    python bench/logps_memory.py            # 1,024 tokens, SmolLM2's head: hidden 576, vocab 49,152

Each variant runs in its own process; printed is the peak RSS growth over the inputs alone
(hidden states and LM-head weight with gradients), the time, and the ratio ours / naive.
The naive variant is what `log_softmax(model(...).logits).gather(...)` costs: a [1024, 49152]
fp32 logits tensor (201 MB), its log-softmax, and their gradients.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

N, H, V = 1024, 576, 49152


def worker(kind: str, chunk: int) -> dict:
    import torch

    torch.manual_seed(0)
    hidden = torch.randn(N, H, requires_grad=True)
    weight = (torch.randn(V, H) * 0.02).requires_grad_()
    targets = torch.randint(0, V, (N,))
    # Pre-allocate *and touch* the gradients (torch.zeros may map pages lazily) so both variants are
    # charged only for their intermediates.
    hidden.grad = torch.full_like(hidden, 0.0)
    weight.grad = torch.full_like(weight, 0.0)
    from toolkit.core.numerics import chunked_token_logps

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    seconds = 0.0
    for _ in range(2):  # the second call is timed (the first pays one-time thread-pool and page costs)
        t = time.perf_counter()
        if kind == "naive":
            logps = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(-1, targets[:, None]).squeeze(-1)
        else:
            logps = chunked_token_logps(hidden, weight, targets, chunk_size=chunk)
        logps.sum().backward()
        seconds = time.perf_counter() - t
        checksum = float(logps.detach().sum())
        del logps
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"kind": kind, "chunk": chunk, "extra_peak_mb": peak - base, "seconds": seconds,
            "checksum": checksum}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print("RESULT " + json.dumps(worker(sys.argv[2], int(sys.argv[3]))))
        return
    rows = []
    for kind, chunk in (("naive", 0), ("chunked", 1024), ("chunked", 512), ("chunked", 256), ("chunked", 128)):
        out = subprocess.run([sys.executable, __file__, "--worker", kind, str(chunk)], capture_output=True, text=True)
        line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
        rows.append(json.loads(line[7:]))
    naive = rows[0]
    print(f"per-token log-probs, forward + backward, N={N} tokens, H={H}, V={V}")
    print("| variant | extra peak RSS MB | ratio to naive | seconds (2nd call) |")
    print("|---|---|---|---|")
    for r in rows:
        name = "naive (full logits)" if r["kind"] == "naive" else f"chunked, chunk_size={r['chunk']}"
        print(f"| {name} | {r['extra_peak_mb']:.0f} | {r['extra_peak_mb'] / naive['extra_peak_mb']:.2f} | "
              f"{r['seconds']:.2f} |")
    assert all(abs(r["checksum"] - naive["checksum"]) < 1e-3 * abs(naive["checksum"]) for r in rows), "values differ"


if __name__ == "__main__":
    main()
