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
- **Saving**: `save_model` writes the weights and the model card (README.md) into a staging folder, then moves
  them in file by file; a path that is a file is refused. `push_to_hub` saves before it talks to the network,
  so a push that fails leaves the model on disk and says where (`HubPushError`); `create_model_card` (which
  `push_to_hub` calls) writes the card into `output_dir`.
- **The console**: one compact line per logged step, full dicts in `metrics.jsonl` (toolkit.core.console).

PPO owns its loop and its checkpoints (docs/architecture.md) and uses the metrics, card and console parts.
"""

from __future__ import annotations

__all__ = ["TrainerLifecycle", "warn_if_smaller_than_a_batch"]

import logging
import math
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from .checkpoint import (
    CompleteCheckpointCallback,
    publish_folder,
    reload_renamed_weights,
    resolve_resume,
    resume_already_finished,
    save_trainer_checkpoint,
)
from .console import install_console
from .distributed import warn_if_sharding_ignored
from .errors import ConfigError, HubPushError
from .memory import OffloadActivations
from .model_card import hub_base_model, write_model_card
from .plugins import notify_checkpoint_saved, notify_step_metrics
from .sequence_parallel import RepeatBatches, RepeatedBatchSampler, SequenceParallel, enable, sequence_parallel_group

logger = logging.getLogger(__name__)

#: the folder inside a save's target where the files are written before they are moved into place
STAGING = ".toolkit-saving"


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
        if getattr(self.args, "activation_offloading", False) and self.args.device.type == "cpu":
            logger.warning("activation_offloading: training on CPU, whose memory is already the host's; nothing is "
                           "moved (it applies on a GPU).")
        warn_if_sharding_ignored(self)  # FSDP asked for on CPU runs unsharded; say so

    def _checkpoint_complete(self, step: int, path: str) -> None:
        notify_checkpoint_saved(self.trainer_kind, step, path)

    # ---------------------------------------------------------------------- sequence parallelism

    #: This rank's sequence-parallel group (`sequence_parallel_size` > 1), else None.
    sequence_parallel: SequenceParallel | None = None

    def setup_sequence_parallel(self, args: Any, models: list, *, refuse: str | None = None,
                                split_seams: tuple[type, tuple[str, ...]] | None = None) -> None:
        """Split every packed row over `args.sequence_parallel_size` consecutive ranks (Ulysses; docs/distributed.md)
        for `models` (the policy and, where there is one, the reference). Call before `Trainer.__init__`.

        `split_seams` (the trainer class, its method names): the loss and forward seams that run the split pass and
        scale its gradient. A subclass overriding one of them runs a forward or a loss of its own, which would see
        whole rows on every rank or leave the gradient unscaled: refused by name."""
        size = getattr(args, "sequence_parallel_size", 1)
        if size == 1:
            return
        if refuse is None and split_seams is not None:
            base, names = split_seams
            own = [n for n in names if getattr(type(self), n) is not getattr(base, n)]
            if own:
                refuse = (f"{type(self).__name__} overrides {', '.join(own)}, which the split rows go through (a "
                          "forward of its own would see whole rows on every rank, a loss of its own would miss the "
                          "gradient's scaling); sequence parallelism runs with the trainer's own.")
        if refuse is None and (args.train_sampling_strategy not in ("random", "sequential")
                               or not args.accelerator_config.use_seedable_sampler
                               or args.accelerator_config.split_batches
                               or args.accelerator_config.dispatch_batches):
            refuse = ("the ranks of a group must draw the same batches: it needs train_sampling_strategy 'random' or "
                      "'sequential', accelerate's seedable sampler, split_batches=False and dispatch_batches unset.")
        if refuse is not None:
            raise ConfigError(f"sequence_parallel_size={size}: {refuse} Set sequence_parallel_size=1.")
        from .models import unwrap_model

        world = args.world_size  # sets up the process group under torchrun / accelerate launch
        if world % size:
            raise ConfigError(f"sequence_parallel_size={size}: must divide the number of processes ({world}). Launch "
                              f"a multiple of {size} processes (torchrun --nproc_per_node), or choose a divisor.")
        self.sequence_parallel = sequence_parallel_group(size)
        try:
            for m in models:
                if m is not None:
                    enable(unwrap_model(m), self.sequence_parallel)
        except ValueError as e:
            raise ConfigError(f"sequence_parallel_size={size}: {e}") from None
        logger.info("Sequence parallelism: each packed row split over %d ranks (Ulysses); %d data-parallel "
                    "replicas of the batch.", size, self.sequence_parallel.dp_size)

    def _sequence_parallel_sampler(self, sampler: Any, batch_size: int, what: str, dataset: Any = None) -> Any:
        """The ranks of a sequence-parallel group must get the same batches: each batch is repeated P times."""
        sp = self.sequence_parallel
        if sp is None:
            return sampler
        from torch.utils.data import RandomSampler, SequentialSampler
        from transformers.trainer_utils import has_length

        if sampler is None and dataset is not None and has_length(dataset):
            sampler = SequentialSampler(dataset)  # transformers leaves evaluation's to accelerate with several ranks
        if sampler is None:
            raise ConfigError(f"sequence_parallel_size={sp.size}: the {what} dataset has no length (a stream), so its "
                              "batches cannot be shared by a sequence-parallel group; pass a datasets.Dataset or list.")

        config = self.accelerator.dataloader_config
        if type(sampler) is RandomSampler and config.use_seedable_sampler:
            # accelerate replaces a RandomSampler it finds with its seeded one; inside ours it would not find it, and
            # the order would differ from a run without sequence parallelism
            from accelerate.data_loader import SeedableRandomSampler

            sampler = SeedableRandomSampler(data_source=sampler.data_source, replacement=sampler.replacement,
                                            num_samples=sampler._num_samples, generator=sampler.generator,
                                            data_seed=config.data_seed)
        return RepeatBatches(sampler, batch_size, sp.size, drop_last=self.args.dataloader_drop_last)

    def compute_loss_context_manager(self) -> Any:
        """Trainer's (autocast), with activation offloading when `args.activation_offloading` is on."""
        stack = super().compute_loss_context_manager()
        if getattr(self.args, "activation_offloading", False) and self.args.device.type != "cpu":
            stack.enter_context(OffloadActivations())
        return stack

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        sampler = super()._get_train_sampler(train_dataset)
        return self._sequence_parallel_sampler(sampler, self._train_batch_size, "train",
                                               train_dataset if train_dataset is not None else self.train_dataset)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """Trainer's; under sequence parallelism the group's ranks get the same held-out batches, each whole and in
        order, no row twice (`RepeatedBatchSampler`)."""
        if self.sequence_parallel is None:
            return super().get_eval_dataloader(eval_dataset)
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if isinstance(dataset, str):  # a name of one of several eval datasets (Trainer's convention)
            dataset = self.eval_dataset[dataset]
        return self._shared_batches(dataset, "eval")

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """Trainer's (`predict`); under sequence parallelism as `get_eval_dataloader`."""
        if self.sequence_parallel is None:
            return super().get_test_dataloader(test_dataset)
        return self._shared_batches(test_dataset, "test")

    def _shared_batches(self, dataset: Any, what: str) -> Any:
        from torch.utils.data import DataLoader, SequentialSampler
        from transformers.trainer_utils import has_length

        sp = self.sequence_parallel
        if dataset is None:
            raise ConfigError(f"{what}: no {what} dataset was given.")
        if not has_length(dataset):
            raise ConfigError(f"sequence_parallel_size={sp.size}: the {what} dataset has no length (a stream), so its "
                              "batches cannot be shared by a sequence-parallel group; pass a datasets.Dataset or list.")
        try:
            batches = RepeatedBatchSampler(SequentialSampler(dataset), self.args.eval_batch_size, sp.size, sp.dp_size)
        except ValueError as e:
            raise ConfigError(f"sequence_parallel_size={sp.size}: {e}") from None
        return self.accelerator.prepare(DataLoader(dataset, batch_sampler=batches, collate_fn=self.data_collator,
                                                   num_workers=self.args.dataloader_num_workers,
                                                   pin_memory=self.args.dataloader_pin_memory))

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
        self._saving_checkpoint = True  # save_model, called by Trainer's checkpoint, leaves sharded weights to it
        try:
            save_trainer_checkpoint(self, super()._save_checkpoint, model, trial,  # type: ignore[misc]
                                    self.write_checkpoint_state)
        finally:
            self._saving_checkpoint = False

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        self._reload_renamed(model if model is not None else self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        super()._load_best_model()  # type: ignore[misc]
        if self.state.best_model_checkpoint:
            self._reload_renamed(self.model, self.state.best_model_checkpoint)

    def _reload_renamed(self, model: Any, folder: str) -> None:
        """checkpoint.reload_renamed_weights, where a whole-model copy can be loaded (not into FSDP shards or a
        DeepSpeed engine: there the check is skipped, and said)."""
        if getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False):
            logger.info("resume: the check for weights saved under older names is skipped under FSDP/DeepSpeed.")
            return
        reload_renamed_weights(model, folder)

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
        """Trainer's save, plus the model card (README.md: base model, method, settings) next to the weights.

        Written into a staging folder inside the target first (the same file system, whatever is mounted where),
        then moved in file by file (each with one rename), so a save killed midway leaves the earlier files, not
        half-written ones. A path that is a file is refused."""
        target = self._save_target(output_dir, _internal_call)
        if target is None:
            return
        staging = target / STAGING
        if self.args.should_save and staging.exists():
            shutil.rmtree(staging)  # left by a save that was killed
        self.accelerator.wait_for_everyone()  # every rank writes into a clean staging folder (FSDP, ZeRO-3 shards)
        if self._gathers_sharded_weights():
            state_dict = full_state_dict(self.model, keep=self.args.should_save)
            if self.args.should_save:
                self._save(str(staging), state_dict=state_dict)  # type: ignore[attr-defined]
        else:
            super().save_model(str(staging), _internal_call=True)  # type: ignore[misc]
        self.accelerator.wait_for_everyone()  # every rank's files are in before they are moved
        if self.args.should_save:
            write_model_card(self, staging)
            publish_folder(staging, target)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:  # as Trainer.save_model does
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _gathers_sharded_weights(self) -> bool:
        """Whether save_model gathers an FSDP2 model's shards itself. Trainer's own save asks accelerate for the full
        state dict only when accelerate's state says FSDP2, and otherwise hands save_pretrained DTensors whose
        storage it reads on rank 0 alone: a collective one rank enters, a hang. So an FSDP2 model (told by its
        modules, which stay FSDPModules whether their weights are sharded right now or not) is gathered here, on
        every rank, and rank 0 writes plain tensors. Left to Trainer: a model transformers sharded at load (its
        save_pretrained gathers on every rank itself), and a checkpoint under SHARDED_STATE_DICT (accelerate writes
        the shards; no full copy is wanted there)."""
        if getattr(self, "is_distributed_loading_by_transformers", False):
            return False
        from torch.distributed.fsdp import FSDPModule

        if not any(isinstance(m, FSDPModule) for m in self.model.modules()):  # type: ignore[attr-defined]
            return False
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)  # type: ignore[attr-defined]
        sharded = "SHARDED" in str(getattr(plugin, "state_dict_type", ""))
        return not (getattr(self, "_saving_checkpoint", False) and sharded)

    def _save_target(self, output_dir: str | None, internal_call: bool) -> Path | None:
        """The folder a save goes to (None: push_to_hub saved there a moment ago); a path that is a file is
        refused before anything is written."""
        target = Path(output_dir or self.args.output_dir)
        if target.exists() and not target.is_dir():
            raise ConfigError(f"save_model: '{target}' is a file; a model is saved as a folder of files (weights, "
                              "config, tokenizer, card). Give a folder path, e.g. 'outputs/my-model'.")
        if getattr(self, "_saved_for_push", False) and internal_call:
            return None
        return target

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, **kwargs: Any) -> Any:
        """Trainer's push, with the trained model saved into output_dir *before* anything talks to the network
        (Trainer creates the Hub repo first): a push that fails (no network, no token, a refused repo) leaves the
        model on disk, and the error says where it is."""
        self.save_model(_internal_call=True)
        self._saved_for_push = True
        try:
            with hub_base_model(self.args.output_dir, self.model):  # the pushed adapter names its base by Hub id
                return super().push_to_hub(commit_message=commit_message, blocking=blocking,  # type: ignore[misc]
                                           token=token, revision=revision, **kwargs)
        except Exception as e:
            where = Path(self.args.output_dir).resolve()
            raise HubPushError(f"push_to_hub: the push failed ({type(e).__name__}: {e}). The trained model is saved "
                               f"in {where} (weights, tokenizer, model card): push that folder when the Hub is "
                               f"reachable (`hf upload <repo-id> {where}`) or call push_to_hub() again.") from e
        finally:
            self._saved_for_push = False

    def create_model_card(self, model_name: str | None = None, dataset_name: str | list[str] | None = None,
                          tags: str | list[str] | None = None, **kwargs: Any) -> None:
        """The card `push_to_hub` uploads (README.md in output_dir); TRL's `dataset_name`, `model_name`, `tags`
        are accepted, and transformers' `dataset` as a synonym of `dataset_name`."""
        write_model_card(self, self.args.output_dir, model_name=model_name,
                         dataset_name=dataset_name if dataset_name is not None else kwargs.get("dataset"), tags=tags)


