"""The settings of async GRPO (toolkit.core.async_grpo): GRPO's, plus the worker, staleness and liveness ones."""

from __future__ import annotations

__all__ = ["AsyncGRPOConfig"]

from dataclasses import dataclass, field

import torch

from .errors import ConfigError
from .trl_names import accepting_trl_names
from .grpo import GRPOConfig


@accepting_trl_names
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
    worker_device: str | None = field(default=None, metadata={
        "help": "Where the rollout worker decodes (transformers backend): 'cpu', 'cuda:1', ... None: the CPU "
                "without CUDA, a GPU of its own when the node has more GPUs than training processes, else the "
                "trainer's GPU (beside it: the weights once more, and the KV cache)."})
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
        if self.worker_device is not None:
            # checked here: the worker is a separate process, where a bad device would fail only after start-up
            try:
                kind = torch.device(self.worker_device).type
            except (RuntimeError, TypeError):
                kind = None
            if kind not in ("cpu", "cuda"):
                raise ConfigError(f"worker_device: '{self.worker_device}' is not a device the rollout worker can "
                                  "decode on; use 'cpu', 'cuda' or 'cuda:N' (or leave it unset).")
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
