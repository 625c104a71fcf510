"""One recipe, unchanged, on a suite of reasoning-gym tasks no one here wrote (issue 62).

Each task runs `toolkit pipeline` with the same two stages (examples/task_suite_sft.toml, then
examples/task_suite_grpo.toml); only the dataset and the task's own settings (its difficulty) differ, and the
held-out accuracy is the task's own `score_answer` on 64 held-out problems, greedy. The table: accuracy of the
embedded SmolLM2-135M-Instruct before, after SFT, after RL, and minutes, per task and on average.

    python bench/task_suite.py                      # the suite (about 45 minutes on 2 cores)
    python bench/task_suite.py --tasks chain_sum    # one task
    python bench/task_suite.py --diagnose           # pass@k of the base, SFT and RL models, the 3 weakest tasks
    python bench/task_suite.py --diagnose --tasks leg_counting products   # ... of these tasks' own run

Writes bench/results/task_suite.{json,txt} (the suite; --tasks writes task_suite_<names>.*) with the commit and
machine; --diagnose adds its table to the suite's files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "outputs" / "task_suite"
SFT, GRPO = "examples/task_suite_sft.toml", "examples/task_suite_grpo.toml"

# task -> (what it exercises, the task's own settings: sizes a 135M model has a chance at)
TASKS: dict[str, tuple[str, dict]] = {
    "chain_sum": ("arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    "products": ("arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    "gcd": ("number theory", {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 50}),
    "letter_counting": ("counting", {"min_words": 3, "max_words": 5}),
    "leg_counting": ("counting", {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3}),
    "word_sequence_reversal": ("string manipulation", {"min_words": 3, "max_words": 4}),
    "number_sorting": ("sorting", {"min_numbers": 3, "max_numbers": 4, "min_decimals": 0, "max_decimals": 0,
                                   "min_value": 0, "max_value": 50}),
    "syllogism": ("logic", {}),
}


def toml_value(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def run_task(task: str) -> dict:
    """The pipeline for one task; its summary as a row of the table."""
    _, settings = TASKS[task]
    out = OUT / task
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    per_task = {"dataset": f"reasoning_gym:{task}", "eval_dataset": f"reasoning_gym:{task}", "task_kwargs": settings}
    overrides = toml_value(per_task)
    (out / "pipeline.toml").write_text(
        f'output_dir = "{out}"\nstages = [\n  {{command = "sft", config = "{SFT}", overrides = {overrides}}},\n'
        f'  {{command = "grpo", config = "{GRPO}", overrides = {overrides}}},\n]\n')
    toolkit = shutil.which("toolkit", path=os.path.dirname(sys.executable)) or "toolkit"
    started = time.perf_counter()
    with open(out / "log.txt", "w") as log:  # written as it runs: `tail -f` shows the steps
        proc = subprocess.run([toolkit, "pipeline", "--config", str(out / "pipeline.toml")], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{task}: the pipeline failed (exit {proc.returncode}); see {out / 'log.txt'}:\n"
                         + (out / "log.txt").read_text()[-2000:])
    summary = json.loads((out / "summary.json").read_text())
    sft, rl = summary["stages"]
    return {"task": task, "kind": TASKS[task][0], "settings": settings,
            "before": sft["heldout_accuracy_before"], "after_sft": sft["heldout_accuracy_after"],
            "after_rl": rl["heldout_accuracy_after"], "sft_minutes": sft["minutes"], "rl_minutes": rl["minutes"],
            "minutes": round((time.perf_counter() - started) / 60, 2)}


def pass_at_k(model_path: str, task: str, *, k: int = 8, n_prompts: int = 64, max_new_tokens: int = 32) -> dict:
    """pass@1 (mean over k samples) and pass@k (any of k correct) at temperature 1 on the held-out problems the
    suite scores: whether the model can produce the answer at all (a ceiling RL can draw on) or not."""
    import torch

    from toolkit.core.data import prompt_rows, tokenize_prompts
    from toolkit.core.generation import SamplingParams, TransformersBackend
    from toolkit.core.gym_tasks import gym_splits, reasoning_gym_reward
    from toolkit.core.models import load_model, load_tokenizer

    torch.manual_seed(0)
    _, held = gym_splits(task, 512, n_prompts, settings=TASKS[task][1])
    model, tok = load_model(model_path).eval(), load_tokenizer(model_path)
    rows, _ = prompt_rows(held, tok, trainer="eval_dataset")
    prompts, _ = tokenize_prompts(rows, tok, max_prompt_length=None)
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id, max_batch_size=128)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=1.0, stop_token_ids=(tok.eos_token_id,))
    groups = backend.generate(prompts, params, n=k, seed=0)
    solved = []
    for row, group in zip(held, groups):
        texts = [tok.decode(c.token_ids, skip_special_tokens=True) for c in group]
        scores = reasoning_gym_reward([row["prompt"]] * k, texts, [[]] * k, reasoning_gym=[row["reasoning_gym"]] * k)
        solved.append([s is not None and s >= 1.0 for s in scores])
    return {"pass@1": sum(sum(s) for s in solved) / (k * len(solved)),
            f"pass@{k}": sum(any(s) for s in solved) / len(solved)}


def rl_training_signal(metrics: Path, window: int = 5) -> dict:
    """What the RL stage had to learn from, from its own log: the training reward over the first and last
    `window` steps, and the share of groups that were tied (all samples scored alike, so no gradient) on average."""
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [s for s in steps if "reward" in s]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"reward_first": mean([s["reward"] for s in steps[:window]]),
            "reward_last": mean([s["reward"] for s in steps[-window:]]),
            "tied_groups": mean([s["frac_reward_zero_std"] for s in steps if "frac_reward_zero_std" in s])}


def table(rows: list[dict]) -> str:
    lines = ["| task | kind | before | after SFT | after RL | RL gain | minutes |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['kind']} | {100 * r['before']:.1f}% | {100 * r['after_sft']:.1f}% | "
                     f"{100 * r['after_rl']:.1f}% | {100 * (r['after_rl'] - r['after_sft']):+.1f} | {r['minutes']:.1f} |")
    if rows:
        mean = {key: sum(r[key] for r in rows) / len(rows) for key in ("before", "after_sft", "after_rl")}
        lines.append(f"| **mean** | | {100 * mean['before']:.1f}% | {100 * mean['after_sft']:.1f}% | "
                     f"{100 * mean['after_rl']:.1f}% | {100 * (mean['after_rl'] - mean['after_sft']):+.1f} | "
                     f"{sum(r['minutes'] for r in rows):.1f} |")
        lines.append(f"\nmean gain over the base model: {100 * (mean['after_rl'] - mean['before']):+.1f} points; "
                     f"tasks below their base model: "
                     f"{', '.join(r['task'] for r in rows if r['after_rl'] < r['before']) or 'none'}")
    return "\n".join(lines)


def render(data: dict, path: Path) -> None:
    prov = data["provenance"]
    text = (f"# bench/task_suite.py at {prov['commit'][:10]}{' (tree changed)' if prov.get('tree_changed') else ''}"
            f" ({prov['date']}, {prov['cpu_cores']} cores)\n\n"
            "One recipe (examples/task_suite_sft.toml then examples/task_suite_grpo.toml), unchanged, per "
            "reasoning-gym task; held-out greedy accuracy by the task's own score_answer on 64 held-out problems; "
            "the embedded SmolLM2-135M-Instruct.\n\n" + table(data["results"]) + "\n")
    if data.get("diagnosis"):
        text += ("\npass@k at temperature 1 on the same held-out problems (8 samples each), the three weakest "
                 "tasks after RL (base model, after SFT, after RL); for the RL stage, its training reward over the first "
                 "and last 5 steps and the share of tied groups (no gradient):\n\n"
                 "| task | model | pass@1 | pass@8 | RL reward first -> last 5 steps | tied groups |\n"
                 "|---|---|---|---|---|---|\n")
        for d in data["diagnosis"]:
            rl = (f"{d['reward_first']:.3f} -> {d['reward_last']:.3f} | {100 * d['tied_groups']:.0f}%"
                  if "reward_first" in d else " | ")
            text += f"| {d['task']} | {d['model']} | {100 * d['pass@1']:.1f}% | {100 * d['pass@8']:.1f}% | {rl} |\n"
    path.with_suffix(".txt").write_text(text)
    path.with_suffix(".json").write_text(json.dumps(data, indent=2))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--diagnose", action="store_true", help="pass@k of the base, SFT and RL models for the three weakest tasks of the results file (the suite's, or --tasks's)")
    args = ap.parse_args()
    suite = args.tasks == list(TASKS)
    path = RESULTS / ("task_suite" if suite else "task_suite_" + "_".join(args.tasks))
    if args.diagnose:
        data = json.loads(path.with_suffix(".json").read_text())
        weakest = sorted(data["results"], key=lambda r: r["after_rl"])[:3]
        from toolkit.core.models import embedded_model_path

        data["diagnosis"] = []
        for r in weakest:
            models = (("base", str(embedded_model_path())), ("SFT", str(OUT / r["task"] / "0-sft" / "final")),
                      ("RL", str(OUT / r["task"] / "1-grpo" / "final")))
            missing = [m for _, m in models[1:] if not Path(m).is_dir()]
            if missing:
                raise SystemExit(f"--diagnose reads the models the suite saved, and {missing[0]} is not there: run "
                                 f"`python bench/task_suite.py --tasks {r['task']}` first (then --diagnose with the "
                                 "same --tasks)")
            for name, model in models:
                d = {"task": r["task"], "model": name, **pass_at_k(model, r["task"])}
                if name == "RL":
                    d.update(rl_training_signal(OUT / r["task"] / "1-grpo" / "metrics.jsonl"))
                print(d, flush=True)
                data["diagnosis"].append(d)
        data["diagnosis_provenance"] = provenance()
        render(data, path)
        print(path.with_suffix(".txt").read_text())
        return 0
    started = time.perf_counter()
    # recorded before the first task: the code every task runs (toolkit/, bench/, examples/ must stay as they are
    # while the suite runs; docs and tests may change)
    prov = provenance()
    results = []
    for task in args.tasks:
        print(f"== {task}", flush=True)
        results.append(run_task(task))
        print(table(results[-1:]).splitlines()[2], flush=True)
    data = {"provenance": prov, "sft_recipe": SFT, "rl_recipe": GRPO, "results": results,
            "benchmark_minutes": round((time.perf_counter() - started) / 60, 1)}
    render(data, path)
    print(path.with_suffix(".txt").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