def warn_if_smaller_than_a_batch(trainer: Any, rows: int, *, what: str = "train_dataset") -> bool:
    """Warn when `rows` examples do not fill one optimizer step (per-device batch x accumulation x processes):
    every step then repeats the same few examples, which is rarely what was meant (a 1-row file, a filter that
    left one row). Returns whether it warned."""
    args = trainer.args
    step = args.per_device_train_batch_size * args.gradient_accumulation_steps * max(args.world_size, 1)
    if rows >= step:
        return False
    logger.warning("%s: %d row(s), fewer than one optimizer step takes (per_device_train_batch_size %d x "
                   "gradient_accumulation_steps %d x %d process(es) = %d): every step trains on the same %d row(s). "
                   "Add data, or lower the batch size.", what, rows, args.per_device_train_batch_size,
                   args.gradient_accumulation_steps, max(args.world_size, 1), step, rows)
    return True


def full_state_dict(model: torch.nn.Module, *, keep: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict with every sharded weight (a DTensor: FSDP2) gathered whole, on the CPU. A collective,
    so every rank calls it; only a rank with `keep` holds the result (one weight at a time is whole on the others),
    so host memory is one model on the writing rank, not one per rank. Weights tied in the model (one parameter
    under two names) stay one tensor, so save_pretrained still sees them as tied and writes the weight once."""
    gathered: dict[int, torch.Tensor | None] = {}
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():  # keep_vars: a tied weight is one object
        key = id(value)
        if key not in gathered:  # each weight gathered once on every rank, or the collectives fall out of step
            whole = value
            if hasattr(value, "full_tensor"):
                with torch.no_grad():
                    # shards offloaded to the CPU are gathered on the mesh's device (nccl gathers CUDA tensors only)
                    if value.device.type != value.device_mesh.device_type:
                        whole = value.to(value.device_mesh.device_type)
                    whole = whole.full_tensor()
            gathered[key] = whole.detach().cpu() if keep else None
        if keep:
            out[name] = gathered[key]  # type: ignore[assignment]
    return out
