"""Group Relative Policy Optimization (GRPO) with verifiable rewards.

`GRPOTrainer` is a `transformers.Trainer`. One optimizer step, top to bottom:

1. Rollout (once per round of `gradient_accumulation_steps x num_iterations` micro-steps):
   the round's prompts (token ids rendered once, at start-up) go to the generation backend,
   which returns `num_generations` completions per prompt as token ids plus the sampler's
   log-probs. Decoded text is only for rewards and logs.
2. Scoring: every reward function (sync or async) on every completion; failures and timeouts
   exclude rows instead of killing the run; weighted sum; group-relative advantages.
3. Loss on exactly the sampled ids: clipped surrogate (or a registered policy loss), optional
   truncated importance sampling between sampler and trainer log-probs, optional KL (k3) to the
   reference, aggregated by `loss_type`. Zero-variance groups, rows without a reward and (if
   asked) truncated completions are dropped from the loss.

Follows DeepSeekMath (GRPO) with the field's later fixes: DAPO clip-higher and token-level
aggregation (default `loss_type="dapo"`), Dr. GRPO's constant normaliser and no-std advantages
(`loss_type="dr_grpo"`, `scale_rewards="none"`), ScaleRL's prompt-level averaging (`loss_type=
"prompt"`), batch-level advantage scaling and no-positive-resampling (`skip_solved_threshold`).
Departs from TRL: prompts are prefilled once per group (not G times), logits are never
materialised, generation is seeded per step (exact resume), and a run without learning signal
says so.

Public seams for wrappers (override in a subclass): `build_prompt_sampler`, `generate_rollout`,
`compute_rewards`, `compute_advantages`, `compute_token_logps`, `compute_policy_loss`; any object
implementing `GenerationBackend` as `generation_backend`. Plugins add policy losses, advantage
estimators, rewards and generation backends by name (toolkit.core.hookspecs).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from datasets import Dataset
from transformers import PreTrainedModel, Trainer

from .attention import packed_layout, supports_varlen, use_varlen_attention
from .checkpoint import write_atomic
from .data import prompt_rows, tokenize_prompts
from .distributed import any_rank, env_world_size
from .errors import ConfigError, TrainingHealthError
from .trl_names import accepting_trl_names
from .generation import Completion, GenerationBackend, SamplingParams, after_generation
from .console import show_logs
from .lifecycle import TrainerLifecycle
from .models import (
    DEFAULT_MODEL,
    OFFLOADING_HELP,
    SEQUENCE_PARALLEL_HELP,
    apply_cpu_training_defaults,
    disable_dropout,
    is_peft_model,
    log_gpu_defaults,
    load_model,
    load_tokenizer,
    place_frozen,
    prepare_model,
    unwrap_model,
)
from .numerics import SCALE_REWARDS, tokens_to_rows
from .objectives import (
    AdvantageInputs,
    PolicyLossInputs,
    PolicyLossOutput,
    PolicyObjectiveSettings,
    policy_objective,
    resolve_estimator_settings,
    resolve_policy_loss_settings,
    resolve_settings,
)
from .objectives.policy import legacy_policy_loss_inputs, policy_term_of
from .packing import TokenLogps, completion_entropy, completion_token_pass, pack_for_layout
from .sequence_parallel import RepeatBatches, sequence_parallel_loss
from .plugins import registry, resolve_reward
from .rewards import RewardRunner, check_reward_columns, score_completions, weighted_total
from .rollout import RoundSampler, gather_scored, generate_and_score, generation_seed
from .rollout_config import RolloutConfig
from .vision import (
    attach_image_features,
    freeze_vision_tower,
    is_vision_processor,
    pixel_inputs,
    text_tokenizer,
    tokenize_vision_prompts,
    validate_vision,
)

__all__ = ["GRPOConfig", "GRPOTrainer", "GroupRolloutConfig", "ResolvedObjective", "Rollout", "TrainingHealth"]

logger = logging.getLogger(__name__)

# Activation checkpointing is on by default only when a micro-batch may hold more completion tokens than this
# (per_device_train_batch_size x max_completion_length, or x max_episode_tokens for multi-turn episodes, whose tool
# output is context in the forward too), on a CPU and on a GPU alike; see GRPOConfig.__post_init__. Reasoned from
# memory, not tuned: on CPU the main job's 128 x 24 = 3072 cost 1.4 GB more without it on the 135M model; on an
# H200 (bench/results/gpu) 64 x 128 = 8192 peaked at 10.3 GB without it and 2.9 GB with it (TRL's default, 3.0 GB)
# on the same model, at 1.27x the step time with it. The cost grows with the tokens and the model's width.
_CHECKPOINTING_ABOVE_TOKENS = 4096


def _checkpointing_default(args: GRPOConfig, episodes: bool) -> bool:
    """GRPO's default for activation checkpointing, on any device (see GRPOConfig.__post_init__)."""
    per_row = args.max_episode_tokens if episodes else args.max_completion_length
    if not (isinstance(args.per_device_train_batch_size, int) and isinstance(per_row, int)):
        return True  # bad numbers fail in the checks that follow; until then keep the safe default
    return args.per_device_train_batch_size * per_row > _CHECKPOINTING_ABOVE_TOKENS


@dataclass
class GroupRolloutConfig(RolloutConfig):
    """Settings of every trainer built on GRPO's group rollouts (GRPO, async GRPO, the experimental online DPO and
    GKD): `RolloutConfig`'s sampling, backend and reward fields plus the group, the rollout's reuse, multi-turn
    episodes and the training-health warnings. The objective's own fields (its loss, its `beta`) belong to each
    method's config (`GRPOConfig`, ...).

    `per_device_train_batch_size` counts completions per micro-batch and must be a multiple of
    `num_generations`; each optimizer step sees `gradient_accumulation_steps` such micro-batches.
    """

    num_generations: int = field(default=8, metadata={"help": "Completions sampled per prompt (the group size G)."})
    num_iterations: int = field(default=1, metadata={"help": "Optimizer steps per rollout (mu in the GRPO paper); "
                                                             ">1 stores old log-probs."})
    skip_steps_without_signal: bool = field(default=True, metadata={
        "help": "An optimizer step whose rollout has no row in the loss on any rank (every group tied under "
                "zero_variance_filter, no rewards) leaves the weights and the optimizer state as they are. With "
                "False it runs on zero gradients, and Adam's momentum keeps moving the weights along the last "
                "informative step for about 1/(1-beta1) = 10 more steps (docs/grpo.md, 'Steps without signal'). "
                "Never skipped under DeepSpeed or with a GradScaler (fp16), which need gradients every step."})
    skip_solved_threshold: float | None = field(default=None, metadata={
        "help": "Stop resampling prompts whose pass rate reached this (e.g. 0.9); see solved_reward."})
    solved_reward: float = field(default=1.0, metadata={"help": "A completion counts as passing at this total reward."})

    environment: str | None = field(default=None, metadata={
        "help": "Multi-turn episodes instead of single completions: a registered environment by name (calculator | "
                "a plugin's; `toolkit plugins` lists them). Each of the G samples of a prompt is then an episode of "
                "up to max_turns model turns, token-exact, the environment's tokens masked out of the loss; its "
                "reward is the episode's (reward_funcs stay empty). docs/agents.md."})
    environment_kwargs: dict | None = field(default=None, metadata={
        "help": "Settings passed to the environment's factory (e.g. {max_tool_turns = 2} for calculator)."})
    max_turns: int = field(default=4, metadata={"help": "Model turns per episode at most (with environment). The "
                                                          "episode's prompt is the environment's reset() messages; "
                                                          "max_prompt_length does not apply to it."})
    max_episode_tokens: int = field(default=512, metadata={
        "help": "Ids per episode after the prompt (sampled + environment) before no new turn starts; each turn "
                "samples at most max_completion_length."})
    environment_concurrency: int = field(default=32, metadata={
        "help": "Environments answering at once (threads): slow tools and sandboxes overlap each other."})
    environment_step_timeout: float = field(default=300.0, metadata={
        "help": "Seconds an environment's reset/step may take; past it the episode ends without a reward "
                "(finish env_error) and the run goes on."})
    environment_max_consecutive_failures: int = field(default=3, metadata={
        "help": "Stop the run (naming the environment and its last error) when every episode of this many steps in a "
                "row failed (its reset or step raised, timed out or returned something that is not an answer), as "
                "reward_max_consecutive_failures does for reward functions."})
    unfinished_episode_reward: float | None = field(default=0.0, metadata={
        "help": "Reward of an episode that ran out of turns or tokens (or had a turn cut at max_completion_length) "
                "before the environment gave any reward: 0 counts it as failed, as held-out evaluation does. "
                "None leaves such episodes out of the loss."})

    no_signal_warn_steps: int = field(default=3, metadata={
        "help": "Warn when every group had equal rewards below solved_reward for this many steps in a row."})
    warn_every: int = field(default=10, metadata={"help": "Repeat a warning of the same cause at most every N steps."})
    entropy_floor: float = field(default=0.05, metadata={
        "help": "Entropy below this is named in the falling-reward warning (low entropy alone is expected for "
                "tasks with one right answer)."})
    reward_drop_warn: float = field(default=0.10, metadata={
        "help": "Warn when the 10-step average reward falls this far below its best (learning going backwards)."})
    kl_ceiling: float = field(default=1.0, metadata={"help": "Warn when a logged mean KL to the reference ('kl') "
                                                             "exceeds this."})
    freeze_vision_tower: bool = field(default=True, metadata={
        "help": "Vision-language models: keep the vision encoder's weights fixed (LoRA targets stay in the "
                "language model too)."})
    train_projector: bool = field(default=True, metadata={
        "help": "Vision-language models: train the projector into the language model even with the tower frozen."})
    activation_offloading: bool | None = field(default=None, metadata={"help": OFFLOADING_HELP})
    sequence_parallel_size: int = field(default=1, metadata={"help": SEQUENCE_PARALLEL_HELP})

    def __post_init__(self):
        # GRPO trains on completions packed behind their shared prompt, a few hundred to a few thousand tokens a
        # micro-batch; there the second forward of activation checkpointing costs more time than the memory is
        # worth. Measured on SmolLM2-135M, 2 CPU cores, 2 runs each (training time of steps 2-4, relative to the
        # same run's generation time since the machine's speed drifts): 32 completions x 16 tokens a micro-batch,
        # 16% faster without it at +0.1-0.2 GB peak RSS; 128 x 24 (the main job's GRPO stage), 8% faster at
        # +1.4 GB (5.0 against 3.5 GB). Above _CHECKPOINTING_ABOVE_TOKENS a micro-batch the memory matters
        # more, and the default stays on; on a GPU too, whose memory is the scarcer (the H200 run in
        # bench/results/gpu: 3.5x TRL's peak without it, equal with it). An environment given to GRPOTrainer as a
        # factory (not named here) is known only there, which resolves the default again for episodes when the
        # user set neither name.
        self._checkpointing_defaulted = (getattr(self, "activation_checkpointing", None) is None
                                         and getattr(self, "gradient_checkpointing", None) is None)
        checkpointing = _checkpointing_default(self, episodes=self.environment is not None)
        apply_cpu_training_defaults(self, cpu_checkpointing=checkpointing, gpu_checkpointing=checkpointing)
        super().__post_init__()
        if self.num_generations < 1:
            raise ConfigError(f"num_generations: must be >= 1, got {self.num_generations}.")
        if self.sequence_parallel_size < 1:
            raise ConfigError(f"sequence_parallel_size: must be >= 1, got {self.sequence_parallel_size}.")
        if self.per_device_train_batch_size % self.num_generations:
            raise ConfigError(
                f"per_device_train_batch_size: counts completions and must be a multiple of num_generations="
                f"{self.num_generations}; got {self.per_device_train_batch_size}. Try "
                f"{self.num_generations * max(1, self.per_device_train_batch_size // self.num_generations)}.")
        if self.num_iterations < 1:
            raise ConfigError(f"num_iterations: must be >= 1, got {self.num_iterations}.")
        if self.num_iterations > 1 and self.save_strategy == "steps" and self.save_steps % self.num_iterations:
            raise ConfigError(
                f"save_steps: with num_iterations={self.num_iterations} a checkpoint must fall on a rollout boundary "
                f"for exact resume; use a multiple of {self.num_iterations} (got {self.save_steps}).")
        if self.skip_solved_threshold is not None and not 0 < self.skip_solved_threshold <= 1:
            raise ConfigError(f"skip_solved_threshold: must be in (0, 1], got {self.skip_solved_threshold}.")
        if self.skip_solved_threshold is not None and env_world_size() > 1:
            # each rank would learn a different solved set and the ranks' prompt orders would drift apart
            raise ConfigError("skip_solved_threshold: not supported with several processes yet (the solved set is "
                              "per rank); leave it None or run one process.")
        if self.environment is not None:
            make = registry().get("environment", self.environment, field="environment")
            try:  # here, not when the trainer is built: a pipeline checks every stage's config before any trains
                inspect.signature(make).bind(**dict(self.environment_kwargs or {}))
            except TypeError as e:
                raise ConfigError(f"environment_kwargs: {e} (environment '{self.environment}' takes "
                                  f"{inspect.signature(make)}).") from None
            self.check_episode_settings()
        elif self.environment_kwargs:
            raise ConfigError("environment_kwargs: set without environment; name the environment (e.g. "
                              "environment = \"calculator\") or remove environment_kwargs.")

    def check_episode_settings(self) -> None:
        """The multi-turn settings; called for `environment` here and by GRPOTrainer for an `environment=` factory."""
        if self.max_turns < 1:
            raise ConfigError(f"max_turns: must be >= 1, got {self.max_turns}.")
        if self.max_episode_tokens < 1:
            raise ConfigError(f"max_episode_tokens: must be >= 1, got {self.max_episode_tokens}.")
        if self.environment_concurrency < 1:
            raise ConfigError(f"environment_concurrency: must be >= 1, got {self.environment_concurrency}.")
        if not self.environment_step_timeout > 0:
            raise ConfigError(f"environment_step_timeout: must be > 0 seconds, got {self.environment_step_timeout}.")
        if self.environment_max_consecutive_failures < 1:
            raise ConfigError(f"environment_max_consecutive_failures: must be >= 1, got "
                              f"{self.environment_max_consecutive_failures}.")


