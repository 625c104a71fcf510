"""Proximal Policy Optimization (PPO) for language models: actor-critic RLHF with GAE.

`PPOTrainer` subclasses `transformers.Trainer` for its optimizer, scheduler, callbacks and logging,
and writes its own loop, because one PPO update is not one optimizer step. One update, top to bottom:

1. Rollout: `rollout_batch_size` prompts (token ids rendered once at start-up) go to the generation
   backend (any registered `GenerationBackend`), one completion each, as token ids.
2. Scores: reward functions (the same callables GRPO takes) and/or a sequence-classification reward
   model on prompt + completion; `missing_eos_penalty` for completions that never stop.
3. Without gradients, one packed forward each: the policy's log-probs (pi_old), the reference's,
   and the critic's values V(s_t) at every completion token.
4. Per-token rewards: -beta x KL_t (k1 or k3 against the reference) on every token, plus the
   score on the last token; GAE (`gamma`, `lam`) gives advantages and returns; advantages are
   whitened over the rollout's tokens.
5. `num_ppo_epochs` passes over `num_mini_batches` shuffled mini-batches: clipped policy loss plus
   `vf_coef` x clipped value loss, one optimizer step per mini-batch (gradient accumulation over
   `per_device_train_batch_size` micro-batches); the epochs stop early if the mini-batch's approximate
   KL to pi_old exceeds `early_stop_approx_kl`.
6. The KL coefficient moves toward `target_kl` (adaptive controller of Ziegler et al., 2019) if set.

Follows Ziegler et al. (2019) and the "N implementation details of RLHF with PPO" (Huang et al.,
2024) that TRL's PPOTrainer implements; where we differ from TRL (reward on the last completion
token, masked means everywhere) docs/ppo.md says why. Critic: a separate model (a copy of the
policy's backbone with a value head, or a given sequence-classification model), a value head on the
policy's own hidden states (`critic="head"`), or with PEFT a head on the adapter-free base
(`critic="base"`).

Seams (override in a subclass): `generate_rollout`, `compute_rewards`, `compute_advantages`,
`compute_token_logps`, `compute_values`, `compute_policy_loss`, `compute_value_loss`,
`build_prompt_order`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
import logging
import math
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from torch import nn
from transformers import PreTrainedModel, Trainer
from transformers.trainer_utils import TrainOutput

from .attention import packed_layout, supports_varlen, use_varlen_attention
from .checkpoint import begin_checkpoint, commit_checkpoint, publish_folder, resolve_resume, write_atomic
from .data import prompt_rows, tokenize_prompts
from .vision import is_vision_processor, tokenize_vision_prompts, validate_vision
from .distributed import env_world_size, refuse_sharding
from .errors import ConfigError, ToolkitDeprecationWarning, TrainingHealthError
from .generation import after_generation
from .console import show_logs
from .lifecycle import STAGING, TrainerLifecycle
from .model_card import write_model_card
from .models import (
    DEFAULT_MODEL,
    apply_cpu_training_defaults,
    is_peft_model,
    log_gpu_defaults,
    load_classifier,
    load_model,
    load_tokenizer,
    place_frozen,
    prepare_model,
    sequence_classifier_parts,
    unwrap_model,
)
from .numerics import (
    clipped_value_loss,
    explained_variance,
    gae,
    kl_estimate,
    masked_whiten,
    tokens_to_rows,
)
from .objectives import PolicyLossInputs, resolve_policy_loss_settings
from .objectives.policy import legacy_policy_loss_inputs, policy_term_of
from .packing import (
    TokenLogps,
    completion_entropy,
    completion_hidden,
    completion_token_pass,
    pack_for_layout,
)
from .plugins import registry, resolve_reward
from .rewards import RewardRunner, check_reward_columns, score_completions
from .rollout import generation_seed, order_seed
from .rollout_config import RolloutConfig

__all__ = [
    "AdaptiveKLController",
    "PPOConfig",
    "PPORollout",
    "PPOTrainer",
    "ScalarHead",
    "sequence_classifier_parts",
]

logger = logging.getLogger(__name__)

CRITICS = ("separate", "head", "base")
STATE_FILE = "ppo_state.pt"          # optimizer and scheduler tensors, loaded with weights_only=True
STATE_JSON = "ppo_state.json"        # the rest of the loop's state: plain JSON
CRITIC_FILE = "critic.safetensors"
# the per-micro-batch token sums compute_loss returns (with return_outputs), reduced over ranks per mini-batch
_STAT_KEYS = ("loss/policy", "loss/value", "policy/approxkl", "policy/clipfrac", "val/clipfrac", "policy/entropy",
              "policy/ratio", "tokens")


@dataclass
class PPOConfig(RolloutConfig):
    """Settings of `PPOTrainer`: `RolloutConfig`'s sampling, backend and reward fields plus the ones below (TRL's
    names where TRL has one).

    One update = one rollout of `rollout_batch_size` completions, then `num_ppo_epochs` x
    `num_mini_batches` optimizer steps; `max_steps` counts updates. A mini-batch is
    `per_device_train_batch_size` x `gradient_accumulation_steps` completions.
    """

    # PPO's loop never wraps the policy's forward in accelerate's autocast, so generation with bf16=True decodes
    # in the weights' own dtype (read by the transformers backend's mixed-precision warning; not a field)
    _generation_under_autocast = False

    output_dir: str | None = field(default="outputs/ppo", metadata={"help": "Checkpoints, final model, report."})
    learning_rate: float = field(default=3e-6, metadata={"help": "Peak AdamW learning rate (policy and critic)."})
    logging_steps: float = field(default=1, metadata={"help": "Log every this many updates."})

    rollout_batch_size: int | None = field(default=None, metadata={
        "help": "Completions per update in each process (N processes: N x this per update); default per_device_train_batch_size x gradient_accumulation_steps x "
                "num_mini_batches, and if given it must equal that."})
    num_mini_batches: int = field(default=1, metadata={"help": "Optimizer steps per epoch over one rollout."})
    num_ppo_epochs: int = field(default=4, metadata={"help": "Passes over each rollout."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (also used for log-probs)."})

    critic: str | None = field(default=None, metadata={
        "help": "head (value head on the policy's hidden states, one shared forward) | separate (own backbone: a "
                "copy of the policy's, or value_model) | base (PEFT: value head on the adapter-free base). Default: "
                "'separate' when a value_model is given, else 'head'."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    loss_type: str = field(default="ppo", metadata={
        "help": "The policy loss by name (the registry GRPO uses): ppo (the clipped surrogate, PPO's own) | a "
                "registered loss that averages over tokens (cispo from plugins/toolkit-cispo, decoupled_ppo, m2po, "
                "seq_mis); `toolkit plugins` lists them. PPO takes a token mean over each mini-batch, so losses that "
                "average otherwise (grpo, dr_grpo, ...) are refused."})
    loss_kwargs: dict | None = field(default=None, metadata={
        "help": "The policy loss's own settings (e.g. {epsilon_max = 5.0} for cispo), checked against its settings "
                "dataclass before any model loads; epsilon is set by its config field."})
    epsilon: float = field(default=0.2, metadata={
        "help": "Clip range of the policy ratio, [1 - epsilon, 1 + epsilon] (GRPO's name; TRL's PPO calls it cliprange)."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value update."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    beta: float = field(default=0.05, metadata={
        "help": "KL penalty coefficient to the reference (initial value if adaptive; GRPO's name, TRL's PPO calls it "
                "kl_coef)."})
    kl_estimator: str = field(default="k1", metadata={"help": "Per-token KL in the reward: k1 | k3."})
    target_kl: float | None = field(default=None, metadata={
        "help": "Adaptive KL controller target (KL summed over a completion); None keeps beta fixed."})
    kl_horizon: int = field(default=10000, metadata={"help": "Horizon of the adaptive KL controller."})
    missing_eos_penalty: float | None = field(default=None, metadata={
        "help": "Subtracted from the score of completions that hit max_completion_length without a stop token."})
    whiten_rewards: bool = field(default=False, metadata={"help": "Whiten the per-token rewards (no mean shift)."})
    whiten_advantages: bool = field(default=True, metadata={"help": "Whiten advantages over the rollout's tokens."})
    early_stop_approx_kl: float | None = field(default=None, metadata={
        "help": "Stop this update's remaining epochs when a mini-batch's approximate KL to pi_old exceeds this."})
    reward_model_weight: float = field(default=1.0, metadata={"help": "Weight of the reward model's score."})
    kl_coef: float | None = field(default=None, metadata={
        "help": "Deprecated alias of beta (toolkit 0.1's and TRL's PPO name); removed in toolkit 0.3."})
    cliprange: float | None = field(default=None, metadata={
        "help": "Deprecated alias of epsilon (toolkit 0.1's and TRL's PPO name); removed in toolkit 0.3."})

    def __post_init__(self):
        # One name per concept across trainers: beta (KL coefficient) and epsilon (ratio clip), as in GRPO.
        defaults = {"beta": 0.05, "epsilon": 0.2}
        for old, new in (("kl_coef", "beta"), ("cliprange", "epsilon")):
            value = getattr(self, old)
            if value is not None:
                if getattr(self, new) != defaults[new] and getattr(self, new) != value:
                    raise ConfigError(f"{old}: the deprecated alias of {new}; both are set ({old}={value}, "
                                      f"{new}={getattr(self, new)}). Keep only {new}.")
                warnings.warn(f"PPOConfig.{old} is deprecated since toolkit 0.2 and removed in 0.3; use {new} (the "
                              f"name GRPO uses). Using {new}={value}.", ToolkitDeprecationWarning, stacklevel=3)
                setattr(self, new, value)
                setattr(self, old, None)
        # PPO's micro-batches are small, so recomputing activations costs more than the memory it saves:
        # measured on SmolLM2 (8 x ~56 tokens, policy + critic), 26.4 s/update with checkpointing vs 19.4 without.
        # Off unless asked for, under either of its names.
        apply_cpu_training_defaults(self, cpu_checkpointing=False)
        super().__post_init__()  # RolloutConfig: sampling, backend and reward fields
        # PPO owns its loop (docs/ppo.md): it saves every `save_steps` updates or not at all.
        strategy = str(getattr(self.save_strategy, "value", self.save_strategy))
        if strategy not in ("no", "steps"):
            raise ConfigError(f"save_strategy: PPO saves every save_steps updates ('steps') or never ('no'); "
                              f"'{strategy}' is not supported.")
        if strategy == "steps" and (self.save_steps < 1 or self.save_steps != int(self.save_steps)):
            raise ConfigError(f"save_steps: PPO counts updates, so save_steps must be a whole number >= 1, got "
                              f"{self.save_steps}.")
        for name in ("num_mini_batches", "num_ppo_epochs", "kl_horizon"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}.")
        mini = self.per_device_train_batch_size * self.gradient_accumulation_steps
        expected = mini * self.num_mini_batches
        if self.rollout_batch_size is None:
            self.rollout_batch_size = expected
        elif self.rollout_batch_size != expected:
            hint = (f"use rollout_batch_size={expected}, or num_mini_batches={self.rollout_batch_size // mini}"
                    if self.rollout_batch_size % mini == 0 else f"use rollout_batch_size={expected}")
            raise ConfigError(
                f"rollout_batch_size: {self.rollout_batch_size} completions cannot be split into num_mini_batches="
                f"{self.num_mini_batches} mini-batches of per_device_train_batch_size x gradient_accumulation_steps "
                f"= {mini}; {hint}.")
        if self.rollout_batch_size < 2 and self.whiten_advantages:
            raise ConfigError("rollout_batch_size: whitening advantages needs at least 2 completions per update.")
        if self.critic is not None and self.critic not in CRITICS:
            raise ConfigError(f"critic: '{self.critic}' is not one of {list(CRITICS)}.")
        if self.kl_estimator not in ("k1", "k3"):
            raise ConfigError(f"kl_estimator: '{self.kl_estimator}' is not k1 | k3.")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            raise ConfigError(f"gamma, lam: must be in [0, 1], got gamma={self.gamma}, lam={self.lam}.")
        loss = registry().get("policy_loss", self.loss_type, field="loss_type")
        if loss.aggregation != "token":
            raise ConfigError(f"loss_type: '{self.loss_type}' averages by '{loss.aggregation}', and PPO takes a token "
                              "mean over each mini-batch (its advantages are per token); use 'ppo' or a loss that "
                              "averages over tokens (`toolkit plugins` lists them with their aggregation).")
        settings = resolve_policy_loss_settings(loss, self, name=self.loss_type)  # checks epsilon and loss_kwargs
        if getattr(settings, "proximal", None) == "loglinear":
            raise ConfigError(f"loss_kwargs.proximal: 'loglinear' interpolates the proximal policy by the version that "
                              f"sampled each token, which PPO (one rollout per update, sampled by the current weights) "
                              f"does not track; use proximal='exact' with loss_type '{self.loss_type}'.")
        if self.cliprange_value <= 0:
            raise ConfigError(f"cliprange_value: must be > 0, got {self.cliprange_value}.")
        if self.beta < 0:
            raise ConfigError(f"beta: must be >= 0, got {self.beta}.")
        if self.vf_coef < 0:  # a negative weight would train the critic away from the returns
            raise ConfigError(f"vf_coef: must be >= 0, got {self.vf_coef}.")
        if self.target_kl is not None and self.target_kl <= 0:
            raise ConfigError(f"target_kl: must be > 0 or None, got {self.target_kl}.")
        if self.early_stop_approx_kl is not None and self.early_stop_approx_kl <= 0:
            raise ConfigError(f"early_stop_approx_kl: must be > 0 or None, got {self.early_stop_approx_kl}.")


class AdaptiveKLController:
    """Ziegler et al. (2019): move the KL coefficient (beta) by at most +-20% x n/horizon toward the KL target."""

    def __init__(self, init: float, target: float | None, horizon: int):
        self.value, self.target, self.horizon = init, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.target is None or not math.isfinite(current_kl):
            return
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


class ScalarHead(nn.Module):
    """A backbone's last hidden state -> one number per position (the critic, or a reward model's score).

    `backbone` is a transformers base model (no LM head) or, for `critic="head"|"base"`, None: the
    caller passes hidden states. Zero-initialised when new, so a fresh critic predicts 0.
    """

    def __init__(self, hidden_size: int, backbone: nn.Module | None = None, head: nn.Module | None = None):
        super().__init__()
        self.backbone = backbone
        if head is None:
            head = nn.Linear(hidden_size, 1, bias=False)
            nn.init.zeros_(head.weight)
        self.head = head

    def forward(self, batch: dict[str, torch.Tensor] | None = None, *, hidden: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is None:
            hidden = completion_hidden(self.backbone, batch, positions=positions)
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


@dataclass
class PPORollout:
    """One update's experience. Per-token tensors are [B, T], right-padded, with `mask`."""

    row_indices: list[int]
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    mask: torch.Tensor
    logps: torch.Tensor          # pi_old (the policy before this update's steps)
    ref_logps: torch.Tensor
    sampler_logps: torch.Tensor
    values: torch.Tensor
    rewards: torch.Tensor        # per token, KL penalty and score
    advantages: torch.Tensor
    returns: torch.Tensor
    scores: torch.Tensor         # [B]
    kl: torch.Tensor             # per token
    truncated: torch.Tensor      # [B] bool
    metrics: dict[str, float] = field(default_factory=dict)


