"""Run reports: held-out accuracy over steps, metrics as JSON lines, and a PNG plot a person can read."""

from __future__ import annotations

__all__ = [
    "AccuracyCallback",
    "heldout_by_rewards",
    "write_report",
]

import json
import time
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


class AccuracyCallback(TrainerCallback):
    """Held-out greedy accuracy every `every` optimizer steps (0: only when asked), kept in `history`.

    `by_rewards=False`: the builtin arithmetic check (the number in the answer). `by_rewards=True`: any prompt
    dataset, scored by the run's own reward functions (`heldout_by_rewards`): accuracy is the fraction of greedy
    completions whose total reward reaches `solved_reward`, and the mean reward is kept in `mean_rewards`.
    Set `trainer` (the CLI does) so steps during training can be measured by rewards.
    """

    def __init__(self, rows: Any, *, every: int = 0, max_new_tokens: int = 16, by_rewards: bool = False):
        self.rows, self.every, self.max_new_tokens, self.by_rewards = rows, every, max_new_tokens, by_rewards
        self.history: list[tuple[int, float]] = []
        self.mean_rewards: list[tuple[int, float]] = []
        # (step, wall-clock minutes of training before this measurement, evaluations excluded): how long the run
        # took to reach each accuracy, comparable between methods (docs/gkd.md's distillation demonstration)
        self.train_minutes: list[tuple[int, float]] = []
        self.trainer: Any = None
        self._started: float | None = None
        self._eval_s = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        if self._started is None:
            self._started = time.perf_counter()

    def _timed(self, step: int, started: float) -> None:
        if self._started is None:  # measured before training began
            self.train_minutes.append((step, 0.0))
            return
        self.train_minutes.append((step, round((started - self._started - self._eval_s) / 60, 3)))
        self._eval_s += time.perf_counter() - started

    def measure(self, trainer, step: int) -> float:
        if trainer is None:
            raise ValueError("AccuracyCallback(by_rewards=True): set callback.trainer = trainer before training.")
        if self.history and self.history[-1][0] == step:
            return self.history[-1][1]
        started = time.perf_counter()
        if self.by_rewards:
            acc, mean = heldout_by_rewards(trainer, self.rows, max_new_tokens=self.max_new_tokens)
            self.mean_rewards.append((step, mean))
        else:
            from .tasks import greedy_accuracy

            acc = greedy_accuracy(trainer.model, trainer.processing_class, self.rows,
                                  max_new_tokens=self.max_new_tokens)
        self.history.append((step, acc))
        self._timed(step, started)
        return acc

    def on_step_end(self, args, state, control, **kwargs):
        if self.every and state.global_step % self.every == 0 and state.global_step < state.max_steps:
            if self.by_rewards:
                acc = self.measure(self.trainer, state.global_step)
            else:
                from .tasks import greedy_accuracy

                started = time.perf_counter()
                acc = greedy_accuracy(kwargs["model"], kwargs["processing_class"], self.rows,
                                      max_new_tokens=self.max_new_tokens)
                self.history.append((state.global_step, acc))
                self._timed(state.global_step, started)
            logger.info("step %d: held-out greedy accuracy %.3f", state.global_step, acc)


@torch.no_grad()
def heldout_by_rewards(trainer: Any, dataset: Any, *, max_new_tokens: int, batch_size: int = 64
                       ) -> tuple[float, float]:
    """(accuracy, mean reward) of greedy completions to the held-out prompts in `dataset`, scored by the trainer's
    reward functions (GRPO's `compute_rewards`, weighted as in training). Accuracy: total reward >= solved_reward.
    A progress bar shows on a terminal when there is more than one batch."""
    from tqdm.auto import tqdm

    from .data import prompt_rows, tokenize_prompts
    from .generation import SamplingParams, TransformersBackend
    from .rewards import RewardRunner, score_completions, weighted_total

    tokenizer, args = trainer.processing_class, trainer.args
    rows, fmt = prompt_rows(dataset, tokenizer, trainer="eval_dataset")
    prompts, _ = tokenize_prompts(rows, tokenizer, max_prompt_length=args.max_prompt_length,
                                  chat_template_kwargs=args.chat_template_kwargs)
    backend = TransformersBackend(trainer.model, pad_token_id=tokenizer.pad_token_id, max_batch_size=batch_size)
    stop = tuple(args.stop_token_ids if args.stop_token_ids is not None else [tokenizer.eos_token_id])
    params = SamplingParams(max_tokens=max_new_tokens, top_k=1, stop_token_ids=stop)
    completion_ids: list[list[int]] = []
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc="held-out eval", disable=None if len(starts) > 1 else True, leave=False):
        groups = backend.generate(prompts[start:start + batch_size], params, n=1, seed=0)
        completion_ids += [g[0].token_ids for g in groups]
    # A runner of its own (the eval set's columns and format; its failures never count towards stopping training)
    runner = RewardRunner(trainer.reward_runner.funcs, timeout=args.reward_timeout, max_consecutive_failures=10**9)
    outcome, _ = score_completions(runner, tokenizer, rows, completion_ids, conversational=fmt.conversational,
                                   extra_columns=fmt.extra_columns)
    total = weighted_total(torch.tensor(outcome.rewards, dtype=torch.float32), trainer.reward_weights)
    judged = ~torch.isnan(total)
    if not judged.any():
        logger.warning("held-out eval: no completion was judged by the reward functions (all None/failed; "
                       "failures: %s); accuracy is unknown (NaN).", dict(outcome.failures))
        return float("nan"), float("nan")
    if not judged.all():
        logger.warning("held-out eval: %d of %d completions were not judged; accuracy counts the judged ones.",
                       int((~judged).sum()), len(total))
    accuracy = float((total[judged] >= args.solved_reward).float().mean())
    return accuracy, float(total[judged].mean())


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
