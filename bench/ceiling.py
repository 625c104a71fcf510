"""What this machine can do at most for the embedded model: the ceiling every benchmark row is a fraction of.

    python bench/ceiling.py --json bench/results/ceiling.json      # about 1 minute on 2 CPU cores

Measured here, in this process (torch's default threads):
- fp32 matmul FLOP/s at the shapes training runs (4,096 tokens x the model's MLP) and a square 2,048
  GEMM; the larger is this machine's matmul peak. Also at 32 rows (one decode step of 32 sequences).
- memory bandwidth: a 512 MB copy (bytes read + written per second), what decoding at small batch
  is bound by (every step reads every weight).

Converted for SmolLM2-135M (the embedded model), from its config:
- training: 6 FLOPs per matmul parameter per token (forward + backward; the LM head counted for every
  token, as SFT computes it) + causal attention (forward 2 x 2 x layers x heads x head_dim x mean
  context, x3 with backward) -> tokens/s ceiling at a given sequence length;
- decoding at batch B: min(compute: 2 FLOPs per matmul parameter per token, the body at the 32-row MLP
  rate and the LM head at the 32-row head rate; memory: bandwidth / (weight bytes / B)).
Then our decode loop (`TransformersBackend`, batch 32 = 4 prompts x 8 samples, 32 tokens, no stop
token) is timed and printed as a fraction of both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance  # noqa: E402


def matmul_flops(m: int, k: int, n: int, seconds: float = 1.5) -> float:
    """Best-of FLOP/s of an [m, k] x [k, n] fp32 matmul over about `seconds` of repeats."""
    import torch

    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    torch.mm(a, b, out=out)
    best, started = float("inf"), time.perf_counter()
    while time.perf_counter() - started < seconds:
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best


def copy_bandwidth(mb: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a large tensor copy (read + write)."""
    import torch

    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def model_costs(config) -> dict:
    """Matmul parameter counts of a Llama-style decoder (what each token multiplies through)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", heads) or heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    inter = config.intermediate_size
    per_layer = h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * inter
    return {"hidden": h, "layers": layers, "vocab": config.vocab_size, "body_matmul_params": per_layer * layers,
            "head_matmul_params": h * config.vocab_size, "attention_width": heads * head_dim}


def train_flops_per_token(costs: dict, seq_len: int) -> float:
    """Forward + backward FLOPs per token of a full-vocabulary causal-LM step on sequences of seq_len."""
    matmul = 6 * (costs["body_matmul_params"] + costs["head_matmul_params"])
    attention = 3 * 4 * costs["layers"] * costs["attention_width"] * (seq_len + 1) / 2  # QK^T, AV; mean causal context
    return matmul + attention


def decode_ceiling(costs: dict, rate_body: float, rate_head: float, bandwidth: float, batch: int,
                   weight_bytes: int) -> dict:
    # seconds per token: the body's matmuls at the 32-row MLP rate, the LM head's at the 32-row head rate
    seconds = 2 * costs["body_matmul_params"] / rate_body + 2 * costs["head_matmul_params"] / rate_head
    compute = 1 / seconds
    memory = bandwidth / (weight_bytes / batch)
    return {"compute_tokens_per_s": compute, "memory_tokens_per_s": memory, "tokens_per_s": min(compute, memory),
            "bound": "memory" if memory < compute else "compute"}


def measure_decode(model, batch_prompts: int = 4, n: int = 8, tokens: int = 32) -> float:
    import torch

    from toolkit.core.generation import SamplingParams, TransformersBackend

    backend = TransformersBackend(model, pad_token_id=0)
    prompts = [[1] + list(range(100 + i, 140 + i)) for i in range(batch_prompts)]  # 41-token prompts
    params = SamplingParams(max_tokens=tokens, temperature=0.7, stop_token_ids=())
    backend.generate(prompts, params, n=n, seed=0)  # warm-up
    best = float("inf")
    for seed in (1, 2):
        with torch.no_grad():
            best = min(best, _timed(lambda: backend.generate(prompts, params, n=n, seed=seed)))
    return batch_prompts * n * tokens / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    from toolkit import embedded_model_path

    model = AutoModelForCausalLM.from_pretrained(str(embedded_model_path()), dtype=torch.float32)
    costs = model_costs(model.config)
    h, inter = costs["hidden"], model.config.intermediate_size
    shapes = {"square 2048": (2048, 2048, 2048), "4096 tokens x MLP": (4096, h, inter),
              "32 rows x MLP (decode)": (32, h, inter), "32 rows x LM head (decode)": (32, h, costs["vocab"])}
    flops = {name: matmul_flops(*shape) for name, shape in shapes.items()}
    peak = max(flops["square 2048"], flops["4096 tokens x MLP"])
    bandwidth = copy_bandwidth()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    train = {str(L): peak / train_flops_per_token(costs, L) for L in (128, 512, 1024)}
    decode = decode_ceiling(costs, flops["32 rows x MLP (decode)"], flops["32 rows x LM head (decode)"], bandwidth, 32,
                            weight_bytes)
    measured = measure_decode(model)
    torch_threads = torch.get_num_threads()
    print(f"matmul fp32 on {torch_threads} threads (GFLOP/s): "
          + ", ".join(f"{k} {v / 1e9:.0f}" for k, v in flops.items()))
    print(f"peak matmul: {peak / 1e9:.0f} GFLOP/s; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"SmolLM2-135M: {costs['body_matmul_params'] / 1e6:.1f}M body + {costs['head_matmul_params'] / 1e6:.1f}M "
          f"LM-head matmul parameters, {weight_bytes / 2**20:.0f} MB of fp32 weights")
    print("training ceiling (forward + backward, full-vocabulary head), tokens/s at sequence length: "
          + ", ".join(f"{k}: {v:.0f}" for k, v in train.items()))
    print(f"decode ceiling at batch 32: compute {decode['compute_tokens_per_s']:.0f} tokens/s, memory "
          f"{decode['memory_tokens_per_s']:.0f} tokens/s ({decode['bound']}-bound)")
    print(f"our decode loop (TransformersBackend) at batch 32, 32 tokens: {measured:.0f} tokens/s = "
          f"{measured / decode['compute_tokens_per_s']:.2f} of the compute ceiling, "
          f"{measured / decode['memory_tokens_per_s']:.2f} of the memory ceiling")
    if args.json:
        out = {"threads": torch_threads, "matmul_flops": flops, "peak_matmul_flops": peak,
               "copy_bandwidth_bytes_per_s": bandwidth, "model": costs, "weight_bytes": weight_bytes,
               "train_tokens_per_s": train, "decode_batch32": decode, "our_decode_batch32_tokens_per_s": measured,
               "provenance": provenance()}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
