"""Run reports: held-out accuracy over steps, metrics as JSON lines, and a PNG plot a person can read."""

from __future__ import annotations

__all__ = [
    "AccuracyCallback",
    "curve_stability",
    "heldout_accuracy",
    "heldout_by_rewards",
    "source_commit",
    "write_report",
]

import contextlib
import json
import logging
import subprocess
import time
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
        with evaluation_precision(trainer.args, trainer.model):
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
                with evaluation_precision(args, kwargs["model"]):
                    acc = greedy_accuracy(kwargs["model"], kwargs["processing_class"], self.rows,
                                          max_new_tokens=self.max_new_tokens)
                self.history.append((state.global_step, acc))
                self._timed(state.global_step, started)
            logger.info("step %d: held-out greedy accuracy %.3f", state.global_step, acc)


def evaluation_precision(args: Any, model: Any) -> Any:
    """Held-out decoding in the training's precision: under the bf16/fp16 autocast training runs in (so a GPU
    run evaluates with the kernels it trains with; flash-attention refuses float32), nothing otherwise."""
    dtype = torch.bfloat16 if getattr(args, "bf16", False) else torch.float16 if getattr(args, "fp16", False) else None
    if dtype is None:
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=dtype)


def heldout_by_rewards(trainer: Any, dataset: Any, *, max_new_tokens: int, batch_size: int = 64
                       ) -> tuple[float, float]:
    """(accuracy, mean reward) of greedy completions to the held-out prompts in `dataset`, scored by the RL
    trainer's reward functions with its weights, prompt length, stop tokens and `solved_reward` (see
    `heldout_accuracy`)."""
    args = trainer.args
    if getattr(trainer, "environment_factory", None) is not None:
        return heldout_episodes(trainer, dataset, batch_size=batch_size)
    return heldout_accuracy(trainer.model, trainer.processing_class, dataset, trainer.reward_runner.funcs,
                            weights=trainer.reward_weights, solved_reward=args.solved_reward,
                            max_new_tokens=max_new_tokens, max_prompt_length=args.max_prompt_length,
                            chat_template_kwargs=args.chat_template_kwargs, stop_token_ids=args.stop_token_ids,
                            reward_timeout=args.reward_timeout, batch_size=batch_size)


@torch.no_grad()
def heldout_episodes(trainer: Any, dataset: Any, *, batch_size: int = 64) -> tuple[float, float]:
    """(success rate, mean reward) of greedy episodes on the held-out rows with the trainer's environment (GRPO with
    `environment`): success is an episode reward >= `solved_reward`; an episode without a reward counts as failed.
    Turns, tool calls and tool errors per episode are kept in `trainer.heldout_episode_stats`."""
    import dataclasses

    from tqdm.auto import tqdm

    from .data import prompt_rows

    rows, _ = prompt_rows(dataset, trainer.processing_class, trainer="eval_dataset")
    greedy = dataclasses.replace(trainer.sampling, top_k=1, temperature=1.0, top_p=1.0, min_p=0.0)
    episodes: list[Any] = []
    starts = range(0, len(rows), batch_size)
    was = trainer.model.training
    trainer.model.eval()
    backend = trainer.evaluation_backend()
    backend.sync_weights(trainer.model)
    try:
        for start in tqdm(starts, desc="held-out episodes", disable=None if len(starts) > 1 else True, leave=False):
            episodes += trainer.run_episodes(rows[start:start + batch_size], greedy, seed=0, backend=backend)
    finally:
        trainer.model.train(was)
    n = max(len(episodes), 1)
    rewards = [ep.reward if ep.reward is not None else 0.0 for ep in episodes]
    trainer.heldout_episode_stats = {
        "turns_mean": sum(len(ep.turns) for ep in episodes) / n,
        "tool_calls_mean": sum(ep.count("tool_calls") for ep in episodes) / n,
        "tool_errors_mean": sum(ep.count("tool_errors") for ep in episodes) / n}
    success = sum(r >= trainer.args.solved_reward for r in rewards) / n
    return success, sum(rewards) / n


