"""Benchmark: GRPO steps per minute with each generation backend, one run, in .venv-vllm.

    bash scripts/setup-vllm.sh && .venv-vllm/bin/python bench/grpo_vllm.py     # ~8 minutes on 2 CPU cores

Same model (the embedded SmolLM2-135M-Instruct), prompts (generated arithmetic), 4 prompts x 8
completions per step, max 16 new tokens, temperature 0.7, dapo loss, no KL, numeric-match reward,
for: our GRPOTrainer with the transformers backend, with the colocated vLLM engine
(generation_backend="vllm", weights pushed every step), and with `toolkit vllm-serve` in its own
process (generation_backend="vllm-server", weights uploaded over HTTP every step), the same with LoRA
as `--lora_r 16` makes it (every linear layer of the blocks: after the first sync, only the blocks
holding adapters are uploaded), and the colocated engine with LoRA both ways: `lora_sync = "merged"` (the
adapted blocks merged and sent) against `"adapter"` (the base weights once, then the adapter alone, loaded as a
vLLM LoRA); and TRL's
GRPOTrainer with use_vllm=True, vllm_mode="colocate" (reported as failed if it does not run on
this CPU). Each configuration runs in its own process; engine start-up is excluded (the first step
is excluded from timing). Printed: steps per minute, generation seconds per step, weight-sync seconds (median
and max of the syncs of steps 2..N: the first is the engine's first reload, or with LoRA the full upload; then
every sync, with the server's own read / parse / load seconds), the last sync's size, and ratios to our
transformers backend.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_args, provenance, run_each, step_timer  # noqa: E402

SETTINGS = dict(prompts_per_step=4, num_generations=8, max_completion_length=16, temperature=0.7, lr=1e-5)
KINDS = ("transformers", "vllm", "vllm-server", "vllm-server-lora", "vllm-lora-merged", "vllm-lora-adapter",
         "trl-vllm-colocate")
# LoRA as `toolkit grpo --lora_r 16` makes it (all linear layers of the blocks): after the first sync only the
# blocks holding adapters are sent
LORA = dict(r=16, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")


def sync_recorder(trainer):
    """A TrainerCallback recording, at the end of every step that uploaded new weights (the backend's
    `weights_version` moved), the seconds of that upload (`last_sync_s`: the engine's load, or the HTTP upload
    and the server's load; gathering or merging the weights is not in it) and, for the server, its own split of
    them (`last_sync_split`: read_s off the socket, parse_s, load_s in the engine). Our vLLM backends sync
    before each step's generation (`sync_every` is 1 here, one round per step); a step with several syncs
    would record its last. Empty for backends without one."""
    from transformers import TrainerCallback

    class SyncRecorder(TrainerCallback):
        def __init__(self):
            self.seconds: list[float] = []
            self.splits: list[dict] = []
            self._version = None

        def on_step_end(self, args, state, control, **kw):
            backend = getattr(trainer, "generation_backend", None)
            version = getattr(backend, "weights_version", None)
            if version is not None and version != self._version and getattr(backend, "last_sync_s", 0):
                self._version = version
                self.seconds.append(backend.last_sync_s)
                # one entry per sync (None where the backend has no split), so the two lists stay aligned
                self.splits.append(dict(getattr(backend, "last_sync_split", None) or {}) or None)

    return SyncRecorder()


def worker(kind: str, steps: int) -> dict:
    import torch

    from toolkit import embedded_model_path
    from toolkit.core.rewards import numeric_match
    from toolkit.core.tasks import arithmetic

    torch.manual_seed(0)
    path = str(embedded_model_path())
    rows = arithmetic(64, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    s = SETTINGS
    common = dict(output_dir=f"/tmp/bench-grpo-vllm-{kind}", max_steps=steps, learning_rate=s["lr"], logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
                  per_device_train_batch_size=s["prompts_per_step"] * s["num_generations"],
                  num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
                  temperature=s["temperature"], beta=0.0, loss_type="dapo")
    timer = step_timer()
    server = None
    if kind.startswith("trl"):
        from datasets import Dataset
        from trl import GRPOConfig as TRLConfig
        from trl import GRPOTrainer as TRLTrainer

        def reward(prompts, completions, completion_ids=None, **kw):
            return numeric_match(prompts, completions, completion_ids, answer=kw["answer"])

        trainer = TRLTrainer(model=path, reward_funcs=reward,
                             # TRL's default vllm_gpu_memory_utilization (0.3; on vLLM's CPU backend, of the machine's
                             # memory, less what the process already holds, for the KV cache): 0.1 left no KV cache
                             # once the trainer held 2.3 GB. max_model_len 256 is what our vLLM rows use.
                             args=TRLConfig(**common, use_cpu=True, bf16=False, use_vllm=True, vllm_mode="colocate",
                                            vllm_max_model_length=256, model_init_kwargs={"dtype": torch.float32}),
                             train_dataset=Dataset.from_list(rows), callbacks=[timer])
    else:
        from toolkit import GRPOConfig, GRPOTrainer

        kwargs = {}
        if kind == "vllm":
            kwargs = {"max_model_len": 256}
        elif kind.startswith("vllm-lora"):  # the colocated engine, LoRA: merged blocks against the adapter alone
            kwargs = {"max_model_len": 256, "lora_sync": kind.removeprefix("vllm-lora-")}
        elif kind.startswith("vllm-server"):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            server = subprocess.Popen([sys.executable, "-m", "toolkit.core.cli", "vllm-serve", "--model", path,
                                       "--port", str(port), "--max_model_len", "256", "--token", "bench-token"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            kwargs = {"url": f"http://127.0.0.1:{port}", "startup_timeout": 300, "token": "bench-token"}
        from peft import LoraConfig

        backend = "vllm" if kind.startswith("vllm-lora") else kind.removesuffix("-lora")
        trainer = GRPOTrainer(path, [numeric_match], GRPOConfig(**common, generation_backend=backend,
                                                                generation_backend_kwargs=kwargs),
                              peft_config=LoraConfig(**LORA) if "lora" in kind else None,
                              train_dataset=rows, callbacks=[timer])
    syncs = sync_recorder(trainer)
    trainer.add_callback(syncs)
    try:
        trainer.train()
    finally:
        if server is not None:
            server.kill()
    ends = timer.ends
    per_step = (ends[-1] - ends[0]) / max(len(ends) - 1, 1)
    hist = [h for h in trainer.state.log_history if "loss" in h][1:]
    gen = [h["time/generation_s"] for h in hist if "time/generation_s" in h]
    backend = getattr(trainer, "generation_backend", None)
    # every trainer here (ours and TRL's) logs completions/mean_length per step: the work each side generated
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    completions_per_step = SETTINGS["prompts_per_step"] * SETTINGS["num_generations"]
    return {"generated_tokens": round(sum(lengths) * completions_per_step) if lengths else None,
            "kind": kind, "steps_per_min": 60 / per_step, "sec_per_step": per_step,
            "generation_s_per_step": sum(gen) / len(gen) if gen else None,
            "last_weight_sync_s": getattr(backend, "last_sync_s", None),
            # every step's sync; the summary leaves out the first (the engine's first reload: the colocated engine
            # is not warmed up, LoRA sends every weight), so it is the median of the steady-state syncs
            "weight_syncs_s": syncs.seconds or None,
            "weight_sync_splits": syncs.splits if any(syncs.splits) else None,  # the server's read/parse/load s
            "weight_sync_s": statistics.median(syncs.seconds[1:]) if len(syncs.seconds) > 1 else None,
            "weight_sync_max_s": max(syncs.seconds[1:]) if len(syncs.seconds) > 1 else None,
            "last_weight_sync_mb": getattr(backend, "last_sync_bytes", 0) / 1e6 or None,
            "last_weight_sync_mode": getattr(backend, "last_sync_mode", None) or None,
            "mean_reward": sum(h.get("reward", 0) for h in hist) / max(len(hist), 1)}


def main() -> None:
    # 8 steps: an engine's reloads took a few steps to settle before the server warmed up (3.6, 1.3, 1.1, 0.66 s
    # in one 4-step run; the colocated engine still does), and the sync summary needs more than a few samples
    args = bench_args(__doc__, worker, default_steps=8)
    results = run_each(__file__, KINDS, args.steps,
                       lambda r: f"{r['steps_per_min']:.2f} steps/min ({r['sec_per_step']:.1f} s/step)",
                       env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}, keep_going=True)
    base = results["transformers"]
    s = SETTINGS
    print(f"\nGRPO, SmolLM2-135M-Instruct, {s['prompts_per_step']} prompts x {s['num_generations']} completions, "
          f"max {s['max_completion_length']} new tokens, {args.steps} steps (first excluded)")
    print("| backend | steps/min | s/step | generation s/step | generated tokens (all steps) | weight sync s, median (max) of steps 2..N | sync MB "
          "| vs transformers |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in KINDS:
        r = results[kind]
        if "failed" in r:
            print(f"| {kind} | failed | | | | | | see below |")
            continue
        gen = f"{r['generation_s_per_step']:.1f}" if r["generation_s_per_step"] is not None else "-"
        sync = (f"{r['weight_sync_s']:.2f} ({r['weight_sync_max_s']:.2f})" if r.get("weight_sync_s") is not None
                else "-")
        mb = f"{r['last_weight_sync_mb']:.0f}" if r.get("last_weight_sync_mb") else "-"
        # LoRA trains something else than the full model: its step time is not compared
        ratio = "-" if "lora" in kind else f"{r['steps_per_min'] / base['steps_per_min']:.2f}x"
        tokens = "-" if r.get("generated_tokens") is None else r["generated_tokens"]
        print(f"| {kind} | {r['steps_per_min']:.2f} | {r['sec_per_step']:.1f} | {gen} | {tokens} | {sync} | {mb} "
              f"| {ratio} |")
    print("\nEvery step's weight sync, seconds (the server's read + parse + engine load in brackets):")
    for kind in KINDS:
        r = results[kind]
        if r.get("weight_syncs_s"):
            splits = r.get("weight_sync_splits") or []
            cells = [f"{t:.2f}" + (f" ({sp.get('read_s', 0):.2f} + {sp.get('parse_s', 0):.2f} + "
                                   f"{sp.get('load_s', 0):.2f})" if sp else "")
                     for t, sp in zip(r["weight_syncs_s"], splits or [None] * len(r["weight_syncs_s"]))]
            print(f"- {kind}: " + ", ".join(cells))
    for kind in KINDS:
        if "failed" in results[kind]:
            print(f"{kind}: {results[kind]['failed']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": s, "steps": args.steps, "results": results,
                                               "provenance": provenance()}, indent=2))


if __name__ == "__main__":
    main()