class PPOTrainer(TrainerLifecycle, Trainer):
    """PPO on prompts with a reward model and/or reward functions; see the module docstring and docs/ppo.md."""

    _tag_names = ["toolkit", "ppo"]  # noqa: RUF012 (transformers reads a list)
    trainer_kind = "ppo"

    def __init__(
        self,
        model: str | PreTrainedModel = DEFAULT_MODEL,
        reward_funcs: Sequence[str | Callable[..., Any]] | str | Callable[..., Any] = (),
        args: PPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        reward_model: str | PreTrainedModel | None = None,
        value_model: str | PreTrainedModel | None = None,
        ref_model: PreTrainedModel | None = None,
        peft_config: Any = None,
        generation_backend: Any = None,
        callbacks: list | None = None,
        model_init_kwargs: dict | None = None,
    ):
        show_logs()  # the start-up summary below is seen in a notebook too (console.show_logs)
        args = args if args is not None else PPOConfig()
        if not isinstance(args, PPOConfig):
            raise ConfigError(f"args: PPOTrainer needs a PPOConfig, got {type(args).__name__}.")
        refuse_sharding("PPOTrainer", args, "it owns its loop and all-reduces the policy's and critic's gradients "
                                            "itself (DDP-style, every rank holds both models whole)")
        if args.fp16 or getattr(args, "mixed_precision", None) == "fp16":  # accelerate launch --mixed_precision
            # fp16 needs a loss scaler between backward and the optimizer step, which PPO's own loop does not
            # run: unscaled float16 gradients underflow and the run learns nothing, silently.
            raise ConfigError("fp16: PPOTrainer does not support fp16 mixed precision (its own loop has no loss "
                              "scaler); use bf16=True (autocast over float32 weights) or train in float32.")
        # The critic layout, resolved here (the config is the caller's and is not written to). By default a shared
        # value head (trlx's and TRL 0.x's layout): one backbone forward and backward serves log-probs and values,
        # and no second model holds weights, gradients and Adam moments (bench/ppo_vs_trl.py measures both
        # layouts). A given value_model means the caller wants a separate critic.
        critic = args.critic if args.critic is not None else ("separate" if value_model is not None else "head")
        self.critic_kind = critic
        given_adapters = isinstance(model, torch.nn.Module) and is_peft_model(model)
        if critic == "base" and peft_config is None and not given_adapters:
            raise ConfigError("critic: 'base' puts the value head on the adapter-free base model and needs "
                              "peft_config; use critic='separate' or 'head' without PEFT.")
        if value_model is not None and critic != "separate":
            raise ConfigError(f"value_model: given, but critic='{critic}' builds its own value head; set "
                              "critic='separate' to use value_model.")
        if train_dataset is None:
            raise ConfigError("train_dataset: PPOTrainer needs prompts (Dataset, list of dicts or .jsonl path).")
        self._setup_rewards(reward_funcs, reward_model, args)
        # 1. Data, before any model work.
        tokenizer = processing_class if processing_class is not None else load_tokenizer(model)
        if getattr(tokenizer, "image_processor", None) is not None:  # (vision.is_vision_processor)
            raise ConfigError("processing_class: PPOTrainer does not take vision-language models yet; SFT, DPO and "
                              "GRPO do (docs/vision.md).")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.prepare_prompts(train_dataset, tokenizer, args)
        if self.reward_runner is not None:
            check_reward_columns(self.reward_runner.funcs, self.reward_runner.names,
                                 ["prompt", *self.dataset_format.extra_columns], where="train_dataset")
        rows = self.rows
        if len(rows) < args.rollout_batch_size * env_world_size():
            on = f" x {env_world_size()} processes" if env_world_size() > 1 else ""
            raise ConfigError(f"train_dataset: {len(rows)} prompts, fewer than one update needs (rollout_batch_size="
                              f"{args.rollout_batch_size}{on}).")

        # 2. Models: policy, reference, critic, reward model.
        policy = self._build_models(model, args, peft_config, model_init_kwargs, ref_model, value_model, reward_model)
        self.sampling = args.sampling_params(tokenizer.eos_token_id)
        self.generation_backend = generation_backend if generation_backend is not None else registry().get(
            "generation_backend", args.generation_backend, field="generation_backend")(policy, tokenizer, args)
        self.kl_controller = AdaptiveKLController(args.beta, args.target_kl, args.kl_horizon)
        self.policy_loss = registry().get("policy_loss", args.loss_type, field="loss_type")
        self.loss_settings = resolve_policy_loss_settings(self.policy_loss, args, name=args.loss_type)
        self._policy_term = policy_term_of(self, PPOTrainer)
        log_gpu_defaults(args, policy, "ppo", batch_size=args.per_device_train_batch_size,
                         prompt_len=args.max_prompt_length or 512, completion_len=args.max_completion_length)
        logger.info(
            "PPO: %d prompts, %d completions per update%s, %d epochs x %d mini-batches; critic=%s; beta=%s (%s%s); "
            "gamma=%s lam=%s loss_type=%s (%s) cliprange_value=%s vf_coef=%s; rewards: %s%s.",
            len(rows), args.rollout_batch_size,
            f" per process x {env_world_size()} processes" if env_world_size() > 1 else "", args.num_ppo_epochs, args.num_mini_batches, critic,
            args.beta, args.kl_estimator, f", adaptive to {args.target_kl}" if args.target_kl else ", fixed",
            args.gamma, args.lam, args.loss_type, self.loss_settings, args.cliprange_value, args.vf_coef,
            self.reward_runner.names if self.reward_runner else "[]", " + reward model" if reward_model else "")

        super().__init__(model=policy, args=args, train_dataset=Dataset.from_list([{"row_index": 0}]),
                         processing_class=tokenizer, callbacks=callbacks)
        # Trainer places only the policy; the reference, critic and reward model were built on the CPU. Every
        # tensor a rollout or an update builds goes to this device too (`_pack`, `generate_rollout`).
        if self.ref_model is not None:
            place_frozen(self.ref_model, self.args.device)
        if self.reward_model is not None and not self._dispatched["reward model"]:
            self.reward_model.to(self.args.device)
        if not self._dispatched["critic"]:
            self.critic.to(self.args.device)
        self._step_metrics: dict[str, list[float]] = defaultdict(list)  # averaged over ranks at each log

    def _setup_rewards(self, reward_funcs: Any, reward_model: Any, args: PPOConfig) -> None:
        """The reward functions (run under their timeouts) and their weights; a reward model is loaded with the
        other models."""
        if callable(reward_funcs) or isinstance(reward_funcs, str):
            reward_funcs = [reward_funcs]
        reward_funcs = list(reward_funcs)
        if not reward_funcs and reward_model is None:
            raise ConfigError("reward_funcs / reward_model: PPO needs a reward source; pass reward functions "
                              "(e.g. reward_funcs=['numeric_match']), a sequence-classification reward_model, or both.")
        self.reward_runner = (RewardRunner([resolve_reward(f) for f in reward_funcs], timeout=args.reward_timeout,
                                           max_consecutive_failures=args.reward_max_consecutive_failures)
                              if reward_funcs else None)
        weights = args.reward_weights or [1.0] * len(reward_funcs)
        if len(weights) != len(reward_funcs):
            raise ConfigError(f"reward_weights: {len(weights)} weights for {len(reward_funcs)} reward functions; "
                              "give one weight per function.")
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)

    def _build_models(self, model: Any, args: PPOConfig, peft_config: Any, model_init_kwargs: dict | None,
                      ref_model: Any, value_model: Any, reward_model: Any) -> Any:
        """The policy (PEFT applied), the frozen reference, the critic, the reward model; packed attention."""
        critic = self.critic_kind
        init_kwargs = {**(args.model_init_kwargs or {}), **(model_init_kwargs or {})}
        dtype = init_kwargs.pop("dtype", init_kwargs.pop("torch_dtype", args.model_dtype))
        policy = load_model(model, dtype=dtype, **init_kwargs)
        self.ref_model = None
        policy = prepare_model(policy, peft_config)  # a wrapper's PeftModel is used as given
        if is_peft_model(policy) and ref_model is None:
            pass  # the reference is the base with adapters disabled
        else:
            self.ref_model = ref_model if ref_model is not None else copy.deepcopy(policy)
            self.ref_model.eval().requires_grad_(False)
        base = unwrap_model(policy)
        hidden_size = base.config.hidden_size
        if critic == "separate":
            if value_model is not None:
                vm = value_model if isinstance(value_model, nn.Module) else load_classifier(value_model, dtype)
                backbone, head = sequence_classifier_parts(vm)
                self.critic = ScalarHead(hidden_size, backbone, head)
            else:
                # A copy of the policy's backbone (no LM head) with a fresh, zero value head.
                self.critic = ScalarHead(hidden_size, copy.deepcopy(getattr(base, base.base_model_prefix)))
            self.critic.requires_grad_(True)
        else:
            self.critic = ScalarHead(hidden_size)
        self.reward_model = None
        # a value or reward model dispatched by accelerate (device_map=) stays where its hooks put it; the flag is
        # read off the loaded model, since the wrapper around its parts below does not carry it
        self._dispatched = {"critic": bool(getattr(value_model, "hf_device_map", None)),
                            "reward model": bool(getattr(reward_model, "hf_device_map", None))}
        if reward_model is not None:
            rm = reward_model if isinstance(reward_model, nn.Module) else load_classifier(reward_model, dtype)
            self.reward_model = ScalarHead(hidden_size, *sequence_classifier_parts(rm)).eval().requires_grad_(False)
        self.padding_free = supports_varlen(base)
        scorers = (base, self.ref_model, self.critic.backbone,
                   self.reward_model.backbone if self.reward_model is not None else None)
        if self.padding_free:
            for m in scorers:
                if m is not None:
                    use_varlen_attention(m)
        # how every forward over prompt + completion lays out its batch: all four models must run it
        self.packed_layout = packed_layout(*scorers) if self.padding_free else "padded"
        return policy

    # ------------------------------------------------------------------------------ data plumbing

    # Copied from toolkit.core.grpo.GRPOTrainer.prepare_prompts with GRPO->PPO
    def prepare_prompts(self, train_dataset: Any, tokenizer: Any, args: Any) -> None:
        """Validate the prompt rows and render each prompt to token ids once (before any model loads); sets
        `rows`, `dataset_format` and `prompt_ids`. A subclass that needs more of each row (GKD's completions)
        extends it."""
        rows, prompt_fmt = prompt_rows(train_dataset, tokenizer, trainer="PPO")
        self.rows, self.dataset_format = rows, prompt_fmt
        images = validate_vision(rows, prompt_fmt, tokenizer, trainer="PPO")  # (refuses images for a text model)
        self.prompt_images = images if is_vision_processor(tokenizer) else None
        if self.prompt_images is not None:
            self.prompt_ids, n_cut = tokenize_vision_prompts(rows, images, tokenizer,
                                                             max_prompt_length=args.max_prompt_length,
                                                             chat_template_kwargs=args.chat_template_kwargs)
        else:
            self.prompt_ids, n_cut = tokenize_prompts(rows, tokenizer, max_prompt_length=args.max_prompt_length,
                                                      chat_template_kwargs=args.chat_template_kwargs)
        logger.info("PPO data: %s, %d prompts, longest prompt %d tokens%s.", prompt_fmt.describe(), len(rows),
                    max(len(p) for p in self.prompt_ids),
                    f"; {n_cut} prompts cut to max_prompt_length={args.max_prompt_length}" if n_cut else "")
        if n_cut:
            logger.warning("PPO: %d of %d prompts were longer than max_prompt_length=%s and were cut from the left.",
                           n_cut, len(rows), args.max_prompt_length)

    def build_prompt_order(self, epoch: int) -> list[int]:
        """The prompt order of one pass over the data (the sampler seam); deterministic per (seed, epoch)."""
        g = torch.Generator().manual_seed(order_seed(self.args.seed, epoch))
        return torch.randperm(len(self.rows), generator=g).tolist()

    def _prompts_for_update(self, update: int) -> list[int]:
        """This rank's prompts of `update`: ranks take consecutive slices of the update's global prompts, so N
        processes train on the prompts one process with N x rollout_batch_size would."""
        per = self.args.rollout_batch_size
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        glob = per * world
        usable = (len(self.rows) // glob) * glob  # the tail that does not fill an update is skipped each pass
        start = update * glob
        update_rows = self.build_prompt_order(start // usable)[start % usable:start % usable + glob]
        return update_rows[rank * per:(rank + 1) * per]

    def num_updates(self) -> int:
        if self.args.max_steps > 0:
            return self.args.max_steps
        glob = self.args.rollout_batch_size * self.accelerator.num_processes
        return max(1, int(self.args.num_train_epochs * (len(self.rows) // glob)))

    # ------------------------------------------------------------------------------ several processes

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over every process (itself in one process): the reduction behind every global statistic."""
        if self.accelerator.num_processes == 1:
            return t
        return self.accelerator.reduce(t.to(self.accelerator.device), reduction="sum").to(t.device)

    def _mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Per-rank means -> means over all ranks (ranks hold equal completion counts, so a mean of means is the
        mean over every completion). Keys are sorted so every rank reduces the same vector."""
        if self.accelerator.num_processes == 1 or not values:
            return values
        keys = sorted(values)
        total = self._sum_over_ranks(torch.tensor([values[k] for k in keys], dtype=torch.float64))
        return {k: float(v) / self.accelerator.num_processes for k, v in zip(keys, total)}

    def _all_reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Sum the gradients of every rank (the loss is already divided by the global token count). PPO trains
        outside accelerate's DDP wrapper (one update is many optimizer steps over its own rollout), so this is
        its DDP: bucketed flat all-reduces, and a parameter without a gradient on this rank counts as zero so
        every rank sends the same buckets."""
        if self.accelerator.num_processes == 1:
            return
        import torch.distributed as dist
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        # which parameters got a gradient on any rank: one that none did stays without one (as in one process,
        # where the optimizer skips it, weight decay and momentum included)
        had = torch.tensor([p.grad is not None for p in params], dtype=torch.float32, device=self.accelerator.device)
        had = self.accelerator.reduce(had, reduction="sum").cpu()
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        bucket: list[torch.Tensor] = []
        size = 0
        for k, g in enumerate(grads):
            bucket.append(g)
            size += g.numel()
            if size >= 2**24 or k == len(grads) - 1:  # 16M elements (64 MB fp32) per all-reduce
                flat = _flatten_dense_tensors(bucket)
                dist.all_reduce(flat)
                for dst, src in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                    dst.copy_(src)
                bucket, size = [], 0
        for p, any_rank in zip(params, had.tolist()):
            if not any_rank:
                p.grad = None

    def _broadcast_parameters(self) -> None:
        """Rank 0's policy and critic weights on every rank before the first update (what DDP does when it
        wraps a model): a head initialised at random on load (e.g. a value model's new score layer) would
        otherwise differ between ranks."""
        if self.accelerator.num_processes == 1:
            return
        import torch.distributed as dist

        with torch.no_grad():
            for p in self._trainable_parameters():
                dist.broadcast(p.data, src=0)

    def _pack(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> dict[str, Any]:
        # Each completion has its own prompt, but the prompts start alike (the chat template's system prompt and
        # the task's instruction): with toolkit_varlen that start is laid out once per batch and every sequence
        # attends to it. Same log-probs, values and gradients as separate sequences, fewer tokens through every
        # forward and backward (bench/ppo_vs_trl.py: 27 of 58 tokens per sequence).
        batch = pack_for_layout(self.packed_layout, prompts, completions,
                                pad_token_id=self.processing_class.pad_token_id)
        # on the training device: PPO runs its own forwards, so Trainer's input placement never sees these batches
        return {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    # ----------------------------------------------------------------------------------- rollout

    @torch.no_grad()
    def generate_rollout(self, row_indices: Sequence[int], update: int) -> PPORollout:
        """Sample one completion per prompt, score it, and compute pi_old, reference, values, rewards and GAE."""
        args = self.args
        t0 = time.perf_counter()
        prompts = [self.prompt_ids[i] for i in row_indices]
        seed = generation_seed(args.seed, update, self.accelerator.process_index)  # ranks draw different samples
        self.generation_backend.sync_weights(self.model)
        groups = self.generation_backend.generate(prompts, self.sampling, n=1, seed=seed)
        after_generation(self.generation_backend)  # a colocated engine gives its GPU memory to the training pass
        completions = [g[0].token_ids for g in groups]
        device = self.args.device
        truncated = torch.tensor([g[0].finish_reason == "length" for g in groups], device=device)
        sampler = [torch.tensor(g[0].logprobs, dtype=torch.float32) for g in groups]
        t_gen = time.perf_counter() - t0

        t1 = time.perf_counter()
        scores = self.compute_rewards([self.rows[i] for i in row_indices], prompts, completions).to(device)
        if args.missing_eos_penalty is not None:
            scores = torch.where(truncated, scores - args.missing_eos_penalty, scores)
        t_score = time.perf_counter() - t1

        t2 = time.perf_counter()
        batch = self._pack(prompts, completions)
        lengths = batch["completion_lengths"]
        T = int(lengths.max())
        mask = torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]
        was = self.model.training
        self.model.eval()
        with self.accelerator.autocast():  # bf16=True: the update's forwards run under the same autocast
            hidden = completion_hidden(self.model, batch)
            logps = tokens_to_rows(self.compute_token_logps(self.model, batch, hidden=hidden), mask)
            ref_ctx = unwrap_peft(self.model).disable_adapter() if self.ref_model is None else contextlib.nullcontext()
            with ref_ctx:
                ref_model = self.ref_model if self.ref_model is not None else self.model
                ref_logps = tokens_to_rows(self.compute_token_logps(ref_model, batch), mask)
            values = tokens_to_rows(self.compute_values(batch, hidden=hidden), mask)
        self.model.train(was)
        t_fwd = time.perf_counter() - t2

        kl = kl_estimate(logps, ref_logps, args.kl_estimator) * mask
        rewards = -self.kl_controller.value * kl
        last = lengths - 1
        rewards[torch.arange(len(prompts), device=last.device), last] += scores
        if args.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False, reduce=self._sum_over_ranks)
        advantages, returns = self.compute_advantages(rewards, values, mask)
        rollout = PPORollout(
            row_indices=list(row_indices), prompt_ids=prompts, completion_ids=completions, mask=mask, logps=logps,
            ref_logps=ref_logps, sampler_logps=tokens_to_rows(torch.cat(sampler).to(device), mask), values=values,
            rewards=rewards, advantages=advantages, returns=returns, scores=scores, kl=kl, truncated=truncated)
        rollout.metrics = self._rollout_metrics(rollout, t_gen, t_score, t_fwd)
        return rollout

    def compute_rewards(self, rows: list[dict[str, Any]], prompts: list[list[int]],
                        completions: list[list[int]]) -> torch.Tensor:
        """[B] scores on the training device: weighted reward functions plus the reward model. Override to score
        differently."""
        total = torch.zeros(len(rows), device=self.args.device)
        if self.reward_runner is not None:
            outcome, _ = score_completions(self.reward_runner, self.processing_class, rows, completions,
                                           conversational=self.dataset_format.conversational,
                                           extra_columns=self.dataset_format.extra_columns)
            per_func = torch.tensor(outcome.rewards, dtype=torch.float32)  # [F, B], NaN = failed
            for name, values in zip(self.reward_runner.names, per_func):
                self._step_metrics[f"rewards/{name}/mean"].append(float(values.nanmean()))
                if torch.isnan(values).any() or torch.isinf(values).any():
                    # PPO has no group to drop a row from; a missing reward would be a silent 0.
                    raise TrainingHealthError(
                        f"PPO: reward function '{name}' gave no finite reward for "
                        f"{int((~torch.isfinite(values)).sum())} of {len(rows)} completions ({outcome.failures.get(name, 0)} failures). Every completion "
                        "needs a score in PPO; fix the function or return 0 for unscoreable rows.")
            total += (per_func * self.reward_weights[:, None]).sum(0).to(total.device)
        if self.reward_model is not None:
            batch = self._pack(prompts, completions)
            with self.accelerator.autocast():
                rm_scores = self.reward_model(batch, positions=batch["sequence_ends"])  # at each sequence's last token
            self._step_metrics["rewards/reward_model/mean"].append(float(rm_scores.mean()))
            total += self.args.reward_model_weight * rm_scores
        return total

    def compute_advantages(self, rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) per token: GAE, then whitening over the update's tokens on every rank. Override for
        another estimator."""
        advantages, returns = gae(rewards, values, mask, gamma=self.args.gamma, lam=self.args.lam)
        if self.args.whiten_advantages:
            advantages = masked_whiten(advantages, mask, reduce=self._sum_over_ranks)  # over every rank's tokens
        return advantages, returns

    # ------------------------------------------------------------------------------ forward passes

    def compute_token_logps(self, model: nn.Module, batch: dict[str, Any], hidden: torch.Tensor | None = None
                            ) -> torch.Tensor:
        """Flat [N] log-probs of the completion tokens at the sampling temperature (the wrapper seam: an override's
        log-probs are what the loss and the rollout read; no entropy comes with them then)."""
        return self._token_pass(model, batch, hidden).logps

    def forward_tokens(self, model: nn.Module, batch: dict[str, Any], hidden: torch.Tensor | None = None
                       ) -> TokenLogps:
        """The completion tokens' log-probs with the entropy of the same forward (`hidden` reuses one). A
        subclass's `compute_token_logps` is honoured (its log-probs only)."""
        if type(self).compute_token_logps is not PPOTrainer.compute_token_logps:
            return TokenLogps(self.compute_token_logps(model, batch, hidden=hidden))
        return self._token_pass(model, batch, hidden)

    def _token_pass(self, model: nn.Module, batch: dict[str, Any], hidden: torch.Tensor | None) -> TokenLogps:
        # an update's entropy comes from the same LM-head product (one fewer per micro-batch); a separate or base
        # critic runs a forward before backward, so the head's activations are kept only for the shared head
        return completion_token_pass(model, batch, temperature=self.args.temperature,
                                     chunk_size=self.args.logps_chunk_size, upcast=self.args.fp32_lm_head,
                                     hidden=hidden, keep_for_backward=self.critic_kind == "head")

    def compute_values(self, batch: dict[str, Any], hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Flat [N] values V(s_t) at the completion tokens; `hidden` is the policy's (used by critic='head')."""
        if self.critic_kind == "separate":
            return self.critic(batch)
        if self.critic_kind == "base":
            with torch.no_grad(), unwrap_peft(self.model).disable_adapter():
                hidden = completion_hidden(self.model, batch)
        return self.critic(hidden=hidden)

    def compute_policy_loss(self, inputs: PolicyLossInputs, *legacy: torch.Tensor
                            ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token policy loss [b, T] and its masks: the registered `loss_type` (`ppo`: the clipped surrogate) on
        per-token advantages (the wrapper seam).

        Before toolkit 0.2.x this seam took `(logps, old_logps, advantages, mask)`; until 0.3 both forms work, with
        a ToolkitDeprecationWarning for the old one (as GRPO's seam)."""
        if legacy:
            inputs = legacy_policy_loss_inputs(type(self).__name__, inputs, *legacy)
        return self.policy_loss(inputs, self.loss_settings)

    def compute_value_loss(self, values, old_values, returns, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token clipped value loss [b, T] and where the clip won."""
        return clipped_value_loss(values, old_values, returns, clip_range=self.args.cliprange_value)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Policy loss + vf_coef x value loss on one micro-batch: token sums divided by `inputs["loss_tokens"]`,
        the token count of the whole mini-batch over its micro-batches and every rank (this micro-batch's own
        count when absent). Gradient accumulation and several processes then add up to the token mean over the
        mini-batch, the masked mean TRL takes when a mini-batch is one micro-batch in one process.

        With return_outputs, the statistics come back as token sums (tensors), with their count in "tokens".
        """
        mask = inputs["mask"]
        denom = inputs.get("loss_tokens", mask.sum())
        hidden = completion_hidden(model, inputs)
        tokens = self.forward_tokens(model, inputs, hidden=hidden)
        logps = tokens_to_rows(tokens.logps, mask)
        values = tokens_to_rows(self.compute_values(inputs, hidden=hidden), mask)
        pg, info = self._policy_term(PolicyLossInputs(logps, inputs["old_logps"], inputs["advantages"],
                                                      loss_mask=mask, sampler_logps=inputs.get("sampler_logps")))
        vf, vf_clipped = self.compute_value_loss(values, inputs["old_values"], inputs["returns"], mask)
        pg_sum, vf_sum = (pg * mask).sum(), (vf * mask).sum()
        loss = (pg_sum + self.args.vf_coef * vf_sum) / denom
        for name, t in (("loss", loss), ("logps", logps), ("values", values)):
            if not torch.isfinite(t).all():
                raise TrainingHealthError(f"PPO update {self.state.global_step}: '{name}' holds NaN or inf. Lower the "
                                          "learning rate, check the reward scale, or raise vf_coef/cliprange_value.")
        if not return_outputs:
            return loss
        with torch.no_grad():
            diff = (logps - inputs["old_logps"]) * mask
            clipped = ((info["clipped_low"] | info["clipped_high"]) & mask if "clipped_low" in info
                       else torch.zeros_like(mask))  # a loss without a clip reports none
            entropy = tokens.entropy
            if entropy is None or entropy.shape[0] != hidden.shape[0]:
                entropy = completion_entropy(model, hidden, temperature=self.args.temperature,
                                             chunk_size=self.args.logps_chunk_size, upcast=self.args.fp32_lm_head)
            sums = {"loss/policy": pg_sum.detach(), "loss/value": vf_sum.detach(),
                    "policy/approxkl": 0.5 * (diff ** 2).sum(), "policy/clipfrac": clipped.sum(),
                    "val/clipfrac": (vf_clipped & mask).sum(), "policy/entropy": entropy.sum(),
                    "policy/ratio": (torch.exp(diff) * mask).sum(), "tokens": mask.sum()}
        return loss, {k: v.double() for k, v in sums.items()}

    # ------------------------------------------------------------------------------- the update

    def _micro_batch(self, r: PPORollout, rows: Sequence[int]) -> dict[str, Any]:
        rows = list(rows)
        batch = self._pack([r.prompt_ids[i] for i in rows], [r.completion_ids[i] for i in rows])
        T = int(batch["completion_lengths"].max())
        batch["mask"] = r.mask[rows, :T]
        for key, src in (("old_logps", r.logps), ("old_values", r.values), ("advantages", r.advantages),
                         ("returns", r.returns), ("sampler_logps", r.sampler_logps)):
            batch[key] = src[rows, :T]
        return batch

    def ppo_update(self, rollout: PPORollout, update: int) -> dict[str, float]:
        """num_ppo_epochs x num_mini_batches optimizer steps on one rollout; returns averaged statistics.

        With several processes each rank holds its share of the update's completions; the mini-batches are
        drawn from one permutation of all ranks' completions, each rank trains its rows of each, the loss is
        divided by the mini-batch's token count over all ranks, and the ranks' gradients are summed before the
        step, so N processes take the steps one process with the whole rollout would (tests/integration/test_multiprocess.py,
        with one and with two mini-batches). Early stopping reads the global approximate KL, so every rank stops
        at the same mini-batch.
        """
        args = self.args
        B = len(rollout.completion_ids)
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        mb_global = B * world // args.num_mini_batches
        micro = args.per_device_train_batch_size
        stats: dict[str, list[float]] = defaultdict(list)
        params = [p for p in self._trainable_parameters()]
        epochs_done, stopped = 0, False
        self.model.train()
        self.critic.train()
        for epoch in range(args.num_ppo_epochs):
            # One permutation of the update's completions over all ranks (rank k holds global rows k*B..k*B+B-1),
            # so every mini-batch holds the rows one process would put in it; each rank trains its own share of
            # it (the shares differ in size; the collectives below are once per mini-batch on every rank).
            g = torch.Generator().manual_seed(generation_seed(args.seed, update, epoch))
            perm = torch.randperm(B * world, generator=g).tolist()
            for m in range(args.num_mini_batches):
                idx = [i - rank * B for i in perm[m * mb_global:(m + 1) * mb_global] if rank * B <= i < (rank + 1) * B]
                loss_tokens = self._sum_over_ranks(rollout.mask[idx].sum().double()).float()
                # the same keys on every rank, also one with no rows in this mini-batch (they are reduced together)
                sums = {k: torch.zeros((), dtype=torch.float64, device=self.args.device) for k in _STAT_KEYS}
                for k in range(0, len(idx), micro):
                    batch = self._micro_batch(rollout, idx[k:k + micro])
                    batch["loss_tokens"] = loss_tokens
                    with self.accelerator.autocast():  # bf16=True; PPO's loop is its own, outside accelerate's wrap
                        loss, s = self.compute_loss(self.model, batch, return_outputs=True)
                    loss.backward()
                    for name in _STAT_KEYS:
                        sums[name] = sums[name] + s[name].to(sums[name].device)
                self._all_reduce_gradients(params)
                keys = sorted(sums)
                total = dict(zip(keys, self._sum_over_ranks(torch.stack([sums[k] for k in keys])).tolist()))
                n_tok = max(total.pop("tokens"), 1.0)
                for name, v in total.items():
                    stats[name].append(v / n_tok)
                if args.max_grad_norm is not None and args.max_grad_norm > 0:
                    stats["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                mb_kl = total["policy/approxkl"] / n_tok
                if args.early_stop_approx_kl is not None and mb_kl > args.early_stop_approx_kl:
                    stopped = True
                    break
            epochs_done += 1
            if stopped:
                logger.info("update %d: approximate KL %.4f > early_stop_approx_kl=%s after epoch %d; next rollout.",
                            update + 1, mb_kl, args.early_stop_approx_kl, epoch + 1)
                break
        out = {f"{k}_avg" if k.startswith(("loss/", "policy/", "val/clipfrac")) else k: sum(v) / len(v)
               for k, v in stats.items()}
        out["ppo_epochs_done"] = float(epochs_done)
        out["early_stopped"] = float(stopped)
        return out

    def _trainable_parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for module in (self.model, self.critic):
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def create_optimizer(self, model=None):
        """One AdamW over the policy's and the critic's trainable parameters (no decay on biases and norms)."""
        if self.optimizer is None:
            decay = set()
            for module in (self.model, self.critic):
                names = set(self.get_decay_parameter_names(module))
                decay.update(id(p) for n, p in module.named_parameters() if n in names)
            params = self._trainable_parameters()
            groups = [{"params": [p for p in params if id(p) in decay], "weight_decay": self.args.weight_decay},
                      {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0}]
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
            self.optimizer = cls([g for g in groups if g["params"]], **kwargs)
        return self.optimizer

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs) -> TrainOutput:
        """The PPO loop; `resume_from_checkpoint=True` picks the newest complete checkpoint (exact resume)."""
        args = self.args
        total = self.num_updates()
        self.create_optimizer()
        self.create_scheduler(num_training_steps=total, optimizer=self.optimizer)  # stepped once per update
        if getattr(args, "activation_checkpointing", None) or getattr(args, "gradient_checkpointing", False):
            ckpt_kwargs = getattr(args, "activation_checkpointing_kwargs", None)
            if ckpt_kwargs is None:
                ckpt_kwargs = getattr(args, "gradient_checkpointing_kwargs", None)
            ckpt_kwargs = dict({"use_reentrant": False} if ckpt_kwargs is None else ckpt_kwargs)
            # transformers' Trainer reads these two itself and hands the rest to torch.utils.checkpoint, which
            # would raise on them; PPO enables checkpointing on two models itself and supports neither.
            for key in ("every_n_layers", "offload"):
                if ckpt_kwargs.pop(key, None) is not None:
                    raise ConfigError(f"activation_checkpointing_kwargs: '{key}' is not supported by PPO (it "
                                      "checkpoints every layer of policy and critic); remove it.")
            for m in (self.model, self.critic.backbone):
                # transformers >= 5.2x renamed gradient_checkpointing_enable (the old name warns)
                if hasattr(m, "activation_checkpointing_enable"):
                    m.activation_checkpointing_enable(activation_checkpointing_kwargs=ckpt_kwargs)
                elif hasattr(m, "gradient_checkpointing_enable"):
                    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
        start = 0
        path = resolve_resume(resume_from_checkpoint, args.output_dir)
        if path is not None:
            start = self._load_checkpoint(path)
            logger.info("Resuming PPO from %s (update %d of %d).", path, start, total)
        self._broadcast_parameters()
        self.state.global_step, self.state.max_steps = start, total
        self.state.logging_steps, self.state.save_steps = args.logging_steps, args.save_steps
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        started, losses = time.perf_counter(), []
        for update in range(start, total):
            self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
            rollout = self.generate_rollout(self._prompts_for_update(update), update)
            t = time.perf_counter()
            stats = self.ppo_update(rollout, update)
            stats["time/train_s"] = time.perf_counter() - t
            global_batch = args.rollout_batch_size * self.accelerator.num_processes
            self.kl_controller.update(rollout.metrics["objective/kl"], global_batch)  # the same KL on every rank
            self.lr_scheduler.step()
            self.state.global_step = update + 1
            self.state.epoch = (update + 1) * global_batch / len(self.rows)
            losses.append(stats.get("loss/policy_avg", 0.0) + args.vf_coef * stats.get("loss/value_avg", 0.0))
            logs = {"loss": round(losses[-1], 6), **rollout.metrics, **stats, "kl_coef": self.kl_controller.value,
                    "learning_rate": self.lr_scheduler.get_last_lr()[0]}
            logs.update(self._mean_over_ranks({name: sum(v) / len(v) for name, v in self._step_metrics.items()}))
            self._step_metrics = defaultdict(list)
            self.control = self.callback_handler.on_step_end(args, self.state, self.control)
            if args.logging_steps and (update + 1) % int(args.logging_steps) == 0:
                self.log(logs)
            if args.save_strategy == "steps" and args.save_steps and (update + 1) % int(args.save_steps) == 0:
                self._save_checkpoint_ppo()
            if self.control.should_training_stop:
                break
        self.control = self.callback_handler.on_train_end(args, self.state, self.control)
        runtime = time.perf_counter() - started
        mean_loss = sum(losses) / len(losses) if losses else 0.0
        return TrainOutput(self.state.global_step, mean_loss, {"train_runtime": runtime, "train_loss": mean_loss})

    # ----------------------------------------------------------------------------- checkpoints

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The policy (a loadable transformers model or adapter) plus the critic's weights in `critic.safetensors`,
        written into a staging folder and moved in file by file as every trainer's save is (TrainerLifecycle).

        Only the main process writes (`should_save`), as Trainer.save_model does.
        """
        target = self._save_target(output_dir, _internal_call)
        if target is None or not self.args.should_save:
            return
        from safetensors.torch import save_file

        staging = target / STAGING
        if staging.exists():
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        self.model.save_pretrained(staging)
        self.processing_class.save_pretrained(staging)
        save_file({k: v.detach().contiguous() for k, v in self.critic.state_dict().items()},
                  str(staging / CRITIC_FILE))
        write_model_card(self, staging)
        publish_folder(staging, target)

    def _save_checkpoint_ppo(self) -> None:
        """checkpoint-N with policy, critic, optimizer, scheduler, KL coefficient and trainer state.

        PPO owns its loop, so it owns its checkpoints too (Trainer's _save_checkpoint is never called), with
        the contract every trainer has (toolkit.core.checkpoint): written into a staging folder, marked
        complete, renamed into place, and only then old checkpoints rotated (`save_total_limit`); no
        pickle (tensors load with weights_only=True).
        """
        if not self.args.should_save:
            return
        step = self.state.global_step
        staging = begin_checkpoint(self.args.output_dir, step)
        self.save_model(str(staging))
        torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.lr_scheduler.state_dict()},
                   staging / STATE_FILE)
        write_atomic(staging / STATE_JSON, json.dumps({"kl_coef": self.kl_controller.value, "global_step": step,
                                                       "critic": self.critic_kind}))
        self.state.save_to_json(str(staging / "trainer_state.json"))
        commit_checkpoint(staging, self.args.output_dir, step, save_total_limit=self.args.save_total_limit)
        self.control = self.callback_handler.on_save(self.args, self.state, self.control)  # plugins hear of it

    def _load_checkpoint(self, path: str) -> int:
        from safetensors.torch import load_file
        from transformers import TrainerState

        folder = Path(path)
        # Everything that can refuse the checkpoint is checked before anything is loaded into this trainer.
        if not (folder / STATE_JSON).exists() or not (folder / CRITIC_FILE).exists():
            raise ConfigError(f"resume_from_checkpoint: '{path}' has no {STATE_JSON} or {CRITIC_FILE}; it was written "
                              "by toolkit 0.1, whose PPO state was a pickle that toolkit no longer loads. Start a new run.")
        loop = json.loads((folder / STATE_JSON).read_text())
        critic_state = load_file(folder / CRITIC_FILE)
        # toolkit 0.2 records the layout; before that only a separate critic's weights hold a backbone (a head
        # and a base critic save the same single layer, so an unrecorded one is taken as this trainer's)
        has_backbone = any(k.startswith("backbone.") for k in critic_state)
        written = loop.get("critic") or ("separate" if has_backbone else
                                         self.critic_kind if self.critic_kind != "separate" else "head")
        if written != self.critic_kind:
            hint = f"set critic='{written}'" + ("" if written == "separate" else " and pass no value_model")
            raise ConfigError(f"resume_from_checkpoint: '{path}' was trained with critic='{written}', but this trainer's "
                              f"critic is '{self.critic_kind}' (the default became 'head' in toolkit 0.2); {hint} to "
                              "resume it.")
        if (folder / "adapter_model.safetensors").exists():
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_file(folder / "adapter_model.safetensors"))
        else:
            missing, unexpected = self.model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)
            tied = set(getattr(self.model, "_tied_weights_keys", None) or []) | {"lm_head.weight"}
            if unexpected or [k for k in missing if k not in tied]:
                raise ConfigError(f"resume_from_checkpoint: '{path}' does not match this policy (missing "
                                  f"{missing[:3]}, unexpected {unexpected[:3]}).")
        self.critic.load_state_dict(critic_state)
        # never unpickles code; onto the CPU first (written from one GPU, read on every rank's own or on none),
        # and load_state_dict moves the optimizer's state to each parameter's device
        tensors = torch.load(folder / STATE_FILE, weights_only=True, map_location="cpu")
        self.optimizer.load_state_dict(tensors["optimizer"])
        self.lr_scheduler.load_state_dict(tensors["scheduler"])
        self.kl_controller.value = loop["kl_coef"]
        previous = TrainerState.load_from_json(str(folder / "trainer_state.json"))
        self.state.log_history = previous.log_history
        return int(loop["global_step"])

    # ------------------------------------------------------------------------------ helpers

    def _rollout_metrics(self, r: PPORollout, t_gen: float, t_score: float, t_fwd: float) -> dict[str, float]:
        """The update's rollout statistics over every rank's completions (sums reduced, then divided), so the
        logged numbers and the adaptive KL controller (which reads objective/kl) are the same on every rank.
        Timings and generation speed are this rank's."""
        m = r.mask
        lengths = m.sum(1).float()
        non_score = (-self.kl_controller.value * r.kl).sum(1)
        mismatch = (r.sampler_logps - r.logps).abs()[m]
        seq = {"objective/scores": r.scores, "objective/kl": r.kl.sum(1), "objective/non_score_reward": non_score,
               "objective/rlhf_reward": non_score + r.scores, "objective/entropy": (-r.logps * m).sum(1),
               "completions/mean_length": lengths, "completions/clipped_ratio": r.truncated.float()}
        tok = {"objective/kl_per_token": r.kl[m], "objective/reward_per_token": r.rewards[m], "val/mean": r.values[m],
               "val/returns_mean": r.returns[m], "sampler/logp_abs_diff_mean": mismatch}
        keys = list(seq) + list(tok)
        count = torch.tensor(float(len(r.scores)), dtype=torch.float64, device=m.device)  # stack wants one device
        local = torch.stack([v.double().sum() for v in seq.values()] + [v.double().sum() for v in tok.values()]
                            + [count, m.sum().double(), (r.scores.double() ** 2).sum()])
        total = self._sum_over_ranks(local).tolist()
        n_seq, n_tok, sq = total[-3], max(total[-2], 1.0), total[-1]
        out = {k: v / (n_seq if k in seq else n_tok) for k, v in zip(keys, total)}
        mean = out["objective/scores"]
        out["objective/scores_std"] = math.sqrt(max(sq - n_seq * mean ** 2, 0.0) / max(n_seq - 1, 1.0))  # unbiased
        worst = mismatch.max() if mismatch.numel() else torch.zeros(())
        if self.accelerator.num_processes > 1:
            import torch.distributed as dist

            worst = worst.double().to(self.accelerator.device)  # nccl reduces device tensors only
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            worst = worst.cpu()
        out["sampler/logp_abs_diff_max"] = float(worst)
        out["val/explained_variance"] = explained_variance(r.values, r.returns, m, reduce=self._sum_over_ranks)
        out.update({"time/generation_s": t_gen, "time/scoring_s": t_score, "time/rollout_forward_s": t_fwd,
                    "generation_tokens_per_s": float(m.sum()) / max(t_gen, 1e-9)})
        return out


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The PEFT model under DDP wrappers (where `disable_adapter` lives)."""
    while hasattr(model, "module"):
        model = model.module
    return model
