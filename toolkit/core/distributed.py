"""Several processes: which rank this is, output from rank 0 only, and plain words when a launch is not what
the user asked for.

torchrun and `accelerate launch` describe the job in the environment (WORLD_SIZE, RANK) before any
torch.distributed call, so these helpers can run before a model or a process group exists: a trainer that
cannot run several processes refuses before loading anything, and the CLI quiets its other ranks from the
first log line. docs/distributed.md says what is global across ranks and what was tested.
"""

from __future__ import annotations

__all__ = [
    "env_rank",
    "env_world_size",
    "exit_process",
    "is_main_process",
    "leave_process_group",
    "quiet_other_ranks",
    "refuse_multiprocess",
    "refuse_sharding",
    "requested_processes",
    "warn_if_fewer_processes_than_asked",
    "warn_if_sharding_ignored",
]

import atexit
import logging
import os
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

from .errors import ConfigError

logger = logging.getLogger(__name__)

_left_a_group = False  # set by leave_process_group: exit_process must know even after the group is gone


def env_world_size() -> int:
    """Processes in the job, as the launcher set it (1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def env_rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def is_main_process() -> bool:
    """Rank 0, the process that prints summaries and writes reports (Trainer saves on its own `should_save`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return env_rank() == 0


def quiet_other_ranks() -> None:
    """INFO logs from rank 0 only; other ranks keep warnings and errors (each says which rank it is)."""
    if env_rank() == 0:
        return
    logging.getLogger().setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(logging.Formatter(f"[rank {env_rank()}] %(levelname)s %(name)s: %(message)s"))


def leave_process_group() -> bool:
    """Destroy this process's default process group if it has one (best effort: the run's result is already
    decided when this is called). Returns whether there was one to leave."""
    global _left_a_group
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    _left_a_group = True
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        logger.debug("destroy_process_group: %s", e)
    return True


def exit_process(code: int = 0) -> NoReturn:
    """End this process with exit status `code`; for the last line of a script run under torchrun.

    A process that was one of several (a process group, or WORLD_SIZE > 1) leaves its group, then does what the
    interpreter's exit would do that matters to a run (threading's exit hooks and non-daemon threads, atexit
    handlers, logging and stdout/stderr flushed) and ends with os._exit, skipping interpreter finalization.
    Why: a communication thread can still be releasing a finished collective (a gloo AsyncBarrierWork holding the
    AsyncAllgatherWork before it, with tensors Python owns) when the main thread starts finalizing; it then takes
    the GIL, CPython ends the thread with pthread_exit, the unwind crosses a C++ noexcept frame and the rank aborts
    (SIGABRT, "terminate called without an active exception") after a run that finished, and torchrun reports
    the job failed. destroy_process_group does not prevent it when something still holds the group (FSDP2's
    DeviceMesh, kept by DTensor's caches, does): the group's threads are not joined. Core dump from a CI run of
    tests/lockstep_worker.py; about 1 run in 25 on a 2-core machine. Any other process exits with sys.exit."""
    if not (leave_process_group() or _left_a_group or env_world_size() > 1):
        sys.exit(code)
    shutdown = getattr(threading, "_shutdown", None)  # runs threading's exit hooks (thread pools), then joins
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed or replaced by something without flush
            pass
    os._exit(code)


def refuse_multiprocess(trainer: str, reason: str) -> None:
    """Stop a trainer that runs in one process only when it was launched with several, before any model loads."""
    if env_world_size() > 1:
        raise ConfigError(f"{trainer} runs in one process only ({reason}); it was launched with WORLD_SIZE="
                          f"{env_world_size()}. Run it without torchrun/accelerate launch, or use a trainer that "
                          "is tested with several processes (SFT, DPO, GRPO, PPO, async GRPO; docs/distributed.md).")


def refuse_sharding(trainer: str, args: object, reason: str) -> None:
    """Stop a trainer that runs DDP-style only when FSDP or DeepSpeed was asked for, before any model loads: the
    sharding would otherwise be skipped without a word and every rank would hold the whole model."""
    asked = [name for name, on in (
        ("fsdp", bool(getattr(args, "fsdp", None))), ("deepspeed", bool(getattr(args, "deepspeed", None))),
        ("ACCELERATE_USE_FSDP", os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"),
        ("ACCELERATE_USE_DEEPSPEED", os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true")) if on]
    if asked:
        raise ConfigError(f"{asked[0]}: {trainer} does not shard its models ({reason}). Launch it with plain DDP "
                          "(torchrun, or an accelerate config without FSDP/DeepSpeed: examples/accelerate/ddp.yaml); "
                          "docs/distributed.md lists what each trainer supports.")


def requested_processes(argv: Sequence[str]) -> int | None:
    """The process count an `accelerate launch` command line asks for, or None when it is not one."""
    words = list(argv)
    module_form = "accelerate.commands.launch" in words[:4]  # python -m accelerate.commands.launch ...
    if not module_form and (not any(os.path.basename(w).startswith("accelerate") for w in words[:3])
                            or "launch" not in words):
        return None
    for i, w in enumerate(words):
        for flag in ("--num_processes", "--num-processes"):
            if w == flag and i + 1 < len(words):
                return int(words[i + 1]) if words[i + 1].isdigit() else None
            if w.startswith(flag + "="):
                value = w.split("=", 1)[1]
                return int(value) if value.isdigit() else None
    return None


def warn_if_fewer_processes_than_asked(parent_argv: Sequence[str] | None = None) -> bool:
    """Warn when `accelerate launch --num_processes N` started a single process (its CPU default does).

    Reads the parent's command line (Linux /proc) unless given one. Returns whether it warned.
    """
    if parent_argv is None:
        try:
            with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
                parent_argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            return False
    asked = requested_processes(parent_argv)
    if asked is None or asked <= 1 or env_world_size() > 1:
        return False
    logger.warning("accelerate launch asked for %d processes but started one: on CPU, accelerate's launcher runs a "
                   "single process unless it is configured for multi-CPU. This run trains in ONE process. For "
                   "%d processes use `torchrun --nproc_per_node %d -m toolkit.core.cli ...` with "
                   "ACCELERATE_USE_CPU=true (docs/distributed.md).", asked, asked, asked)
    return True


def warn_if_sharding_ignored(trainer: object) -> bool:
    """Warn when a run configured for FSDP is not sharded. accelerate (1.15) turns FSDP on only for GPU-like
    launches; on CPU, or in one process, it runs the whole model on every rank without a word."""
    args = getattr(trainer, "args", None)
    # `fsdp=` in the arguments, or `accelerate launch --config_file <an FSDP config>` (which sets this variable)
    asked = getattr(args, "fsdp", None) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
    if not asked or getattr(trainer, "is_fsdp_enabled", False):
        return False
    runs = f"DDP over {env_world_size()} processes" if env_world_size() > 1 else "in one process"
    logger.warning("FSDP was configured (%s) but this run is not sharded: accelerate enables FSDP only for GPU "
                   "(or other accelerator) launches with several processes, so it runs %s and every rank holds the "
                   "whole model. docs/distributed.md says what was tested where.",
                   f"fsdp={args.fsdp!r}" if getattr(args, "fsdp", None) else "ACCELERATE_USE_FSDP=true", runs)
    return True
