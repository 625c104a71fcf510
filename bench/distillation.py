"""The distillation demonstration: how long a fresh student needs, distilled on-policy from the GRPO-trained
model (GKD), to reach the teacher's held-out accuracy, against how long GRPO itself took to get there.

    toolkit grpo --config examples/grpo_arithmetic.toml   # the teacher: GRPO, outputs/grpo-arithmetic
    toolkit gkd --config examples/gkd_arithmetic.toml     # the student: GKD, outputs/gkd-arithmetic
    python bench/distillation.py --json bench/results/distillation.json > bench/results/distillation.txt

Reads both runs' report files (summary.json: held-out greedy accuracy every `eval_every` steps; metrics.jsonl:
per-step phase timings) and writes the table (stdout), the JSON and a plot next to the JSON. Time is measured
two ways: optimizer steps (both runs sample 32 completions of up to 16 tokens per step from the same 135M model),
and training minutes, the sum of each step's generation, scoring, scoring-forward and training seconds as the
trainer logged them (evaluation excluded; `time/train_s` is per micro-batch, so the sum is exact for
gradient_accumulation_steps = 1, as both runs here use). Both runs use the same model, task, batch and learning rate; their
minutes are only comparable if the machine was otherwise idle during both (the JSON records each run's s/step).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

PHASES = ("time/generation_s", "time/scoring_s", "time/scoring_forward_s", "time/train_s")


def _run(folder: Path) -> dict:
    summary = json.loads((folder / "summary.json").read_text())
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    logged = [int(e["step"]) for e in steps if "step" in e and any(k in e for k in PHASES)]
    if logged != list(range(1, len(logged) + 1)):
        # with logging_steps > 1 the logged phase times are averages over several steps: the sum would undercount
        raise SystemExit(f"{folder}: metrics.jsonl does not log every step (logging_steps = 1 is needed to sum "
                         "the phase times).")
    minutes, total = {0: 0.0}, 0.0
    for entry in steps:
        if "step" in entry and any(k in entry for k in PHASES):
            total += sum(entry.get(k, 0.0) for k in PHASES)
            minutes[int(entry["step"])] = total / 60
    history = [(int(s), float(a)) for s, a in summary["accuracy_history"]]
    last = max(minutes)
    return {"folder": str(folder), "accuracy_history": history,
            "minutes_at": {s: round(minutes.get(s, minutes[last]), 2) for s, _ in history},
            "steps": last, "train_minutes": round(minutes[last], 2),
            "s_per_step": round(60 * minutes[last] / max(last, 1), 2),
            "accuracy_before": summary.get("heldout_accuracy_before"),
            "accuracy_after": summary.get("heldout_accuracy_after")}


def _first_reaching(run: dict, target: float) -> tuple[int, float] | None:
    for step, acc in run["accuracy_history"]:
        if acc >= target - 1e-9:
            return step, run["minutes_at"][step]
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher-run", default="outputs/grpo-arithmetic/report", help="The GRPO run's report folder.")
    ap.add_argument("--student-run", default="outputs/gkd-arithmetic/report", help="The GKD run's report folder.")
    ap.add_argument("--json", default=None, help="Write the results here (and the plot next to it).")
    ap.add_argument("--runs-commit", default=None, help="The commit the two runs were made at, when not this one.")
    a = ap.parse_args()
    teacher, student = _run(Path(a.teacher_run)), _run(Path(a.student_run))
    target = teacher["accuracy_after"]
    grpo_hit, gkd_hit = _first_reaching(teacher, target), _first_reaching(student, target)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"commit": commit, "runs_commit": a.runs_commit or commit, "date": datetime.date.today().isoformat(),
           "target_accuracy": target,
           "grpo": {**teacher, "reached_at": grpo_hit}, "gkd": {**student, "reached_at": gkd_hit}}
    runs = f", runs at {a.runs_commit[:7]}" if a.runs_commit else ""
    print(f"Distillation demonstration (report written at commit {commit[:7]}{runs}, {out['date']}): held-out greedy "
          "accuracy on 64 generated +/- problems")
    print(f"teacher (GRPO, {teacher['folder']}): {teacher['accuracy_before']:.3f} -> {teacher['accuracy_after']:.3f} "
          f"in {teacher['steps']} steps, {teacher['train_minutes']} training min ({teacher['s_per_step']} s/step)")
    print(f"student (GKD from the teacher, {student['folder']}): {student['accuracy_before']:.3f} -> "
          f"{student['accuracy_after']:.3f} in {student['steps']} steps, {student['train_minutes']} training min "
          f"({student['s_per_step']} s/step)")
    print(f"{'step':>5} {'GRPO acc':>9} {'GRPO min':>9}   {'step':>5} {'GKD acc':>8} {'GKD min':>8}")
    rows = max(len(teacher["accuracy_history"]), len(student["accuracy_history"]))
    for i in range(rows):
        left = right = ""
        if i < len(teacher["accuracy_history"]):
            s, acc = teacher["accuracy_history"][i]
            left = f"{s:>5} {acc:>9.3f} {teacher['minutes_at'][s]:>9.2f}"
        if i < len(student["accuracy_history"]):
            s, acc = student["accuracy_history"][i]
            right = f"{s:>5} {acc:>8.3f} {student['minutes_at'][s]:>8.2f}"
        print(f"{left:<25}   {right}")
    for name, hit in (("GRPO", grpo_hit), ("GKD student", gkd_hit)):
        print(f"{name} first at >= {target:.3f}: " + (f"step {hit[0]}, {hit[1]:.2f} training min" if hit else
                                                      "not reached in its run"))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, run in (("GRPO (the teacher's own run)", teacher), ("GKD student from the teacher", student)):
            ax.plot([run["minutes_at"][s] for s, _ in run["accuracy_history"]],
                    [acc for _, acc in run["accuracy_history"]], marker="o", label=name)
        ax.axhline(target, color="grey", linestyle="--", label=f"teacher's final accuracy {target:.3f}")
        ax.set_xlabel("training minutes (2 CPU cores; evaluation excluded)")
        ax.set_ylabel("held-out greedy accuracy")
        ax.legend()
        fig.tight_layout()
        fig.savefig(Path(a.json).with_suffix(".png"), dpi=100)


if __name__ == "__main__":
    main()
