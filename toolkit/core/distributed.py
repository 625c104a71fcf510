"""Several processes: which rank this is, output from rank 0 only, and plain words when a launch is not what
the user asked for.

torchrun and `accelerate launch` describe the job in the environment (WORLD_SIZE, RANK) before any
torch.distributed call, so these helpers can run before a model or a process group exists: a trainer that
cannot run several processes refuses before loading anything, and the CLI quiets its other ranks from the
first log line. docs/distributed.md says what is global across ranks and what was tested.
"""

from __future__ import annotations

__all__ = [
    "any_rank",
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
from typing import Any, NoReturn

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
    dist = sys.modules.get("torch.distributed")  # not imported: no process group can exist (and --help stays fast)
    if dist is not None and dist.is_available() and dist.is_initialized():
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
    dist = sys.modules.get("torch.distributed")  # not imported: no process group to leave
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        return False
    _left_a_group = True
    try:
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        logger.debug("destroy_process_group: %s", e)
    return True


def exit_process(code: int | None = 0) -> NoReturn:
    """End this process with exit status `code` (None is 0); the last statement of a script run under torchrun,
    outside any `with` or `try` (os._exit runs no `finally`). Call it from the main thread.

    A process that joined a process group (or that torchrun started as one of several, with torch.distributed
    imported) ends without interpreter finalization: it runs what CPython's exit runs first, in the same order
    (threading's exit hooks, such as thread pools', and the join of non-daemon threads; then atexit handlers,
    logging's among them), leaves the process group, flushes Python's standard streams and C stdio, and calls
    os._exit. Files a script left open and unflushed are not flushed: close them (a `with` block) before this.
    Why: a communication thread can still be releasing a finished collective (a gloo AsyncBarrierWork holding
    the AsyncAllgatherWork before it, with tensors Python owns) when the main thread starts finalizing; it then
    takes the GIL, CPython ends the thread with pthread_exit, the unwind crosses a C++ noexcept frame and the
    rank aborts (SIGABRT, "terminate called without an active exception") after a run that finished, and
    torchrun reports the job failed. destroy_process_group does not prevent it while something still holds the
    group (FSDP2's DeviceMesh, kept by DTensor's caches, does): the group's threads are not joined. Seen in CI
    (core dump of tests/helpers/lockstep_worker.py). Any other process, and an interactive one, exits with sys.exit."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("exit_process: call it from the main thread (from another thread it cannot end the "
                           "process the way the interpreter's exit does).")
    if code is None:
        code = 0
    elif not isinstance(code, int):  # what sys.exit does with a message: print it, status 1
        print(code, file=sys.stderr)
        code = 1
    dist = sys.modules.get("torch.distributed")
    joined = _left_a_group or (dist is not None and dist.is_available() and dist.is_initialized())
    launched = dist is not None and env_world_size() > 1
    if not (joined or launched) or sys.flags.interactive or hasattr(sys, "ps1"):
        sys.exit(code)
    shutdown = getattr(threading, "_shutdown", None)  # threading's exit hooks (thread pools), then the joins
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()  # logging.shutdown is one of them
    leave_process_group()  # after: an exit hook or thread may still need the group, as at a normal exit
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except Exception:  # noqa: BLE001 (closed, or replaced by something that cannot flush: nothing to save)
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)  # C and C++ libraries' buffered stdout
    except Exception:  # noqa: BLE001
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


def any_rank(accelerator: Any, flag: bool) -> bool:
    """Whether `flag` holds on any rank (itself in one process); every rank must call it at the same point."""
    if accelerator.num_processes == 1:
        return flag
    import torch

    t = torch.tensor([1.0 if flag else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(t, reduction="sum").item() > 0)
