"""Asynchronous GRPO: a rollout worker process generates and scores while the trainer trains.

`AsyncGRPOTrainer` is `GRPOTrainer` with the rollout moved into its own process:

    worker process                                   trainer process
    ----------------------------------------------   ------------------------------------------------
    round r: wait until weights version >= r - k     take the next scored round from the queue
             (k = max_staleness), load them if new   drop it if (step - its version) > max_staleness
             generate G completions per prompt       loss as GRPO, with the sampler's log-probs as the
             score them (sync + async rewards)         behaviour policy (truncated importance sampling)
             put (round, version, ids, log-probs,    optimizer step; every sync_every steps publish
                  rewards) into a bounded queue        the weights to shared memory (version = step)

Every sample carries the version of the weights that generated it. With `max_staleness = 0` the
worker generates round r only with the weights of step r, so the updates equal synchronous GRPO's
(tests/test_async_grpo.py checks it); with k > 0 generation of round r+1..r+k overlaps training on
round r. Weights reach the worker through shared memory (no copy through a pipe); the worker
loads them between rounds, and with `inflight_weight_updates` also between decode steps of the round
in progress (PipelineRL; each token then records the version that sampled it).

Robustness: the worker's heartbeat comes from progress of its main loop (each decode step with the
transformers backend, each wait-loop turn; reward scoring counts as bounded by reward_timeout, and a
vLLM generate call or weight upload, which report no steps, as bounded by worker_start_timeout), not
from a side thread alone, and it sends its traceback if it fails; the
trainer notices a dead, frozen or stuck worker within `heartbeat_timeout`, then restarts it (`worker_restarts`) or saves a
checkpoint and stops with the worker's traceback. Nothing waits forever. The worker's prompt
position is part of the checkpoint, so a resumed run continues with the right round.

Prompt order, generation seeds and round numbering are those of GRPOTrainer (round r = step r).
Reward functions run in the worker and must be importable (module-level functions or names).
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from .checkpoint import write_atomic
from .distributed import env_world_size, refuse_sharding
from .errors import ConfigError, TrainingHealthError
from .generation import Completion
from .grpo import GRPOConfig, GRPOTrainer, Rollout, _accepts_keyword
from .models import DEFAULT_MODEL, unwrap_model
from .rollout import generate_and_score, generation_seed
from .rollout_worker import Handoff, ScoredRound, StopFlag, round_sampler, worker_main

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer"]

logger = logging.getLogger(__name__)

STATE_FILE = "async_grpo_state.json"


@dataclass
class AsyncGRPOConfig(GRPOConfig):
    """`GRPOConfig` plus the asynchronous settings below (a GRPO run file loads as is)."""

    output_dir: str | None = field(default="outputs/async-grpo", metadata={"help": "Checkpoints, final model."})
    max_staleness: int = field(default=1, metadata={
        "help": "Most optimizer steps between the weights that generated a sample and the step that trains on it; "
                "0 reproduces synchronous GRPO. Older samples are dropped (counted and logged)."})
    queue_size: int = field(default=2, metadata={"help": "Scored rounds the worker may have waiting."})
    sync_every: int = field(default=1, metadata={"help": "Publish weights to the worker every N optimizer steps."})
    worker_threads: int = field(default=1, metadata={"help": "torch threads of the rollout worker."})
    trainer_threads: int | None = field(default=None, metadata={
        "help": "torch threads of the trainer (None: unchanged). On 2 cores: 1 and 1."})
    worker_restarts: int = field(default=0, metadata={
        "help": "Restart a dead worker this many times before stopping the run (with a checkpoint)."})
    scoring_concurrency: int = field(default=2, metadata={
        "help": "Rounds the worker may have in flight between generation and the queue: it generates the next "
                "round while earlier ones wait for their rewards (an HTTP judge, a sandbox), so reward functions "
                "may run on up to this many batches at once, from as many threads (they must be thread-safe; pure "
                "functions are). 1: one batch at a time, each round scored before the worker generates the next "
                "call."})
    rounds_per_generation: int = field(default=1, metadata={
        "help": "Rounds the worker may generate in one generate call, when the staleness bound admits them all with "
                "the weights it holds (round r + j is admitted when r + j - version <= max_staleness). On CPU a "
                "decode step reads every weight whatever the batch, so 2 rounds of 8 sequences cost about 1.1x one "
                "round (measured: 2.5 s -> 2.8 s, 135M model, one thread): more samples per second for a worker "
                "whose trainer waits for it, at the price of the later rounds' staleness. Give scoring_concurrency "
                ">= this + 1, so that a call's rounds score while the next call generates. The gain needs the "
                "whole call in one batch (rounds x prompts x num_generations <= generation_batch_size); a vLLM "
                "call of k rounds must finish within worker_start_timeout. 1: one round per call (max_staleness 0 "
                "always generates one)."})
    inflight_weight_updates: bool = field(default=False, metadata={
        "help": "Load newly published weights between decode steps of the rollouts in progress (PipelineRL), "
                "not only between rounds: the rollouts continue under the new weights, each token records the "
                "version that sampled it, and the loss's behaviour log-prob is each token's own. transformers "
                "backend only."})
    warm_start: bool | None = field(default=None, metadata={
        "help": "While the worker starts (a new interpreter, imports, the model built: 10-30 s on CPU), the trainer "
                "generates and scores rounds itself, as synchronous GRPO does, instead of waiting; the worker takes "
                "over from the round after the trainer's last. None (default): on with the transformers backend, "
                "off with vLLM (the trainer's own generation would share the GPU with an engine that is sizing its "
                "cache from the free memory). False: wait for the worker."})
    heartbeat_timeout: float = field(default=60.0, metadata={
        "help": "Seconds without progress of the worker's main loop after which it counts as hung (a vLLM "
                "generate call or weight upload may take up to worker_start_timeout)."})
    worker_start_timeout: float = field(default=300.0, metadata={
        "help": "Seconds the first round may take (start-up included) before the worker counts as hung."})

    def __post_init__(self):
        super().__post_init__()
        if self.max_staleness < 0:
            raise ConfigError(f"max_staleness: must be >= 0, got {self.max_staleness}.")
        for name in ("queue_size", "sync_every", "worker_threads", "scoring_concurrency", "rounds_per_generation"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {getattr(self, name)!r}.")
        if self.sync_every > self.max_staleness + 1:
            raise ConfigError(
                f"sync_every: with max_staleness={self.max_staleness} the worker needs new weights at least every "
                f"{self.max_staleness + 1} steps; use sync_every <= {self.max_staleness + 1} or raise max_staleness.")
        if self.num_iterations != 1:
            raise ConfigError("num_iterations: async GRPO trains each round once (1); the off-policy correction "
                              "already uses the sampler's log-probs.")
        if self.skip_solved_threshold is not None:
            raise ConfigError("skip_solved_threshold: not supported by async GRPO (the worker picks prompts ahead "
                              "of the trainer); leave it None.")
        if self.generation_backend not in ("transformers", "vllm", "vllm-server"):
            raise ConfigError(f"generation_backend: the async worker runs transformers, vllm or vllm-server, got "
                              f"'{self.generation_backend}'.")
        if self.inflight_weight_updates and self.generation_backend != "transformers":
            raise ConfigError(f"inflight_weight_updates: needs generation_backend 'transformers' (its decode loop "
                              f"loads new weights between steps); a '{self.generation_backend}' generate call is one "
                              "engine call with no point to swap weights in. Set it False to load weights between "
                              "rounds.")
        if self.inflight_weight_updates and self.environment is not None:
            raise ConfigError("inflight_weight_updates: not with multi-turn episodes (environment): an episode's turns "
                              "are separate generate calls whose per-token versions are not carried yet; set it False "
                              "(weights are then loaded between rounds).")
        if self.heartbeat_timeout <= 0 or self.worker_start_timeout <= 0:
            raise ConfigError("heartbeat_timeout, worker_start_timeout: must be > 0.")
        if self.worker_restarts < 0:
            raise ConfigError(f"worker_restarts: must be >= 0, got {self.worker_restarts}.")


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPO with generation in a separate worker process; see the module docstring and docs/async_grpo.md."""

    # multi-turn episodes: the worker process builds the environments (the trainer's factory, sent pickled; docs/agents.md)
    supports_environments = True

    _tag_names = ["toolkit", "grpo", "async-grpo"]  # noqa: RUF012

    def __init__(
        self,
        model: Any = DEFAULT_MODEL,
        reward_funcs: Any = (),
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        model_init_kwargs: dict | None = None,
        ref_model: Any = None,
        environment: Any = None,
    ):
        args = args if args is not None else AsyncGRPOConfig()
        if not isinstance(args, AsyncGRPOConfig):
            raise ConfigError(f"args: AsyncGRPOTrainer needs an AsyncGRPOConfig, got {type(args).__name__}.")
        # Several processes: each trainer rank feeds its own rollout worker the (identical) DDP weights and trains
        # on that rank's share of every round. Sharded weights (FSDP, ZeRO-3) would reach the worker as shards.
        refuse_sharding("AsyncGRPOTrainer", args, "each rank's rollout worker loads the whole weights from its "
                                                  "trainer")
        if env_world_size() > 1 and args.generation_backend == "vllm-server":
            raise ConfigError("generation_backend: 'vllm-server' with several trainer processes would have every "
                              "rank's worker push its weights into the one server while the others generate; use "
                              "'transformers' or 'vllm' (one engine per rank), or one process.")
        # The worker process runs GRPO's own prompt order and scoring; a subclass's override of these seams
        # would silently not run there, so it is refused.
        for seam in ("build_prompt_sampler", "compute_rewards"):
            if getattr(type(self), seam) is not getattr(GRPOTrainer, seam):
                raise ConfigError(f"{type(self).__name__}.{seam}: async GRPO generates and scores in its worker "
                                  f"process, which runs GRPO's own {seam}; the override would not run there. Use "
                                  "GRPOTrainer for a custom sampler or scorer.")
        funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
        try:
            pickle.dumps(funcs)
        except Exception as e:
            raise ConfigError(f"reward_funcs: async GRPO runs rewards in the worker process, so they must be "
                              f"importable (module-level functions or built-in names), not lambdas or closures "
                              f"({type(e).__name__}: {e}).") from e
        if environment is not None:
            # the worker process builds the episodes' environments: it gets the factory itself, pickled
            problem = _not_importable_in_worker(environment)
            if problem is not None:
                raise ConfigError(f"environment: async GRPO builds the environments in its worker process, so the "
                                  f"factory must be importable there (a class or a module-level function in a .py "
                                  f"module, or a functools.partial of one; not a lambda, a closure or a class "
                                  f"defined in a notebook), or name a registered environment in "
                                  f"AsyncGRPOConfig.environment; {problem}.")
            if args.inflight_weight_updates:
                raise ConfigError("inflight_weight_updates: not with multi-turn episodes (environment): an episode's "
                                  "turns are separate generate calls whose per-token versions are not carried yet; "
                                  "set it False (weights are then loaded between rounds).")
        # what the worker process gets to build the environments, checked before any model loads
        worker_env = self._environment_for_worker(self._environment_factory(environment, args), args.environment)
        callbacks = list(callbacks or []) + [_AsyncStateCallback(self)]
        super().__init__(model, funcs, args, train_dataset=train_dataset, processing_class=processing_class,
                         peft_config=peft_config, generation_backend=_InWorker(), callbacks=callbacks,
                         optimizers=optimizers, model_init_kwargs=model_init_kwargs, ref_model=ref_model,
                         environment=environment)
        if self.args.trainer_threads:
            torch.set_num_threads(self.args.trainer_threads)
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._next_round = 0
        self._dropped = 0
        self._restarts = 0
        self._last_get = None
        self._worker_env_factory = worker_env
        # warm_start resolved (the config is not written to): on by default with the transformers backend only
        self.warm_start = (self.args.warm_start if self.args.warm_start is not None
                           else self.args.generation_backend == "transformers")
        self._warm = False          # generating rounds here until the worker is ready (warm_start)
        self._warm_rounds = 0       # rounds generated in this process
        self._superseded = 0        # worker rounds discarded because this process had generated them (Handoff)
        self._failures_done: dict[str, int] = {}  # reward failures counted by earlier workers
        self._failures_now: dict[str, int] = {}   # the running worker's running totals
        self._staleness: Counter = Counter()

    # ------------------------------------------------------------------------------- the worker

    def _engine_state(self) -> dict[str, torch.Tensor]:
        from .vllm_backend import engine_weights  # generic: merged PEFT weights in checkpoint naming

        return dict(engine_weights(self.model))

    def _start_worker(self) -> None:
        args = self.args
        state = self._engine_state()
        if not hasattr(self, "_shared"):
            # On the CPU whatever the training device: the worker decodes on the CPU, and a copy_ from a GPU into
            # host memory has finished when it returns, before the version is bumped. GPU tensors would reach the
            # worker through CUDA IPC, where copy_ is only queued and a reader could see half-written weights.
            self._shared = {k: v.detach().to("cpu", copy=True).contiguous().share_memory_() for k, v in state.items()}
            # lock=False here and for the heartbeat and stop flag below: a synchronized Value takes a semaphore on
            # every read, and a worker stopped or killed while holding it (an OOM kill; SIGSTOP in the hung-worker
            # test, where CI once hung for 15 minutes in the trainer's Event.set()) would block the trainer
            # forever. Aligned 8-byte reads and writes are whole; weight publishing has its own lock.
            self._version = self._ctx.Value("q", 0, lock=False)
            self._lock = self._ctx.Lock()
        # No worker is running here. One killed while it was reading the weights took the lock down with it:
        # a fresh lock (the new worker receives it) instead of a trainer that waits forever.
        if not self._lock.acquire(timeout=0):
            self._lock = self._ctx.Lock()
        else:
            self._lock.release()
        with self._lock:
            for k, v in state.items():
                self._shared[k].copy_(v)
            self._version.value = self.state.global_step
        self._out_q = self._ctx.Queue(maxsize=args.queue_size)
        self._err_q = self._ctx.Queue()
        self._heartbeat = self._ctx.Value("d", time.time(), lock=False)
        self._stop = StopFlag(self._ctx)
        # a worker of this run got past its start-up before (read by _worker_failure's diagnosis of a restart)
        self._ever_ready = getattr(self, "_ever_ready", False) or (hasattr(self, "_handoff")
                                                                   and self._handoff.worker_ready())
        self._handoff = Handoff(self._ctx, self._next_round)
        # After a restart with several ranks the warm phase is over for good: a rank that re-entered it alone would
        # call a collective (the readiness check) the other ranks do not. One process may warm-start again.
        self._warm = self.warm_start and (not hasattr(self, "_started_at") or self.accelerator.num_processes == 1)
        # a new worker counts its reward failures from zero: keep the totals of the one before
        self._failures_done = {k: v + self._failures_done.get(k, 0) for k, v in self._failures_now.items()} | {
            k: v for k, v in self._failures_done.items() if k not in self._failures_now}
        self._failures_now = {}
        base = unwrap_model(self.model)
        config = base.config
        if hasattr(self.model, "peft_config"):
            config = self.model.get_base_model().config
        spec = {
            "config": config, "reward_funcs": self.reward_runner.funcs,
            "reward_timeout": args.reward_timeout, "reward_max_failures": args.reward_max_consecutive_failures,
            "start_timeout": args.worker_start_timeout,
            "pad_token_id": self.processing_class.pad_token_id,
            "max_batch_size": args.generation_batch_size, "tokenizer": self.processing_class, "rows": self.rows,
            "prompt_ids": self.prompt_ids, "num_generations": args.num_generations, "per_round": self.prompts_per_round,
            "seed": args.seed, "sampling": self.sampling, "max_staleness": args.max_staleness,
            "conversational": self.dataset_format.conversational,
            "extra_columns": list(self.dataset_format.extra_columns), "varlen": self.padding_free,
            "backend": args.generation_backend, "backend_kwargs": self._worker_backend_kwargs(),
            "rank": self.accelerator.process_index, "num_processes": self.accelerator.num_processes,
            "inflight": args.inflight_weight_updates, "scoring_concurrency": args.scoring_concurrency,
            "rounds_per_generation": args.rounds_per_generation,
            "episodes": None if self.environment_factory is None else {
                # the factory itself when it pickles (an `environment=` object, or a registered class or module-level
                # function: then one registered at run time in this process works too); else the worker builds
                # it by name from its own registry (entry-point plugins and built-ins)
                "factory": self._worker_env_factory,
                "name": args.environment, "kwargs": dict(args.environment_kwargs or {}),
                "max_turns": args.max_turns, "max_tokens": args.max_episode_tokens,
                "concurrency": args.environment_concurrency, "step_timeout": args.environment_step_timeout,
                "end_text": self.episode_delta.end_text, "chat_template_kwargs": args.chat_template_kwargs},
        }
        self._rounds = round_sampler(spec)
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
        self._setup_q = self._ctx.Queue()
        self._setup_q.put(payload)
        self._setup_q.cancel_join_thread()  # a worker that died before reading must not hold this process's exit
        self._proc = self._ctx.Process(
            target=worker_main, name="toolkit-rollout-worker", daemon=True,
            args=(self._setup_q, self._shared, {"threads": args.worker_threads, "parent_pid": os.getpid(),
                            "start_timeout": args.worker_start_timeout},
                  self._version, self._lock, self._out_q, self._err_q, self._heartbeat, self._stop, self._handoff))
        self._proc.start()
        self._started_at = time.time()
        logger.info("async GRPO: rollout worker pid %d started at round %d (max_staleness=%d, queue_size=%d, "
                    "warm_start=%s).", self._proc.pid, self._next_round, args.max_staleness, args.queue_size,
                    self._warm)

    def evaluation_backend(self):
        """Held-out evaluation generates in this process with the training model (the worker owns the real
        backend and generates rounds)."""
        from .generation import TransformersBackend

        return TransformersBackend(self.model, pad_token_id=self.processing_class.pad_token_id,
                                   max_batch_size=self.args.generation_batch_size)

    def _warm_backend(self):
        """Warm-start rounds generate here as the worker would: in its dtype (generation_backend_kwargs.dtype).
        Kept while the warm start lasts, so that a cast copy is refreshed from round to round rather than built
        each time; dropped when the worker takes over (the copy costs the weights once more)."""
        from .generation import TransformersBackend

        dtype = ((self.args.generation_backend_kwargs or {}).get("dtype")
                 if self.args.generation_backend == "transformers" else None)
        if dtype is None:
            return self.evaluation_backend()
        if getattr(self, "_warm_backend_", None) is None:
            self._warm_backend_ = TransformersBackend(self.model, pad_token_id=self.processing_class.pad_token_id,
                                                      max_batch_size=self.args.generation_batch_size, dtype=dtype)
        self._warm_backend_.sync_weights(self.model)
        return self._warm_backend_

    def _worker_backend_kwargs(self) -> dict[str, Any]:
        args = self.args
        kwargs = dict(args.generation_backend_kwargs or {})
        if args.generation_backend == "vllm":
            base = self.model.get_base_model() if hasattr(self.model, "peft_config") else unwrap_model(self.model)
            kwargs.setdefault("model_path", base.config._name_or_path)
            from .vllm_backend import vllm_context_length

            kwargs.setdefault("max_model_len", vllm_context_length(args))
            kwargs.setdefault("seed", args.seed)
        return kwargs

    def stop_worker(self) -> None:
        if self._proc is None:
            return
        self._stop.set()
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._proc = None
        self._setup_q.close()  # a worker that died before reading its spec leaves the feeder blocked otherwise

    def publish_weights(self) -> None:
        """Copy the current weights into shared memory and bump the version (= the optimizer step)."""
        if self._proc is None:
            return
        state = self._engine_state()
        while not self._lock.acquire(timeout=0.5):
            if not self._proc.is_alive():
                return  # the worker died holding the lock; the failure check restarts it with a fresh lock
        try:
            for k, v in state.items():
                self._shared[k].copy_(v)
            self._version.value = self.state.global_step
        finally:
            self._lock.release()

    def _worker_failure(self) -> str | None:
        try:
            return self._err_q.get_nowait()
        except queue.Empty:
            pass
        if not self._proc.is_alive():
            try:  # a traceback put just before the exit may still be in the queue's pipe
                return self._err_q.get(timeout=0.5)
            except queue.Empty:
                pass
            code = self._proc.exitcode
            why = f"the worker process exited with code {code} without a traceback"
            if code is not None and code < 0:
                try:
                    name = signal.Signals(-code).name
                except ValueError:
                    name = f"signal {-code}"
                oom = "; the out-of-memory killer sends it" if -code == signal.SIGKILL else ""
                return f"{why} (killed by {name}{oom})"
            if code and not self._handoff.worker_ready() and not self._ever_ready:
                # it failed before our code ran: spawn re-imports the main module first, and a script that trains
                # at import time starts a second trainer there, which Python refuses (its message is on stderr)
                return (f"{why}, before it was ready; its error is on this process's stderr. If you run a script: "
                        "the worker is a spawned process that imports your main module again, so the code that "
                        "trains must be under `if __name__ == \"__main__\":`")
            return f"{why}; its output, if any, is on this process's stderr"
        # Until the worker says it is ready (imports, model or engine built) it has worker_start_timeout from its
        # start; from then on its main loop's progress is the heartbeat.
        if not self._handoff.worker_ready():
            waited = time.time() - self._started_at
            if waited > self.args.worker_start_timeout:
                return (f"not ready {waited:.0f} s after its start (> worker_start_timeout "
                        f"{self.args.worker_start_timeout:.0f} s): the worker hangs while starting")
            return None
        limit = self.args.heartbeat_timeout
        silent = time.time() - self._heartbeat.value
        if silent > limit:
            return f"no heartbeat for {silent:.0f} s (> {limit:.0f} s): the worker is hung"
        return None

    def _next_scored_round(self) -> ScoredRound:
        if self._proc is None:
            self._start_worker()
        if self._warm:
            # every rank generates here until every rank's worker is ready (the staleness check below is collective)
            if self._any_rank(not self._handoff.worker_ready()):
                problem = self._worker_failure()
                if problem is not None:
                    self._handle_failure(problem)  # a restart starts a new warm start; otherwise this raises
                return self._round_here()
            self._warm = False
            self._warm_backend_ = None  # its cast copy, if any, is not needed any more
            logger.info("async GRPO: the rollout worker was ready %.1f s after its start; it generates from round %d "
                        "on (%d rounds were generated in the trainer meanwhile).",
                        self._handoff.ready_at() - self._started_at, self._next_round, self._warm_rounds)
        started = time.perf_counter()
        while True:
            try:
                item = self._out_q.get(timeout=0.5)
            except queue.Empty:
                problem = self._worker_failure()
                if problem is None:
                    continue
                self._handle_failure(problem)
                started = time.perf_counter()
                continue
            if item.round < self._next_round:
                self._superseded += 1
                continue  # the handoff crossed: this round was generated here (Handoff); the worker's copy is spare
            staleness = self.state.global_step - item.version
            if self._any_rank(staleness > self.args.max_staleness):
                # every rank drops its share of the round together, so the ranks keep training the same rounds
                self._dropped += 1
                self._next_round = item.round + 1
                logger.info("async GRPO: dropped round %d (this rank's share: staleness %d, max_staleness %d; a round "
                            "is dropped on every rank when any rank's share is too stale).", item.round, staleness,
                            self.args.max_staleness)
                continue
            self._next_round = item.round + 1
            self._staleness[staleness] += 1
            item.trainer_wait_s = time.perf_counter() - started
            return item

    @torch.no_grad()
    def _round_here(self) -> ScoredRound:
        """Warm start: round `_next_round` generated and scored in this process with the current weights, with the
        worker's prompts and seed for it (so at max_staleness 0 it is the round the worker would have made)."""
        r, G = self._next_round, self.args.num_generations
        self._handoff.claim(r)
        rank = self.accelerator.process_index
        idx, seed = self._rounds.round(r, rank), generation_seed(self.args.seed, r, rank)
        backend = self._warm_backend()  # the training model itself (or its cast copy: dtype)
        t0 = time.perf_counter()
        if self.environment_factory is not None:
            timings: dict[str, float] = {}
            takes_timings = _accepts_keyword(self.run_episodes, "timings")  # an older override: no waits logged
            eps = self.run_episodes([self.rows[i] for i in idx for _ in range(G)], self.sampling, seed=seed,
                                    group_size=G, backend=backend, **({"timings": timings} if takes_timings else {}))
            item = ScoredRound(round=r, version=self.state.global_step, row_indices=idx, completions=[],
                               rewards_per_func=[], failures={}, gen_s=time.perf_counter() - t0, score_s=0.0,
                               wait_s=0.0, tokens=sum(sum(ep.mask) for ep in eps), episodes=eps,
                               environment_s=timings.get("environment_s"))
        else:
            scored = generate_and_score(backend, [self.prompt_ids[i] for i in idx], [self.rows[i] for i in idx],
                                        sampling=self.sampling, n=G, seed=seed, score=self.compute_rewards)
            item = ScoredRound(round=r, version=self.state.global_step, row_indices=idx,
                               completions=[[(c.token_ids, c.logprobs, c.finish_reason) for c in g]
                                            for g in scored.groups],
                               rewards_per_func=scored.rewards_per_func.tolist(), failures={},
                               gen_s=scored.generation_s, score_s=scored.scoring_s, wait_s=0.0,
                               tokens=sum(len(c.token_ids) for g in scored.groups for c in g))
        item.trainer_wait_s, item.in_trainer = 0.0, True
        self._next_round = r + 1
        self._staleness[0] += 1
        self._warm_rounds += 1
        return item

    def _reward_failure_totals(self, worker_totals: dict[str, int]) -> dict[str, int]:
        """Batches lost to reward errors over the whole run: earlier workers', the running worker's (its rounds may
        arrive out of scoring order, so its running totals never go back) and the trainer's own (warm start)."""
        self._failures_now = {k: max(v, self._failures_now.get(k, 0)) for k, v in worker_totals.items()} | {
            k: v for k, v in self._failures_now.items() if k not in worker_totals}
        here = self.reward_runner.failures
        names = set(self._failures_done) | set(self._failures_now) | set(here)
        return {k: self._failures_done.get(k, 0) + self._failures_now.get(k, 0) + here.get(k, 0) for k in names}

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank (itself in one process); every rank must call it at the same point."""
        if self.accelerator.num_processes == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.accelerator.device)
        return bool(self.accelerator.reduce(t, reduction="sum").item() > 0)

    def _handle_failure(self, problem: str) -> None:
        self.stop_worker()
        if self._restarts < self.args.worker_restarts:
            self._restarts += 1
            logger.error("async GRPO: rollout worker failed (%s); restart %d of %d from round %d.",
                         problem.strip().splitlines()[-1], self._restarts, self.args.worker_restarts,
                         self._next_round)
            self._start_worker()
            return
        if self.accelerator.num_processes > 1:
            # The other ranks are inside this step's collectives and cannot join a save; the launcher stops them
            # when this process exits. The last periodic checkpoint is the one to resume from.
            raise TrainingHealthError(
                f"async GRPO step {self.state.global_step}, rank {self.accelerator.process_index}: the rollout "
                f"worker failed and worker_restarts={self.args.worker_restarts} are used up. No checkpoint was "
                "written now (with several processes the other ranks cannot join a save mid-step); resume from the "
                f"last saved checkpoint with resume_from_checkpoint=True.\nWorker: {problem}")
        path = self._emergency_checkpoint()
        raise TrainingHealthError(
            f"async GRPO step {self.state.global_step}: the rollout worker failed and worker_restarts="
            f"{self.args.worker_restarts} are used up. Checkpoint saved to {path}; resume with "
            f"resume_from_checkpoint=True.\nWorker: {problem}")

    def _emergency_checkpoint(self) -> str:
        self._save_checkpoint(self.model, trial=None)
        folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        return str(folder)

    def write_checkpoint_state(self, folder: Path) -> None:
        """GRPO's state plus the worker's position, before the checkpoint is marked complete."""
        super().write_checkpoint_state(folder)
        write_atomic(folder / STATE_FILE, json.dumps({"next_round": self._next_round, "dropped": self._dropped}))

    @staticmethod
    def _environment_for_worker(factory: Any, name: str | None) -> Any:
        """The environment factory the worker gets (None: no episodes, or the worker looks the name up itself).

        The factory itself when it can reach the worker process: an `environment=` object (checked in __init__),
        or a registered class or module-level function with its kwargs (so an environment registered at run
        time in this process works there too). A registered factory that cannot (a lambda in a plugin) is looked
        up by name in the worker's own registry, which holds entry-point plugins and built-ins only; a name that
        is not there is refused here, before training starts."""
        if factory is None:
            return None
        problem = _not_importable_in_worker(factory)
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

    # --------------------------------------------------------------------------------- rollout

    def generate_rollout(self, row_indices) -> Rollout:
        """The next scored round from the worker (the dataloader's indices are the same rounds; unused)."""
        item = self._next_scored_round()
        if item.infos_replaced:
            self.health.warn(self.state.global_step, "env_info",
                               f"{item.infos_replaced} value(s) in the environment's step info could not be sent from "
                               "the rollout worker (not picklable) and were replaced by their repr; return plain "
                               "data (numbers, strings, lists, dicts) in EnvResponse.info")
        if item.episodes is not None:
            rollout = self.rollout_from_episodes(item.row_indices, item.episodes, item.gen_s)
            if item.environment_s is not None:
                from .environments import environment_wait_metrics

                rollout.metrics.update(environment_wait_metrics(item.environment_s, item.gen_s))
            rollout.sampler_versions = [[item.version] * len(ids) for ids in rollout.completion_ids]
        else:
            # each token's version: the worker's record with in-flight updates, else the round's
            versions = item.token_versions or [[None] * len(g) for g in item.completions]
            groups = [[Completion(list(ids), list(lp), reason, v if v is not None else [item.version] * len(ids))
                       for (ids, lp, reason), v in zip(g, vg)] for g, vg in zip(item.completions, versions)]
            self._reward_failures = self._reward_failure_totals(item.failures)
            rollout = self.build_rollout(item.row_indices, groups, torch.tensor(item.rewards_per_func), item.gen_s,
                                         item.score_s)
        now = time.perf_counter()
        cycle = now - self._last_get if self._last_get is not None else float("nan")
        self._last_get = now
        m = rollout.metrics
        staleness = self.state.global_step - item.version
        m["async/staleness"] = float(staleness)
        m["async/staleness_max"] = float(staleness)
        for k in range(self.args.max_staleness + 1):
            m[f"async/staleness_hist/{k}"] = float(self._staleness[k])
        m["async/queue_depth"] = float(self._out_q.qsize()) if hasattr(self._out_q, "qsize") else float("nan")
        m["async/samples_dropped"] = float(self._dropped * self.prompts_per_round * self.args.num_generations)
        m["async/trainer_wait_s"] = item.trainer_wait_s
        if not math.isnan(cycle) and cycle > 0:
            m["async/trainer_idle_fraction"] = min(1.0, item.trainer_wait_s / cycle)
        # the worker's compute is generation (scoring waits overlap it with scoring_concurrency > 1); its idle time is
        # the wait for weights plus any wait for a round in flight to be scored or queued
        busy = item.gen_s + (item.score_s if self.args.scoring_concurrency == 1 else 0.0)
        if not item.in_trainer:
            m["async/generator_idle_fraction"] = item.wait_s / max(item.wait_s + busy, 1e-9)
        m["async/generation_tokens_per_s"] = item.tokens / max(item.gen_s, 1e-9)
        m["async/rounds_per_generate"] = float(item.batch_rounds)
        m["async/worker_restarts"] = float(self._restarts)
        m["async/rounds_in_trainer"] = float(self._warm_rounds)  # warm start: generated here while the worker started
        if self._handoff.worker_ready():  # seconds from the (last) worker's start to its being ready to generate
            m["async/worker_startup_s"] = self._handoff.ready_at() - self._started_at
        m["async/publish_s"] = getattr(self, "_publish_s", 0.0)  # the last weight publish (trainer side)
        if rollout.sampler_versions is not None:
            # in-flight updates: how many weight versions sampled this round, and the share of tokens sampled by
            # weights newer than the round's first
            seen = {v for row in rollout.sampler_versions for v in row}
            n_tok = sum(len(row) for row in rollout.sampler_versions)
            m["async/round_versions"] = float(len(seen) or 1)
            m["async/inflight_token_fraction"] = (sum(v > item.version for row in rollout.sampler_versions
                                                      for v in row) / max(n_tok, 1))
        return rollout

    # ------------------------------------------------------------------------------- lifecycle

    def restore_checkpoint_state(self, folder: Path | None) -> None:
        super().restore_checkpoint_state(folder)
        self._next_round = 0
        if folder is not None and (folder / STATE_FILE).exists():
            state = json.loads((folder / STATE_FILE).read_text())
            self._next_round, self._dropped = state["next_round"], state["dropped"]

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs):
        try:
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        finally:
            self.stop_worker()


def _not_importable_in_worker(obj: Any) -> str | None:
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


class _InWorker:
    """The trainer process's stand-in backend: generation happens in the rollout worker (which owns the real one)."""

    def sync_weights(self, model) -> None:
        pass

    def generate(self, *a, **k):
        raise RuntimeError("AsyncGRPOTrainer generates in its rollout worker; the trainer process has no backend.")


class _AsyncStateCallback(TrainerCallback):
    """Publishes weights to the worker after optimizer steps."""

    def __init__(self, trainer: AsyncGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.sync_every == 0:
            started = time.perf_counter()
            self.trainer.publish_weights()
            self.trainer._publish_s = time.perf_counter() - started
