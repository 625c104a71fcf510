"""Benchmark: multi-turn episodes per second when the environment waits (tools, sandboxes, judges).

    python bench/agent_rollouts.py                   # 20-40 minutes on 2 CPU cores
    python bench/agent_rollouts.py --steps 8         # more GRPO steps per training row

The environment is the calculator of examples/grpo_tools.toml ("What is 47 * 8 + 19?", a `calc` tool, up to 3
turns) with every step waiting a uniformly drawn 0.2-1.0 s first (`environment_kwargs.latency`): a latency-bound
tool, as a sandbox or a remote judge is. Two parts, each row in its own process, one after the other:

Rollouts only (the embedded SmolLM2-135M-Instruct, 2 rounds of 4 prompts x 8 episodes, through
`toolkit.core.environments.run_episodes`, the function GRPO calls): `sequential` (environment_concurrency 1, each
step waits for the previous one) against `concurrent` (32 threads, the default). Both sample the same ids (seeded
generation, deterministic environment), so their success rates are equal by construction.

Training (GRPO on episodes from the tool-use pipeline's SFT warm-up, `outputs/tools/0-sft/final`, written by
`toolkit pipeline --config examples/tools_pipeline.toml`; when it is missing this script runs that SFT stage
first, about 3 minutes): `--steps` steps of 4 prompts x 8 episodes, learning rate 1e-5, then held-out success
(64 greedy episodes, the same latency). Rows: `sync-sequential` (GRPOTrainer, environment_concurrency 1: each
environment step after the previous one, as a plain loop over episodes does), `sync` (GRPOTrainer, 32 threads),
`async` (AsyncGRPOTrainer, max_staleness 1, 32 threads: the worker's rollouts, waits included, overlap training),
`async-2rounds` (the same with max_staleness 2, rounds_per_generation 2, scoring_concurrency 3 and 64 environment
threads: a worker that is behind its trainer runs up to two rounds' episodes in one lockstep call, so a decode
step, which reads every weight whatever the batch, and a turn's slowest wait each serve up to 64 episodes; the
price is samples up to 2 steps stale; the table gives the mean rounds per call). Episodes/s counts trained
episodes over training wall time (held-out evaluations excluded); sampled tokens count the trained episodes' (a
round a worker generated and then dropped is not counted). The async worker and the trainer split the 2 cores
(1 thread each).
Writes bench/results/agent_rollouts.{json,txt}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, run_in_subprocess  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LATENCY = [0.2, 1.0]
WARMUP = os.path.join(ROOT, "outputs", "tools", "0-sft", "final")


def rollouts(kind: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.core.environments import TemplateDelta, calculator_environment, run_episodes
    from toolkit.core.generation import SamplingParams, TransformersBackend
    from toolkit.core.models import embedded_model_path
    from toolkit.core.tasks import task_rows

    torch.manual_seed(0)
    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(max_tokens=40, temperature=1.0, stop_token_ids=(stop,))
    prompts, generations, rounds = 4, 8, 2
    rows = task_rows("calculator", prompts * rounds, max_value=99, kind="prompt_only")
    delta = TemplateDelta(tok, end_text="<|im_end|>")
    episodes, started = [], time.perf_counter()
    for r in range(rounds):
        batch = [row for row in rows[r * prompts:(r + 1) * prompts] for _ in range(generations)]
        turn = [0]

        def sample(contexts):
            turn[0] += 1
            return [g[0] for g in backend.generate(contexts, params, n=1, seed=1000 * r + turn[0])]

        envs = [calculator_environment(max_tool_turns=2, latency=LATENCY) for _ in batch]
        episodes += run_episodes(envs, batch, sample, delta, max_turns=3, max_tokens=160,
                                 concurrency=1 if kind == "sequential" else 32)
    seconds = time.perf_counter() - started
    return {"kind": kind, "episodes": len(episodes), "seconds": round(seconds, 2),
            "episodes_per_s": round(len(episodes) / seconds, 3),
            "success": round(sum((ep.reward or 0.0) >= 1.0 for ep in episodes) / len(episodes), 4),
            "turns_mean": round(sum(len(ep.turns) for ep in episodes) / len(episodes), 3),
            "ids_hash": hash(tuple(tuple(ep.ids) for ep in episodes))}


def training(kind: str, steps: int) -> dict:
    from transformers import TrainerCallback

    from toolkit.core.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from toolkit.core.grpo import GRPOConfig, GRPOTrainer
    from toolkit.core.report import heldout_episodes
    from toolkit.core.tasks import task_splits

    train, held_out = task_splits("calculator", 512, 64, max_value=99, max_terms=2, kind="prompt_only")
    settings = dict(output_dir=f"/tmp/agent-rollouts-{kind}", max_steps=steps, per_device_train_batch_size=32,
                    num_generations=8, max_completion_length=40, temperature=1.0, learning_rate=1e-5,
                    lr_scheduler_type="constant", loss_type="dapo", logging_steps=1, save_strategy="no", seed=0,
                    report_to="none", disable_tqdm=True, environment="calculator",
                    environment_kwargs={"max_tool_turns": 2, "latency": LATENCY}, max_turns=3,
                    max_episode_tokens=160,
                    # as many environment steps at once as one generate call has episodes (64 with two rounds)
                    environment_concurrency={"sync-sequential": 1, "async-2rounds": 64}.get(kind, 32))

    class Clock(TrainerCallback):
        """Training time: from the start of training to the end of its last step (the async worker's start-up
        counts, its shutdown does not)."""

        started = ended = None

        def on_train_begin(self, args, state, control, **kw):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.ended = time.perf_counter()

    clock = Clock()
    if kind.startswith("async"):
        extra = (dict(max_staleness=2, rounds_per_generation=2, scoring_concurrency=3) if kind == "async-2rounds"
                 else dict(max_staleness=1))
        t = AsyncGRPOTrainer(WARMUP, [], AsyncGRPOConfig(**settings, **extra, worker_threads=1, trainer_threads=1),
                             train_dataset=train, callbacks=[clock])
    else:
        t = GRPOTrainer(WARMUP, [], GRPOConfig(**settings), train_dataset=train, callbacks=[clock])
    t.train()
    seconds = clock.ended - clock.started
    success, mean = heldout_episodes(t, held_out)
    per_step = settings["per_device_train_batch_size"]
    episodes = steps * per_step
    return {"kind": kind, "episodes": episodes, "seconds": round(seconds, 2),
            "episodes_per_s": round(episodes / seconds, 3), "heldout_success": round(success, 4),
            "reward_per_step": [round(h["reward"], 3) for h in t.state.log_history if "reward" in h],
            "turns_per_step": [round(h["episodes/turns_mean"], 2) for h in t.state.log_history
                               if "episodes/turns_mean" in h],
            # the work differs with what each run learns (more tool calls, longer episodes): count it
            "sampled_tokens": round(sum(h["episodes/sampled_tokens_mean"] * per_step for h in t.state.log_history
                                        if "episodes/sampled_tokens_mean" in h)),
            # seconds the rounds' episodes waited for their environments (nothing decoding meanwhile), and that
            # over the training time: in the sync rows the cores' idle share, all that overlapping the waits can
            # win back on the same cores (at most 1 / (1 - share))
            "environment_s": round(sum(_values(t, "episodes/environment_s")), 2),
            "environment_share_of_training": round(sum(_values(t, "episodes/environment_s")) / seconds, 3),
            # async warm start: rounds the trainer generated itself while its worker started, and the start-up
            # (trained rounds only: rounds a worker generated and then dropped are not counted)
            **({"rounds_in_trainer": _last(t, "async/rounds_in_trainer"),
                # a call of k rounds logs k on each of its k rounds: N rounds over the sum of 1/k is the calls'
                # mean (a one-round call that the trainer made itself at warm start counts as one). Needs
                # logging_steps=1 (set above): a log averaging several rounds' k would not invert.
                "rounds_per_generate_mean": _per_call(t, "async/rounds_per_generate"),
                "worker_startup_s": _last(t, "async/worker_startup_s")} if kind.startswith("async") else {})}


def _values(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def _per_call(trainer, key):
    values = _values(trainer, key)
    return round(len(values) / sum(1 / v for v in values), 2) if values else None


def _last(trainer, key):
    values = _values(trainer, key)
    return round(values[-1], 2) if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker:
        out = rollouts(args.worker) if args.worker in ("sequential", "concurrent") else training(args.worker,
                                                                                                 args.steps)
        print("RESULT " + json.dumps(out), flush=True)
        return
    if not os.path.exists(os.path.join(WARMUP, "config.json")):
        print("running the tool-use SFT warm-up (examples/tools_warmup_sft.toml) first", flush=True)
        subprocess.run([sys.executable, "-m", "toolkit.core.cli", "sft", "--config",
                        os.path.join(ROOT, "examples", "tools_warmup_sft.toml"), "--output_dir",
                        os.path.dirname(WARMUP)], check=True, cwd=ROOT)
    script = os.path.abspath(__file__)
    results = {}
    for kind in ("sequential", "concurrent", "sync-sequential", "sync", "async", "async-2rounds"):
        print(f"{kind} ...", flush=True)
        results[kind] = run_in_subprocess(script, ["--worker", kind, "--steps", str(args.steps)],
                                          env={"HF_HUB_OFFLINE": "1"})
        print(f"  {results[kind]}", flush=True)
    same = results["sequential"].pop("ids_hash") == results["concurrent"].pop("ids_hash")
    ratio = lambda a, b: results[a]["episodes_per_s"] / results[b]["episodes_per_s"]  # noqa: E731
    out = {"settings": {"latency_s": LATENCY, "steps": args.steps, "model": "smollm2-135m-instruct",
                        "training_start": "outputs/tools/0-sft/final", "episodes_per_step": 32},
           "results": results, "same_episodes_sequential_concurrent": same,
           "ratios": {"concurrent/sequential": round(ratio("concurrent", "sequential"), 3),
                      "sync/sync-sequential": round(ratio("sync", "sync-sequential"), 3),
                      "async/sync": round(ratio("async", "sync"), 3),
                      "async-2rounds/sync": round(ratio("async-2rounds", "sync"), 3),
                      "async/sync-sequential": round(ratio("async", "sync-sequential"), 3)},
           "provenance": provenance()}
    p = out["provenance"]
    lines = [f"# bench/agent_rollouts.py at {p['commit'][:10]}{' (tree changed)' if p['tree_changed'] else ''} "
             f"({p['date']}, {p['cpu_cores']} cores): environment steps wait {LATENCY[0]}-{LATENCY[1]} s", "",
             "Rollouts only (2 rounds x 32 episodes, embedded model):", "",
             "| row | episodes/s | seconds | success | turns/episode |", "|---|---|---|---|---|"]
    for k in ("sequential", "concurrent"):
        r = results[k]
        lines.append(f"| {k} | {r['episodes_per_s']} | {r['seconds']} | {r['success']} | {r['turns_mean']} |")
    lines += ["", f"same episodes (ids) in both rows: {same}", "",
              f"GRPO training ({args.steps} steps x 32 episodes from the SFT warm-up; held-out: 64 greedy episodes):",
              "", "| row | episodes/s | training seconds | held-out success | reward per step | turns per episode, per step | "
              "sampled tokens | environment waits, s (share of training time) |", "|---|---|---|---|---|---|---|---|"]
    for k in ("sync-sequential", "sync", "async", "async-2rounds"):
        r = results[k]
        lines.append(f"| {k} | {r['episodes_per_s']} | {r['seconds']} | {r['heldout_success']} | "
                     f"{r['reward_per_step']} | {r['turns_per_step']} | {r['sampled_tokens']} | "
                     f"{r['environment_s']} ({r['environment_share_of_training']:.0%}) |")
    share = results["sync"]["environment_share_of_training"]
    lines += ["", f"Environment waits: the time a round's episodes waited for their environments, with nothing "
                  f"decoding (lockstep). In the sync row the cores stood idle for {share:.0%} of the training time, "
                  f"so overlapping the waits with training, all async adds on these cores, can make it at most "
                  f"{1 / max(1 - share, 1e-9):.2f}x as fast (more only from splitting the cores between two "
                  f"processes, or from doing less work). In the async rows the waits are the worker's, overlapped "
                  f"with training."]
    for k in ("async", "async-2rounds"):
        a = results[k]
        if a.get("rounds_in_trainer") is not None:
            lines += ["", f"{k} warm start: the worker was ready after {a['worker_startup_s']} s; the trainer "
                          f"generated {a['rounds_in_trainer']:.0f} of the {args.steps} rounds itself meanwhile; "
                          f"rounds per generate call: {a['rounds_per_generate_mean']} on average (over the calls "
                          f"whose rounds were trained)"]
    lines += [""] + [f"{k}: {v:.2f}x" for k, v in out["ratios"].items()]
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "agent_rollouts.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(ROOT, "bench", "results", "agent_rollouts.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
