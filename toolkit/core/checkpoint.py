"""Checkpoints you can trust: a `checkpoint-N` folder is complete or absent, never in between.

Every trainer writes a checkpoint the same way (`save_trainer_checkpoint` for the trainers on
`transformers.Trainer`'s loop, `begin_checkpoint` / `commit_checkpoint` for PPO's own loop):

1. everything (model, optimizer, scheduler, RNG, trainer state, the trainer's own state files) is
   written into a staging folder `output_dir/.staging/checkpoint-N`, never into `checkpoint-N` itself;
2. the completion marker is written last, atomically, inside the staging folder;
3. the staging folder is renamed into place: one `rename`, which the file system does atomically. If a
   `checkpoint-N` already exists (a re-save of step N), it is first renamed aside to
   `.replaced-checkpoint-N` and deleted only after the new one is in place; a kill between the two
   renames is repaired on the next look (`_recover` renames it back), so a complete checkpoint-N is
   never lost;
4. only then are old checkpoints rotated away (`save_total_limit`, the most recently completed kept),
   each renamed out of the `checkpoint-N` namespace before it is deleted, so the newest complete
   checkpoint always survives and no marked, half-deleted folder can exist. Folders toolkit did not mark
   are never deleted.

Several processes: every rank writes its files into the same staging folder, a barrier follows, and
only the main process marks, renames and rotates. (`save_on_each_node` on a shared file system is not
supported by this protocol.)

Resume picks the newest folder with the marker. A plain `transformers.Trainer` or TRL checkpoint (no
marker, but a `trainer_state.json`, which Trainer writes after the weights) is accepted with a warning.

`TOOLKIT_FAULT_AT=<point>:<step>` kills the process with SIGKILL at a named point of a checkpoint
write (`staged`, `marked`, `aside`, `swapped`, `rotating`); the crash tests (tests/integration/test_crash_resume.py) use it
to aim kills inside the write. It costs one environment lookup per checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from .errors import ConfigError

__all__ = [
    "COMPLETE_MARKER",
    "CompleteCheckpointCallback",
    "begin_checkpoint",
    "commit_checkpoint",
    "is_complete",
    "latest_complete_checkpoint",
    "publish_folder",
    "resolve_resume",
    "resume_already_finished",
    "rotate_checkpoints",
    "save_trainer_checkpoint",
    "write_atomic",
]

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "toolkit_checkpoint_complete.json"
STAGING_DIR = ".staging"
_REPLACED_PREFIX = ".replaced-"   # a complete checkpoint-N stepping aside for a re-save of step N (restorable)
_DELETING_PREFIX = ".deleting-"   # a checkpoint being rotated away (never restored)
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def _fault(point: str, step: int) -> None:
    """Die here if the crash tests asked for it (TOOLKIT_FAULT_AT=point:step)."""
    if os.environ.get("TOOLKIT_FAULT_AT") == f"{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync(path: Path) -> None:
    """Flush a file's or a folder's entries to disk (best effort: some file systems refuse it on folders)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for f in path.rglob("*"):
        if f.is_file():
            _fsync(f)
    _fsync(path)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def publish_folder(staging: str | os.PathLike, target: str | os.PathLike) -> None:
    """Move every entry of `staging` (written completely, then flushed) into `target`, each with one rename, then
    remove `staging`: a reader of `target` sees each file old or new, never half-written (a model saved over the
    output_dir that also holds the checkpoints, which cannot be renamed as a whole)."""
    staging, target = Path(staging), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for entry in sorted(staging.iterdir()):
        if entry.is_file():
            _fsync(entry)
        dest = target / entry.name
        if dest.is_dir() and not dest.is_symlink() and entry.is_dir():
            shutil.rmtree(dest)  # a sub-folder (rare: save_pretrained writes flat) is replaced as a whole
        os.replace(entry, dest)
    _fsync(target)
    shutil.rmtree(staging, ignore_errors=True)


def is_complete(folder: str | os.PathLike) -> bool:
    return (Path(folder) / COMPLETE_MARKER).exists()


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), c) for c in root.iterdir() if (m := _CHECKPOINT_RE.match(c.name)) and c.is_dir()]
    return sorted(found)


