"""Run reports: held-out accuracy over steps, metrics as JSON lines, and a PNG plot a person can read."""

from __future__ import annotations

__all__ = [
    "AccuracyCallback",
    "write_report",
]

import json
import logging
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class AccuracyCallback(TrainerCallback):
    """Held-out greedy accuracy every `every` optimizer steps (0: only when asked), kept in `history`."""

    def __init__(self, rows: list[dict[str, Any]], *, every: int = 0, max_new_tokens: int = 16):
        self.rows, self.every, self.max_new_tokens = rows, every, max_new_tokens
        self.history: list[tuple[int, float]] = []

    def measure(self, trainer, step: int) -> float:
        from .tasks import greedy_accuracy

        acc = greedy_accuracy(trainer.model, trainer.processing_class, self.rows, max_new_tokens=self.max_new_tokens)
        if not self.history or self.history[-1][0] != step:
            self.history.append((step, acc))
        return acc

    def on_step_end(self, args, state, control, **kwargs):
        if self.every and state.global_step % self.every == 0 and state.global_step < state.max_steps:
            from .tasks import greedy_accuracy

            acc = greedy_accuracy(kwargs["model"], kwargs["processing_class"], self.rows,
                                  max_new_tokens=self.max_new_tokens)
            self.history.append((state.global_step, acc))
            logger.info("step %d: held-out greedy accuracy %.3f", state.global_step, acc)


def write_report(trainer, out_dir: Path, accuracy: list[tuple[int, float]], summary: dict[str, Any], *,
                 reward_key: str = "reward", title: str = "GRPO", step_name: str = "optimizer step") -> dict[str, str]:
    """Write metrics.jsonl, summary.json and report.png under out_dir/report; return their paths."""
    report = out_dir / "report"
    report.mkdir(parents=True, exist_ok=True)
    with open(report / "metrics.jsonl", "w") as f:
        for entry in trainer.state.log_history:
            f.write(json.dumps(entry) + "\n")
    paths = {"metrics": str(report / "metrics.jsonl"), "summary_file": str(report / "summary.json")}
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; no report.png (pip install matplotlib).")
    else:
        steps = [h["step"] for h in trainer.state.log_history if reward_key in h]
        rewards = [h[reward_key] for h in trainer.state.log_history if reward_key in h]
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.plot(steps, rewards, color="tab:blue", alpha=0.35, label="mean reward (per step)")
        if len(rewards) >= 5:
            k = max(3, len(rewards) // 10)
            smooth = [sum(rewards[max(0, i - k + 1):i + 1]) / len(rewards[max(0, i - k + 1):i + 1])
                      for i in range(len(rewards))]
            ax.plot(steps, smooth, color="tab:blue", label=f"mean reward ({k}-step average)")
        if accuracy:
            ax.plot([s for s, _ in accuracy], [a for _, a in accuracy], "o-", color="tab:red",
                    label="held-out greedy accuracy")
        ax.set_xlabel(step_name)
        ax.set_ylim(min([-0.02, *rewards]), max([1.02, *rewards]))
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
        ax.set_title(f"{title}: reward and held-out accuracy")
        fig.tight_layout()
        fig.savefig(report / "report.png", dpi=110)
        plt.close(fig)
        paths["plot"] = str(report / "report.png")
    (report / "summary.json").write_text(json.dumps({**summary, "accuracy_history": accuracy}, indent=2))
    return paths
