"""A console a person can read: one compact line per logged step, the full record in `metrics.jsonl`.

transformers prints every log as a Python dict; GRPO's has ~40 keys, so a run scrolls walls of numbers and
the few that tell whether learning happens are lost. Every trainer installs `CompactConsole` instead:

    step 12/80 | loss 0.0123 | reward 0.563 ±0.21 | entropy 0.412 | kl 0.0031 | lr 1.0e-05 | 4.2 s/step | ok

The last field is the health verdict: `ok`, or how many warnings toolkit logged since the previous line
(the warnings themselves are above it). The full dict of every log goes to `output_dir/metrics.jsonl`
(one JSON object per line, rank 0) and to the trackers (`report_to`). The progress bar stays. Set
`TOOLKIT_CONSOLE=full` to get transformers' dict lines back. In a notebook transformers' progress table stays and the
lines are printed under it.
"""

from __future__ import annotations

__all__ = ["CONSOLE_ENV", "VERBOSITY_ENV", "CompactConsole", "FirstAndLastStepLogs", "MetricsFile", "compact_line",
           "install_console", "show_logs"]

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from transformers import PrinterCallback, ProgressCallback, TrainerCallback

CONSOLE_ENV = "TOOLKIT_CONSOLE"
VERBOSITY_ENV = "TOOLKIT_VERBOSITY"

# (log key, label, format) in the order a person reads them; missing keys are skipped.
_FIELDS = (
    ("loss", "loss", ".4f"), ("eval_loss", "eval_loss", ".4f"), ("reward", "reward", ".3f"),
    ("eval_reward", "eval_reward", ".3f"),
    ("objective/scores", "score", ".3f"), ("rewards/accuracies", "pref_acc", ".3f"),
    ("eval_rewards/accuracies", "eval_pref_acc", ".3f"), ("accuracy", "pair_acc", ".3f"),
    ("eval_accuracy", "eval_pair_acc", ".3f"), ("heldout_accuracy", "heldout_acc", ".3f"),
    ("entropy", "entropy", ".3f"), ("kl", "kl", ".4f"), ("grad_norm", "grad", ".3g"), ("learning_rate", "lr", ".1e"),
    ("train_loss", "train_loss (mean)", ".4f"), ("train_runtime", "runtime_s", ".1f"),
)


