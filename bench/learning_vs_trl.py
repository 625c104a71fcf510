"""Benchmark: held-out accuracy per minute of training. The main job's RL stage with our GRPOTrainer and with
TRL's GRPOTrainer, the same wall-clock budget each, one run.

    python bench/learning_vs_trl.py                      # about 25 minutes on 2 CPU cores
    python bench/learning_vs_trl.py --minutes 3          # a shorter budget
    python bench/learning_vs_trl.py --seeds 0 1 2        # several seeds (each side, each seed)

Both sides start from the main job's SFT checkpoint (`outputs/arithmetic/0-sft/final`, written by
`bash scripts/run-main.sh`; when it is missing this script runs that SFT stage first, about 6 minutes) and
train on the same 512 generated problems with the main job's GRPO settings, read from
examples/arithmetic_pipeline.toml: 16 prompts x 8 samples per step, max 24 new tokens, temperature 1, learning
rate 1e-5 constant after 5 warm-up steps, DAPO loss, no KL, exact numeric match as the reward. Everything else is
each library's own default (TRL: gradient checkpointing on, which the `trl-no-gc` row switches off to show what
it costs; fp32 on both, as bf16 autocast is not what either side runs on these CPUs).

Each side gets `--minutes` of training time: the clock runs from the start of training and excludes the held-out
evaluations, which are the same function on both sides (greedy decoding of the 128 held-out problems of the main
job, scored by the number in the answer) and run at step 0, after each `--eval-every` minutes of training and
when the budget is spent. Each run is its own process; the runs go one after the other, never sharing the cores.
Writes bench/results/learning_vs_trl.{json,txt,png} (the table below, the curves, the settings, the commit).
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
PIPELINE = os.path.join(ROOT, "examples", "arithmetic_pipeline.toml")
KINDS = ("toolkit", "trl", "trl-no-gc")


def main_job_settings(seed: int = 0):
    """The main job's SFT stage and its GRPO stage's (RunArgs, GRPOConfig), as the pipeline would run them."""
    from toolkit.core.config import build_configs, load_run_file
    from toolkit.core.grpo import GRPOConfig
    from toolkit.core.pipeline import load_pipeline

    out, stages = load_pipeline(PIPELINE)
    sft, grpo = [s for s in stages if s["command"] == "sft"][0], [s for s in stages if s["command"] == "grpo"][0]
    values = {**load_run_file(grpo["config"]), **grpo["overrides"]}
    values.update(output_dir="/tmp/bench-learning-toolkit", save_strategy="no", max_steps=100_000, seed=seed)
    run, cfg = build_configs(values, GRPOConfig)
    return out, sft, run, cfg


def budget_callback(rows, minutes: float, eval_every: float, max_new_tokens: int):
    """Stops training after `minutes` of training (evaluations excluded) and measures held-out greedy accuracy
    at step 0, after every `eval_every` minutes and at the end: `.points` = [(step, train minutes, accuracy)]."""
    from transformers import TrainerCallback

    from toolkit.core.tasks import greedy_accuracy

    class Budget(TrainerCallback):
        def __init__(self):
            self.points: list[tuple[int, float, float]] = []
            self.t0 = self.eval_s = 0.0
            self.next_eval = eval_every

        def measure(self, step, model, tokenizer):
            train_min = (time.perf_counter() - self.t0 - self.eval_s) / 60
            started = time.perf_counter()
            acc = greedy_accuracy(model, tokenizer, rows, max_new_tokens=max_new_tokens)
            self.eval_s += time.perf_counter() - started
            self.points.append((step, round(train_min, 3), acc))
            print(f"  step {step:4d}  {train_min:5.2f} min  held-out accuracy {acc:.3f}", flush=True)
            return train_min

        def on_train_begin(self, args, state, control, model=None, processing_class=None, **kw):
            self.t0 = time.perf_counter()
            self.measure(0, model, processing_class)
            self.t0, self.eval_s = time.perf_counter(), 0.0  # the step-0 evaluation is not training time

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            train_min = (time.perf_counter() - self.t0 - self.eval_s) / 60
            if train_min >= minutes:
                self.measure(state.global_step, model, processing_class)
                control.should_training_stop = True
            elif train_min >= self.next_eval:
                self.measure(state.global_step, model, processing_class)
                while self.next_eval <= train_min:
                    self.next_eval += eval_every

    return Budget()


def worker(kind: str, start: str, minutes: float, eval_every: float, seed: int) -> dict:
    import torch

    from toolkit.core.rewards import numeric_match
    from toolkit.core.tasks import task_splits

    _, _, run, cfg = main_job_settings(seed)
    if list(run.reward_funcs) != ["numeric_match"] or run.dataset != "builtin:arithmetic":
        raise SystemExit(f"the main job's GRPO stage changed (reward {run.reward_funcs}, data {run.dataset}); "
                         "update this benchmark")
    train, held_out = task_splits("arithmetic", run.dataset_size, run.eval_size, max_value=run.task_max_value,
                                  max_terms=run.task_max_terms, kind="prompt_only")
    budget = budget_callback(held_out, minutes, eval_every, cfg.max_completion_length)
    torch.manual_seed(seed)
    if kind == "toolkit":
        from toolkit.core.grpo import GRPOTrainer

        trainer = GRPOTrainer(start, [numeric_match], cfg, train_dataset=train, callbacks=[budget])
    else:
        from datasets import Dataset
        from trl import GRPOConfig as TRLConfig
        from trl import GRPOTrainer as TRLTrainer

        def reward(prompts, completions, completion_ids=None, **kw):  # TRL passes the dataset columns as kwargs
            return numeric_match(prompts, completions, completion_ids, answer=kw["answer"])

        same = dict(learning_rate=cfg.learning_rate, lr_scheduler_type=str(getattr(cfg.lr_scheduler_type, "value",
                    cfg.lr_scheduler_type)), warmup_steps=cfg.warmup_steps,
                    per_device_train_batch_size=cfg.per_device_train_batch_size,
                    gradient_accumulation_steps=cfg.gradient_accumulation_steps,
                    num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
                    temperature=cfg.temperature, top_p=cfg.top_p, loss_type=cfg.loss_type, beta=cfg.beta,
                    epsilon=cfg.epsilon, scale_rewards=cfg.scale_rewards,
                    mask_truncated_completions=cfg.mask_truncated_completions, max_steps=cfg.max_steps)
        extra = {"gradient_checkpointing": False} if kind == "trl-no-gc" else {}
        args = TRLConfig(output_dir=f"/tmp/bench-learning-{kind}", **same, **extra, logging_steps=1,
                         save_strategy="no", report_to="none", seed=seed, disable_tqdm=True, use_cpu=True,
                         bf16=False, model_init_kwargs={"dtype": torch.float32})
        trainer = TRLTrainer(model=start, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(train),
                             callbacks=[budget])
    trainer.train()
    steps = trainer.state.global_step
    train_min = budget.points[-1][1]
    # both trainers log completions/mean_length per step: equal work per step shows as equal generated tokens
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    completions_per_step = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    return {"kind": kind, "seed": seed, "steps": steps, "train_minutes": train_min,
            "sec_per_step": round(train_min * 60 / max(steps, 1), 2), "points": budget.points,
            "generated_tokens_per_step": round(sum(lengths) / len(lengths) * completions_per_step) if lengths else None,
            "gradient_checkpointing": bool(getattr(trainer.args, "gradient_checkpointing", False))}


def ensure_start(out: str, sft: dict) -> str:
    """The main job's SFT checkpoint; runs that stage (as the pipeline does) when it is not there."""
    final = os.path.join(ROOT, out, "0-sft", "final")
    if os.path.isfile(os.path.join(final, "config.json")):
        return final
    print(f"no SFT checkpoint at {final}: running the main job's SFT stage first (about 6 minutes) ...", flush=True)
    cmd = [sys.executable, "-m", "toolkit.cli", "sft", "--config", sft["config"],
           "--output_dir", os.path.join(ROOT, out, "0-sft")]
    for key, value in sft["overrides"].items():
        cmd.append(f"--{key}={json.dumps(value)}")
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    return final


