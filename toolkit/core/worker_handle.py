"""The trainer's side of async GRPO's rollout worker process: start, weights, rounds, liveness, diagnosis.

`WorkerHandle` owns everything that crosses the process boundary: the spawned process, the weights in shared
memory with their version and lock, the queue of scored rounds, the error queue, the heartbeat, the stop flag
and the warm-start hand-off (toolkit.core.rollout_worker). The trainer (toolkit.core.async_grpo) asks it to
start, publish weights, give the next scored round, and say whether the worker failed and why; restarting, the
staleness gate and the metrics stay in the trainer.

Nothing here can wait forever on a dead worker: the flags are lock-free shared values (a synchronized Value takes
a semaphore on every read, and a worker stopped or killed while holding it would block the trainer for good),
the weights lock is replaced when a dead worker took it down, and every wait is bounded.
"""

from __future__ import annotations

__all__ = ["InWorkerBackend", "WorkerHandle", "check_sendable", "environment_for_worker", "not_importable_in_worker"]

import logging
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from .errors import ConfigError
from .rollout_worker import Handoff, ScoredRound, StopFlag, WorkerSpec, worker_main

logger = logging.getLogger(__name__)


class InWorkerBackend:
    """The trainer process's stand-in generation backend: generation happens in the rollout worker (which owns the
    real one)."""

    def sync_weights(self, model: Any) -> None:
        pass

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("AsyncGRPOTrainer generates in its rollout worker; the trainer process has no backend.")