@torch.no_grad()
def heldout_accuracy(model: Any, tokenizer: Any, dataset: Any, reward_funcs: list, *, weights: Any = None,
                     solved_reward: float = 1.0, max_new_tokens: int = 64, max_prompt_length: int | None = None,
                     chat_template_kwargs: dict | None = None, stop_token_ids: list[int] | None = None,
                     reward_timeout: float = 60.0, batch_size: int = 64) -> tuple[float, float]:
    """(accuracy, mean reward) of the model's greedy completions to the prompts of `dataset` (any prompt dataset;
    its other columns reach the reward functions, as in GRPO), scored by `reward_funcs` (callables) and summed
    with `weights` (default 1 each). Accuracy: the fraction of judged completions whose total reaches
    `solved_reward`. Rows no function judged (None, failures) are left out with a warning; NaN if none was.
    A progress bar shows on a terminal when there is more than one batch. Used by every trainer's CLI run."""
    from tqdm.auto import tqdm

    from .data import prompt_rows, tokenize_prompts
    from .generation import SamplingParams, TransformersBackend
    from .rewards import RewardRunner, score_completions, weighted_total

    from .vision import is_vision_processor, text_tokenizer, tokenize_vision_prompts, validate_vision

    rows, fmt = prompt_rows(dataset, tokenizer, trainer="eval_dataset")
    images = validate_vision(rows, fmt, tokenizer, trainer="eval_dataset", where="eval_dataset")
    vision = is_vision_processor(tokenizer)  # prompts with images: generated with them in context
    if vision:
        prompts, _ = tokenize_vision_prompts(rows, images, tokenizer, max_prompt_length=max_prompt_length,
                                             chat_template_kwargs=chat_template_kwargs)
    else:
        prompts, _ = tokenize_prompts(rows, tokenizer, max_prompt_length=max_prompt_length,
                                      chat_template_kwargs=chat_template_kwargs)
    text = text_tokenizer(tokenizer)
    backend = TransformersBackend(model, pad_token_id=text.pad_token_id, max_batch_size=batch_size,
                                  processor=tokenizer if vision else None)
    stop = tuple(stop_token_ids if stop_token_ids is not None else [text.eos_token_id])
    params = SamplingParams(max_tokens=max_new_tokens, top_k=1, stop_token_ids=stop)
    completion_ids: list[list[int]] = []
    starts = range(0, len(prompts), batch_size)
    for start in tqdm(starts, desc="held-out eval", disable=None if len(starts) > 1 else True, leave=False):
        extra = {"images": images[start:start + batch_size]} if vision else {}
        groups = backend.generate(prompts[start:start + batch_size], params, n=1, seed=0, **extra)
        completion_ids += [g[0].token_ids for g in groups]
    # A runner of its own (the eval set's columns and format; its failures never count towards stopping training)
    runner = RewardRunner(list(reward_funcs), timeout=reward_timeout, max_consecutive_failures=10**9)
    outcome, _ = score_completions(runner, tokenizer, rows, completion_ids, conversational=fmt.conversational,
                                   extra_columns=fmt.extra_columns)
    rewards = torch.tensor(outcome.rewards, dtype=torch.float32)
    weights = torch.ones(rewards.shape[0]) if weights is None else torch.as_tensor(weights, dtype=torch.float32)
    total = weighted_total(rewards, weights)
    judged = ~torch.isnan(total)
    if not judged.any():
        logger.warning("held-out eval: no completion was judged by the reward functions (all None/failed; "
                       "failures: %s); accuracy is unknown (NaN).", dict(outcome.failures))
        return float("nan"), float("nan")
    if not judged.all():
        logger.warning("held-out eval: %d of %d completions were not judged; accuracy counts the judged ones.",
                       int((~judged).sum()), len(total))
    accuracy = float((total[judged] >= solved_reward).float().mean())
    return accuracy, float(total[judged].mean())