def _recover(root: Path) -> None:
    """A kill between the two renames of a re-save leaves the old complete folder as .replaced-checkpoint-N and no
    checkpoint-N: put it back."""
    if not root.is_dir():
        return
    for aside in root.glob(f"{_REPLACED_PREFIX}checkpoint-*"):
        final = root / aside.name[len(_REPLACED_PREFIX):]
        if not final.exists() and is_complete(aside):
            os.replace(aside, final)
            logger.warning("restored %s, which a re-save interrupted between its two renames.", final)


def latest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The `checkpoint-N` folder with the highest N that carries the completion marker."""
    _recover(Path(output_dir))
    found = [c for _, c in _checkpoints(Path(output_dir)) if is_complete(c)]
    return str(found[-1]) if found else None


def _looks_like_trainer_checkpoint(folder: Path) -> bool:
    """A plain transformers/TRL checkpoint: Trainer writes trainer_state.json after the weights."""
    return (folder / "trainer_state.json").exists() and (any(
        (folder / name).exists() for name in ("model.safetensors", "adapter_model.safetensors",
                                              "model.safetensors.index.json", "pytorch_model.bin",
                                              "pytorch_model.bin.index.json"))
        or any(folder.glob("pytorch_model_fsdp_*")) or any(folder.glob("global_step*")))  # FSDP / DeepSpeed


def resolve_resume(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """Turn `True` into the newest complete checkpoint; check an explicit path.

    A folder without toolkit's marker is accepted, with a warning, when it is a whole transformers/TRL
    checkpoint (weights and trainer_state.json); otherwise it is refused, naming the last good one.
    """
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        found = latest_complete_checkpoint(output_dir)
        if found is not None:
            return found
        plain = [c for _, c in _checkpoints(Path(output_dir)) if _looks_like_trainer_checkpoint(c)]
        if plain:
            logger.warning("resume_from_checkpoint=True: '%s' holds no toolkit checkpoint; resuming from %s, a "
                           "transformers/TRL checkpoint (no completion marker, so completeness is assumed from its "
                           "trainer_state.json).", output_dir, plain[-1])
            return str(plain[-1])
        raise ConfigError(
            f"resume_from_checkpoint=True, but '{output_dir}' holds no complete checkpoint (a folder checkpoint-N "
            f"with {COMPLETE_MARKER}). Start without resuming, or pass a checkpoint path.")
    path = Path(str(resume_from_checkpoint))
    if not path.is_dir():
        raise ConfigError(f"resume_from_checkpoint: '{path}' is not a folder.")
    if is_complete(path):
        return str(path)
    if _looks_like_trainer_checkpoint(path):
        logger.warning("resume_from_checkpoint: '%s' has no toolkit completion marker; resuming from it as a "
                       "transformers/TRL checkpoint (completeness assumed from its trainer_state.json).", path)
        return str(path)
    raise ConfigError(
        f"resume_from_checkpoint: '{path}' is incomplete (no {COMPLETE_MARKER}, no trainer_state.json); the run "
        f"that wrote it probably stopped while saving. Use the previous checkpoint: "
        f"{latest_complete_checkpoint(path.parent)}.")


# ------------------------------------------------------------------------------------------------
# Writing: stage, mark, swap into place, rotate
# ------------------------------------------------------------------------------------------------


def begin_checkpoint(output_dir: str | os.PathLike, step: int) -> Path:
    """An empty staging folder for checkpoint `step` (a leftover from a crashed write is removed first)."""
    staging = Path(output_dir) / STAGING_DIR / f"checkpoint-{step}"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit_checkpoint(staging: str | os.PathLike, output_dir: str | os.PathLike, step: int, *,
                      save_total_limit: int | None = None, keep: tuple[str, ...] = ()) -> Path:
    """Mark `staging` complete, move it to `output_dir/checkpoint-<step>` atomically, then rotate old ones.

    `keep`: folders rotation must not delete (e.g. the best model's checkpoint).
    """
    staging, root = Path(staging), Path(output_dir)
    final = root / f"checkpoint-{step}"
    _fault("staged", step)
    _fsync_tree(staging)  # the data is on disk before the marker says so (power loss, not only SIGKILL)
    write_atomic(staging / COMPLETE_MARKER, json.dumps({"global_step": step}))
    _fsync(staging)
    _fault("marked", step)
    _recover(root)
    aside = None
    if final.exists():
        # A re-save of this step: the old folder steps aside, still complete and restorable (`_recover`), until
        # the new one is in place.
        aside = root / f"{_REPLACED_PREFIX}checkpoint-{step}"
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
        _fault("aside", step)
    os.replace(staging, final)
    _fsync(root)
    _fault("swapped", step)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    rotate_checkpoints(root, save_total_limit, keep=(str(final), *keep), step=step)
    return final


def rotate_checkpoints(output_dir: str | os.PathLike, save_total_limit: int | None, *, keep: tuple[str, ...] = (),
                       step: int = -1) -> None:
    """Delete complete checkpoints beyond the `save_total_limit` most recently completed (never those in `keep`),
    and leftovers of interrupted writes (staging and set-aside folders).

    Only folders toolkit marked complete are ever rotated: an unmarked `checkpoint-N` (another tool's, a
    DeepSpeed/FSDP layout, an interrupted toolkit 0.1 save) is left alone. A folder is first renamed out of
    the `checkpoint-N` namespace, then deleted, so a kill mid-delete never leaves a marked, half-empty folder.
    """
    root = Path(output_dir)
    _recover(root)
    for leftover in [*root.glob(f"{_DELETING_PREFIX}*"), *root.glob(f"{_REPLACED_PREFIX}*"),
                     *(root / STAGING_DIR).glob("checkpoint-*")]:
        shutil.rmtree(leftover, ignore_errors=True)
    if save_total_limit is None or save_total_limit <= 0:
        return
    # Most recently completed last (the marker's mtime; the step breaks ties), as transformers orders by mtime.
    complete = sorted((c for _, c in _checkpoints(root) if is_complete(c)),
                      key=lambda c: ((c / COMPLETE_MARKER).stat().st_mtime, int(c.name.split("-")[1])))
    keep_set = {str(Path(k)) for k in keep}
    doomed = [c for c in complete[:-save_total_limit] if str(c) not in keep_set]
    for i, folder in enumerate(doomed):
        gone = root / f"{_DELETING_PREFIX}{folder.name}"
        os.replace(folder, gone)
        if i == 0:
            _fault("rotating", step)
        shutil.rmtree(gone, ignore_errors=True)


def save_trainer_checkpoint(trainer: Any, save: Callable[[Any, Any], None], model: Any, trial: Any,
                            write_state: Callable[[Path], None] | None = None) -> None:
    """`Trainer._save_checkpoint`, made atomic: `save(model, trial)` (Trainer's own) writes into the staging
    folder, `write_state(folder)` adds the trainer's own files, then `commit_checkpoint`.

    Trainer rotates checkpoints inside its save; here that happens in the staging parent, where there is
    nothing to rotate, and `commit_checkpoint` rotates the real folder afterwards, once the new
    checkpoint is complete (transformers deletes before the new checkpoint counts, which left no complete
    checkpoint when a kill came in between).
    """
    args, state = trainer.args, trainer.state
    step = state.global_step
    root = Path(trainer._get_output_dir(trial=trial))
    staging_root = root / STAGING_DIR
    if args.should_save:
        begin_checkpoint(root, step)
    trainer.accelerator.wait_for_everyone()
    trainer._get_output_dir = lambda trial=None: str(staging_root)  # Trainer writes checkpoint-N under it
    # Trainer would push the staging folder, which is renamed away at once: push the committed one instead.
    trainer._push_from_checkpoint = lambda folder: None
    try:
        save(model, trial)
    finally:
        del trainer._get_output_dir, trainer._push_from_checkpoint
    trainer.accelerator.wait_for_everyone()  # every rank's files (e.g. rng_state_<k>.pth) are in before the marker
    staging = staging_root / f"checkpoint-{step}"
    keep: tuple[str, ...] = ()
    if state.best_global_step:
        best = root / f"checkpoint-{state.best_global_step}"
        if best.exists() or state.best_global_step == step:
            state.best_model_checkpoint = str(best)
            keep = (str(best),)
    if args.should_save:
        state.save_to_json(str(staging / "trainer_state.json"))  # with the best checkpoint's final path
        if write_state is not None:
            write_state(staging)
        final = commit_checkpoint(staging, root, step, save_total_limit=args.save_total_limit, keep=keep)
        if args.push_to_hub:
            trainer._push_from_checkpoint(str(final))
    trainer.accelerator.wait_for_everyone()


def resume_already_finished(trainer: Any, path: str | None) -> Any | None:
    """Resuming from a checkpoint that already reached `max_steps`: load it and train nothing.

    transformers' loop checks `max_steps` only after a step, so a run resumed from its own last checkpoint
    in the middle of an epoch trained one step more than asked (found by tests/integration/test_crash_resume.py: a
    kill after the final save, then a resume, gave GRPO a step 5 of 4). Returns the TrainOutput to return
    from `train()` in that case, None otherwise.
    """
    from transformers import TrainerState
    from transformers.trainer_utils import TrainOutput

    if path is None or trainer.args.max_steps <= 0 or not (Path(path) / "trainer_state.json").exists():
        return None
    state = TrainerState.load_from_json(str(Path(path) / "trainer_state.json"))
    if state.global_step < trainer.args.max_steps:
        return None
    logger.info("%s is at step %d, which already reaches max_steps=%d: loading it, nothing left to train.", path,
                state.global_step, trainer.args.max_steps)
    trainer._load_from_checkpoint(path)
    trainer.state = state
    return TrainOutput(state.global_step, 0.0, {"train_runtime": 0.0, "train_loss": 0.0})


class CompleteCheckpointCallback(TrainerCallback):
    """Tells `on_complete(step, path)` that checkpoint-N is complete (its marker is on disk).

    The checkpoint itself is written by `save_trainer_checkpoint`; trainers pass the plugin notification
    `toolkit_on_checkpoint_saved` as `on_complete`.
    """

    def __init__(self, on_complete: Callable[[int, str], None] | None = None):
        if on_complete is not None and not callable(on_complete):
            raise TypeError(f"CompleteCheckpointCallback(on_complete=...) takes a callable (step, path), got "
                            f"{on_complete!r}; toolkit 0.1's CompleteCheckpointCallback(trainer_kind) is gone: pass "
                            "lambda step, path: toolkit.core.plugins.notify_checkpoint_saved(kind, step, path).")
        self.on_complete = on_complete

    def on_save(self, args, state, control, **kwargs):
        if not args.should_save:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if is_complete(folder) and self.on_complete is not None:
            self.on_complete(state.global_step, str(folder))


def reload_renamed_weights(model: Any, folder: str | os.PathLike) -> bool:
    """Load a checkpoint's weights into `model` where Trainer's resume would silently skip them; True if it did.

    transformers 5 saves some models (Qwen2-VL, LLaVA and other vision-language families) under their older key
    names and maps them back only inside `from_pretrained`. Trainer's resume (and best-model) loading reads the
    file with `strict=False`, so such a model kept its own weights and the "resumed" run trained a different
    model (found by tests/trainers/test_vision.py's exact-resume test). When the file's keys are not the model's,
    the folder is loaded with `from_pretrained` (which renames) and copied in strictly."""
    from safetensors import safe_open

    inner = getattr(model, "module", model)
    if getattr(inner, "peft_config", None) is not None:
        return False  # adapter checkpoints keep PEFT's own names
    files = sorted(Path(folder).glob("model*.safetensors"))
    if not files or not hasattr(inner, "from_pretrained"):
        return False
    saved: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt") as handle:
            saved |= set(handle.keys())
    if saved <= set(inner.state_dict()):
        return False
    dtype = next(inner.parameters()).dtype
    loaded = type(inner).from_pretrained(str(folder), dtype=dtype)
    inner.load_state_dict(loaded.state_dict(), strict=True)
    logger.info("%s: weights saved under older key names were loaded through from_pretrained's renaming.", folder)
    return True