class WorkerHandle:
    """One rollout worker process at a time, and what the trainer shares with it (see the module docstring).

    `start_timeout` (worker_start_timeout) bounds a worker's start-up; `heartbeat_timeout` the silence of its main
    loop once it is ready. A restart is `stop()` then `start(...)` again: the shared weights and their version are
    kept, the queues and flags are new, and whether any worker of this handle was ever ready is remembered for the
    diagnosis of a failed start (`failure`)."""

    def __init__(self, *, threads: int, queue_size: int, start_timeout: float, heartbeat_timeout: float):
        self.ctx = mp.get_context("spawn")
        self.threads, self.queue_size = threads, queue_size
        self.start_timeout, self.heartbeat_timeout = start_timeout, heartbeat_timeout
        self.process: Any = None
        self.shared: dict[str, torch.Tensor] | None = None
        self.version: Any = None
        self.lock: Any = None
        self.handoff: Handoff | None = None
        self.started_at: float | None = None
        self.ever_ready = False  # a worker of this handle got past its start-up (a restart's diagnosis reads it)
        self.out_q: Any = None
        self.err_q: Any = None
        self.heartbeat: Any = None
        self.stop_flag: StopFlag | None = None
        self.setup_q: Any = None

    @property
    def running(self) -> bool:
        return self.process is not None

    # ------------------------------------------------------------------------------ start and stop

    def start(self, spec: WorkerSpec, weights: dict[str, torch.Tensor], version: int, next_round: int) -> None:
        """Start a worker that generates from round `next_round` with `weights` at `version`."""
        self._share_weights(weights, version)
        self.out_q = self.ctx.Queue(maxsize=self.queue_size)
        self.err_q = self.ctx.Queue()
        self.heartbeat = self.ctx.Value("d", time.time(), lock=False)
        self.stop_flag = StopFlag(self.ctx)
        self.ever_ready = self.ever_ready or (self.handoff is not None and self.handoff.worker_ready())
        self.handoff = Handoff(self.ctx, next_round)
        # Under spawn, Process.start() writes the pickled arguments into a pipe that the child reads only after its
        # new interpreter has imported the main module (10 s and more with torch); arguments larger than the pipe's
        # buffer (64 KiB) would hold this process that long. So the arguments are the small shared objects (the
        # weights as shared-memory handles, about 110 bytes a tensor; their file descriptors pass to the child at
        # spawn), and the spec (megabytes: tokenizer, rows) goes through a queue, whose feeder thread waits
        # instead. It is pickled here, so an object that cannot be pickled fails now, in this process, naming
        # itself.
        try:
            payload = bytes(ForkingPickler.dumps(spec))
        except Exception as e:
            raise ConfigError(f"async GRPO: the rollout worker's settings cannot be sent to its process "
                              f"({type(e).__name__}: {e}). Reward functions, the dataset's rows and the tokenizer "
                              "must be picklable.") from e
        # kept on self like the other queues: Process.start() drops its arguments, and a queue collected here would
        # unlink its semaphores before the child has unpickled them
        self.setup_q = self.ctx.Queue()
        self.setup_q.put(payload)
        self.setup_q.cancel_join_thread()  # a worker that died before reading must not hold this process's exit
        boot = {"threads": self.threads, "parent_pid": os.getpid(), "start_timeout": self.start_timeout}
        self.process = self.ctx.Process(
            target=worker_main, name="toolkit-rollout-worker", daemon=True,
            args=(self.setup_q, self.shared, boot, self.version, self.lock, self.out_q, self.err_q, self.heartbeat,
                  self.stop_flag, self.handoff))
        self.process.start()
        self.started_at = time.time()

    def _share_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
        if self.shared is None:
            # On the CPU whatever the training device: the worker decodes on the CPU, and a copy_ from a GPU into
            # host memory has finished when it returns, before the version is bumped. GPU tensors would reach the
            # worker through CUDA IPC, where copy_ is only queued and a reader could see half-written weights.
            self.shared = {k: v.detach().to("cpu", copy=True).contiguous().share_memory_() for k, v in weights.items()}
            # lock=False here and for the heartbeat and stop flag: a synchronized Value takes a semaphore on every
            # read, and a worker stopped or killed while holding it (an OOM kill; SIGSTOP in the hung-worker test,
            # where CI once hung for 15 minutes in the trainer's Event.set()) would block the trainer forever.
            # Aligned 8-byte reads and writes are whole; weight publishing has its own lock.
            self.version = self.ctx.Value("q", 0, lock=False)
            self.lock = self.ctx.Lock()
        # No worker is running here. One killed while it was reading the weights took the lock down with it: a fresh
        # lock (the new worker receives it) instead of a trainer that waits forever.
        if not self.lock.acquire(timeout=0):
            self.lock = self.ctx.Lock()
        else:
            self.lock.release()
        with self.lock:
            self._copy_in(weights, version)

    def _copy_in(self, weights: dict[str, torch.Tensor], version: int) -> None:
        for k, v in weights.items():
            self.shared[k].copy_(v)
        self.version.value = version

    def stop(self) -> None:
        """Stop the worker (a kill after 10 s); nothing waits longer."""
        if self.process is None:
            return
        self.stop_flag.set()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=10)
        self.process = None
        self.setup_q.close()  # a worker that died before reading its spec leaves the feeder blocked otherwise

    # ------------------------------------------------------------------------------ weights and rounds

    def publish(self, weights: dict[str, torch.Tensor], version: int) -> None:
        """Copy `weights` into shared memory and set their version (the optimizer step)."""
        if self.process is None:
            return
        while not self.lock.acquire(timeout=0.5):
            if not self.process.is_alive():
                return  # the worker died holding the lock; the failure check restarts it with a fresh lock
        try:
            self._copy_in(weights, version)
        finally:
            self.lock.release()

    def get(self, timeout: float) -> ScoredRound | None:
        """The next scored round, or None if none came within `timeout` seconds."""
        try:
            return self.out_q.get(timeout=timeout)
        except queue.Empty:
            return None

    def queue_depth(self) -> float:
        try:
            return float(self.out_q.qsize())
        except (NotImplementedError, AttributeError):  # macOS has no sem_getvalue
            return float("nan")

    def ready(self) -> bool:
        """Whether the running worker finished its start-up and generates."""
        return self.handoff is not None and self.handoff.worker_ready()

    def startup_s(self) -> float | None:
        """Seconds from the running worker's start to its being ready (None: not ready yet)."""
        return self.handoff.ready_at() - self.started_at if self.ready() else None

    # ------------------------------------------------------------------------------ liveness

    def failure(self) -> str | None:
        """Why the worker is not working (its traceback, its exit, a start-up or heartbeat timeout), or None."""
        try:
            return self.err_q.get_nowait()
        except queue.Empty:
            pass
        if not self.process.is_alive():
            return self._exit_diagnosis()
        # Until the worker says it is ready (imports, model or engine built) it has start_timeout from its start;
        # from then on its main loop's progress is the heartbeat.
        if not self.handoff.worker_ready():
            waited = time.time() - self.started_at
            if waited > self.start_timeout:
                return (f"not ready {waited:.0f} s after its start (> worker_start_timeout {self.start_timeout:.0f} "
                        "s): the worker hangs while starting")
            return None
        silent = time.time() - self.heartbeat.value
        if silent > self.heartbeat_timeout:
            return f"no heartbeat for {silent:.0f} s (> {self.heartbeat_timeout:.0f} s): the worker is hung"
        return None

    def _exit_diagnosis(self) -> str:
        try:  # a traceback put just before the exit may still be in the queue's pipe
            return self.err_q.get(timeout=0.5)
        except queue.Empty:
            pass
        code = self.process.exitcode
        why = f"the worker process exited with code {code} without a traceback"
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            oom = "; the out-of-memory killer sends it" if -code == signal.SIGKILL else ""
            return f"{why} (killed by {name}{oom})"
        if code and not self.handoff.worker_ready() and not self.ever_ready:
            # it failed before our code ran: spawn re-imports the main module first, and a script that trains at
            # import time starts a second trainer there, which Python refuses (its message is on stderr)
            return (f"{why}, before it was ready; its error is on this process's stderr. If you run a script: the "
                    "worker is a spawned process that imports your main module again, so the code that trains must "
                    "be under `if __name__ == \"__main__\":`")
        return f"{why}; its output, if any, is on this process's stderr"