def curve_stability(rewards: list[tuple[int, float]], accuracy: list[tuple[int, float]], *, window: int = 10,
                    after: int = 20) -> dict[str, Any]:
    """How stable a run's learning was, in the numbers a person checks on its plot.

    `reward_average_max_drop`: after step `after`, how far the `window`-step average training reward fell at worst
    below its running maximum (the best average so far); `heldout_best` / `heldout_final_minus_best`: whether the
    model at the end is the best one measured. None where the run is too short to say."""
    out: dict[str, Any] = {"reward_average_window": window, "reward_drop_checked_after_step": after,
                           "reward_average_max_drop": None, "heldout_best": None, "heldout_final_minus_best": None}
    best, drop = None, None
    for i in range(window - 1, len(rewards)):
        average = sum(r for _, r in rewards[i - window + 1:i + 1]) / window
        best = average if best is None else max(best, average)
        if rewards[i][0] > after:
            drop = max(drop or 0.0, best - average)
    out["reward_average_max_drop"] = None if drop is None else round(drop, 4)
    measured = [a for _, a in accuracy if a == a]  # NaN: not judged
    if measured:
        out["heldout_best"] = max(measured)
        out["heldout_final_minus_best"] = round(measured[-1] - max(measured), 4)
    return out


def source_commit() -> str | None:
    """The git commit toolkit's source is at (12 hex; "-dirty" when tracked files have uncommitted changes), or None
    outside a checkout: reports name what they ran."""
    here = Path(__file__).resolve().parent
    try:
        # only a checkout of toolkit itself: an installed wheel inside some other repository is not that repository
        if subprocess.run(["git", "ls-files", "--error-unmatch", Path(__file__).name], capture_output=True,
                          timeout=10, cwd=here).returncode != 0:
            return None
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                timeout=10, cwd=here).stdout.strip()
        # uncommitted changes to tracked files: the commit alone does not describe the code that ran
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=here).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if dirty else "")) or None


def _run_headline(summary: dict[str, Any], accuracy: list[tuple[int, float]], reward_key: str,
                  rewards: list[float]) -> str:
    """The plot's title: held-out accuracy before -> after (only where it was measured), the reward's first and
    last logged value, minutes, commit."""
    parts = []
    before, after = summary.get("heldout_accuracy_before"), summary.get("heldout_accuracy_after")
    if accuracy and before is not None and after is not None:
        parts.append(f"held-out accuracy {100 * before:.1f}% -> {100 * after:.1f}%")
    if rewards:
        parts.append(f"{reward_key.split('/')[-1]} {rewards[0]:.2f} -> {rewards[-1]:.2f}")
    if summary.get("minutes") is not None:
        parts.append(f"{summary['minutes']:.1f} min")
    commit = source_commit()
    if commit:
        parts.append(f"commit {commit}")
    return " | ".join(parts) or "training reward"


def write_report(trainer, out_dir: Path, accuracy: list[tuple[int, float]], summary: dict[str, Any], *,
                 reward_key: str = "reward", title: str = "GRPO", step_name: str = "optimizer step") -> dict[str, Any]:
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
        episodes = [h for h in trainer.state.log_history if "episodes/turns_mean" in h]
        if episodes:  # multi-turn runs: a second panel with what the episodes did
            fig, (ax, ax2) = plt.subplots(2, 1, figsize=(8, 7.5), sharex=True, height_ratios=[3, 2])
            at = [h["step"] for h in episodes]
            for key, label, color in (("episodes/turns_mean", "turns per episode", "tab:green"),
                                      ("episodes/tool_calls_mean", "tool calls per episode", "tab:purple"),
                                      ("episodes/tool_errors_mean", "tool errors per episode", "tab:orange")):
                ax2.plot(at, [h.get(key, float("nan")) for h in episodes], ".-", color=color, label=label)
            ax2.set_xlabel(step_name)
            ax2.grid(alpha=0.3)
            ax2.legend(loc="upper left")
        else:
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
        if not episodes:
            ax.set_xlabel(step_name)
        ax.set_ylim(min([-0.02, *rewards]), max([1.02, *rewards]))
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left")
        ax.set_title(f"{title}: {_run_headline(summary, accuracy, reward_key, rewards)}", fontsize=10)
        fig.tight_layout()
        fig.savefig(report / "report.png", dpi=110)
        plt.close(fig)
        paths["plot"] = str(report / "report.png")
    logged = [(h["step"], h[reward_key]) for h in trainer.state.log_history if reward_key in h and "step" in h]
    paths["stability"] = curve_stability(logged, accuracy)
    (report / "summary.json").write_text(json.dumps({**summary, **paths, "accuracy_history": accuracy}, indent=2))
    return paths
