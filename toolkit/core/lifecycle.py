"""What every trainer on `transformers.Trainer` does the same way, written once.

`TrainerLifecycle` is a mixin placed before `transformers.Trainer` in a trainer's bases
(`class SFTTrainer(TrainerLifecycle, Trainer)`). The trainers stay self-contained in what makes them
different (data, loss, rollouts); what must not differ between them lives here:

- **Checkpoints**: `_save_checkpoint` writes Trainer's checkpoint atomically (toolkit.core.checkpoint: staged,
  marked, renamed into place) with the trainer's own files from `write_checkpoint_state`; plugins hear of it
  once it is complete (`toolkit_on_checkpoint_saved`).
- **Resume**: `train(resume_from_checkpoint=True)` picks the newest *complete* checkpoint, loads a run that
  already reached `max_steps` without training a step more, and hands the folder to
  `restore_checkpoint_state` before Trainer's loop starts.
- **Step metrics**: `record_metric(name, value)` collects values between two logs (a float or a 0-d tensor,
  read only when the step is logged); `log` averages them (a name ending in `_max` keeps the largest, NaN is
  skipped), calls `on_log_metrics` and tells plugins (`toolkit_on_step_metrics`).
- **The model card**: `save_model` writes README.md next to the weights, `create_model_card` (which
  `push_to_hub` calls) writes it into `output_dir`.
- **The console**: one compact line per logged step, full dicts in `metrics.jsonl` (toolkit.core.console).

PPO owns its loop and its checkpoints (docs/architecture.md) and uses the metrics, card and console parts.
"""

from __future__ import annotations

__all__ = ["TrainerLifecycle"]

import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CompleteCheckpointCallback, resolve_resume, resume_already_finished, save_trainer_checkpoint
from .console import install_console
from .distributed import warn_if_sharding_ignored
from .model_card import write_model_card
from .plugins import notify_checkpoint_saved, notify_step_metrics

logger = logging.getLogger(__name__)


class TrainerLifecycle:
    """Mixin for toolkit's trainers: atomic checkpoints and resume, averaged step metrics, the model card.

    Subclasses set `trainer_kind` (the name plugin hooks receive) and may override `write_checkpoint_state`,
    `restore_checkpoint_state` and `on_log_metrics`; all three are public seams.
    """

    #: The trainer's name in plugin hooks (`toolkit_on_step_metrics`, `toolkit_on_checkpoint_saved`).
    trainer_kind: str = "trainer"
    #: (title, BibTeX) of a method the core's model cards do not know (toolkit.experimental, a plugin's trainer).
    method_card: tuple[str, str] | None = None

    def __init__(self, *args: Any, callbacks: list | None = None, **kwargs: Any):
        self._metric_values: dict[str, dict[str, list[Any]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        callbacks = list(callbacks or []) + [CompleteCheckpointCallback(on_complete=self._checkpoint_complete)]
        super().__init__(*args, callbacks=callbacks, **kwargs)
        install_console(self)  # one compact line per logged step; full dicts in metrics.jsonl
        warn_if_sharding_ignored(self)  # FSDP asked for on CPU runs unsharded; say so

    def _checkpoint_complete(self, step: int, path: str) -> None:
        notify_checkpoint_saved(self.trainer_kind, step, path)

    # ------------------------------------------------------------------------------ metrics

    def record_metric(self, name: str, value: float | torch.Tensor, *, mode: str = "train") -> None:
        """Collect a value of metric `name` for the next logged step (`mode`: "train" or "eval"); the logged value
        is the mean of everything collected (the largest for a name ending in `_max`).

        A tensor is kept as it is and read when the step is logged, so recording costs no device-to-host copy; each
        element of a tensor with several counts as one value (per-pair accuracies, say)."""
        self._metric_values[mode][name].append(value.detach() if torch.is_tensor(value) else value)

    def recorded_metrics(self, mode: str = "train") -> dict[str, list[float]]:
        """What `record_metric` collected since the last logged step, as numbers (for tests and callbacks)."""
        return {name: [x for v in values for x in (v.flatten().tolist() if torch.is_tensor(v) else [v])]
                for name, values in self._metric_values[mode].items()}

    def on_log_metrics(self, logs: dict[str, float], mode: str) -> None:
        """Called with a logged step's metrics (averaged) before they are printed and sent; add derived metrics or
        watch them here (`mode`: "train" or "eval")."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "eval" if any(k.startswith("eval_") for k in logs) else "train"
        if mode == "eval" or "loss" in logs:  # a logged step (not the run's closing summary)
            prefix = "eval_" if mode == "eval" else ""
            for name, values in self._metric_values[mode].items():
                numbers = [x for v in values for x in (v.flatten().tolist() if torch.is_tensor(v) else [v])]
                numbers = [float(x) for x in numbers if not math.isnan(x)]
                if numbers:
                    value = max(numbers) if name.endswith("_max") else sum(numbers) / len(numbers)
                    logs[prefix + name] = round(value, 6)
            self._metric_values[mode] = defaultdict(list)
            self.on_log_metrics(logs, mode)
        super().log(logs, start_time)  # type: ignore[misc]
        notify_step_metrics(self.trainer_kind, self.state.global_step, logs)

    # ------------------------------------------------------------------------------ checkpoints and resume

    def write_checkpoint_state(self, folder: Path) -> None:
        """The trainer's own state files, written into the staging checkpoint before it is marked complete."""

    def restore_checkpoint_state(self, folder: Path | None) -> None:
        """Called by `train` before Trainer's loop starts, with the checkpoint being resumed (None: a fresh run):
        read back what `write_checkpoint_state` wrote, and reset per-run state."""

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Trainer's checkpoint plus the trainer's own state, written atomically (toolkit.core.checkpoint)."""
        save_trainer_checkpoint(self, super()._save_checkpoint, model, trial,  # type: ignore[misc]
                                self.write_checkpoint_state)

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """As Trainer.train; `resume_from_checkpoint=True` resumes from the newest *complete* checkpoint."""
        path = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        finished = resume_already_finished(self, path)
        if finished is not None:
            return finished
        if path is not None:
            logger.info("Resuming from %s", path)
        self.restore_checkpoint_state(Path(path) if path is not None else None)
        return super().train(resume_from_checkpoint=path, **kwargs)  # type: ignore[misc]

    # ------------------------------------------------------------------------------ the model card

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's save, plus the model card (README.md: base model, method, settings) next to the weights."""
        super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        if self.args.should_save:
            write_model_card(self, output_dir or self.args.output_dir)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | list[str] | None = None,
                          tags: str | list[str] | None = None, **kwargs: Any) -> None:
        """The card `push_to_hub` uploads (README.md in output_dir); TRL's `dataset_name`, `model_name`, `tags`
        are accepted, and transformers' `dataset` as a synonym of `dataset_name`."""
        write_model_card(self, self.args.output_dir, model_name=model_name,
                         dataset_name=dataset_name if dataset_name is not None else kwargs.get("dataset"), tags=tags)
