"""Staleness sweep: async GRPO at max_staleness 0, 1, 2, 4, 8 with each off-policy objective.

    python bench/async_staleness.py             # about 30 minutes on 2 CPU cores; writes bench/results/async_staleness.*
    python bench/async_staleness.py --seeds 1,2,3   # max_staleness 0 and 4 on more seeds: async_staleness_seeds.*

Each run: the embedded SmolLM2-135M-Instruct on the arithmetic task (the main job's GRPO setting, shortened:
STEPS steps x 2 prompts x 8 completions, max 16 new tokens, temperature 0.7, lr 2e-5), AsyncGRPOTrainer with
the objective as loss_type, queue_size = max(2, max_staleness). On these shared cores generation is not faster
than training, so samples would hardly be stale: the trainer is throttled (it sleeps `trainer_delay_s` after
each step, as a trainer on slower hardware or with a larger model would take longer) and the worker has 2
threads against the trainer's 1, so the worker runs ahead up to the bound. The realised mean staleness is
reported beside each bound. Recorded: held-out greedy accuracy on 128 problems after training, the reward of
the last 5 steps, the largest |loss|, whether any step was non-finite (diverged) and, in the table, which
bounds ended below the untrained model (collapsed: finite losses do not mean a run learned).

One seed of the full sweep cannot say whether a 5-point gap is noise (neighbouring bounds of earlier sweeps
differed by up to 23 points), so `--seeds` runs the criterion's two bounds, 0 and 4, on other seeds (the seed of
the config: sampling and data order; the held-out problems stay the same). At max_staleness 0 the objectives
differ only by the sampler's numerical gap to the trainer (ratios 1 up to ~1e-3), and the full sweep gave the
same accuracy for all three, so the seeds run staleness 0 once per seed, with the first objective.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance, run_in_subprocess  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(os.path.dirname(__file__)))
STALENESS = (0, 1, 2, 4, 8)
OBJECTIVES = {"decoupled_ppo": {}, "m2po": {}, "seq_mis": {}}
SETTINGS = dict(prompts_per_step=2, num_generations=8, max_completion_length=16, temperature=0.7, lr=2e-5,
                heldout=128, worker_threads=2, trainer_threads=1, trainer_delay_s=2.0)


def worker(kind: str, steps: int, seed: int = 0) -> dict:
    import torch

    from toolkit import AsyncGRPOConfig, AsyncGRPOTrainer
    from toolkit.core.rewards import numeric_match
    from toolkit.core.tasks import arithmetic_splits, greedy_accuracy

    s = SETTINGS
    train, held_out = arithmetic_splits(256, s["heldout"], max_value=20, max_terms=2, kind="prompt_only")
    if kind == "base":  # the untrained model: what training moves from
        from toolkit.core.models import load_model, load_tokenizer

        torch.set_num_threads(2)
        model, tok = load_model("smollm2-135m-instruct"), load_tokenizer("smollm2-135m-instruct")
        return {"kind": kind, "heldout_accuracy": greedy_accuracy(model, tok, held_out,
                                                                  max_new_tokens=s["max_completion_length"])}
    objective, k = kind.rsplit("-", 1)
    k = int(k)
    args = AsyncGRPOConfig(
        output_dir=f"/tmp/bench-staleness-{kind}", max_steps=steps, learning_rate=s["lr"], logging_steps=1,
        save_strategy="no", report_to="none", seed=seed, disable_tqdm=True, lr_scheduler_type="constant",
        per_device_train_batch_size=s["prompts_per_step"] * s["num_generations"], num_generations=s["num_generations"],
        max_completion_length=s["max_completion_length"], temperature=s["temperature"], loss_type=objective,
        loss_kwargs=OBJECTIVES[objective] or None, max_staleness=k, queue_size=max(2, k),
        worker_threads=s["worker_threads"], trainer_threads=s["trainer_threads"])
    from transformers import TrainerCallback

    class Throttle(TrainerCallback):
        def on_step_end(self, *a, **kw):
            time.sleep(s["trainer_delay_s"])

    trainer = AsyncGRPOTrainer("smollm2-135m-instruct", [numeric_match], args, train_dataset=train,
                               callbacks=[Throttle()])
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    torch.set_num_threads(2)
    acc = greedy_accuracy(trainer.model, trainer.processing_class, held_out, max_new_tokens=s["max_completion_length"])
    hist = [h for h in trainer.state.log_history if "loss" in h]
    losses = [h["loss"] for h in hist]
    return {"kind": kind, "objective": objective, "max_staleness": k, "seed": seed, "wall_s": wall, "heldout_accuracy": acc,
            "reward_last5": sum(h["reward"] for h in hist[-5:]) / len(hist[-5:]),
            "reward_curve": [h["reward"] for h in hist],
            "staleness_mean": sum(h.get("async/staleness", 0.0) for h in hist) / len(hist),
            "staleness_max": max(h.get("async/staleness_max", 0.0) for h in hist),
            "max_abs_loss": max(abs(x) for x in losses), "diverged": not all(math.isfinite(x) for x in losses)}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)  # a worker's seed
    ap.add_argument("--seeds", default=None, help="comma-separated seeds: run max_staleness 0 and 4 on each and "
                                                  "write bench/results/async_staleness_seeds.* (not the full sweep)")
    ap.add_argument("--out", default="async_staleness_seeds",
                    help="the results' name with --seeds: bench/results/<out>.{json,txt} (more seeds in their own file)")
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.steps, args.seed)), flush=True)
        return
    if args.seeds is not None:
        _seeds(args.steps, [int(x) for x in args.seeds.split(",")], args.out)
        return
    started = time.perf_counter()
    results = {"base": run_in_subprocess(os.path.abspath(__file__), ["--worker", "base"], env={"HF_HUB_OFFLINE": "1"})}
    print(f"untrained model: held-out {results['base']['heldout_accuracy']:.3f}", flush=True)
    for objective in OBJECTIVES:
        for k in STALENESS:
            kind = f"{objective}-{k}"
            print(f"running {kind} ...", flush=True)
            r = run_in_subprocess(os.path.abspath(__file__), ["--steps", str(args.steps), "--worker", kind],
                                  env={"HF_HUB_OFFLINE": "1"})
            results[kind] = r
            print(f"  {r['wall_s']:.0f} s, held-out {r['heldout_accuracy']:.3f}, staleness mean "
                  f"{r['staleness_mean']:.2f} (max {r['staleness_max']:.0f}), diverged {r['diverged']}", flush=True)
    out = {"settings": {**SETTINGS, "steps": args.steps, "staleness": STALENESS, "objectives": OBJECTIVES,
                        "model": "smollm2-135m-instruct"},
           "results": results, "run_seconds": time.perf_counter() - started, "provenance": provenance()}
    p = out["provenance"]
    lines = [f"# bench/async_staleness.py at {p['commit'][:10]}{' (tree changed)' if p['tree_changed'] else ''} "
             f"({p['date']}, {p['cpu_cores']} cores); run time {out['run_seconds'] / 60:.0f} min", "",
             f"Async GRPO, {args.steps} steps x {SETTINGS['prompts_per_step']} prompts x "
             f"{SETTINGS['num_generations']} completions, trainer throttled by {SETTINGS['trainer_delay_s']} s per step; "
             f"held-out greedy accuracy on {SETTINGS['heldout']} problems "
             f"(realised mean staleness in brackets); the untrained model: {results['base']['heldout_accuracy']:.3f}",
             "",
             "| objective | " + " | ".join(f"max_staleness {k}" for k in STALENESS)
             + " | staleness 4 - 0 (points) | diverged | collapsed at |", "|---|" + "---|" * (len(STALENESS) + 3)]
    for objective in OBJECTIVES:
        rs = [results[f"{objective}-{k}"] for k in STALENESS]
        delta = 100 * (results[f"{objective}-4"]["heldout_accuracy"] - results[f"{objective}-0"]["heldout_accuracy"])
        # finite losses do not mean the run learned: M2PO at max_staleness 8 once ended at 0.070 held-out against
        # the untrained model's 0.219 with every loss finite, so a run that ends below the untrained model is named
        collapsed = [str(k) for k, r in zip(STALENESS, rs)
                     if r["heldout_accuracy"] < results["base"]["heldout_accuracy"]]
        lines.append(f"| {objective} | " + " | ".join(f"{r['heldout_accuracy']:.3f} ({r['staleness_mean']:.1f})"
                                                      for r in rs)
                     + f" | {delta:+.1f} | {any(r['diverged'] for r in rs)} | {', '.join(collapsed) or 'none'} |")
    lines += ["", "diverged: some step's loss was not finite. collapsed at: the max_staleness bounds whose final "
              "held-out accuracy is below the untrained model's."]
    text = "\n".join(lines)
    print(text)
    results_dir = os.path.join(ROOT, "bench", "results")
    with open(os.path.join(results_dir, "async_staleness.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(results_dir, "async_staleness.txt"), "w") as f:
        f.write(text + "\n")
    _plot(out, os.path.join(results_dir, "async_staleness.png"))


def _seeds(steps: int, seeds: list[int], name: str = "async_staleness_seeds") -> None:
    started = time.perf_counter()
    objectives = list(OBJECTIVES)
    results = {}
    for seed in seeds:
        kinds = [f"{objectives[0]}-0"] + [f"{o}-4" for o in objectives]
        for kind in kinds:
            print(f"running {kind}, seed {seed} ...", flush=True)
            r = run_in_subprocess(os.path.abspath(__file__),
                                  ["--steps", str(steps), "--worker", kind, "--seed", str(seed)],
                                  env={"HF_HUB_OFFLINE": "1"})
            results[f"{kind}-s{seed}"] = r
            print(f"  {r['wall_s']:.0f} s, held-out {r['heldout_accuracy']:.3f}, staleness mean "
                  f"{r['staleness_mean']:.2f} (max {r['staleness_max']:.0f}), diverged {r['diverged']}", flush=True)
    out = {"settings": {**SETTINGS, "steps": steps, "staleness": (0, 4), "seeds": seeds, "objectives": OBJECTIVES,
                        "model": "smollm2-135m-instruct"},
           "results": results, "run_seconds": time.perf_counter() - started, "provenance": provenance()}
    p = out["provenance"]

    def acc(kind: str, seed: int) -> float:
        return results[f"{kind}-s{seed}"]["heldout_accuracy"]

    def mean_sd(xs: list[float]) -> str:
        m = sum(xs) / len(xs)
        sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
        return f"{m:+.1f} +- {sd:.1f}" if len(xs) > 1 else f"{m:+.1f}"

    base0 = f"{objectives[0]}-0"
    lines = [f"# bench/async_staleness.py --seeds {','.join(map(str, seeds))} at {p['commit'][:10]}"
             f"{' (tree changed)' if p['tree_changed'] else ''} ({p['date']}, {p['cpu_cores']} cores); "
             f"run time {out['run_seconds'] / 60:.0f} min", "",
             f"Async GRPO, {steps} steps x {SETTINGS['prompts_per_step']} prompts x {SETTINGS['num_generations']} "
             f"completions, trainer throttled by {SETTINGS['trainer_delay_s']} s per step; held-out greedy accuracy "
             f"on {SETTINGS['heldout']} problems (realised mean staleness in brackets). max_staleness 0 runs once "
             f"per seed ({objectives[0]}; at 0 the objectives coincide up to the sampler's numerical gap).", "",
             "| seed | max_staleness 0 | " + " | ".join(f"{o} at 4" for o in objectives) + " |",
             "|---|---|" + "---|" * len(objectives)]
    for seed in seeds:
        r0 = results[f"{base0}-s{seed}"]
        cells = []
        for o in objectives:
            r4 = results[f"{o}-4-s{seed}"]
            cells.append(f"{r4['heldout_accuracy']:.3f} ({r4['staleness_mean']:.1f}; "
                         f"{100 * (r4['heldout_accuracy'] - r0['heldout_accuracy']):+.1f} pts)")
        lines.append(f"| {seed} | {r0['heldout_accuracy']:.3f} | " + " | ".join(cells) + " |")
    lines += ["", "| objective | staleness 4 - 0, points (mean +- sd over seeds) | within 5 points on average | "
              "diverged |", "|---|---|---|---|"]
    for o in objectives:
        deltas = [100 * (acc(f"{o}-4", s) - acc(base0, s)) for s in seeds]
        mean = sum(deltas) / len(deltas)
        diverged = any(results[f"{o}-4-s{s}"]["diverged"] for s in seeds)
        lines.append(f"| {o} | {mean_sd(deltas)} | {'yes' if mean >= -5 else 'no'} | {diverged} |")
    text = "\n".join(lines)
    print(text)
    results_dir = os.path.join(ROOT, "bench", "results")
    with open(os.path.join(results_dir, f"{name}.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(results_dir, f"{name}.txt"), "w") as f:
        f.write(text + "\n")


def _plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for objective in out["settings"]["objectives"]:
        rs = [out["results"][f"{objective}-{k}"] for k in out["settings"]["staleness"]]
        a.plot(list(out["settings"]["staleness"]), [r["heldout_accuracy"] for r in rs], marker="o", label=objective)
        for k, r in zip(out["settings"]["staleness"], rs):
            if k in (0, 4):
                curve = r["reward_curve"]
                smooth = [sum(curve[max(0, i - 4):i + 1]) / len(curve[max(0, i - 4):i + 1]) for i in range(len(curve))]
                b.plot(smooth, label=f"{objective}, max_staleness {k}", linestyle="-" if k == 0 else "--")
    a.set_xlabel("max_staleness")
    a.set_ylabel("held-out accuracy (128)")
    a.set_title("final held-out accuracy")
    a.legend()
    b.set_xlabel("step")
    b.set_ylabel("reward (5-step mean)")
    b.set_title("reward during training")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
