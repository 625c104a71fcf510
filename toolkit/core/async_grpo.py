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
(tests/trainers/test_async_grpo.py checks it); with k > 0 generation of round r+1..r+k overlaps training on
round r. Weights reach the worker through shared memory (no copy through a pipe); the worker
loads them between rounds, and with `inflight_weight_updates` also between decode steps of the round
in progress (PipelineRL; each token then records the version that sampled it).

Robustness: the trainer notices a dead, frozen or stuck worker within `heartbeat_timeout` (liveness comes
from the worker's main loop; toolkit.core.worker_handle), then restarts it (`worker_restarts`) or saves a
checkpoint and stops with the worker's traceback. Nothing waits forever. The worker's prompt position is
part of the checkpoint, so a resumed run continues with the right round. Prompt order, generation seeds and
round numbering are GRPOTrainer's (round r = step r); reward functions run in the worker and must be
importable. The process plumbing: toolkit.core.rollout_worker (the worker) and worker_handle (its handle).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from .checkpoint import write_atomic
from .distributed import any_rank, env_world_size, refuse_sharding
from .errors import ConfigError, TrainingHealthError
from .generation import Completion
from .async_grpo_config import AsyncGRPOConfig
from .grpo import GRPOTrainer, Rollout, _accepts_keyword
from .models import DEFAULT_MODEL, unwrap_model
from .rollout import RoundSampler, generate_and_score, generation_seed
from .rollout_worker import (
    ADAPTER_PREFIX,
    BASE_PREFIX,
    EpisodeSpec,
    ScoredRound,
    WorkerSpec,
    choose_worker_device,
)
from .worker_handle import InWorkerBackend, WorkerHandle, check_sendable, environment_for_worker

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer"]

logger = logging.getLogger(__name__)
_UNDECIDED = object()


def _engine_dtype(name: Any) -> torch.dtype:
    """The worker engine's dtype as torch's (generation_backend_kwargs.dtype: a name or a torch.dtype; "auto" and
    anything unknown: float32, the weights' own here)."""
    if isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32

STATE_FILE = "async_grpo_state.json"


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPO with generation in a separate worker process; see the module docstring and docs/async_grpo.md.

    The worker process is `self.worker` (a `WorkerHandle`: process, shared weights, queues, liveness); this class
    keeps the staleness gate, the warm start, restarts and the metrics."""
    supports_vision = True  # prompts with images: the worker gets each row's images and samples with them

    supports_environments = True  # multi-turn episodes: the worker builds the environments (docs/agents.md)

    _tag_names = ["toolkit", "grpo", "async-grpo"]  # noqa: RUF012

    def sequence_parallel_refusal(self) -> str | None:
        return ("async GRPO's rollout workers generate per rank; sequence parallelism is not built for them yet "
                "(use GRPOTrainer, which supports it).")

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
        eval_dataset: Any = None,
    ):
        args = args if args is not None else AsyncGRPOConfig()
        funcs = self._check_worker_arguments(args, reward_funcs, environment)
        # what the worker process gets to build the environments, checked before any model loads
        self._worker_env_factory = environment_for_worker(self._environment_factory(environment, args),
                                                          args.environment)
        callbacks = list(callbacks or []) + [_AsyncStateCallback(self)]
        super().__init__(model, funcs, args, train_dataset=train_dataset, processing_class=processing_class,
                         peft_config=peft_config, generation_backend=InWorkerBackend(), callbacks=callbacks,
                         optimizers=optimizers, model_init_kwargs=model_init_kwargs, ref_model=ref_model,
                         environment=environment, eval_dataset=eval_dataset)
        if self.args.trainer_threads:
            torch.set_num_threads(self.args.trainer_threads)
        on_gpu = torch.cuda.is_available() and not args.use_cpu
        self.worker_device = choose_worker_device(
            args.worker_device, cuda=on_gpu, gpus=torch.cuda.device_count() if on_gpu else 0,
            trainer_index=self.accelerator.local_process_index,
            local_processes=int(os.environ.get("LOCAL_WORLD_SIZE", self.accelerator.num_processes)),
            trainer_device=f"cuda:{self.args.device.index or 0}" if on_gpu else None)
        if self.worker_device != "cpu" and args.generation_backend == "vllm":
            beside = self.worker_device == f"cuda:{self.args.device.index or 0}"
            logger.info("async GRPO: the rollout worker's vLLM engine runs on %s%s.", self.worker_device,
                        " beside the trainer (its share of the card from the memory model)" if beside else
                        ", a GPU of its own")
        elif self.worker_device != "cpu" and args.generation_backend == "transformers":
            beside = self.worker_device == f"cuda:{self.args.device.index or 0}"
            logger.info("async GRPO: the rollout worker decodes on %s%s.", self.worker_device,
                        " beside the trainer (its own copy of the weights and its KV cache on the same card; "
                        "worker_device = 'cpu' or another GPU to keep the trainer's memory)" if beside else
                        ", a GPU of its own")
        self.worker = WorkerHandle(threads=args.worker_threads, queue_size=args.queue_size,
                                   start_timeout=args.worker_start_timeout, heartbeat_timeout=args.heartbeat_timeout)
        # the worker's prompt order (GRPO's), for the rounds generated here during a warm start
        self._rounds = RoundSampler(len(self.rows), self.prompts_per_round, 1, seed=args.seed,
                                    num_processes=self.accelerator.num_processes)
        # warm_start resolved (the config is not written to): on by default with the transformers backend only
        self.warm_start = (self.args.warm_start if self.args.warm_start is not None
                           else self.args.generation_backend == "transformers")
        self._next_round = 0
        self._dropped = 0            # rounds dropped as too stale
        self._restarts = 0
        self._last_get: float | None = None
        self._warm = False           # generating rounds here until the worker is ready (warm_start)
        self._warm_rounds = 0        # rounds generated in this process
        self._warm_copy = None       # the warm start's cast generation copy (generation_backend_kwargs.dtype)
        self._lora_plan: Any = _UNDECIDED  # _worker_lora_rank's answer, once decided
        self._backend_kwargs: dict[str, Any] | None = None  # _worker_backend_kwargs, computed once
        self._superseded = 0         # worker rounds discarded because this process had generated them (Handoff)
        self._failures_done: dict[str, int] = {}  # reward failures counted by earlier workers
        self._failures_now: dict[str, int] = {}   # the running worker's running totals
        self._staleness: Counter = Counter()
        self._publish_s = 0.0        # the last weight publish's seconds (trainer side)

    @staticmethod
    def _check_worker_arguments(args: Any, reward_funcs: Any, environment: Any) -> list[Any]:
        """What the worker process cannot run, refused before any model loads; returns the reward functions."""
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
        funcs = [reward_funcs] if callable(reward_funcs) or isinstance(reward_funcs, str) else list(reward_funcs)
        check_sendable(funcs, environment)
        if environment is not None and args.inflight_weight_updates:
            raise ConfigError("inflight_weight_updates: not with multi-turn episodes (environment): an episode's "
                              "turns are separate generate calls whose per-token versions are not carried yet; "
                              "set it False (weights are then loaded between rounds).")
        return funcs

    def _check_seams(self) -> None:
        # The worker process runs GRPO's own prompt order and scoring; a subclass's override of these seams
        # would silently not run there, so it is refused.
        for seam in ("build_prompt_sampler", "compute_rewards"):
            if getattr(type(self), seam) is not getattr(GRPOTrainer, seam):
                raise ConfigError(f"{type(self).__name__}.{seam}: async GRPO generates and scores in its worker "
                                  f"process, which runs GRPO's own {seam}; the override would not run there. Use "
                                  "GRPOTrainer for a custom sampler or scorer.")

    def prepare_prompts(self, train_dataset: Any, tokenizer: Any, args: Any) -> None:
        super().prepare_prompts(train_dataset, tokenizer, args)
        if self.prompt_images is None:
            return
        # prompts with images, refused before any model loads: what the worker's backend cannot sample with them
        if args.generation_backend != "transformers":
            raise ConfigError(f"generation_backend: '{args.generation_backend}' takes no images yet; the rollout "
                              "worker samples prompts with images with the 'transformers' backend (docs/vision.md).")
        if args.inflight_weight_updates or (args.generation_backend_kwargs or {}).get("static_decode"):
            raise ConfigError("inflight_weight_updates / generation_backend_kwargs.static_decode: not with prompts "
                              "that show images (both re-run prompts without their images); turn them off for a "
                              "vision-language model.")

    def setup_objective(self, args: Any) -> None:
        self._check_seams()  # before any model work is wasted on a subclass the worker cannot run
        super().setup_objective(args)

    # ------------------------------------------------------------------------------- the worker

    def _engine_state(self, *, full: bool = True) -> dict[str, torch.Tensor]:
        """The weights the worker loads: merged PEFT weights in checkpoint naming; or, with adapter-only LoRA sync
        (`_worker_lora_rank`), the adapter's tensors (`lora:` + PEFT's names, in the engine's dtype) and, when
        `full` (a worker's start), the base weights once (`base:` + engine names)."""
        if self._worker_lora_rank() is None:
            from .vllm_backend import engine_weights  # generic: merged PEFT weights in checkpoint naming

            return dict(engine_weights(self.model))
        from .vllm_backend import adapter_files, base_engine_weights

        dtype = _engine_dtype(self._worker_backend_kwargs().get("dtype", "float32"))
        state = {ADAPTER_PREFIX + k: v for k, v in adapter_files(self.model, dtype)[0].items()}
        if full:
            state.update({BASE_PREFIX + k: v for k, v in base_engine_weights(self.model)})
        return state

    def _worker_lora_config(self) -> dict[str, Any] | None:
        """The adapter_config the worker's engine loads each published adapter with (adapter-only sync), or None."""
        if self._worker_lora_rank() is None:
            return None
        from .vllm_backend import adapter_config

        return adapter_config(self.model)

    def _worker_lora_rank(self) -> int | None:
        """The LoRA rank of the worker engine's adapter slot when the worker syncs the adapter alone, else None
        (merged blocks, or no LoRA): vLLM in the worker, a PEFT LoRA model, and `lora_sync` "adapter" (or "auto"
        with the worker's engine on a GPU: on vLLM's CPU engine LoRA generation is slower than the sync saves,
        `vllm_backend.lora_sync_mode`). Decided once; "adapter" on a model that cannot sync that way is refused
        by name, "auto" falls back to merged and says why."""
        if self._lora_plan is not _UNDECIDED:
            return self._lora_plan
        plan = None
        args = self.args
        requested = (args.generation_backend_kwargs or {}).get("lora_sync", "auto")
        if args.generation_backend == "vllm":
            from .vllm_backend import adapter_sync_refusal, engine_lora_rank, lora_sync_mode, peft_lora_rank

            rank = peft_lora_rank(self.model)
            mode = lora_sync_mode(requested, on_gpu=self.worker_device.startswith("cuda"))
            if rank is None and requested == "adapter":
                raise ConfigError("generation_backend_kwargs.lora_sync = 'adapter': the model has no LoRA adapter "
                                  "(pass peft_config, or leave lora_sync unset).")
            if rank is not None and mode == "adapter":
                from .vllm_backend import _VLLM_LORA_RANKS

                slot = engine_lora_rank(min(rank, _VLLM_LORA_RANKS[-1]))  # above vLLM's largest: refused below
                reason = adapter_sync_refusal(self.model, slot)
                if reason is not None and requested == "adapter":
                    raise ConfigError(f"generation_backend_kwargs.lora_sync = 'adapter': {reason}. Set it to 'auto' "
                                      "or 'merged' to send the adapters merged into whole blocks.")
                if reason is not None:
                    logger.warning("async GRPO: the worker's vLLM engine gets merged blocks, not the adapter alone, "
                                   "because %s.", reason)
                else:
                    plan = slot
            if rank is not None:
                logger.info("async GRPO: LoRA weights reach the worker's vLLM engine %s.",
                            "as the adapter alone (the base weights once)" if plan else
                            "merged into whole blocks (lora_sync='adapter' to send the adapter alone)")
        self._lora_plan = plan
        return plan

    def _worker_spec(self) -> WorkerSpec:
        """What the worker process runs: GRPO's rollout settings for this rank, and its own backend."""
        args = self.args
        base = self.model.get_base_model() if hasattr(self.model, "peft_config") else unwrap_model(self.model)
        episodes = None if self.environment_factory is None else EpisodeSpec(
            # the factory itself when it pickles (an `environment=` object, or a registered class or module-level
            # function: then one registered at run time in this process works too); else the worker builds it by
            # name from its own registry (entry-point plugins and built-ins)
            factory=self._worker_env_factory, name=args.environment, kwargs=dict(args.environment_kwargs or {}),
            max_turns=args.max_turns, max_tokens=args.max_episode_tokens, concurrency=args.environment_concurrency,
            step_timeout=args.environment_step_timeout, end_text=self.episode_delta.end_text,
            chat_template_kwargs=args.chat_template_kwargs)
        return WorkerSpec(
            config=base.config, tokenizer=self.processing_class, rows=self.rows, prompt_ids=self.prompt_ids,
            conversational=self.dataset_format.conversational, extra_columns=list(self.dataset_format.extra_columns),
            reward_funcs=self.reward_runner.funcs, reward_timeout=args.reward_timeout,
            reward_max_failures=args.reward_max_consecutive_failures, sampling=self.sampling,
            num_generations=args.num_generations, per_round=self.prompts_per_round, seed=args.seed,
            max_staleness=args.max_staleness, start_timeout=args.worker_start_timeout,
            backend=args.generation_backend, backend_kwargs=self._worker_backend_kwargs(),
            pad_token_id=self.text_tokenizer.pad_token_id, max_batch_size=args.generation_batch_size,
            varlen=self.padding_free, rank=self.accelerator.process_index,
            num_processes=self.accelerator.num_processes, inflight=args.inflight_weight_updates,
            scoring_concurrency=args.scoring_concurrency, rounds_per_generation=args.rounds_per_generation,
            episodes=episodes, device=self.worker_device, lora_config=self._worker_lora_config(),
            # prompts with images: the worker builds the policy's own class (AutoModelForCausalLM cannot build a
            # vision-language model) and samples each prompt with its images, as GRPO's transformers backend does
            prompt_images=self.prompt_images, model_class=type(base) if self.prompt_images is not None else None)

    def _start_worker(self) -> None:
        first_start = self.worker.started_at is None
        # After a restart with several ranks the warm phase is over for good: a rank that re-entered it alone would
        # call a collective (the readiness check) the other ranks do not. One process may warm-start again.
        self._warm = self.warm_start and (first_start or self.accelerator.num_processes == 1)
        # a new worker counts its reward failures from zero: keep the totals of the one before
        self._failures_done = {k: v + self._failures_done.get(k, 0) for k, v in self._failures_now.items()} | {
            k: v for k, v in self._failures_done.items() if k not in self._failures_now}
        self._failures_now = {}
        self.worker.start(self._worker_spec(), self._engine_state(), self.state.global_step, self._next_round)
        logger.info("async GRPO: rollout worker pid %d started at round %d (max_staleness=%d, queue_size=%d, "
                    "warm_start=%s).", self.worker.process.pid, self._next_round, self.args.max_staleness,
                    self.args.queue_size, self._warm)

    def stop_worker(self) -> None:
        self.worker.stop()

    def publish_weights(self) -> None:
        """Copy the current weights into shared memory and bump the version (= the optimizer step)."""
        if self.worker.running:
            self.worker.publish(self._engine_state(full=False), self.state.global_step)

    def evaluation_backend(self):
        """Held-out evaluation generates in this process with the training model (the worker owns the real
        backend and generates rounds)."""
        from .generation import TransformersBackend

        return TransformersBackend(self.model, pad_token_id=self.text_tokenizer.pad_token_id,
                                   max_batch_size=self.args.generation_batch_size, **self._vision_kwargs())

    def _vision_kwargs(self) -> dict[str, Any]:
        """A backend's processor= for prompts with images (vision-language models), else nothing."""
        return {"processor": self.processing_class} if self.prompt_images is not None else {}

    def _warm_backend(self):
        """Warm-start rounds generate here as the worker would: in its dtype (generation_backend_kwargs.dtype).
        Kept while the warm start lasts, so that a cast copy is refreshed from round to round rather than built
        each time; dropped when the worker takes over (the copy costs the weights once more)."""
        from .generation import TransformersBackend

        dtype = ((self.args.generation_backend_kwargs or {}).get("dtype")
                 if self.args.generation_backend == "transformers" else None)
        if dtype is None:
            return self.evaluation_backend()
        if self._warm_copy is None:
            self._warm_copy = TransformersBackend(self.model, pad_token_id=self.text_tokenizer.pad_token_id,
                                                  max_batch_size=self.args.generation_batch_size, dtype=dtype,
                                                  **self._vision_kwargs())
        self._warm_copy.sync_weights(self.model)
        return self._warm_copy

    def _worker_backend_kwargs(self) -> dict[str, Any]:
        """The worker backend's settings (computed once: the GPU defaults log what they chose)."""
        if self._backend_kwargs is None:
            self._backend_kwargs = self._compute_worker_backend_kwargs()
        return dict(self._backend_kwargs)

    def _compute_worker_backend_kwargs(self) -> dict[str, Any]:
        args = self.args
        kwargs = dict(args.generation_backend_kwargs or {})
        if int(kwargs.get("tensor_parallel_size", 1) or 1) > 1:
            raise ConfigError("generation_backend_kwargs.tensor_parallel_size: async GRPO's rollout worker is one "
                              "process on one device, so its engine cannot be tensor-parallel; use "
                              "generation_backend = 'vllm-server' with `toolkit vllm-serve --tensor_parallel_size N`.")
        if args.generation_backend == "vllm":
            base = self.model.get_base_model() if hasattr(self.model, "peft_config") else unwrap_model(self.model)
            kwargs.setdefault("model_path", base.config._name_or_path)
            from .vllm_backend import vllm_context_length

            kwargs.setdefault("max_model_len", vllm_context_length(args))
            kwargs.setdefault("seed", args.seed)
            # the worker generates round after round while the trainer trains: nothing to give back in between
            kwargs.setdefault("sleep_mode", False)
            rank = self._worker_lora_rank()
            if rank is not None:  # an engine with LoRA support; the worker loads the adapter itself
                kwargs.update(max_lora_rank=rank, lora_sync="adapter")
            else:
                kwargs.pop("lora_sync", None)  # merged weights: the worker's engine loads them whole
            if self.worker_device.startswith("cuda"):
                from .vllm_backend import gpu_engine_kwargs

                if self.worker_device != f"cuda:{self.args.device.index or 0}":
                    kwargs.setdefault("gpu_memory_utilization", 0.9)  # a GPU of its own
                # dtype and CUDA graphs as a colocated engine; beside the trainer, the share the memory model leaves
                # it with the trainer's whole step resident (no sleep: both run at once)
                kwargs = gpu_engine_kwargs(self.model, args, kwargs)
        return kwargs

    # ------------------------------------------------------------------------------- the staleness gate

    def _next_scored_round(self) -> ScoredRound:
        if not self.worker.running:
            self._start_worker()
        if self._warm:
            # every rank generates here until every rank's worker is ready (the staleness check below is collective)
            if any_rank(self.accelerator, not self.worker.ready()):
                problem = self.worker.failure()
                if problem is not None:
                    self._handle_failure(problem)  # a restart starts a new warm start; otherwise this raises
                return self._round_here()
            self._warm = False
            self._warm_copy = None  # its cast copy, if any, is not needed any more
            logger.info("async GRPO: the rollout worker was ready %.1f s after its start; it generates from round %d "
                        "on (%d rounds were generated in the trainer meanwhile).", self.worker.startup_s(),
                        self._next_round, self._warm_rounds)
        started = time.perf_counter()
        while True:
            item = self.worker.get(timeout=0.5)
            if item is None:
                problem = self.worker.failure()
                if problem is not None:
                    self._handle_failure(problem)
                    started = time.perf_counter()
                continue
            if item.round < self._next_round:
                self._superseded += 1
                continue  # the handoff crossed: this round was generated here (Handoff); the worker's copy is spare
            staleness = self.state.global_step - item.version
            if any_rank(self.accelerator, staleness > self.args.max_staleness):
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
        self.worker.handoff.claim(r)
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
                                        sampling=self.sampling, n=G, seed=seed, score=self.compute_rewards,
                                        images=([self.prompt_images[i] for i in idx] if self.prompt_images is not None
                                                else None))
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
        self._save_checkpoint(self.model, trial=None)
        path = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)
        raise TrainingHealthError(
            f"async GRPO step {self.state.global_step}: the rollout worker failed and worker_restarts="
            f"{self.args.worker_restarts} are used up. Checkpoint saved to {path}; resume with "
            f"resume_from_checkpoint=True.\nWorker: {problem}")

    # ------------------------------------------------------------------------------- checkpoints

    def write_checkpoint_state(self, folder: Path) -> None:
        """GRPO's state plus the worker's position, before the checkpoint is marked complete."""
        super().write_checkpoint_state(folder)
        write_atomic(folder / STATE_FILE, json.dumps({"next_round": self._next_round, "dropped": self._dropped}))

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
        rollout.metrics.update(self._async_metrics(item, rollout))
        return rollout

    def _async_metrics(self, item: ScoredRound, rollout: Rollout) -> dict[str, float]:
        """The round's async metrics: staleness, queue, idle time on both sides, restarts, in-flight versions."""
        now = time.perf_counter()
        cycle = now - self._last_get if self._last_get is not None else float("nan")
        self._last_get = now
        staleness = self.state.global_step - item.version
        m = {"async/staleness": float(staleness), "async/staleness_max": float(staleness)}
        for k in range(self.args.max_staleness + 1):
            m[f"async/staleness_hist/{k}"] = float(self._staleness[k])
        m["async/queue_depth"] = self.worker.queue_depth()
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
        startup = self.worker.startup_s()
        if startup is not None:  # seconds from the (last) worker's start to its being ready to generate
            m["async/worker_startup_s"] = startup
        m["async/publish_s"] = self._publish_s  # the last weight publish (trainer side)
        if rollout.sampler_versions is not None:
            # in-flight updates: how many weight versions sampled this round, and the share of tokens sampled by
            # weights newer than the round's first
            seen = {v for row in rollout.sampler_versions for v in row}
            n_tok = sum(len(row) for row in rollout.sampler_versions)
            m["async/round_versions"] = float(len(seen) or 1)
            m["async/inflight_token_fraction"] = (sum(v > item.version for row in rollout.sampler_versions
                                                      for v in row) / max(n_tok, 1))
        return m


class _AsyncStateCallback(TrainerCallback):
    """Publishes weights to the worker after optimizer steps."""

    def __init__(self, trainer: AsyncGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.sync_every == 0:
            started = time.perf_counter()
            self.trainer.publish_weights()
            self.trainer._publish_s = time.perf_counter() - started  # noqa: SLF001 (its own trainer's timer)
