"""Benchmark: AsyncGRPOTrainer against our synchronous GRPOTrainer, same settings and samples, in two cases.

    python bench/async_grpo.py                  # about 25 minutes on 2 CPU cores; writes bench/results/async_grpo.*
    python bench/async_grpo.py --steps 40       # more steps per run (latency case; compute case: 2/3 of it)
    python bench/async_grpo.py --cases latency --seeds 3,4,5 --out async_grpo_seeds_3_5   # more seeds, own file

* latency-bound: the reward is a judge over HTTP on loopback (toolkit.testing.JudgeServer, a real server)
  that answers each round after 0.5-2 s (uniform, seeded), as a remote LLM judge does; 2 prompts x 4
  completions per step. Sync waits for the judge every step; async's worker generates the next rounds while
  the judge works (scoring_concurrency 4, max_staleness 2, up to 2 rounds per generate call) and the trainer
  trains meanwhile. Both sides with importance_sampling_mode "mask", [0.5, 2] (a no-op for sync, whose
  sampler is its trainer). Three seeds each.
* compute-bound: numeric-match reward (no waiting), 4 prompts x 8 completions per step: both phases compete
  for the same 2 cores, so the ratio says what splitting them costs. One seed.

Both sides: embedded SmolLM2-135M-Instruct, arithmetic task, max 16 new tokens, temperature 0.7, lr 2e-5,
dapo; sync uses both cores (2 torch threads) in turn; async gives the worker one thread and the trainer one.
Each run is its own process; wall time is training only (model load and evaluation excluded; async's worker
start-up included: the trainer generates rounds itself until its worker is ready (warm start); also reported
without step 1 as the steady state); held-out
accuracy is greedy on 128 problems after training. The pipeline model (bench/async_model.py) is fed each
async run's own per-round times and its prediction is printed beside the measured wall clock; it then
predicts the separate-device deployment from the sync run's per-phase times (each side alone).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, run_in_subprocess, step_timer  # noqa: E402
from async_model import Phases, simulate_async, simulate_sync  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {
    # rounds_per_generation 2: the worker generates two rounds in one call when the staleness bound admits both
    # (a decode step on CPU costs about the same for 16 sequences as for 8); scoring_concurrency 4 lets both score
    # while the next call generates
    # importance_sampling_mode "mask" with [0.5, 2] (MIS): tokens whose sampler ratio is outside it drop out of the
    # loss. Sync's sampler is its trainer (ratios 1 to float rounding), so it changes nothing there. With the
    # default (truncate, cap 2) and rounds_per_generation 2, async seed 2 collapsed (held-out 0.000, 1 of 3 seeds;
    # one rerun with the mask: 0.305)
    "latency": dict(prompts_per_step=2, num_generations=4, judge_latency=(0.5, 2.0), max_staleness=2,
                    scoring_concurrency=4, rounds_per_generation=2, seeds=(0, 1, 2),
                    importance_sampling_mode="mask", importance_sampling_min=0.5, importance_sampling_cap=2.0),
    # rounds_per_generation 2 changes nothing here (a one-off run of seed 0 trained the same tokens): at
    # max_staleness 1 a second round needs the trainer to have trained the round just generated, so it stays at 1
    "compute": dict(prompts_per_step=4, num_generations=8, judge_latency=None, max_staleness=1,
                    scoring_concurrency=2, rounds_per_generation=1, seeds=(0,)),
}
COMMON = dict(max_completion_length=16, temperature=0.7, lr=2e-5, heldout=128)


def worker(kind: str, steps: int, threads: tuple[int, int] = (1, 1), knobs: dict | None = None) -> dict:
    import torch

    from toolkit.core.rewards import HTTPJudge, numeric_match
    from toolkit.core.tasks import arithmetic_splits, greedy_accuracy
    from toolkit.testing import JudgeServer

    case, mode, seed = kind.split("-")
    c, seed = {**CASES[case], **(knobs or {})}, int(seed)
    # the same data for every seed (the seed varies sampling and training), so held-out numbers compare
    train, held_out = arithmetic_splits(256, COMMON["heldout"], max_value=20, max_terms=2, kind="prompt_only")
    judge = JudgeServer(latency=c["judge_latency"], seed=seed) if c["judge_latency"] else None
    rewards = [HTTPJudge(judge.url)] if judge else [numeric_match]
    common = dict(output_dir=f"/tmp/bench-async-{kind}", max_steps=steps, learning_rate=COMMON["lr"],
                  logging_steps=1, save_strategy="no", report_to="none", seed=seed, disable_tqdm=True,
                  per_device_train_batch_size=c["prompts_per_step"] * c["num_generations"],
                  num_generations=c["num_generations"], max_completion_length=COMMON["max_completion_length"],
                  temperature=COMMON["temperature"], lr_scheduler_type="constant", loss_type="dapo",
                  importance_sampling_mode=c.get("importance_sampling_mode", "truncate"),
                  importance_sampling_min=c.get("importance_sampling_min"),
                  importance_sampling_cap=c.get("importance_sampling_cap", 2.0))
    if mode == "sync":
        from toolkit import GRPOConfig, GRPOTrainer

        torch.set_num_threads(2)
        trainer = GRPOTrainer("smollm2-135m-instruct", rewards, GRPOConfig(**common), train_dataset=train,
                              callbacks=[timer := step_timer()])
    else:
        from toolkit import AsyncGRPOConfig, AsyncGRPOTrainer

        trainer = AsyncGRPOTrainer("smollm2-135m-instruct", rewards,
                                   AsyncGRPOConfig(**common, max_staleness=c["max_staleness"], worker_threads=threads[0],
                                                   trainer_threads=threads[1], scoring_concurrency=c["scoring_concurrency"],
                                                   rounds_per_generation=c.get("rounds_per_generation", 1)),
                                   train_dataset=train, callbacks=[timer := step_timer()])
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    if judge:
        judge.close()
    torch.set_num_threads(2)
    acc = greedy_accuracy(trainer.model, trainer.processing_class, held_out,
                          max_new_tokens=COMMON["max_completion_length"])
    hist = [h for h in trainer.state.log_history if "loss" in h]

    def mean(key, skip=1):
        v = [h[key] for h in hist[skip:] if key in h]
        return sum(v) / len(v) if v else None

    samples = steps * c["prompts_per_step"] * c["num_generations"]
    # generate calls of one round and of two (rounds_per_generation): a call's time, and what a second round adds
    calls = {k: [h["time/generation_s"] * k for h in hist[1:] if h.get("async/rounds_per_generate") == k]
             for k in (1, 2)}
    one_round = sum(calls[1]) / len(calls[1]) if calls[1] else None
    extra_round = sum(calls[2]) / len(calls[2]) - one_round if calls[2] and one_round else None
    # steady state: from the end of step 1 to the end of the last (step 1's one-off costs left out)
    steady = (steps - 1) * c["prompts_per_step"] * c["num_generations"] / (timer.ends[-1] - timer.ends[0])
    step_s = (timer.ends[-1] - timer.ends[0]) / max(steps - 1, 1)  # steady seconds per step
    return {"kind": kind, "wall_s": wall, "samples": samples, "samples_per_s": samples / wall,
            "steady_samples_per_s": steady,
            "heldout_accuracy": acc, "reward_last5": sum(h["reward"] for h in hist[-5:]) / len(hist[-5:]),
            "completion_tokens": sum(h.get("completions/mean_length", 0) * c["prompts_per_step"] *
                                     c["num_generations"] for h in hist),
            "step_s": step_s, "trainer_wait_s_per_step": mean("async/trainer_wait_s"),
            # seconds from the worker's start to its being ready (the trainer generates its own rounds meanwhile)
            "worker_startup_s": next((h["async/worker_startup_s"] for h in hist if "async/worker_startup_s" in h),
                                     float("nan")) if mode == "async" else 0.0,
            "rounds_in_trainer": hist[-1].get("async/rounds_in_trainer", 0.0) if mode == "async" else 0.0,
            "generation_s_per_step": mean("time/generation_s"), "scoring_s_per_step": mean("time/scoring_s"),
            "train_s_per_step": mean("time/train_s"), "publish_s": mean("async/publish_s"),
            "trainer_idle_fraction": mean("async/trainer_idle_fraction"),
            "generator_idle_fraction": mean("async/generator_idle_fraction"),
            "staleness_mean": mean("async/staleness", skip=0),
            "gen_call_one_round_s": one_round, "gen_extra_round_s": extra_round,
            "rounds_from_two_round_calls": len(calls[2]) if mode == "async" else 0}


def _model_rows(case: str, c: dict, steps: int, sync: dict, asy: dict) -> dict:
    """The pipeline model, fed the async run's own per-round times (validation) and the sync run's (each
    side alone: the separate-device deployment)."""
    knobs = dict(max_staleness=c["max_staleness"], queue_size=2, scoring_concurrency=c["scoring_concurrency"],
                 warm_start=True, rounds_per_generation=c.get("rounds_per_generation", 1))
    # a one-round call's time and what a second round adds, when the run made two-round calls (else per-round means)
    batched = asy.get("gen_extra_round_s") is not None
    gen_one = asy["gen_call_one_round_s"] if batched else asy["generation_s_per_step"]
    extra = asy["gen_extra_round_s"] if batched else None
    # a step costs the trainer more than its forward/backward (optimizer, rollout bookkeeping, logging): the sync
    # run's steady step time less its phases. The async prediction takes it from the sync run (not from the
    # async run, whose step time is what is predicted); the async run's own residual is printed beside it.
    async_overhead = max(0.0, asy["step_s"] - (asy["trainer_wait_s_per_step"] or 0.0) - asy["train_s_per_step"]
                         - (asy["publish_s"] or 0.0))
    sync_overhead = max(0.0, sync["step_s"] - sync["generation_s_per_step"] - sync["scoring_s_per_step"]
                        - sync["train_s_per_step"])
    measured = Phases(gen_s=gen_one, train_s=asy["train_s_per_step"] + sync_overhead,
                      score_s=asy["scoring_s_per_step"], sync_s=asy["publish_s"] or 0.0,
                      startup_s=asy["worker_startup_s"], extra_round_s=extra)
    predicted_wall = simulate_async(measured, steps, **knobs)
    # separate devices: each side at the speed it has alone (the sync run's phases), start-up as measured
    # (a second round's share of a call taken as measured in the async run)
    alone = Phases(gen_s=sync["generation_s_per_step"], train_s=sync["train_s_per_step"] + sync_overhead,
                   score_s=sync["scoring_s_per_step"], sync_s=asy["publish_s"] or 0.0,
                   startup_s=asy["worker_startup_s"],
                   extra_round_s=sync["generation_s_per_step"] * extra / gen_one if batched else None)
    return {"predicted_async_wall_s": predicted_wall, "measured_async_wall_s": asy["wall_s"],
            "prediction_error": predicted_wall / asy["wall_s"] - 1,
            "sync_model_wall_s": simulate_sync(alone, steps), "measured_sync_wall_s": sync["wall_s"],
            "async_step_overhead_s": async_overhead, "sync_step_overhead_s": sync_overhead,
            "worker_startup_s": asy["worker_startup_s"],
            "separate_devices_ratio": simulate_sync(alone, steps) / simulate_async(alone, steps, **knobs),
            "separate_devices_steady_ratio": _steady_ratio(alone, knobs)}


def _steady_ratio(p: Phases, knobs: dict, n: int = 400) -> float:
    """Sync over async seconds per step once the pipeline is full (start-up amortised away)."""
    per_step = (simulate_async(p, n, **knobs) - simulate_async(p, n // 2, **knobs)) / (n - n // 2)
    return (p.gen_s + p.score_s + p.train_s) / per_step


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--cases", default=",".join(CASES), help="which cases to run (comma-separated)")
    ap.add_argument("--seeds", default=None, help="the seeds of every case run (comma-separated; default: each "
                                                  "case's own)")
    ap.add_argument("--async-threads", default="1,1", help="torch threads of async's worker and trainer "
                                                            "(comma-separated; sync always uses 2)")
    ap.add_argument("--knobs", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--out", default="async_grpo", help="results file name in bench/results (without suffix)")
    args = ap.parse_args()
    if (args.cases != ",".join(CASES) or args.seeds is not None) and args.out == "async_grpo":
        ap.error("--cases/--seeds run a subset: name its own results file with --out (async_grpo.* holds the full run)")
    if args.worker:
        case = args.worker.split("-")[0]
        steps = args.steps if case == "latency" else max(1, round(args.steps * 2 / 3))
        threads = tuple(int(x) for x in args.async_threads.split(","))
        print("RESULT " + json.dumps(worker(args.worker, steps, threads, json.loads(args.knobs))), flush=True)
        return
    script = os.path.abspath(__file__)
    results: dict[str, dict] = {}
    started = time.perf_counter()
    cases = {name: dict(CASES[name]) for name in args.cases.split(",")}
    if args.seeds is not None:
        for c in cases.values():
            c["seeds"] = tuple(int(x) for x in args.seeds.split(","))
    for case, c in cases.items():
        for seed in c["seeds"]:
            for mode in ("sync", "async"):
                kind = f"{case}-{mode}-{seed}"
                print(f"running {kind} ...", flush=True)
                r = run_in_subprocess(script, ["--steps", str(args.steps), "--worker", kind,
                                                       "--async-threads", args.async_threads],
                                      env={"HF_HUB_OFFLINE": "1"})
                results[kind] = r
                print(f"  {r['wall_s']:.0f} s, {r['samples_per_s']:.2f} samples/s, held-out "
                      f"{r['heldout_accuracy']:.3f}", flush=True)
    summary = {}
    for case, c in cases.items():
        rows = [(results[f"{case}-sync-{s}"], results[f"{case}-async-{s}"]) for s in c["seeds"]]
        steps = rows[0][0]["samples"] // (c["prompts_per_step"] * c["num_generations"])
        summary[case] = {
            "steps": steps,
            "ratio_per_seed": [a["samples_per_s"] / s["samples_per_s"] for s, a in rows],
            "steady_ratio_per_seed": [a["steady_samples_per_s"] / s["steady_samples_per_s"] for s, a in rows],
            "sync_steady_samples_per_s": [s["steady_samples_per_s"] for s, _ in rows],
            "async_steady_samples_per_s": [a["steady_samples_per_s"] for _, a in rows],
            "sync_samples_per_s": [s["samples_per_s"] for s, _ in rows],
            "async_samples_per_s": [a["samples_per_s"] for _, a in rows],
            "sync_heldout": [s["heldout_accuracy"] for s, _ in rows],
            "async_heldout": [a["heldout_accuracy"] for _, a in rows],
            "model": [_model_rows(case, c, steps, s, a) for s, a in rows],
        }
    out = {"settings": {"cases": cases, **COMMON, "model": "smollm2-135m-instruct", "steps": args.steps,
                        "async_threads": args.async_threads,
                        "command": " ".join(["python", "bench/async_grpo.py"] + sys.argv[1:])}, "results": results,
           "summary": summary, "run_seconds": time.perf_counter() - started, "provenance": provenance()}
    text = _table(out)
    print(text)
    with open(os.path.join(ROOT, "bench", "results", f"{args.out}.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(ROOT, "bench", "results", f"{args.out}.txt"), "w") as f:
        f.write(text + "\n")


def _fmt(values, digits=2):
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _table(out: dict) -> str:
    p, res = out["provenance"], out["results"]
    lines = [f"# bench/async_grpo.py at {p['commit'][:10]}{' (tree changed)' if p['tree_changed'] else ''} "
             f"({p['date']}, {p['cpu_cores']} cores, torch {p['versions']['torch']}); run time "
             f"{out['run_seconds'] / 60:.0f} min; `{out['settings'].get('command', 'python bench/async_grpo.py')}`",
             ""]
    for case, s in out["summary"].items():
        c = out["settings"]["cases"][case]
        judge = (f"HTTP judge on loopback, {c['judge_latency'][0]}-{c['judge_latency'][1]} s per round"
                 if c["judge_latency"] else "numeric_match (no waiting)")
        lines += [f"## {case}-bound: {s['steps']} steps x {c['prompts_per_step']} prompts x {c['num_generations']} "
                  f"completions, reward {judge}; async max_staleness={c['max_staleness']}, scoring_concurrency="
                  f"{c['scoring_concurrency']}, rounds_per_generation={c.get('rounds_per_generation', 1)}, sampler correction "
                  f"{c.get('importance_sampling_mode', 'truncate')} [{c.get('importance_sampling_min')}, "
                  f"{c.get('importance_sampling_cap', 2.0)}] (both sides), threads "
                  f"{'+'.join(out['settings'].get('async_threads', '1,1').split(','))} (sync: 2); seeds "
                  f"{list(c['seeds'])}", "",
                  "| | sync | async | async/sync |", "|---|---|---|---|",
                  f"| samples/s, whole run (worker start-up included) | {_fmt(s['sync_samples_per_s'])} | "
                  f"{_fmt(s['async_samples_per_s'])} | {_fmt(s['ratio_per_seed'])}x (per seed: "
                  f"{', '.join(f'{x:.2f}' for x in s['ratio_per_seed'])}) |",
                  f"| samples/s, steady state (steps 2..N) | {_fmt(s['sync_steady_samples_per_s'])} | "
                  f"{_fmt(s['async_steady_samples_per_s'])} | {_fmt(s['steady_ratio_per_seed'])}x (per seed: "
                  f"{', '.join(f'{x:.2f}' for x in s['steady_ratio_per_seed'])}) |",
                  f"| held-out accuracy (128) | {_fmt(s['sync_heldout'], 3)} | {_fmt(s['async_heldout'], 3)} | "
                  f"per seed, sync/async: {', '.join(f'{a:.3f}/{b:.3f}' for a, b in zip(s['sync_heldout'], s['async_heldout']))} |"]
        for key, label in (("generation_s_per_step", "generation s/round"), ("scoring_s_per_step", "scoring s/round"),
                           ("train_s_per_step", "train s/step"), ("completion_tokens", "completion tokens (all steps)")):
            sv = [res[f"{case}-sync-{x}"][key] or 0.0 for x in c["seeds"]]
            av = [res[f"{case}-async-{x}"][key] or 0.0 for x in c["seeds"]]
            lines.append(f"| {label} | {_fmt(sv)} | {_fmt(av)} | |")
        idle_t = [res[f"{case}-async-{x}"]["trainer_idle_fraction"] or 0.0 for x in c["seeds"]]
        idle_g = [res[f"{case}-async-{x}"]["generator_idle_fraction"] or 0.0 for x in c["seeds"]]
        lines.append(f"| async: trainer idle / generator idle | | {_fmt(idle_t)} / {_fmt(idle_g)} | |")
        here = [res[f"{case}-async-{x}"].get("rounds_in_trainer", 0.0) for x in c["seeds"]]
        ready = [res[f"{case}-async-{x}"]["worker_startup_s"] for x in c["seeds"]]
        lines.append(f"| async: worker ready after (s) / rounds the trainer generated meanwhile (warm start) | | "
                     f"{_fmt(ready, 1)} / {', '.join(f'{x:.0f}' for x in here)} | |")
        if c.get("rounds_per_generation", 1) > 1:
            runs = [res[f"{case}-async-{x}"] for x in c["seeds"]]
            lines.append("| async: rounds from two-round generate calls (of steps 2..N) / s of a one-round call / "
                         "s a second round adds | | "
                         + "; ".join(f"{a.get('rounds_from_two_round_calls', a.get('two_round_calls', 0))} / "
                                     f"{a.get('gen_call_one_round_s') or 0:.2f} / "
                                     + (f"{a['gen_extra_round_s']:.2f}" if a.get("gen_extra_round_s") is not None
                                        else "-") for a in runs) + " | |")
        m = s["model"]
        lines += ["", "Pipeline model (bench/async_model.py): predicted vs measured async wall "
                  + ", ".join(f"{x['predicted_async_wall_s']:.0f} vs {x['measured_async_wall_s']:.0f} s "
                              f"({x['prediction_error']:+.0%})" for x in m)
                  + "; sync model (its overhead fitted on itself) vs measured "
                  + ", ".join(f"{x['sync_model_wall_s']:.0f} vs {x['measured_sync_wall_s']:.0f} s" for x in m)
                  + " (inputs: the async run's per-phase means, the sync run's per-step overhead "
                  + ", ".join(f"{x['sync_step_overhead_s']:.2f}" for x in m) + " s (the async run's residual: "
                  + ", ".join(f"{x['async_step_overhead_s']:.2f}" for x in m) + " s), worker start-up "
                  + ", ".join(f"{x['worker_startup_s']:.1f}" for x in m) + " s); separate devices (each side at "
                  "its measured speed alone): predicted async/sync "
                  + ", ".join(f"{x['separate_devices_ratio']:.2f}x" for x in m) + " for this run's length, "
                  + ", ".join(f"{x['separate_devices_steady_ratio']:.2f}x" for x in m) + " once the pipeline is full",
                  ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
