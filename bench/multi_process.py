"""Benchmark: 2 processes x 1 thread (torchrun, gloo, DDP) against 1 process x 2 threads, on the embedded
SmolLM2-135M-Instruct, for SFT and GRPO, in one run.

    python bench/multi_process.py                          # about 8 minutes on 2 CPU cores
    python bench/multi_process.py --steps 3 --json bench/results/multiprocess.json

Same model, data, global batch and settings in both layouts: SFT takes 8 rows per optimizer step
(1 x 8, or 2 ranks x 4), GRPO 4 prompts x 4 completions per step (1 x 16 or 2 x 8 completions) with
every completion exactly `max_completion_length` tokens long (no stop token), so both layouts do the
same work per step. Printed: seconds per step after the first (warm-up), tokens per second over the
whole step (SFT: the real tokens trained on; GRPO: prompt + completion tokens generated and trained
on), and the ratio 2x1 / 1x2. On 2 cores this measures the cost of splitting the cores between
processes (gradient all-reduce over gloo, two copies of the model, less intra-op parallelism per
matmul), not a speed-up: the two layouts use the same 2 cores.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import step_timer  # noqa: E402

SFT = dict(global_batch=8, max_length=256)
GRPO = dict(prompts=4, generations=4, max_completion_length=32)


def sft_rows(n: int = 64) -> list[dict]:
    words = ("the model learns to add numbers and to stop when the answer is complete while the data "
             "comes in many different lengths").split()
    return [{"text": " ".join(words[(i + j) % len(words)] for j in range(40 + 7 * (i % 12)))} for i in range(n)]


def worker(kind: str, steps: int) -> dict | None:
    import torch

    from toolkit import embedded_model_path
    from toolkit.core.data import detect_format, tokenize_for_sft

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    path = str(embedded_model_path())
    timer = step_timer()
    common = dict(output_dir=f"/tmp/bench-mp-{kind}-{world}", max_steps=steps, logging_steps=1, save_strategy="no",
                  report_to="none", seed=0, disable_tqdm=True, learning_rate=1e-6)
    if kind == "sft":
        from toolkit import SFTConfig, SFTTrainer

        rows = sft_rows()
        trainer = SFTTrainer(path, SFTConfig(**common, max_length=SFT["max_length"],
                                             per_device_train_batch_size=SFT["global_batch"] // world),
                             train_dataset=rows, callbacks=[timer])
        tok = trainer.processing_class
        examples, _ = tokenize_for_sft(rows, detect_format(rows), tok, max_length=SFT["max_length"],
                                       completion_only_loss=False, assistant_only_loss=False)
        # every step trains on 8 of these rows: the mean row length x 8 is the step's token count in both layouts
        tokens_per_step = SFT["global_batch"] * sum(len(e["input_ids"]) for e in examples) / len(examples)
    else:
        from toolkit import GRPOConfig, GRPOTrainer
        from toolkit.core.tasks import arithmetic

        data = arithmetic(64, seed=0, kind="prompt_only")
        cfg = GRPOConfig(**common, per_device_train_batch_size=GRPO["prompts"] * GRPO["generations"] // world,
                         num_generations=GRPO["generations"], max_completion_length=GRPO["max_completion_length"],
                         stop_token_ids=[-1])  # an id never sampled: every completion is max_completion_length long
        trainer = GRPOTrainer(path, [lambda completions, **kw: [float(len(c) % 3) for c in completions]], cfg,
                              train_dataset=data, callbacks=[timer])
        tok = trainer.processing_class
        prompt_tokens = sum(len(tok.apply_chat_template(r["prompt"], add_generation_prompt=True)["input_ids"])
                            for r in data) / len(data)
        tokens_per_step = GRPO["prompts"] * GRPO["generations"] * (prompt_tokens + GRPO["max_completion_length"])
    started = time.perf_counter()
    trainer.train()
    ends = timer.ends
    if not trainer.is_world_process_zero():
        return None
    per_step = (ends[-1] - ends[0]) / max(len(ends) - 1, 1)
    return {"kind": kind, "world": world, "threads_per_process": torch.get_num_threads(), "steps": len(ends),
            "s_per_step": per_step, "tokens_per_step": tokens_per_step, "tokens_per_s": tokens_per_step / per_step,
            "wall_s": time.perf_counter() - started,
            "peak_rss_mb_rank0": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def launch(kind: str, world: int, steps: int) -> dict:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(2 // world),
           "ACCELERATE_USE_CPU": "true"}
    script = os.path.abspath(__file__)
    if world == 1:
        cmd = [sys.executable, script, "--worker", kind, "--steps", str(steps)]
    else:
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
        cmd = [torchrun, "--nproc_per_node", str(world), "--master_port", "29571", script, "--worker", kind,
               "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stdout[-3000:], proc.stderr[-6000:])
        raise SystemExit(f"{kind} with {world} processes failed")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--json", default=None, help="also write the results (and the commit) to this file")
    args = ap.parse_args()
    if args.worker:
        result = worker(args.worker, args.steps)
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        from toolkit.core.distributed import exit_process

        exit_process(0)  # a rank can abort in interpreter teardown after finishing (see exit_process)
    results = []
    for kind in ("sft", "grpo"):
        for world in (1, 2):
            print(f"running {kind}, {world} process(es) x {2 // world} thread(s) ...", flush=True)
            r = launch(kind, world, args.steps)
            results.append(r)
            print(f"  {r['s_per_step']:.2f} s/step, {r['tokens_per_s']:.0f} tokens/s, rank-0 peak RSS "
                  f"{r['peak_rss_mb_rank0']:.0f} MB", flush=True)
    by = {(r["kind"], r["world"]): r for r in results}
    print("\n| trainer | 1 process x 2 threads tokens/s | 2 processes x 1 thread tokens/s | ratio 2x1 / 1x2 |")
    print("|---|---|---|---|")
    for kind in ("sft", "grpo"):
        one, two = by[(kind, 1)], by[(kind, 2)]
        print(f"| {kind} | {one['tokens_per_s']:.0f} | {two['tokens_per_s']:.0f} | "
              f"{two['tokens_per_s'] / one['tokens_per_s']:.2f} |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "steps": args.steps, "sft": SFT, "grpo": GRPO, "results": results}, f,
                      indent=2)


if __name__ == "__main__":
    main()