class _WarningCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        # Attached to the "toolkit" logger, this handler alone would stop Python's last-resort handler (stderr,
        # WARNING and up) from printing toolkit's warnings where nothing else is configured (a notebook): counted,
        # never shown, and after an interrupted train() (no on_train_end) for the rest of the session. So it
        # passes them on to it then.
        if not self._seen_elsewhere(record) and logging.lastResort is not None:
            logging.lastResort.handle(record)

    @staticmethod
    def _seen_elsewhere(record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = logging.getLogger(record.name)
        while logger is not None:
            if any(not isinstance(h, _WarningCounter) and record.levelno >= h.level for h in logger.handlers):
                return True
            if not logger.propagate:
                return False
            logger = logger.parent
        return False


def compact_line(logs: dict[str, Any], *, step: int, max_steps: int, seconds_per_step: float | None,
                 warnings: int) -> str:
    """The one line for a log dict (pure; tested on its own)."""
    parts = [f"step {step}/{max_steps}" if max_steps > 0 else f"step {step}"]
    for key, label, fmt in _FIELDS:
        value = logs.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            text = f"{label} {value:{fmt}}"
            if key in ("reward", "eval_reward") and isinstance(logs.get(f"{key}_std"), (int, float)):
                text += f" ±{logs[key + '_std']:.2f}"
            parts.append(text)
    skipped = logs.get("update_skipped")  # GRPO: steps whose rollout had no row in the loss left the weights alone
    if isinstance(skipped, (int, float)) and skipped > 0:
        parts.append("no signal, update skipped" if skipped >= 1 else f"{skipped:.0%} of updates skipped (no signal)")
    if seconds_per_step is not None:
        parts.append(f"{seconds_per_step:.2f} s/step")
    loss = logs.get("loss", logs.get("eval_loss"))
    if isinstance(loss, float) and not math.isfinite(loss):
        parts.append("NON-FINITE LOSS")
    else:
        parts.append("ok" if warnings == 0 else f"{warnings} warning{'s' if warnings > 1 else ''} above")
    return " | ".join(parts)


class MetricsFile(TrainerCallback):
    """Every log's full dict, one JSON object per line, in output_dir/metrics.jsonl (rank 0).

    A run from step 0 starts the file afresh; a resumed run keeps the lines up to its checkpoint's step and
    drops the later ones (they belong to the interrupted attempt and are logged again)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or not args.output_dir:
            return
        path = Path(args.output_dir) / "metrics.jsonl"
        if state.global_step == 0 or not path.exists():
            path.unlink(missing_ok=True)
            return
        kept = [ln for ln in path.read_text().splitlines() if ln.strip() and _step_of(ln) <= state.global_step]
        path.write_text("".join(ln + "\n" for ln in kept))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs or not args.output_dir:
            return
        path = Path(args.output_dir)
        path.mkdir(parents=True, exist_ok=True)
        record = {"step": state.global_step, **{k: v for k, v in logs.items() if k != "total_flos"}}
        with open(path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record, default=str) + "\n")


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return 0


class CompactConsole(TrainerCallback):
    """One line per log on rank 0; warnings logged by toolkit during training are counted into the line."""

    def __init__(self, progress: ProgressCallback | None = None) -> None:
        self.progress = progress
        self.counter = _WarningCounter()
        self._last_time: float | None = None
        self._last_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        self._last_time, self._last_step = time.perf_counter(), state.global_step
        self.counter.count = 0
        toolkit_logger = logging.getLogger("toolkit")
        if self.counter not in toolkit_logger.handlers:  # attached while training only (train() may be rerun)
            toolkit_logger.addHandler(self.counter)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        now = time.perf_counter()
        per_step = None
        if self._last_time is not None and state.global_step > self._last_step and "loss" in logs:
            per_step = (now - self._last_time) / (state.global_step - self._last_step)
            self._last_time, self._last_step = now, state.global_step
        line = compact_line(logs, step=state.global_step, max_steps=state.max_steps, seconds_per_step=per_step,
                            warnings=self.counter.count)
        self.counter.count = 0
        bar = getattr(self.progress, "training_bar", None) if self.progress is not None else None
        if bar is not None:
            bar.write(line)
        else:
            print(line, flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        logging.getLogger("toolkit").removeHandler(self.counter)


class FirstAndLastStepLogs(TrainerCallback):
    """Log the first optimizer step and the last one: with `logging_steps = 10` (SFT and DPO here, and TRL) a
    5-step run never shows a loss, and a long run shows none for its first minutes, when a person most wants to
    see that the loss is finite and moving. The steps between follow `logging_steps` unchanged. (PPO runs its own
    loop and logs every update.)"""

    def on_step_end(self, args, state, control, **kwargs):
        if args.logging_strategy == "steps" and state.global_step in (1, state.max_steps):
            control.should_log = True  # (Trainer logs a step once however many callbacks ask)
        return control


class _OwnHandler(logging.StreamHandler):
    """The handler `show_logs` gives the "toolkit" logger (marked, so it is added once)."""


class _LevelFormatter(logging.Formatter):
    """`[toolkit] message`, with the level named from WARNING up (`[toolkit] WARNING: ...`)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"[toolkit] {record.levelname}: {text}" if record.levelno >= logging.WARNING else f"[toolkit] {text}"


def show_logs() -> None:
    """Show toolkit's INFO lines (the start-up summary, held-out accuracy, what was chosen and why) where nobody
    configured logging: a notebook or a plain script, where Python prints only WARNING and up. Called when a trainer
    is built. In such a process the "toolkit" logger gets a handler of its own (stderr, at TOOLKIT_VERBOSITY:
    info by default, warning or error to quieten it) and stops propagating, as transformers does with its own
    logger, so a later `logging.basicConfig` does not print every line twice. A process that configured logging
    (the `toolkit` command, pytest, an application) keeps its own handlers and levels."""
    logger = logging.getLogger("toolkit")
    if any(isinstance(h, _OwnHandler) for h in logger.handlers):
        return
    if logging.getLogger().handlers or any(not isinstance(h, _WarningCounter) for h in logger.handlers):
        return
    name = os.environ.get(VERBOSITY_ENV, "info").upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        logger.warning("%s=%s is not a logging level (debug, info, warning, error); using info.", VERBOSITY_ENV,
                       name.lower())
        level = logging.INFO
    if os.environ.get("RANK", "0") != "0":  # a script under torchrun / accelerate launch: rank 0 tells the story
        level = max(level, logging.WARNING)
    handler = _OwnHandler(sys.stderr)  # stdout stays the program's own (a script may print data there)
    handler.setFormatter(_LevelFormatter())
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False


class _BarOnly(ProgressCallback):
    """transformers' progress bars (training and evaluation), without the dict lines."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        return


def install_console(trainer: Any) -> None:
    """`MetricsFile` and `FirstAndLastStepLogs` always; and transformers' dict printing swapped for `CompactConsole`
    (unless TOOLKIT_CONSOLE=full, or a custom progress display is in place). In a notebook transformers' table
    stays and the compact lines print under it (the table shows the loss only)."""
    trainer.add_callback(MetricsFile())
    trainer.add_callback(FirstAndLastStepLogs())
    if os.environ.get(CONSOLE_ENV, "").lower() == "full":
        return
    handler = trainer.callback_handler
    progress = None
    if any(type(cb) is PrinterCallback for cb in handler.callbacks):
        trainer.remove_callback(PrinterCallback)
    elif any(type(cb) is ProgressCallback for cb in handler.callbacks):
        trainer.remove_callback(ProgressCallback)
        progress = _BarOnly()
        trainer.add_callback(progress)
    elif not any(type(cb).__name__ == "NotebookProgressCallback" for cb in handler.callbacks):
        return  # a custom progress callback: leave the display to it
    # (a notebook keeps transformers' table, which shows the loss only; the line below it adds reward, entropy, ...)
    trainer.add_callback(CompactConsole(progress))