# ------------------------------------------------------------------------------------ what can reach the worker


def not_importable_in_worker(obj: Any) -> str | None:
    """Why `obj` cannot reach a spawned worker process (None: it can). Pickle sends a class or function by its
    module and name, so it must unpickle, and its module must be importable there: a notebook's `__main__` is not
    (a script's is: spawn runs it again as `__mp_main__`)."""
    import pickletools
    import sys

    try:
        data = pickle.dumps(obj)
        pickle.loads(data)
    except Exception as e:  # noqa: BLE001 (anything pickle raises)
        return f"it does not pickle ({type(e).__name__}: {e})"
    # anything in it (a partial's function or arguments, an instance's class) defined in `__main__` is pickled by
    # reference to that module, and an interactive session's cannot be imported in the worker
    refers_to_main = any(arg == "__main__" or (isinstance(arg, str) and arg.startswith("__main__ "))
                         for _, arg, _ in pickletools.genops(data))
    if refers_to_main and not getattr(sys.modules.get("__main__"), "__file__", None):
        return ("it refers to something defined in an interactive session (a notebook's __main__), which the worker "
                "process cannot import")
    return None


def check_sendable(reward_funcs: list[Any], environment: Any) -> None:
    """Reward functions and an `environment=` factory must reach the spawned worker process: refused here, naming
    why, before any model loads."""
    try:
        pickle.dumps(reward_funcs)
    except Exception as e:
        raise ConfigError(f"reward_funcs: async GRPO runs rewards in the worker process, so they must be "
                          f"importable (module-level functions or built-in names), not lambdas or closures "
                          f"({type(e).__name__}: {e}).") from e
    if environment is None:
        return
    # the worker process builds the episodes' environments: it gets the factory itself, pickled
    problem = not_importable_in_worker(environment)
    if problem is not None:
        raise ConfigError(f"environment: async GRPO builds the environments in its worker process, so the factory "
                          f"must be importable there (a class or a module-level function in a .py module, or a "
                          f"functools.partial of one; not a lambda, a closure or a class defined in a notebook), or "
                          f"name a registered environment in AsyncGRPOConfig.environment; {problem}.")


def environment_for_worker(factory: Any, name: str | None) -> Any:
    """The environment factory the worker gets (None: no episodes, or the worker looks the name up itself).

    The factory itself when it can reach the worker process: an `environment=` object (checked in __init__),
    or a registered class or module-level function with its kwargs (so an environment registered at run
    time in this process works there too). A registered factory that cannot (a lambda in a plugin) is looked
    up by name in the worker's own registry, which holds entry-point plugins and built-ins only; a name that
    is not there is refused here, before training starts."""
    if factory is None:
        return None
    problem = not_importable_in_worker(factory)
    if problem is None:
        return factory
    from .plugins import PluginRegistry

    if name in PluginRegistry().names("environment"):
        logger.warning("async GRPO: environment '%s' cannot be sent to the rollout worker (%s); the worker builds "
                       "it from its own registry (the plugin's entry point)", name, problem)
        return None
    raise ConfigError(f"environment: '{name}' was registered in this process only (not through an entry point), "
                      f"and its factory cannot be sent to async GRPO's worker process: {problem}. Register a class "
                      "or a module-level function (or a functools.partial of one), or install the plugin with "
                      "an entry point.")
