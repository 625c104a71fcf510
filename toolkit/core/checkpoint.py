"""Checkpoints you can trust: a checkpoint counts only once it is complete.

transformers writes `checkpoint-N/` file by file; a crash in the middle leaves a folder that looks
like a checkpoint and that `resume_from_checkpoint=True` would happily pick. We write a marker
file, atomically (temp file + rename), after everything else in the folder is on disk, and resume
only from folders that carry it.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

from transformers import TrainerCallback

from .errors import ConfigError

COMPLETE_MARKER = "toolkit_checkpoint_complete.json"
__all__ = ["COMPLETE_MARKER", "CompleteCheckpointCallback", "is_complete", "latest_complete_checkpoint",
           "resolve_resume", "write_atomic"]

_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


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


def is_complete(folder: str | os.PathLike) -> bool:
    return (Path(folder) / COMPLETE_MARKER).exists()


def latest_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The `checkpoint-N` folder with the highest N that carries the completion marker."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = []
    for child in root.iterdir():
        m = _CHECKPOINT_RE.match(child.name)
        if m and child.is_dir() and is_complete(child):
            found.append((int(m.group(1)), child))
    return str(max(found)[1]) if found else None


def resolve_resume(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """Turn `True` into the latest complete checkpoint; check that an explicit path is complete."""
    if resume_from_checkpoint in (None, False):
        return None
    if resume_from_checkpoint is True:
        found = latest_complete_checkpoint(output_dir)
        if found is None:
            raise ConfigError(
                f"resume_from_checkpoint=True, but '{output_dir}' holds no complete checkpoint "
                f"(a folder checkpoint-N with {COMPLETE_MARKER}). Start without resuming, or pass a checkpoint path."
            )
        return found
    path = str(resume_from_checkpoint)
    if not Path(path).is_dir():
        raise ConfigError(f"resume_from_checkpoint: '{path}' is not a folder.")
    if not is_complete(path):
        raise ConfigError(
            f"resume_from_checkpoint: '{path}' is incomplete (no {COMPLETE_MARKER}); the run that wrote it probably "
            f"stopped while saving. Use the previous checkpoint: {latest_complete_checkpoint(Path(path).parent)}."
        )
    return path


class CompleteCheckpointCallback(TrainerCallback):
    """Marks `checkpoint-N` complete after Trainer has written model, optimizer, scheduler, RNG and state.

    Put it after every other callback that writes into the folder. `on_complete(step, path)` runs once
    the marker is on disk (trainers pass the plugin notification `toolkit_on_checkpoint_saved`).
    """

    def __init__(self, on_complete: Callable[[int, str], None] | None = None):
        self.on_complete = on_complete

    def on_save(self, args, state, control, **kwargs):
        if not args.should_save:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            write_atomic(folder / COMPLETE_MARKER, json.dumps({"global_step": state.global_step}))
            if self.on_complete is not None:
                self.on_complete(state.global_step, str(folder))