@accepting_trl_names
@dataclass
class GRPOConfig(GroupRolloutConfig):
    """Settings of `GRPOTrainer`: `GroupRolloutConfig`'s fields plus GRPO's objective below (TRL's names)."""

    output_dir: str | None = field(default="outputs/grpo", metadata={"help": "Checkpoints, final model, report."})
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak AdamW learning rate."})

    loss_type: str = field(default="dapo", metadata={
        "help": "grpo (sequence mean) | bnpo (token mean per micro-batch) | dr_grpo (constant normaliser) | "
                "dapo (token mean over the whole step) | prompt (ScaleRL prompt-level mean) | gspo / gspo_token "
                "(GSPO's sequence ratio; use epsilon ~3e-4) | a plugin's loss "
                "(e.g. cispo from plugins/toolkit-cispo); `toolkit plugins` lists them."})
    loss_kwargs: dict | None = field(default=None, metadata={
        "help": "The policy loss's own settings (e.g. {epsilon_max = 5.0} for cispo), checked against its settings "
                "dataclass before any model loads; settings named by a config field (epsilon) are set there."})
    advantage_estimator: str = field(default="grpo", metadata={
        "help": "grpo (group baseline, scaled by scale_rewards) | rloo (leave-one-out) | a registered estimator."})
    advantage_estimator_kwargs: dict | None = field(default=None, metadata={
        "help": "The advantage estimator's own settings (a plugin estimator's), checked like loss_kwargs."})
    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range of the importance ratio."})
    epsilon_high: float | None = field(default=None, metadata={
        "help": "Upper clip range (DAPO clip-higher); default: epsilon."})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient to the reference model (k3 estimator). "
                                                       "0 loads no reference model."})
    disable_dropout: bool = field(default=False, metadata={
        "help": "No dropout in the policy (TRL's name and default): sampler and trainer log-probs then agree for "
                "models trained with dropout."})
    log_completions: bool = field(default=False, metadata={
        "help": "At every logging step, a table of the last rollout's prompts, completions, rewards (each function's "
                "and the total) and advantages: printed, and sent to TensorBoard (text) and trackio (a table) "
                "where reported to (TRL's name). Rank 0's rows."})
    num_completions_to_print: int | None = field(default=None, metadata={
        "help": "Rows of the log_completions table (None: the whole rollout, as TRL)."})
    kl_bias_correction: bool = field(default=True, metadata={
        "help": "Multiply the KL term by the importance ratio pi/pi_old: the completions were sampled from pi_old, "
                "so this makes the k3 estimate (and its gradient) that of KL(pi || ref). TRL's default too."})
    scale_rewards: str = field(default="group", metadata={
        "help": "Advantage scaling: group (the group's std) | batch (the std of the step's raw rewards, TRL's "
                "meaning) | batch_centred (the step's std of group-centred rewards, ScaleRL) | none (Dr. GRPO)."})
    importance_sampling_cap: float | None = field(default=2.0, metadata={
        "help": "Truncated importance sampling between sampler and trainer log-probs: weights min(ratio, cap). "
                "None (with importance_sampling_min None too) turns the correction off."})
    importance_sampling_level: str = field(default="token", metadata={
        "help": "Level of the sampler correction (importance_sampling_cap): token | sequence (one weight per "
                "completion, the product of its token ratios). Not GSPO: that is loss_type='gspo'."})
    importance_sampling_mode: str = field(default="truncate", metadata={
        "help": "truncate (TIS: ratios clamped to [importance_sampling_min, importance_sampling_cap]) | mask (MIS: "
                "tokens, or with importance_sampling_level='sequence' whole completions, whose ratio is outside "
                "that range drop out of the loss). TRL's vllm_importance_sampling_mode = <level>_<mode>."})
    importance_sampling_min: float | None = field(default=None, metadata={
        "help": "Lower bound of the sampler ratio for importance_sampling_mode (None: no lower bound)."})
    off_policy_mask_threshold: float | None = field(default=None, metadata={
        "help": "DeepSeek-V3.2's off-policy sequence mask: completions with a negative advantage whose mean "
                "per-token KL from the sampling policy exceeds this (e.g. 0.5) leave the loss. None: off."})
    zero_variance_filter: bool = field(default=True, metadata={
        "help": "Drop groups whose rewards are all equal from the loss (they carry no signal)."})
    mask_truncated_completions: bool = field(default=False, metadata={
        "help": "Exclude completions that hit max_completion_length without a stop token from the loss."})

    def __post_init__(self):
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        super().__post_init__()
        if self.num_generations < 2:
            raise ConfigError(f"num_generations: must be >= 2 (advantages are relative to the group), got "
                              f"{self.num_generations}.")
        if self.loss_type in ("gspo", "gspo_token") and self.epsilon >= 0.01:
            # a length-normalised sequence ratio moves far less than a token's: PPO's 0.2 would almost never clip
            logger.warning("loss_type=%s with epsilon=%s: GSPO's sequence ratio stays close to 1, so this clip range "
                           "barely binds; the GSPO paper uses epsilon=3e-4, epsilon_high=4e-4.", self.loss_type,
                           self.epsilon)
        if self.scale_rewards not in SCALE_REWARDS:
            raise ConfigError(f"scale_rewards: '{self.scale_rewards}' is not one of {list(SCALE_REWARDS)}.")
        # every loss and estimator setting, checked by the objects' own settings dataclasses before any model loads
        reg = registry()
        resolve_policy_loss_settings(reg.get("policy_loss", self.loss_type, field="loss_type"), self,
                                     name=self.loss_type)
        resolve_estimator_settings(reg.get("advantage_estimator", self.advantage_estimator,
                                           field="advantage_estimator"), self, name=self.advantage_estimator)
        resolve_settings(PolicyObjectiveSettings, self, kwargs=None, kwargs_field="", owner="GRPO")


@dataclass
class Rollout:
    """One round of generations, scored. Rows are prompt-major: row i*G+j is completion j of prompt i."""

    prompt_ids: list[list[int]]          # per row
    completion_ids: list[list[int]]      # per row
    sampler_logps: list[list[float]]     # per row
    rewards: torch.Tensor                # [R] total reward (NaN: none)
    rewards_per_func: torch.Tensor       # [F, R]
    advantages: torch.Tensor             # [R]
    included: torch.Tensor               # [R] bool: the row counts in the loss
    group_ids: torch.Tensor              # [R] global prompt index within the round
    truncated: torch.Tensor              # [R] bool
    old_logps: list[torch.Tensor] | None = None   # per row [L] when num_iterations > 1
    ref_logps: list[torch.Tensor] | None = None   # per row [L] when beta > 0
    metrics: dict[str, float] = field(default_factory=dict)
    # per row [L]: 1 where the policy sampled the id (trained), 0 for an environment's ids (context only);
    # None: every completion id was sampled (single-turn)
    token_masks: list[list[int]] | None = None
    # per row [L]: the policy version (optimizer step) whose weights sampled each id; None: not reported
    sampler_versions: list[list[int]] | None = None
    # [P, 2] long: (chosen row, rejected row) of each preference pair, for a pairwise objective (online DPO; set by
    # its select_rows); every row of a pair is in the loss. None: no pairs.
    pairs: torch.Tensor | None = None
    # per group (prompt of the round): the images its prompt shows, encoded once per forward for all its rows.
    # None: a text model.
    prompt_images: list[list[Any]] | None = None


@dataclass(frozen=True)
class ResolvedObjective:
    """GRPO's objective settings as resolved from the config (GRPOTrainer.resolved_objective)."""

    loss_settings: Any                              # the policy loss's settings dataclass
    objective_settings: PolicyObjectiveSettings     # what policy_objective adds around it (KL, correction, ...)