def table(results: list[dict]) -> str:
    """One row per run: every measurement as accuracy @ training minutes (step), then the end and the best."""
    lines = ["| side | seed | steps | s/step | generated tokens/step | held-out accuracy @ training minutes (step) | end "
             "| best |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        pts = r["points"]
        curve = ", ".join(f"{acc:.1%} @ {m:.1f} ({step})" for step, m, acc in pts)
        tokens = r.get("generated_tokens_per_step")
        lines.append(f"| {r['kind']} | {r['seed']} | {r['steps']} | {r['sec_per_step']:.1f} | "
                     f"{'-' if tokens is None else tokens} | {curve} | "
                     f"{pts[-1][2]:.1%} | {max(p[2] for p in pts):.1%} |")
    return "\n".join(lines)


def describe(data: dict) -> str:
    s, prov = data["settings"], data["provenance"]
    return (f"Held-out accuracy per training minute: the main job's GRPO stage (examples/arithmetic_pipeline.toml), "
            f"ours vs TRL's GRPOTrainer, {data['minutes']:g} training minutes each, from {data['start']} "
            f"(its SFT stage: {data['start_sft_heldout_accuracy']}).\n"
            f"{s['prompts_per_step']} prompts x {s['num_generations']} samples per step, max "
            f"{s['max_completion_length']} new tokens, temperature {s['temperature']}, lr {s['learning_rate']} "
            f"({s['warmup_steps']} warm-up steps, then constant), loss {s['loss_type']}, beta {s['beta']}; "
            f"{s['eval_size']} held-out problems, greedy, measured after each {data['eval_every_minutes']:g} training "
            "minutes (at the end of the step that crosses the mark) and at the end; a run stops at the end of the "
            "step that crosses the budget.\n"
            f"Measured at commit {prov['commit'][:12]}{' (tree changed)' if prov['tree_changed'] else ''}, "
            f"{prov['date']}, {prov['cpu_cores']} cores, torch {prov['versions']['torch']}, transformers "
            f"{prov['versions']['transformers']}, trl {prov['versions']['trl']}.\n\n"
            + table(data["results"]) + f"\n\nbenchmark run time: {data['benchmark_minutes']:.1f} min\n")


def write_outputs(data: dict, out: str) -> None:
    text = describe(data)
    print("\n" + text)
    with open(out + ".txt", "w") as f:
        f.write(text)
    plot(data["results"], out + ".png", data["minutes"])


def plot(results: list[dict], path: str, minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"toolkit": "tab:blue", "trl": "tab:red", "trl-no-gc": "tab:orange"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        xs = [p[1] for p in r["points"]]
        ys = [100 * p[2] for p in r["points"]]
        ax.plot(xs, ys, marker="o", color=colors.get(r["kind"]), alpha=0.9 if r["seed"] == results[0]["seed"] else 0.5,
                label=f"{r['kind']} (seed {r['seed']}, {r['steps']} steps)")
    ax.set_xlabel("training minutes (held-out evaluations excluded), 2 CPU cores")
    ax.set_ylabel("held-out greedy accuracy (%), 128 problems")
    ax.set_title(f"GRPO stage of the main job: ours vs TRL, {minutes:g} min each")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0, help="training minutes per run")
    ap.add_argument("--eval-every", type=float, default=1.0, help="minutes of training between evaluations")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--start", default=None, help="a model to start from instead of the main job's SFT checkpoint")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "learning_vs_trl"),
                    help="results path without extension (.json, .txt, .png are written)")
    ap.add_argument("--render", action="store_true",
                    help="write the .txt and .png again from the .json of a finished run (no training)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.start, args.minutes, args.eval_every, args.seed)),
              flush=True)
        return
    if args.render:
        with open(args.out + ".json") as f:
            write_outputs(json.load(f), args.out)
        return
    out, sft, run, cfg = main_job_settings()
    start = args.start or ensure_start(out, sft)
    results = []
    began = time.perf_counter()
    for seed in args.seeds:
        for kind in args.kinds:
            print(f"running {kind} (seed {seed}, {args.minutes:g} training minutes) ...", flush=True)
            results.append(run_in_subprocess(__file__, ["--worker", kind, "--start", start, "--seed", str(seed),
                                                        "--minutes", str(args.minutes),
                                                        "--eval-every", str(args.eval_every)]))
            r = results[-1]
            print(f"  {r['steps']} steps, {r['sec_per_step']:.1f} s/step, accuracy {r['points'][0][2]:.1%} -> "
                  f"{r['points'][-1][2]:.1%}", flush=True)
    total = (time.perf_counter() - began) / 60
    stage = os.path.join(os.path.dirname(start), "summary.json")
    start_summary = json.load(open(stage)) if os.path.isfile(stage) else {}
    data = {"provenance": provenance(), "start": os.path.relpath(start, ROOT),
            "start_sft_heldout_accuracy": start_summary.get("heldout_accuracy_after"),
            "start_sft_commit": start_summary.get("commit"), "minutes": args.minutes,
            "eval_every_minutes": args.eval_every, "settings": {
                "prompts_per_step": cfg.per_device_train_batch_size // cfg.num_generations,
                "num_generations": cfg.num_generations, "max_completion_length": cfg.max_completion_length,
                "temperature": cfg.temperature, "learning_rate": cfg.learning_rate,
                "warmup_steps": cfg.warmup_steps, "loss_type": cfg.loss_type, "beta": cfg.beta,
                "dataset_size": run.dataset_size, "eval_size": run.eval_size},
            "benchmark_minutes": round(total, 1), "results": results}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(data, f, indent=2)
    write_outputs(data, args.out)


if __name__ == "__main__":
    main()