def _accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn` takes keyword `name` (by name or through **kwargs; a **kwargs wrapper around a function that
    does not take it cannot be told apart)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == name and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
               or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class GRPOTrainer(TrainerLifecycle, Trainer):
    """GRPO on prompt-only (or prompt-completion; the completion is ignored) data with reward functions.

    See the module docstring for the step; docs/grpo.md for every option.

    Trainers built on GRPO's rollouts with another objective (toolkit.experimental's online DPO and GKD) take a
    `GroupRolloutConfig` of their own and override the objective seams, all public: `uses_reference_model`,
    `setup_objective`, `describe_objective`, `compute_advantages`, `select_rows`, `compute_loss` (reading
    `forward_tokens`, `record_metric`, `health`); docs/grpo.md, "Building on GRPO's rollouts".
    """

    _tag_names = ["toolkit", "grpo"]
    supports_vision = True  # rows with images (docs/vision.md); a subclass that cannot take them sets False
    trainer_kind = "grpo"
    #: False for an objective that reads no reward (GKD): the run may then have no reward functions.
    needs_rewards = True
    #: False for a trainer whose rollouts are not GRPO's episodes (online DPO, GKD): `environment` is refused.
    supports_environments = True

    def __init__(
        self,
        model: str | PreTrainedModel = DEFAULT_MODEL,
        reward_funcs: Sequence[str | Callable[..., Any]] | str | Callable[..., Any] = (),
        args: GroupRolloutConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        generation_backend: GenerationBackend | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        model_init_kwargs: dict | None = None,
        ref_model: PreTrainedModel | None = None,
        environment: Callable[[], Any] | None = None,
        eval_dataset: Any = None,
    ):
        show_logs()  # the start-up summary below is seen in a notebook too (console.show_logs)
        args = args if args is not None else GRPOConfig()
        if not isinstance(args, GroupRolloutConfig):
            raise ConfigError(f"args: {type(self).__name__} needs a GRPOConfig, got {type(args).__name__}.")
        if train_dataset is None:
            raise ConfigError(f"train_dataset: {type(self).__name__} needs prompts (Dataset, list of dicts or .jsonl "
                              "path).")
        self._setup_environment(environment, args)
        self._setup_rewards(reward_funcs, args)

        # 1. Data, before any model work.
        tokenizer = processing_class if processing_class is not None else load_tokenizer(model)
        self.vision = is_vision_processor(tokenizer)  # an AutoProcessor: prompts may show images
        self.text_tokenizer = text_tokenizer(tokenizer)  # pad/eos ids, decoding
        if self.text_tokenizer.pad_token_id is None:
            self.text_tokenizer.pad_token = self.text_tokenizer.eos_token
        if self.vision and not type(self).supports_vision:
            raise ConfigError(f"processing_class: {type(self).__name__} does not take vision-language models yet; "
                              "GRPOTrainer, AsyncGRPOTrainer and the experimental OnlineDPOTrainer do.")
        if self.vision and generation_backend is None and args.generation_backend not in ("transformers", "vllm"):
            raise ConfigError(f"generation_backend: '{args.generation_backend}' takes no images yet; prompts with "
                              "images are sampled by the 'transformers' backend, or by 'vllm' (the colocated engine) "
                              "for the architectures its build can import (docs/vision.md).")
        if self.vision and (environment is not None or args.environment is not None):
            raise ConfigError("environment: multi-turn episodes are not supported for vision-language models yet; "
                              "train single-turn (docs/vision.md).")
        self.prepare_prompts(train_dataset, tokenizer, args)
        self.eval_rows: list[dict[str, Any]] | None = None
        self.eval_prompt_ids: list[list[int]] | None = None
        self.eval_images: list[list[Any]] | None = None  # per held-out prompt, vision-language models only
        if eval_dataset is None and str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no":
            raise ConfigError(f"eval_strategy: '{getattr(args.eval_strategy, 'value', args.eval_strategy)}' needs "
                              "held-out prompts: pass eval_dataset=... to the trainer, or set eval_strategy='no' (on "
                              "the command line held-out evaluation is eval_dataset with eval_every and "
                              "report_accuracy).")
        if eval_dataset is not None:  # TRL's evaluation: sampled completions of held-out prompts, scored
            if self.environment_factory is not None:
                raise ConfigError("eval_dataset: evaluation of multi-turn episodes is not supported yet; drop "
                                  "eval_dataset (held-out accuracy of episodes: docs/agents.md).")
            self.eval_rows, self.eval_format = prompt_rows(eval_dataset, tokenizer, trainer="GRPO")
            check_reward_columns(self.reward_runner.funcs, self.reward_runner.names,
                                 ["prompt", *self.eval_format.extra_columns], where="eval_dataset")
            if args.metric_for_best_model in ("loss", "eval_loss"):  # transformers' default with a best-model setting
                raise ConfigError("metric_for_best_model: GRPO's evaluation logs eval_reward, not eval_loss; set "
                                  "metric_for_best_model = 'reward' and greater_is_better = True (needed by "
                                  "load_best_model_at_end or reduce_lr_on_plateau).")
            # held-out prompts with images: checked like the training rows (a DataError names the eval row), decoded
            # once, and sampled with their images in context
            eval_images = validate_vision(self.eval_rows, self.eval_format, tokenizer, trainer="GRPO",
                                          where="eval_dataset")
            self.eval_images = eval_images if self.vision else None
            if self.eval_images is not None:
                self.eval_prompt_ids, _ = tokenize_vision_prompts(self.eval_rows, eval_images, tokenizer,
                                                                  max_prompt_length=args.max_prompt_length,
                                                                  chat_template_kwargs=args.chat_template_kwargs,
                                                                  where="eval_dataset")
            else:
                self.eval_prompt_ids, _ = tokenize_prompts(self.eval_rows, tokenizer,
                                                           max_prompt_length=args.max_prompt_length,
                                                           chat_template_kwargs=args.chat_template_kwargs)
        check_reward_columns(self.reward_runner.funcs, self.reward_runner.names,
                             ["prompt", *self.dataset_format.extra_columns], where="train_dataset")
        prompts_per_micro = args.per_device_train_batch_size // args.num_generations
        self.prompts_per_round = prompts_per_micro * args.gradient_accumulation_steps
        if len(self.rows) < self.prompts_per_round:
            raise ConfigError(f"train_dataset: {len(self.rows)} prompts, fewer than one step needs "
                              f"({self.prompts_per_round} = per_device_train_batch_size / num_generations x "
                              "gradient_accumulation_steps).")

        # 2. Models, the objective, the generation backend.
        model = self._load_models(model, args, peft_config, model_init_kwargs, ref_model)
        if args.sequence_parallel_size > 1 and self.prompts_per_round % args.sequence_parallel_size:
            logger.warning("sequence_parallel_size=%d: a round's %d prompts do not divide over the group, so some of "
                           "its ranks generate fewer prompts (or none) and wait for the others; a multiple of %d "
                           "prompts per round shares generation evenly.", args.sequence_parallel_size,
                           self.prompts_per_round, args.sequence_parallel_size)
        self.setup_sequence_parallel(args, [model, self.ref_model], refuse=self.sequence_parallel_refusal(),
                                     split_seams=(GRPOTrainer, ("compute_loss", "compute_token_logps",
                                                                "forward_tokens")))
        self.sampling = args.sampling_params(self.text_tokenizer.eos_token_id)
        self.setup_objective(args)
        self.episode_delta = self._episode_delta(tokenizer, args) if self.environment_factory is not None else None
        self.generation_backend = generation_backend if generation_backend is not None else registry().get(
            "generation_backend", args.generation_backend, field="generation_backend")(model, tokenizer, args)
        batch, groups = args.per_device_train_batch_size, args.num_generations
        episodes = self.environment_factory is not None
        if episodes:  # the episode rule (_setup_environment) decided for these micro-batches: it stays
            args._checkpointing_by_memory = False
        # a round's completions decode together, in chunks of at most generation_batch_size rows
        round_rows = min(batch * args.gradient_accumulation_steps, args.generation_batch_size)
        log_gpu_defaults(args, model, "grpo", batch_size=batch,
                         num_generations=groups if batch % groups == 0 or groups % batch == 0 else batch,
                         prompt_len=args.max_prompt_length or 512,
                         completion_len=args.max_episode_tokens if episodes else args.max_completion_length,
                         reference_model=self.reads_reference, generation_rows=max(round_rows, batch))
        logger.info("%s; %d prompts x %d completions per step; rewards %s with weights %s.",
                    self.describe_objective(args), self.prompts_per_round, args.num_generations, self.reward_names,
                    self.reward_weights.tolist())

        super().__init__(model=model, args=args, data_collator=_index_collator,
                         train_dataset=Dataset.from_list([{"row_index": i} for i in range(len(self.rows))]),
                         eval_dataset=(Dataset.from_list([{"row_index": i} for i in range(len(self.eval_rows))])
                                       if self.eval_rows is not None else None),
                         processing_class=tokenizer, callbacks=callbacks, optimizers=optimizers)
        if self.ref_model is not None:
            # Trainer places only the policy; the frozen copy was made before that, on the CPU
            place_frozen(self.ref_model, self.args.device)
        self.loss_is_scaled_for_ga = True
        self.solved: set[int] = set()
        self._micro = 0
        self._skip_update = False
        self._rows_in_loss_all_ranks = 0  # set by _split, over all ranks
        self._rollout: Rollout | None = None
        self._rollout_step = 0  # the optimizer step at which the current rollout was built (pi_old's version)
        self._micro_batches: list[dict[str, Any]] = []
        self._reward_failures: dict[str, int] = {}  # set by compute_rewards; build_rollout may be called without it
        self.health = TrainingHealth(args)

    def _setup_environment(self, environment: Callable[[], Any] | None, args: GroupRolloutConfig) -> None:
        """Multi-turn episodes: the environment factory (None: single completions), checked before any model."""
        if (environment is not None or args.environment is not None) and not self.supports_environments:
            raise ConfigError(f"environment: {type(self).__name__} does not run multi-turn episodes yet; use "
                              "GRPOTrainer (docs/agents.md).")
        self.environment_factory = self._environment_factory(environment, args)
        if self.environment_factory is None:
            return
        args.check_episode_settings()
        if (environment is not None and getattr(args, "_checkpointing_defaulted", False)
                and _checkpointing_default(args, episodes=True)):
            # The config resolved its default for single completions; these micro-batches hold episodes.
            args.activation_checkpointing = args.gradient_checkpointing = True
            logger.info("Activation checkpointing on: a micro-batch may hold %d x %d episode tokens (more than "
                        "%d); set activation_checkpointing=False to trade memory for speed.",
                        args.per_device_train_batch_size, args.max_episode_tokens, _CHECKPOINTING_ABOVE_TOKENS)

    def _setup_rewards(self, reward_funcs: Any, args: GroupRolloutConfig) -> None:
        """The reward functions by name or callable, run under their timeouts, and their weights."""
        if callable(reward_funcs) or isinstance(reward_funcs, str):
            reward_funcs = [reward_funcs]
        if self.environment_factory is not None and list(reward_funcs):
            raise ConfigError("reward_funcs: with an environment the episode's reward is the environment's (its "
                              "step() returns it); give no reward functions, or score the final answer inside the "
                              "environment.")
        self.reward_runner = RewardRunner([resolve_reward(f) for f in reward_funcs], timeout=args.reward_timeout,
                                          max_consecutive_failures=args.reward_max_consecutive_failures,
                                          allow_empty=not self.needs_rewards or self.environment_factory is not None)
        weights = args.reward_weights or [1.0] * len(self.reward_names)
        if len(weights) != len(self.reward_names):
            raise ConfigError(f"reward_weights: {len(weights)} weights for {len(self.reward_names)} reward "
                              f"functions ({', '.join(self.reward_names)}); give one weight per function.")
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

    def _load_models(self, model: Any, args: GroupRolloutConfig, peft_config: Any, model_init_kwargs: dict | None,
                     ref_model: Any) -> Any:
        """The policy (loaded, PEFT applied), the frozen reference where the objective reads one, attention."""
        init_kwargs = {**(args.model_init_kwargs or {}), **(model_init_kwargs or {})}
        model = load_model(model, dtype=init_kwargs.pop("dtype", init_kwargs.pop("torch_dtype", args.model_dtype)),
                           **init_kwargs)
        if getattr(args, "disable_dropout", False):
            disable_dropout(model)
        self.ref_model = None
        if self.vision:
            peft_config = freeze_vision_tower(model, peft_config, freeze=args.freeze_vision_tower,
                                              train_projector=args.train_projector)
        model = prepare_model(model, peft_config)  # a wrapper's PeftModel is used as given
        self.reads_reference = self.uses_reference_model(args)
        if self.reads_reference and not (is_peft_model(model) and ref_model is None):
            # With PEFT the reference is the base model with adapters disabled: no second copy.
            self.ref_model = ref_model if ref_model is not None else copy.deepcopy(model)
            self.ref_model.eval().requires_grad_(False)
        base = unwrap_model(model)
        # rows with images are padded: a packed row would need each prompt's image positions (M-RoPE for Qwen2-VL)
        self.padding_free = supports_varlen(base) and not self.vision
        if self.padding_free:
            use_varlen_attention(base)
            if self.ref_model is not None:
                use_varlen_attention(self.ref_model)
        # The shared-prompt layout only where the kernel can express it (toolkit_varlen); flash-attention
        # gets prompt copies it can delimit from position_ids (attention.packed_layout).
        self.packed_layout = packed_layout(base, self.ref_model) if self.padding_free else "padded"
        return model

    def sequence_parallel_refusal(self) -> str | None:
        """Why this trainer cannot split its rows over a sequence-parallel group, or None."""
        if self.vision:
            return "splits packed rows; vision-language rollouts are padded."
        if self.packed_layout == "padded":
            return "splits packed rows, and this model's attention cannot run them (use attn_implementation='sdpa')."
        if self.environment_factory is not None:
            return "multi-turn episodes are not split over a group yet."
        return None

    def _score_nothing(self, rows: list[dict[str, Any]], completion_ids: list[list[int]]) -> torch.Tensor:
        """The rewards of an empty share of a round (a rank of a sequence-parallel group without prompts): none,
        and no failures to report. A `compute_rewards` override is not called for it."""
        self._reward_failures = {}
        return torch.zeros((len(self.reward_names), 0))

    def _replica(self) -> tuple[int, int]:
        """(this rank's replica, replicas): the data-parallel view; a sequence-parallel group is one replica."""
        sp = self.sequence_parallel
        if sp is not None:
            return sp.dp_rank, sp.dp_size
        return self.accelerator.process_index, self.accelerator.num_processes

    # ------------------------------------------------------------------------------ the objective

    def uses_reference_model(self, args: GroupRolloutConfig) -> bool:
        """Whether the objective reads reference log-probs: a frozen copy is loaded (or, with PEFT, the base with
        adapters off is used) and each rollout carries `ref_logps`. GRPO: when `beta > 0`."""
        return args.beta > 0

    def setup_objective(self, args: GroupRolloutConfig) -> None:
        """Build the objective: for GRPO the named policy loss and advantage estimator (the objectives room, or a
        plugin's), their settings checked. Called once, after the models are loaded."""
        reg = registry()
        self.policy_loss = reg.get("policy_loss", args.loss_type, field="loss_type")
        self.loss_aggregation = self.policy_loss.aggregation
        self.advantage_estimator = reg.get("advantage_estimator", args.advantage_estimator, field="advantage_estimator")
        self.advantage_settings = resolve_estimator_settings(self.advantage_estimator, args,
                                                             name=args.advantage_estimator)
        self._policy_term = policy_term_of(self, GRPOTrainer)
        self._objective_cache: tuple[Any, ResolvedObjective] | None = None

    def describe_objective(self, args: GroupRolloutConfig) -> str:
        """The start-up log's account of the objective (the effective loss settings)."""
        resolved = self.resolved_objective(args)
        return (f"GRPO loss settings: loss_type={args.loss_type} (aggregation {self.loss_aggregation}, "
                f"{resolved.loss_settings}) beta={args.beta} num_iterations={args.num_iterations} "
                f"scale_rewards={args.scale_rewards} importance_sampling_cap={args.importance_sampling_cap} "
                f"zero_variance_filter={args.zero_variance_filter} "
                f"mask_truncated_completions={args.mask_truncated_completions}; G={args.num_generations}")

    def resolved_objective(self, args: GroupRolloutConfig | None = None) -> ResolvedObjective:
        """The policy loss's settings and `policy_objective`'s, resolved from `args` (default: the trainer's) in this
        one place: once, and again only when a field they read has changed (a callback that schedules epsilon or
        beta)."""
        source = args if args is not None else self.args
        names = [f.name for f in dataclasses.fields(PolicyObjectiveSettings)]
        if dataclasses.is_dataclass(self.policy_loss.settings):
            names += [f.name for f in dataclasses.fields(self.policy_loss.settings)]
        key = (tuple(repr(getattr(source, n, None)) for n in names), repr(getattr(source, "loss_kwargs", None)))
        if self._objective_cache is None or self._objective_cache[0] != key:
            resolved = ResolvedObjective(
                loss_settings=resolve_policy_loss_settings(self.policy_loss, source, name=source.loss_type),
                objective_settings=dataclasses.replace(
                    resolve_settings(PolicyObjectiveSettings, source, kwargs=None, kwargs_field="", owner="GRPO"),
                    aggregation_constant=self._aggregation_constant(source)))
            self._objective_cache = (key, resolved)
        return self._objective_cache[1]

    # Kept as attributes because plugins and wrappers read them (plugins/toolkit-cispo does); they now follow the
    # config (a callback that schedules epsilon sees the new value) instead of freezing at construction.
    @property
    def loss_settings(self) -> Any:
        """The policy loss's settings dataclass, resolved from the current config."""
        return self.resolved_objective().loss_settings

    @property
    def objective_settings(self) -> PolicyObjectiveSettings:
        """`policy_objective`'s settings (KL, correction, aggregation), resolved from the current config."""
        return self.resolved_objective().objective_settings

    def _aggregation_constant(self, args: GRPOConfig) -> int:
        """Dr. GRPO's constant normaliser: the most sampled tokens a sample can hold (an episode's: every turn at
        max_completion_length)."""
        if getattr(self, "environment_factory", None) is not None:
            return args.max_turns * args.max_completion_length
        return args.max_completion_length

    # ------------------------------------------------------------------------------ environments

    @staticmethod
    def _environment_factory(environment: Callable[[], Any] | None, args: GRPOConfig) -> Callable[[], Any] | None:
        """A callable that builds one fresh environment per episode: the `environment` argument, or the registered
        `args.environment` with `args.environment_kwargs`."""
        if environment is not None:
            if not callable(environment):
                raise ConfigError("environment: pass a factory (a class or a function returning a fresh environment "
                                  f"per episode), got {type(environment).__name__}.")
            return environment
        if args.environment is None:
            return None
        make = registry().get("environment", args.environment, field="environment")
        kwargs = dict(args.environment_kwargs or {})
        try:
            inspect.signature(make).bind(**kwargs)
        except TypeError as e:
            raise ConfigError(f"environment_kwargs: {e} (environment '{args.environment}' takes "
                              f"{inspect.signature(make)}).") from None
        # a partial, not a lambda: async GRPO sends the factory to its worker process (picklable when `make` is a
        # class or a module-level function, so an environment registered at run time reaches the worker too)
        return functools.partial(make, **kwargs)

    def _check_environment_failures(self, errors: list[str], episodes: int) -> None:
        """Stop the run when every episode of environment_max_consecutive_failures steps in a row failed: the loss has
        been 0 since, and a broken environment would otherwise train nothing for ever, quietly."""
        # every rank's episodes failed (all ranks decide together: one rank's few episodes must not stop the run)
        all_failed = not any_rank(self.accelerator, len(errors) < episodes)
        self._env_failure_run = getattr(self, "_env_failure_run", 0) + 1 if all_failed else 0
        limit = self.args.environment_max_consecutive_failures
        if self._env_failure_run >= limit:
            factory = self.environment_factory
            name = self.args.environment or getattr(getattr(factory, "func", factory), "__name__", repr(factory))
            raise TrainingHealthError(
                f"environment '{name}': every episode failed (this rank's {episodes}, and every other rank's) in each of "
                f"the last {limit} steps "
                f"(environment_max_consecutive_failures={limit}), so nothing was trained; last error: {errors[-1]}. "
                "Fix the environment (its reset/step must return chat messages / an EnvResponse and not raise).")

    def _episode_delta(self, tokenizer: Any, args: GRPOConfig) -> Any:
        """The template's ids between turns, for this tokenizer, stop token and the environment's tools; checked at
        start-up (a template whose turns do not end with the stop token is refused before training starts)."""
        from .environments import Environment, TemplateDelta

        probe = self.environment_factory()
        if not isinstance(probe, Environment):
            raise ConfigError(f"environment: {type(probe).__name__} has no reset(row) / step(text) methods "
                              "(toolkit.core.environments.Environment).")
        end_text = tokenizer.convert_ids_to_tokens(self.sampling.stop_token_ids[0])
        delta = TemplateDelta(tokenizer, end_text=end_text, tools=getattr(probe, "tools", None),
                              chat_template_kwargs=args.chat_template_kwargs)
        # A turn, one environment answer (at the least a short tool result in the template's tool message) and a
        # second turn must fit max_episode_tokens, or no episode can ever answer after its environment
        answer = None
        for role in ("tool", "user"):  # a template without a tool role answers in user turns
            try:
                answer = len(delta.after_turn([{"role": role, "name": "tool", "content": "x " * 16}]))
                break
            except Exception:  # noqa: BLE001 (a template that refuses the role: try the next)
                continue
        if answer is None:
            return delta
        need = 2 * args.max_completion_length + answer
        if args.max_turns > 1 and args.max_episode_tokens < need:
            raise ConfigError(
                f"max_episode_tokens: {args.max_episode_tokens} cannot hold a turn (max_completion_length="
                f"{args.max_completion_length}), one short environment answer ({answer} tokens with this chat "
                f"template) and a second turn ({args.max_completion_length}); no episode could answer after its "
                f"environment. Raise max_episode_tokens to at least {need}, or lower max_completion_length.")
        return delta

    @property
    def reward_names(self) -> list[str]:
        """The reward columns: the reward functions', or the environment's one."""
        return ["environment"] if self.environment_factory is not None else list(self.reward_runner.names)

    @torch.no_grad()
    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
                 ) -> dict[str, float]:
        """TRL's GRPO evaluation: `num_generations` sampled completions of each held-out prompt (the eval_dataset
        given to the trainer; each rank its share), scored by the reward functions; logged and returned as
        `<prefix>_reward` (the weighted total's mean), `<prefix>_reward_std`, `<prefix>_rewards/<f>/mean` and
        `<prefix>_completions/mean_length`. The same seed at every evaluation, so two evaluations differ by the
        weights only. Held-out greedy accuracy on a task's answers is the command line's `report_accuracy`."""
        if eval_dataset is not None:
            raise ConfigError("evaluate(eval_dataset=...): give the eval_dataset to the trainer when building it "
                              "(its prompts are checked and tokenized once, before any model loads).")
        if self.eval_rows is None:
            raise ConfigError("evaluate: the trainer was built without an eval_dataset; pass GRPOTrainer(..., "
                              "eval_dataset=...) to evaluate (and eval_strategy to do it during training).")
        rank, world = self.accelerator.process_index, self.accelerator.num_processes
        mine = list(range(rank, len(self.eval_rows), world))
        backend = self.evaluation_backend()
        backend.sync_weights(self.model)
        scored = generate_and_score(backend, [self.eval_prompt_ids[i] for i in mine],
                                    [self.eval_rows[i] for i in mine], sampling=self.sampling,
                                    n=self.args.num_generations, score=self._score_held_out,
                                    seed=generation_seed(self.args.seed, 10**9, rank),
                                    images=([self.eval_images[i] for i in mine] if self.eval_images is not None
                                            else None))
        after_generation(backend)
        from accelerate.utils import gather_object

        total = weighted_total(scored.rewards_per_func, self.reward_weights)
        per_func = gather_object([scored.rewards_per_func.T.tolist()]) if world > 1 else [
            scored.rewards_per_func.T.tolist()]
        totals = [x for part in (gather_object([total.tolist()]) if world > 1 else [total.tolist()]) for x in part]
        lengths = [len(c.token_ids) for g in scored.groups for c in g]
        lengths = [x for part in (gather_object([lengths]) if world > 1 else [lengths]) for x in part]
        rows = [r for part in per_func for r in part]
        judged = torch.tensor(totals, dtype=torch.float32)
        judged = judged[~torch.isnan(judged)]
        metrics = {f"{metric_key_prefix}_reward": float(judged.mean()) if len(judged) else float("nan"),
                   f"{metric_key_prefix}_reward_std": float(judged.std()) if len(judged) > 1 else 0.0,
                   f"{metric_key_prefix}_completions/mean_length": sum(lengths) / max(len(lengths), 1)}
        for f, name in enumerate(self.reward_names):
            values = [r[f] for r in rows if not math.isnan(r[f])]
            metrics[f"{metric_key_prefix}_rewards/{name}/mean"] = sum(values) / len(values) if values else float("nan")
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def _score_held_out(self, rows: list[dict[str, Any]], completion_ids: list[list[int]]) -> torch.Tensor:
        """[F, R] rewards of held-out completions, in the eval set's own format, by a runner of their own: a failure
        here neither counts towards the training's reward_max_consecutive_failures nor resets it (NaN rows)."""
        if not hasattr(self, "_eval_runner"):
            runner = self.reward_runner
            self._eval_runner = RewardRunner(list(runner.funcs), timeout=self.args.reward_timeout,
                                             max_consecutive_failures=10**9, allow_empty=True)
        outcome, _ = score_completions(self._eval_runner, self.processing_class, rows, completion_ids,
                                       conversational=self.eval_format.conversational,
                                       extra_columns=self.eval_format.extra_columns)
        return torch.tensor(outcome.rewards, dtype=torch.float32)

    def evaluation_backend(self) -> GenerationBackend:
        """The backend held-out evaluation generates with (async GRPO's trainer process has none of its own)."""
        return self.generation_backend

    def run_episodes(self, rows: Sequence[dict[str, Any]], sampling: SamplingParams, *, seed: int,
                     group_size: int = 1, backend: GenerationBackend | None = None,
                     timings: dict[str, float] | None = None) -> list[Any]:
        """One episode per row with fresh environments (toolkit.core.environments.run_episodes). Rows come in
        groups of `group_size` equal rows: their first turns share one prompt prefill (n=group_size). `timings`
        gets the seconds spent generating and waiting for environments (see run_episodes)."""
        from .environments import fresh_environments, group_sampler, run_episodes
        from .generation import any_rank_if_sharded

        args = self.args
        backend = backend if backend is not None else self.generation_backend
        sample = group_sampler(backend, sampling, seed=seed, n_rows=len(rows), group_size=group_size)
        # several ranks: episodes end at different turns on different ranks. With DDP each rank decodes on its
        # own; a sharded (FSDP2) model all-gathers in every forward, so every rank then runs a turn while any
        # rank has an episode left, and its backend pads the forwards (TransformersBackend; a plugin backend that
        # runs the sharded training model must keep its forwards in step the same way, see GenerationBackend).
        # A vLLM engine shared by tensor-parallel ranks needs the same: every rank of its group asks it each turn.
        if getattr(backend, "decodes_in_lockstep", False):
            def keep_going(flag: bool) -> bool:
                return any_rank(self.accelerator, flag)
        else:
            def keep_going(flag: bool) -> bool:
                return any_rank_if_sharded(flag, self.model)
        return run_episodes(fresh_environments(self.environment_factory, len(rows)), list(rows), sample,
                            self.episode_delta,
                            max_turns=args.max_turns, max_tokens=args.max_episode_tokens,
                            stop_token_ids=sampling.stop_token_ids, concurrency=args.environment_concurrency,
                            step_timeout=args.environment_step_timeout,
                            any_rank=keep_going, timings=timings,
                            answer_reserve=args.max_completion_length)

    @torch.no_grad()
    def generate_episodes(self, row_indices: Sequence[int]) -> Rollout:
        """G episodes per prompt of the round, scored by their environments: a Rollout whose rows are episodes
        (prompt = the rendered starting messages, completion = every id after it, `token_masks` = sampled)."""
        t0 = time.perf_counter()
        self.generation_backend.sync_weights(self.model)
        G = self.args.num_generations
        timings: dict[str, float] = {}
        # a subclass's run_episodes written before `timings` existed is called as before (and logs no waits)
        takes_timings = _accepts_keyword(self.run_episodes, "timings")
        t_episodes = time.perf_counter()
        episodes = self.run_episodes([self.rows[i] for i in row_indices for _ in range(G)], self.sampling,
                                     seed=generation_seed(self.args.seed, self.state.global_step,
                                                          self.accelerator.process_index), group_size=G,
                                     **({"timings": timings} if takes_timings else {}))
        after_generation(self.generation_backend)
        from .environments import environment_wait_metrics

        now = time.perf_counter()
        rollout = self.rollout_from_episodes(row_indices, episodes, now - t0)
        if "environment_s" in timings:
            # over the episodes' time (as the async worker's rounds), not the weight sync before them
            rollout.metrics.update(environment_wait_metrics(timings["environment_s"], now - t_episodes))
        return rollout

    def rollout_from_episodes(self, row_indices: Sequence[int], episodes: Sequence[Any], t_gen: float) -> Rollout:
        """Finished episodes (G per prompt, prompt-major) -> a Rollout (also async GRPO's, from its worker)."""
        from .environments import episode_metrics, episode_reward

        G = self.args.num_generations
        errors = [ep.infos[-1]["env_error"] for ep in episodes if "env_error" in (ep.infos[-1] if ep.infos else {})]
        if errors:
            self.health.warn(self.state.global_step, "env_error", f"an environment failed in {len(errors)} of "
                             f"{len(episodes)} episodes (left out of the loss): {errors[-1]}")
        self._check_environment_failures(errors, len(episodes))
        for k, ep in enumerate(episodes):
            if not ep.prompt_ids:  # its reset failed: a placeholder row (out of the loss) that packs like any other
                ep.prompt_ids = list(self.prompt_ids[row_indices[k // G]])
                ep.ids, ep.mask, ep.logprobs = [self.text_tokenizer.eos_token_id], [0], [0.0]
        groups = [[Completion(list(ep.ids), list(ep.logprobs), "length" if ep.truncated else "stop")
                   for ep in episodes[k * G:(k + 1) * G]] for k in range(len(row_indices))]
        rewards = torch.tensor([[episode_reward(ep, self.args.unfinished_episode_reward) for ep in episodes]],
                               dtype=torch.float32)
        self._reward_failures = {}
        # per row: an environment whose reset() varies (a random start) gives each episode of a group its own prompt
        rollout = self.build_rollout(row_indices, groups, rewards, t_gen, 0.0,
                                     row_prompt_ids=[ep.prompt_ids for ep in episodes],
                                     token_masks=[list(ep.mask) for ep in episodes])
        rollout.metrics.update(episode_metrics(episodes))
        return rollout

    # ------------------------------------------------------------------------------ data plumbing

    def prepare_prompts(self, train_dataset: Any, tokenizer: Any, args: Any) -> None:
        """Validate the prompt rows and render each prompt to token ids once (before any model loads); sets
        `rows`, `dataset_format` and `prompt_ids`. A subclass that needs more of each row (GKD's completions)
        extends it."""
        rows, prompt_fmt = prompt_rows(train_dataset, tokenizer, trainer="GRPO")
        self.rows, self.dataset_format = rows, prompt_fmt
        images = validate_vision(rows, prompt_fmt, tokenizer, trainer="GRPO")  # (refuses images for a text model)
        self.prompt_images = images if is_vision_processor(tokenizer) else None
        if self.prompt_images is not None:
            self.prompt_ids, n_cut = tokenize_vision_prompts(rows, images, tokenizer,
                                                             max_prompt_length=args.max_prompt_length,
                                                             chat_template_kwargs=args.chat_template_kwargs)
        else:
            self.prompt_ids, n_cut = tokenize_prompts(rows, tokenizer, max_prompt_length=args.max_prompt_length,
                                                      chat_template_kwargs=args.chat_template_kwargs)
        logger.info("GRPO data: %s, %d prompts, longest prompt %d tokens%s.", prompt_fmt.describe(), len(rows),
                    max(len(p) for p in self.prompt_ids),
                    f"; {n_cut} prompts cut to max_prompt_length={args.max_prompt_length}" if n_cut else "")
        if n_cut:
            logger.warning("GRPO: %d of %d prompts were longer than max_prompt_length=%s and were cut from the left.",
                           n_cut, len(rows), args.max_prompt_length)

    def build_prompt_sampler(self) -> RoundSampler:
        """The sampler of prompt indices (the wrapper seam for curricula and custom orders).

        Must yield one list of `prompts_per_round` row indices per micro-step, the same list
        `gradient_accumulation_steps x num_iterations` times in a row (a round), deterministically
        for a given epoch (exact resume); see RoundSampler.
        """
        return RoundSampler(
            len(self.rows), self.prompts_per_round, self.args.gradient_accumulation_steps * self.args.num_iterations,
            seed=self.args.seed, num_processes=self._replica()[1], solved=self.solved)

    def get_train_dataloader(self):
        from torch.utils.data import DataLoader

        sampler = self.build_prompt_sampler()
        self._round_sampler = sampler
        flat = _Flat(sampler)
        if self.sequence_parallel is not None:  # the ranks of a group get the same round
            flat = RepeatBatches(flat, self.prompts_per_round, self.sequence_parallel.size)
        loader = DataLoader(self.train_dataset, batch_size=self.prompts_per_round, sampler=flat,
                            collate_fn=self.data_collator, num_workers=0)
        return self.accelerator.prepare(loader)

    # ----------------------------------------------------------------------------------- rollout

    @torch.no_grad()
    def generate_rollout(self, row_indices: Sequence[int]) -> Rollout:
        """Generate G completions for each prompt of the round and score them. Override to change the sampler."""
        if self.environment_factory is not None:
            return self.generate_episodes(row_indices)
        t0 = time.perf_counter()
        self.generation_backend.sync_weights(self.model)
        t_sync = time.perf_counter() - t0
        sp = self.sequence_parallel
        mine = list(row_indices)
        if sp is not None:  # the group shares the round: each rank generates and scores its part, then all gather
            share = math.ceil(len(mine) / sp.size)
            mine = mine[sp.rank * share:(sp.rank + 1) * share]
        # a rank of a group with no prompt this round still steps generation (a sharded model decodes in lockstep)
        # but calls no reward function with nothing to score
        score = self.compute_rewards if mine else self._score_nothing
        scored = generate_and_score(
            self.generation_backend, [self.prompt_ids[i] for i in mine], [self.rows[i] for i in mine],
            sampling=self.sampling, n=self.args.num_generations, score=score,
            seed=generation_seed(self.args.seed, self.state.global_step, self.accelerator.process_index),
            images=[self.prompt_images[i] for i in mine] if self.prompt_images is not None else None)
        after_generation(self.generation_backend)  # a colocated engine gives its GPU memory to the training pass
        if sp is not None:
            scored = gather_scored(scored, sp)
        return self.build_rollout(row_indices, scored.groups, scored.rewards_per_func, t_sync + scored.generation_s,
                                  scored.scoring_s)

    @torch.no_grad()
    def build_rollout(self, row_indices: Sequence[int], groups: list[list[Completion]], rewards_per_func: torch.Tensor,
                      t_gen: float, t_score: float, *, row_prompt_ids: list[list[int]] | None = None,
                      token_masks: list[list[int]] | None = None) -> Rollout:
        """Scored generations -> a Rollout: total reward, advantages, the rows in the loss, old/reference log-probs.
        `row_prompt_ids` (per row; default: each group's rendered dataset prompt) and `token_masks` (per row) come
        from multi-turn episodes (`generate_episodes`)."""
        args, G = self.args, self.args.num_generations
        prompt_ids = [self.prompt_ids[i] for i in row_indices]
        completion_ids = [c.token_ids for g in groups for c in g]
        sampler_logps = [c.logprobs for g in groups for c in g]
        truncated = torch.tensor([c.finish_reason == "length" for g in groups for c in g])
        for name, values in zip(self.reward_names, rewards_per_func):
            if torch.isinf(values).any():
                raise TrainingHealthError(
                    f"GRPO step {self.state.global_step}: reward function '{name}' returned inf for "
                    f"{int(torch.isinf(values).sum())} rows. Return a finite number, or None to exclude a row.")
        total = weighted_total(rewards_per_func, self.reward_weights)
        advantages, zero_std = self._advantages_over_ranks(total)
        group_ids = torch.arange(len(row_indices)).repeat_interleave(G)
        rollout = Rollout(
            prompt_ids=row_prompt_ids if row_prompt_ids is not None else [p for p in prompt_ids for _ in range(G)],
            completion_ids=completion_ids,
            sampler_logps=sampler_logps, rewards=total, rewards_per_func=rewards_per_func, advantages=advantages,
            included=~torch.isnan(total), group_ids=group_ids, truncated=truncated, token_masks=token_masks,
            # the version of the weights that sampled each token: the backend's record (in-flight updates), else
            # this step's (synchronous generation; async GRPO passes its round's version)
            sampler_versions=[c.versions if c.versions is not None else [self.state.global_step] * len(c.token_ids)
                              for g in groups for c in g],
            prompt_images=[self.prompt_images[i] for i in row_indices] if self.prompt_images is not None else None,
        )
        rollout.included = self.select_rows(rollout, zero_std)
        t2 = time.perf_counter()
        if args.num_iterations > 1:
            rollout.old_logps = self._score_rows(self.model, rollout)
        if self.reads_reference:
            rollout.ref_logps = self._score_rows(None, rollout)
        t_extra = time.perf_counter() - t2
        if args.skip_solved_threshold is not None:
            passed = (total >= args.solved_reward).float().view(-1, G).mean(-1)
            for idx, rate in zip(row_indices, passed.tolist()):
                if rate >= args.skip_solved_threshold:
                    self.solved.add(int(idx))
        rollout.metrics = self._rollout_metrics(rollout, zero_std, t_gen, t_score, t_extra)
        return rollout

    def select_rows(self, rollout: Rollout, zero_std: torch.Tensor) -> torch.Tensor:
        """[R] bool: the rows of a scored rollout that count in the loss (`rollout.included` holds the rows with a
        reward). GRPO leaves out groups whose rewards tie (`zero_std`, under zero_variance_filter) and, if asked,
        truncated completions. A pairwise objective (online DPO) also sets `rollout.pairs` here."""
        included = rollout.included.clone()
        if self.args.zero_variance_filter:
            included &= ~zero_std
        if self.args.mask_truncated_completions:
            included &= ~rollout.truncated
        return included

    def compute_rewards(self, rows: list[dict[str, Any]], completion_ids: list[list[int]]) -> torch.Tensor:
        """[F, R] rewards of each function for each row (NaN = excluded). Override to add a reward model."""
        outcome, self._last_texts = score_completions(
            self.reward_runner, self.processing_class, rows, completion_ids,
            conversational=self.dataset_format.conversational, extra_columns=self.dataset_format.extra_columns)
        self._reward_failures = outcome.failures
        return torch.tensor(outcome.rewards, dtype=torch.float32)

    def compute_advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages [R], zero_std [R]) from total rewards by `advantage_estimator`; override or register another.

        With several processes `rewards` holds the whole step, every rank's rows in rank order (groups never
        span ranks); the caller keeps this rank's slice. An override must not rely on per-rank row state.
        """
        return self.advantage_estimator(AdvantageInputs(rewards, self.args.num_generations), self.advantage_settings)

    def _advantages_over_ranks(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`compute_advantages` over the whole step's rewards, all ranks together, then this rank's rows.

        With N processes each rank holds 1/N of the step's groups; batch-level statistics (scale_rewards=
        "batch", or a plugin estimator's) must see all of them, or a 2-process run would optimise something
        else than a 1-process run with twice the batch. Ranks hold equal row counts in rank order (RoundSampler),
        so the gathered vector is the 1-process step's.
        """
        n = self.accelerator.num_processes
        if n == 1:
            return self.compute_advantages(total)
        everything = self.accelerator.gather(total.to(self.accelerator.device)).cpu()
        replica, replicas = self._replica()
        if replicas < n:  # the ranks of a sequence-parallel group hold the same rows: each replica's once
            everything = everything.view(n, -1)[::n // replicas].reshape(-1)
        advantages, zero_std = self.compute_advantages(everything)
        rows = slice(replica * len(total), (replica + 1) * len(total))
        return advantages[rows], zero_std[rows]

    def _score_rows(self, model: torch.nn.Module | None, rollout: Rollout) -> list[torch.Tensor]:
        """Per-row completion log-probs under `model` (None: the reference) without gradients."""
        out: list[torch.Tensor] = []
        B = self.args.per_device_train_batch_size
        for start in range(0, len(rollout.completion_ids), B):
            batch = self._pack(rollout, range(start, min(start + B, len(rollout.completion_ids))))
            # the scorer is on the training device; Trainer moves only the micro-batches it is given
            batch = {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            if model is None and self.ref_model is None:
                ctx = self.accelerator.unwrap_model(self.model).disable_adapter()
                scorer = self.model
            else:
                ctx = contextlib.nullcontext()
                scorer = model if model is not None else self.ref_model
            was = scorer.training
            scorer.eval()
            with ctx:
                flat = self.forward_tokens(scorer, batch).logps
            scorer.train(was)
            out += list(flat.cpu().split(batch["completion_lengths"].tolist()))
        return out

    # ------------------------------------------------------------------------------- batching

    def _pack(self, rollout: Rollout, rows: Sequence[int]) -> dict[str, Any]:
        prompts = [rollout.prompt_ids[r] for r in rows]
        completions = [rollout.completion_ids[r] for r in rows]
        # With toolkit_varlen the G completions of a prompt share one copy of it in the row ((G-1) x prompt
        # tokens less forward and backward work) and the start all prompts share (the chat template's system
        # prompt) is laid out once for the micro-batch: same log-probs and gradients (tests/unit/test_packing.py).
        batch = pack_for_layout(self.packed_layout, prompts, completions, pad_token_id=self.text_tokenizer.pad_token_id)
        if rollout.prompt_images is not None and any(rollout.prompt_images[int(rollout.group_ids[r])] for r in rows):
            # the images of the groups in these rows, once per group: the forward encodes them once and every
            # completion of the group reuses the features (vision.attach_image_features)
            groups = list(dict.fromkeys(int(rollout.group_ids[r]) for r in rows))
            batch["pixels"] = pixel_inputs(self.processing_class, [rollout.prompt_images[g] for g in groups])
            batch["images_per_example"] = [len(rollout.prompt_images[g]) for g in groups]
            batch["row_example"] = [groups.index(int(rollout.group_ids[r])) for r in rows]
        return batch

    def _micro_batch(self, rollout: Rollout, rows: Sequence[int], step_counts: dict[str, float]) -> dict[str, Any]:
        batch = self._pack(rollout, rows)
        lengths = batch["completion_lengths"]
        L = max(int(lengths.max()), 1)
        mask = torch.arange(L)[None, :] < lengths[:, None]
        batch["completion_mask"] = mask
        batch["loss_mask"] = mask & rollout.included[list(rows)][:, None]
        if rollout.token_masks is not None:
            # an episode's environment ids are context, not actions: out of the loss and of the sampler
            # correction (their "sampler log-prob" is a placeholder), so they get exactly zero gradient
            sampled = _pad_rows([torch.tensor(rollout.token_masks[r]) for r in rows], L).bool()
            batch["sampled_mask"] = sampled
            batch["loss_mask"] = batch["loss_mask"] & sampled
        batch["advantages"] = rollout.advantages[list(rows)]
        batch["group_ids"] = rollout.group_ids[list(rows)]
        batch["sampler_logps"] = _pad_rows([torch.tensor(rollout.sampler_logps[r]) for r in rows], L)
        if rollout.sampler_versions is not None:
            batch["sampler_versions"] = _pad_rows([torch.tensor(rollout.sampler_versions[r], dtype=torch.long)
                                                   for r in rows], L).long()
        if rollout.old_logps is not None:
            batch["old_logps"] = _pad_rows([rollout.old_logps[r] for r in rows], L)
        if rollout.ref_logps is not None:
            batch["ref_logps"] = _pad_rows([rollout.ref_logps[r] for r in rows], L)
        if rollout.pairs is not None:
            # each pair's two rows, as positions in this micro-batch (groups, and so pairs, never span two)
            position = {r: i for i, r in enumerate(rows)}
            pairs = [(position[c], position[j]) for c, j in rollout.pairs.tolist() if c in position]
            batch["pairs"] = torch.tensor(pairs, dtype=torch.long).view(-1, 2)
        for k, v in step_counts.items():
            batch[k] = torch.tensor(v)
        return batch

    def _split(self, rollout: Rollout) -> list[dict[str, Any]]:
        B, GA = self.args.per_device_train_batch_size, self.args.gradient_accumulation_steps
        included_tokens = sum((sum(rollout.token_masks[r]) if rollout.token_masks is not None
                               else len(rollout.completion_ids[r]))
                              for r in range(len(rollout.completion_ids)) if rollout.included[r])
        local = torch.tensor([included_tokens, int(rollout.included.sum()),
                              len(set(rollout.group_ids[rollout.included].tolist()))], dtype=torch.float64)
        n = self.accelerator.num_processes
        # The loss divides by the step's counts over all ranks. DDP then averages the ranks' gradients (a
        # division by n), so each rank divides by global / n: the sum over ranks is divided by the global count,
        # exactly as one process holding the whole step would (tests/integration/test_multiprocess.py).
        total = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum").cpu() if n > 1 else local
        if self.sequence_parallel is not None:
            # a group's ranks counted their shared rows P times; each replica divides by global / replicas, and
            # sequence_parallel_loss makes up for DDP's average over the P ranks of each group
            total = total / self.sequence_parallel.size
            n = self.sequence_parallel.dp_size
        self._rows_in_loss_all_ranks = int(total[1])  # read by _update_without_signal
        counts = {name: float(max(float(v), 1.0)) / n
                  for name, v in zip(("step_tokens", "step_sequences", "step_prompts"), total)}
        return [self._micro_batch(rollout, self._trained_rows(rollout, range(k * B, (k + 1) * B)), counts)
                for k in range(GA)]

    @staticmethod
    def _trained_rows(rollout: Rollout, rows: range) -> list[int]:
        """The rows of a micro-batch that go through forward and backward: those in the loss.

        A row out of the loss (its group tied under zero_variance_filter, no reward, a masked truncation) has a
        zero loss mask, so it adds nothing to the gradient, only compute: a third to a half of a step's rows on
        a task the model half-solves. Leaving them out gives the same loss and gradients (the step's counts
        already count only rows in the loss; tests/trainers/test_grpo.py) in less time. The per-token metrics (entropy, kl,
        importance_ratio/*, sampler/*, train_tokens_per_s) describe the rows in the forward. A micro-batch with no
        row in the loss keeps its first row (masked; only its sampler gap is logged): every micro-step still runs
        one forward and backward, so the ranks' collectives stay in step (a round with no row in the loss on any
        rank runs that forward under no_grad and no backward: skip_steps_without_signal).
        """
        kept = [r for r in rows if bool(rollout.included[r])]
        return kept or [rows[0]]

    # -------------------------------------------------------------------------------- the loss

    def compute_token_logps(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Flat [N] log-probs of the completion tokens at the sampling temperature (the wrapper seam: an override's
        log-probs are what the loss and the scoring passes read; no entropy is logged then). With images, the
        batch it gets already carries the encoded features (`forward_tokens`)."""
        return self._token_pass(model, batch).logps

    def forward_tokens(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> TokenLogps:
        """One forward over a packed batch: the completion tokens' log-probs, with the entropy and hidden states the
        metrics read from the same forward. A subclass's `compute_token_logps` is honoured (its log-probs only)."""
        # rows with images: each group's images encoded once, here, for an override's log-probs too
        batch = attach_image_features(model, batch, self.processing_class)
        if type(self).compute_token_logps is not GRPOTrainer.compute_token_logps:
            return TokenLogps(self.compute_token_logps(model, batch))
        return self._token_pass(model, batch)

    def _token_pass(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> TokenLogps:
        batch = attach_image_features(model, batch, self.processing_class)  # (a no-op once attached)
        # the training forward's entropy comes from the same LM-head product (one fewer per step)
        return completion_token_pass(model, batch, temperature=self.args.temperature,
                                     chunk_size=self.args.logps_chunk_size, upcast=self.args.fp32_lm_head,
                                     keep_for_backward=True)

    def compute_policy_loss(self, inputs: PolicyLossInputs, *legacy: torch.Tensor
                            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy loss [B, T] and metric masks: the registered `loss_type` (the wrapper seam).

        Before toolkit 0.2 this seam took `(logps, old_logps, advantages, mask)`. Until 0.3 both forms work,
        with a ToolkitDeprecationWarning for the old one: a subclass overriding it with four tensors is
        called that way, and `super().compute_policy_loss(logps, old_logps, advantages, mask)` from such an
        override is answered here.
        """
        if legacy:
            inputs = legacy_policy_loss_inputs(type(self).__name__, inputs, *legacy)
        # the settings are current: a callback that schedules epsilon takes effect (resolved_objective)
        return self.policy_loss(inputs, self.resolved_objective().loss_settings)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        tokens = self.forward_tokens(model, inputs)
        present = inputs["completion_mask"]
        logps = tokens_to_rows(tokens.logps, present)
        # the tokens the policy produced: all completion ids, or an episode's sampled ones
        mask = present & inputs["sampled_mask"] if "sampled_mask" in inputs else present
        old = inputs.get("old_logps")
        loss_inputs = PolicyLossInputs(
            logps=logps, old_logps=logps.detach() if old is None else old, advantages=inputs["advantages"],
            loss_mask=inputs["loss_mask"], completion_mask=mask, sampler_logps=inputs["sampler_logps"],
            ref_logps=inputs.get("ref_logps"), group_ids=inputs["group_ids"], step_tokens=inputs["step_tokens"],
            step_sequences=inputs["step_sequences"], step_prompts=inputs["step_prompts"],
            num_micro_batches=self.current_gradient_accumulation_steps if model.training else 1,
            sampler_versions=inputs.get("sampler_versions"), policy_version=self.state.global_step,
            # pi_old: the current weights on-policy, else those of the step that built the rollout
            proximal_version=self.state.global_step if old is None else self._rollout_step)
        out = policy_objective(loss_inputs, self._policy_term, aggregation=self.loss_aggregation,
                               settings=self.resolved_objective().objective_settings,
                               corrects_behaviour=self.policy_loss.corrects_behaviour)
        if self.sequence_parallel is not None:  # each rank of the group holds its positions' share of the gradient
            out = dataclasses.replace(out, loss=sequence_parallel_loss(out.loss, self.sequence_parallel))
        finite = dict(loss=out.loss, logps=tokens.logps, advantages=inputs["advantages"])
        # read after backward is queued (training_step): no host sync before it. Not under DeepSpeed, whose backward
        # also steps the optimizer at the end of an accumulation: there the check stays before backward.
        if model.training and not getattr(self, "is_deepspeed_enabled", False):
            self.health.defer_finite_check(self.state.global_step, **finite)
        else:
            self.health.check_finite(self.state.global_step, **finite)
        self._record_loss_metrics(loss_inputs, out, tokens, present)
        return (out.loss, {"logps": tokens.logps.detach()}) if return_outputs else out.loss

    # ------------------------------------------------------------------------------ the step

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Generate and score at the first micro-step of a round; then a normal Trainer step on a micro-batch."""
        round_len = self.args.gradient_accumulation_steps * self.args.num_iterations
        k = self._micro % round_len
        if k == 0 or self._rollout is None:
            rows = inputs["row_index"].tolist()
            self._rollout_step = self.state.global_step
            self._rollout = self.generate_rollout(rows)
            self._micro_batches = self._split(self._rollout)
            for name, value in self._rollout.metrics.items():
                self.record_metric(name, value)
            self._skip_update = self._update_without_signal(self._rollout)
        self._micro += 1
        micro = self._micro_batches[k % self.args.gradient_accumulation_steps]
        t = time.perf_counter()
        if self._skip_update:
            loss = self._forward_without_update(model, micro)
        else:
            loss = super().training_step(model, micro, num_items_in_batch=None)
        self.health.raise_if_not_finite()  # the loss's NaN/inf check, before any optimizer step
        self.record_metric("update_skipped", float(self._skip_update))
        self.record_metric("time/train_s", time.perf_counter() - t)
        self.record_metric("train_tokens_per_s", float(micro["input_ids"].numel()) / max(time.perf_counter() - t, 1e-9))
        return loss

    def _forward_without_update(self, model: torch.nn.Module, micro: dict[str, Any]) -> torch.Tensor:
        """A micro-step of a round without signal: the loss's forward on the micro-batch's stand-in row under
        no_grad, so the step logs its metrics (sampler gap, entropy) as any step does, and no backward. The
        gradients stay None and the optimizer leaves every parameter and its moments as they are (torch's
        optimizers skip parameters without .grad), on every rank alike (all ranks skip or none; the forward's
        own collectives, FSDP's gathers, run on all of them)."""
        model.train()
        if callable(getattr(self.optimizer, "train", None)):  # schedule-free optimizers: as Trainer.training_step
            self.optimizer.train()
        with torch.no_grad(), self.compute_loss_context_manager():
            self.compute_loss(model, self._prepare_inputs(micro))
        return torch.zeros((), device=self.args.device)

    def _update_without_signal(self, rollout: Rollout) -> bool:
        """Whether this round's optimizer step(s) should leave the model alone: no rollout row in the loss on any
        rank (skip_steps_without_signal).

        Such a step has an exactly zero gradient (rows out of the loss carry a zero loss mask, KL term included),
        yet Adam would still move every weight by its momentum m/sqrt(v): after a step with signal the next ~10
        empty ones repeat it at 0.9^k of its size. On a task where most rounds score all-equal (small groups, a
        hard task) that drift, not the data, moves the policy; it is what collapsed async GRPO runs at staleness
        2 (bench/async_grpo.py). Skipping needs gradients left None, which DeepSpeed's engine and a GradScaler
        (fp16; it asserts that it saw gradients) do not accept: there the step runs on zeros as before.
        """
        if not self.args.skip_steps_without_signal:
            return False
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED or self.accelerator.scaler is not None:
            return False
        # _split counted the rows in the loss over all ranks: every rank skips, or none does (DDP's backward
        # all-reduces, so one rank without a backward would hang the others)
        return self._rows_in_loss_all_ranks == 0

    # ------------------------------------------------------------------------------ checkpoints, logs

    def write_checkpoint_state(self, folder: Path) -> None:
        """The prompts marked solved (skip_solved_threshold), into the checkpoint before it is marked complete."""
        write_atomic(folder / "grpo_state.json", json.dumps({"solved": sorted(self.solved)}))

    def restore_checkpoint_state(self, folder: Path | None) -> None:
        if folder is not None and (folder / "grpo_state.json").exists():
            self.solved.clear()
            self.solved.update(json.loads((folder / "grpo_state.json").read_text())["solved"])
        self._micro = 0
        self._rollout = None

    def on_log_metrics(self, logs: dict[str, float], mode: str) -> None:
        if mode == "train":
            self.health.observe(self.state.global_step, logs)
            if getattr(self.args, "log_completions", False) and self._rollout is not None \
                    and self.is_world_process_zero():
                self.log_completions_table(self._rollout)

    def completions_table(self, rollout: Rollout) -> tuple[list[str], list[list[Any]]]:
        """(columns, rows) of a rollout for `log_completions`: prompt and completion texts (special tokens
        dropped), each reward function's value, the total and the advantage; `num_completions_to_print` rows."""
        n = self.args.num_completions_to_print
        rows = range(len(rollout.completion_ids) if n is None else min(n, len(rollout.completion_ids)))
        decode = self.processing_class.batch_decode
        prompts = decode([rollout.prompt_ids[i] for i in rows], skip_special_tokens=True)
        completions = decode([rollout.completion_ids[i] for i in rows], skip_special_tokens=True)
        columns = ["prompt", "completion", *self.reward_names, "reward", "advantage"]
        table = [[prompts[k].strip()[-200:], completions[k].strip(),
                  *(round(float(rollout.rewards_per_func[f, i]), 4) for f in range(len(self.reward_names))),
                  round(float(rollout.rewards[i]), 4), round(float(rollout.advantages[i]), 4)]
                 for k, i in enumerate(rows)]
        return columns, table

    def log_completions_table(self, rollout: Rollout) -> None:
        """Print the table (a markdown table: readable on a console and in a notebook) and send it to the
        trackers that take one: TensorBoard as a text summary, trackio as a table."""
        columns, rows = self.completions_table(rollout)
        step = self.state.global_step

        def cell(value: Any) -> str:
            return str(value).replace("|", "\\|").replace("\n", " ⏎ ")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        markdown = "\n".join(lines)
        print(f"completions at step {step} ({len(rows)} of {len(rollout.completion_ids)}):\n{markdown}", flush=True)
        from transformers.integrations import TensorBoardCallback

        for callback in self.callback_handler.callbacks:
            writer = getattr(callback, "tb_writer", None) if isinstance(callback, TensorBoardCallback) else None
            if writer is not None:
                writer.add_text("completions", markdown, step)
                writer.flush()
        if "trackio" in (self.args.report_to or []):
            import trackio

            trackio.log({"completions": trackio.Table(columns=columns, data=rows)}, step=step)

    # ------------------------------------------------------------------------------ metrics

    def _rollout_metrics(self, r: Rollout, zero_std: torch.Tensor, t_gen: float, t_score: float,
                         t_extra: float) -> dict[str, float]:
        # generated tokens: an episode's sampled ids (its environment ids are not generated)
        lengths = torch.tensor([sum(m) for m in r.token_masks] if r.token_masks is not None
                               else [len(c) for c in r.completion_ids], dtype=torch.float32)
        m: dict[str, float] = {
            "reward": _nanmean(r.rewards), "reward_std": _nanstd(r.rewards),
            "frac_reward_zero_std": float(zero_std.view(-1, self.args.num_generations)[:, 0].float().mean()),
            "frac_rows_in_loss": float(r.included.float().mean()),
            "completions/mean_length": float(lengths.mean()), "completions/max_length_max": float(lengths.max()),
            "completions/clipped_ratio": float(r.truncated.float().mean()),
            "time/generation_s": t_gen, "time/scoring_s": t_score, "time/scoring_forward_s": t_extra,
            "generation_tokens_per_s": float(lengths.sum()) / max(t_gen, 1e-9),
            "solved_prompts": float(len(self.solved)),
        }
        for name, row in zip(self.reward_names, r.rewards_per_func):
            m[f"rewards/{name}/mean"] = _nanmean(row)
            m[f"rewards/{name}/std"] = _nanstd(row)
            m[f"rewards/{name}/failures"] = float(self._reward_failures.get(name, 0))
        return m

    def _record_loss_metrics(self, inputs: PolicyLossInputs, out: PolicyLossOutput, tokens: TokenLogps,
                             present: torch.Tensor) -> None:
        """The loss's metrics for this micro-batch, kept as tensors until the step is logged.

        No host sync here (nothing is read, nothing indexed by a mask: a boolean index is a sync on a GPU): a metric
        with nothing to describe is NaN, which the log skips, as not recording it did."""
        record = self.record_metric
        info, tis, kl, mask, lm = out.info, out.importance_weights, out.kl, inputs.completion_mask, inputs.loss_mask
        nan = torch.full((), float("nan"), device=mask.device)

        def where_any(m: torch.Tensor, value: torch.Tensor | float, empty: torch.Tensor | float) -> torch.Tensor:
            value = torch.as_tensor(value, dtype=torch.float32, device=m.device)
            return torch.where(m.any(), value, torch.as_tensor(empty, dtype=torch.float32, device=m.device))

        def masked_mean(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            # where, not a product: a NaN/inf outside the mask (padding) must not reach the mean, as with indexing
            return torch.where(m, v, torch.zeros((), dtype=v.dtype, device=v.device)).sum() / m.sum().clamp(min=1)

        def masked_max(v: torch.Tensor, m: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
            return sign * torch.where(m, sign * v.float(), torch.full_like(v, float("-inf"), dtype=torch.float32)).max()

        # How far the sampler's log-probs are from the trainer's for the same tokens (engine numerics, stale
        # weights): the quantity importance_sampling_cap corrects, logged every step (the masked stand-in row of a
        # micro-batch with nothing to train is a real sample, so it still measures this).
        gap = (inputs.old_logps - inputs.sampler_logps).abs()
        record("sampler/logp_abs_diff_mean", where_any(mask, masked_mean(gap, mask), nan))
        record("sampler/logp_abs_diff_max", where_any(mask, masked_max(gap, mask), nan))
        # the rest describes the training signal: NaN (skipped) where nothing here was trained

        def signal(value: torch.Tensor | float) -> torch.Tensor:
            return where_any(lm, value, nan)

        denom = lm.sum().clamp(min=1)
        if "clipped_low" in info:
            record("clip_ratio/low_mean", signal((info["clipped_low"] & lm).sum() / denom))
            record("clip_ratio/high_mean", signal((info["clipped_high"] & lm).sum() / denom))
            record("clip_ratio/region_mean", signal(((info["clipped_low"] | info["clipped_high"]) & lm).sum() / denom))
        for name, value in info.items():  # a loss's own diagnostics: masks as a share, weights as a mean
            if name in ("ratio", "clipped_low", "clipped_high") or value.shape != lm.shape:
                continue
            if value.dtype == torch.bool:
                record(f"loss/{name}_frac", signal((value & lm).sum() / denom))
            else:
                record(f"loss/{name}_mean", signal(masked_mean(value.detach().float(), lm)))
        if out.off_policy_mask is not None:  # share of the completions in the loss that the mask left out
            rows = lm.any(-1)
            kept = masked_mean(out.off_policy_mask.squeeze(-1).float(), rows)
            record("off_policy_mask/masked_frac", signal(where_any(rows, 1.0 - kept, 0.0)))
        if tis is not None:
            tis = tis.detach()
            if self.args.importance_sampling_mode == "mask":
                record("importance_ratio/masked_frac", signal(where_any(mask, masked_mean((tis == 0).float(), mask), 0.0)))
            record("importance_ratio/mean", signal(where_any(mask, masked_mean(tis.float(), mask), 1.0)))
            record("importance_ratio/min", signal(where_any(mask, masked_max(tis, mask, -1.0), 1.0)))
            record("importance_ratio/max_max", signal(where_any(mask, masked_max(tis, mask), 1.0)))
        if kl is not None:
            record("kl", signal((kl.detach() * mask).sum() / mask.sum().clamp(min=1)))
        entropy = tokens.entropy
        if entropy is None and tokens.hidden is not None:
            # a forward without autograd (a step without signal) computes no entropy with its log-probs
            entropy = completion_entropy(self.model, tokens.hidden, temperature=self.args.temperature,
                                         chunk_size=self.args.logps_chunk_size, upcast=self.args.fp32_lm_head)
        if entropy is not None and entropy.shape[0] == tokens.logps.shape[0]:
            per_row = tokens_to_rows(entropy.detach().float(), present)  # on sampled tokens
            record("entropy", signal(where_any(mask, masked_mean(per_row, mask), 0.0)))


class TrainingHealth:
    """Warnings a person can act on, at most once per cause per `warn_every` steps; NaN/inf stops the run."""

    def __init__(self, args: GRPOConfig):
        self.args = args
        self.last: dict[str, int] = {}
        self.no_signal_run = 0
        self.rewards: list[float] = []
        self.best_average: float | None = None
        self.best_step = 0
        self.falling_run = 0

    def warn(self, step: int, cause: str, message: str) -> None:
        """Log `message` as a warning, unless one of the same `cause` was logged less than `warn_every` steps ago."""
        if step - self.last.get(cause, -10**9) >= self.args.warn_every:
            self.last[cause] = step
            logger.warning("step %d: %s", step, message)

    def check_finite(self, step: int, **tensors: torch.Tensor) -> None:
        """Stop the run now if a tensor holds NaN or inf (one host sync per tensor)."""
        for name, t in tensors.items():
            if not torch.isfinite(t).all():
                raise TrainingHealthError(
                    f"GRPO step {step}: '{name}' holds NaN or inf ({int((~torch.isfinite(t)).sum())} values). "
                    "Lower the learning rate, check the reward functions for inf, or lower importance_sampling_cap.")

    def defer_finite_check(self, step: int, **tensors: torch.Tensor) -> None:
        """As check_finite, read later by raise_if_not_finite: on a GPU reading a flag waits for every kernel
        queued before it, so the loss path queues its backward first and the check costs no stall of its own."""
        self._pending_finite = getattr(self, "_pending_finite", [])
        self._pending_finite.append((step, {name: t.detach() for name, t in tensors.items()}))

    def raise_if_not_finite(self) -> None:
        """Run the deferred checks (one host sync for all of them), then forget them."""
        pending, self._pending_finite = getattr(self, "_pending_finite", []), []
        if not pending:
            return
        flags = torch.stack([torch.isfinite(t).all() for _, ts in pending for t in ts.values()])
        if not bool(flags.all()):
            for step, ts in pending:
                self.check_finite(step, **ts)

    # A drop counts when the 10-log average reward is below its best by more than reward_drop_warn and more than
    # 5 standard errors of a 10-log average (sd of the last 30 step rewards / sqrt(10)), for 5 logs in a row.
    # The best of many noisy averages sits above the true mean, so a fixed 0.10 alone fired on flat curves: at
    # 32 completions per step 44% of flat 80-step runs warned; with this rule 0.5% do (16 completions: 1%),
    # while a rise to 0.6 and fall to 0.35 is caught in 199 of 200 (simulated; tests/trainers/test_grpo.py keeps both).
    _WINDOW, _SIGMAS, _PERSIST, _SIGMA_WINDOW = 10, 5.0, 5, 30

    def _observe_reward(self, step: int, reward: float, entropy: float | None) -> None:
        self.rewards.append(reward)
        if len(self.rewards) < self._WINDOW:
            return
        average = sum(self.rewards[-self._WINDOW:]) / self._WINDOW
        if self.best_average is None or average > self.best_average:
            self.best_average, self.best_step, self.falling_run = average, step, 0
            return
        recent = self.rewards[-self._SIGMA_WINDOW:]
        spread = statistics.pstdev(recent) if len(recent) > 1 else 0.0
        margin = max(self.args.reward_drop_warn, self._SIGMAS * spread / math.sqrt(self._WINDOW))
        self.falling_run = self.falling_run + 1 if average < self.best_average - margin else 0
        if self.falling_run >= self._PERSIST:
            collapsed = (f" with entropy at {entropy:.4f} (< entropy_floor={self.args.entropy_floor}): the policy "
                         "narrowed onto worse answers" if entropy is not None and entropy < self.args.entropy_floor
                         else "")
            self.warn(step, "reward_falling",
                       f"REWARD FALLING: the 10-step average reward is {average:.3f}, {self.best_average - average:.3f} "
                       f"below its best ({self.best_average:.3f} at step {self.best_step}) for {self.falling_run} "
                       f"steps{collapsed}. Lower the learning rate, raise beta, or keep the checkpoint from the best "
                       "step.")

    def observe(self, step: int, logs: dict[str, float]) -> None:
        """Warn on what predicts failure, not on what healthy runs also show.

        Calibrated against noise (flat simulated curves at the main job's batch shape stay silent) and on runs built
        to trigger each cause
        (tests/trainers/test_grpo.py): every group tied while the reward is below `solved_reward` (no signal; tied at the
        top means solved); the 10-step average reward clearly below its best (`_observe_reward`; with the entropy
        named when it is under `entropy_floor`: the policy narrowed onto worse answers); truncation; KL.
        """
        reward = logs.get("reward")
        if logs.get("frac_reward_zero_std", 0.0) >= 1.0 and not (reward is not None and
                                                                 reward >= self.args.solved_reward):
            self.no_signal_run += 1
            if self.no_signal_run >= self.args.no_signal_warn_steps:
                self.warn(step, "no_signal",
                           f"NO LEARNING SIGNAL: every group had identical rewards for {self.no_signal_run} steps "
                           f"(mean reward {logs.get('reward', float('nan')):.3f}), so the loss is zero. Make the task "
                           "easier or the reward denser, raise num_generations or temperature.")
        else:
            self.no_signal_run = 0
        if reward is not None and math.isfinite(reward):
            self._observe_reward(step, reward, logs.get("entropy"))
        if logs.get("completions/clipped_ratio", 0.0) >= 1.0:
            self.warn(step, "truncated", "every completion hit max_completion_length without a stop token; raise "
                                          "max_completion_length or check the stop tokens.")
        if "kl" in logs and logs["kl"] > self.args.kl_ceiling:
            self.warn(step, "kl", f"KL to the reference is {logs['kl']:.3f} (> kl_ceiling={self.args.kl_ceiling}); "
                                   "raise beta or lower the learning rate.")


# ------------------------------------------------------------------------------------ helpers


class _Flat(torch.utils.data.Sampler):
    """A sampler over the flat index stream of a RoundSampler (DataLoader batches it per round)."""

    def __init__(self, rounds: RoundSampler):
        self.rounds = rounds

    def set_epoch(self, epoch: int) -> None:
        self.rounds.set_epoch(epoch)

    def __iter__(self):
        for batch in self.rounds:
            yield from batch

    def __len__(self) -> int:
        return len(self.rounds) * self.rounds.per_round


def _index_collator(features: list[dict[str, int]]) -> dict[str, torch.Tensor]:
    return {"row_index": torch.tensor([f["row_index"] for f in features], dtype=torch.long)}


def _pad_rows(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    out = torch.zeros(len(rows), length, dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r.float()
    return out


def _nanmean(t: torch.Tensor) -> float:
    t = t[~torch.isnan(t)]
    return float(t.mean()) if t.numel() else float("nan")


def _nanstd(t: torch.Tensor) -> float:
    t = t[~torch.isnan(t)]
    return float(t.std()) if t.numel() > 1 else 0.0
