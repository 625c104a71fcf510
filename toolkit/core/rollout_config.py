"""The settings every trainer that samples from its own policy shares: prompts, sampling, the generation
backend, reward functions and the LM head.

`RolloutConfig` is the base of `PPOConfig` and of the GRPO family's configs (`GroupRolloutConfig`, then
`GRPOConfig`, `AsyncGRPOConfig` and the experimental online DPO and GKD): a field means the same thing in each
of them and is checked here once, before any model loads. What is particular to one method (its loss, its
`beta`) is declared by that method's own config, never inherited from another method and refused.
"""

from __future__ import annotations

__all__ = ["RolloutConfig"]

from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from .errors import ConfigError
from .generation import SamplingParams
from .models import BF16_HELP
from .numerics import DEFAULT_CHUNK_SIZE
from .plugins import registry


@dataclass
class RolloutConfig(TrainingArguments):
    """`TrainingArguments` plus sampling, generation backend, reward and LM-head settings (TRL's names).

    A subclass resolves its defaults that must precede `TrainingArguments.__post_init__` (activation
    checkpointing) first, then calls `super().__post_init__()`, which checks every field below.
    """

    logging_steps: float = field(default=1, metadata={"help": "Log every this many optimizer steps."})
    report_to: Any = field(default="none", metadata={"help": "Integrations to report to."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Kept False (rows are looked up by index)."})
    optim: str = field(default="adamw_torch_fused", metadata={"help": "Optimizer (TrainingArguments names)."})

    bf16: bool | None = field(default=None, metadata={"help": BF16_HELP})
    max_prompt_length: int | None = field(default=512, metadata={
        "help": "Prompts longer than this many tokens are cut from the left, and the count reported."})
    max_completion_length: int = field(default=64, metadata={"help": "Most tokens sampled per completion."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; the trainer's log-probs use "
                                                              "the same temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass (1.0 = off)."})
    top_k: int = field(default=0, metadata={"help": "Sample among the k most likely tokens (0 = off)."})
    min_p: float = field(default=0.0, metadata={"help": "Drop tokens below min_p x the top probability (0 = off)."})
    stop_token_ids: list[int] | None = field(default=None, metadata={
        "help": "Tokens that end a completion; default: the tokenizer's EOS."})
    generation_batch_size: int = field(default=256, metadata={
        "help": "Most sequences the transformers backend decodes at once."})
    generation_backend: str = field(default="transformers", metadata={
        "help": "Generation backend by name: transformers | a registered backend (e.g. vllm)."})
    generation_backend_kwargs: dict | None = field(default=None, metadata={
        "help": "Settings passed to the generation backend's factory; the transformers backend takes only dtype "
                "and static_decode (checked here). A backend object handed to the trainer is already built and "
                "reads none."})

    reward_weights: list[float] | None = field(default=None, metadata={"help": "One weight per reward function."})
    reward_timeout: float = field(default=60.0, metadata={"help": "Seconds a reward function may take per batch."})
    reward_max_consecutive_failures: int = field(default=3, metadata={
        "help": "Stop the run (naming the function, its error and the columns it got) when a reward function fails "
                "on this many batches in a row; a failure is an exception, a timeout, a wrong length, or NaN."})

    logps_chunk_size: int = field(default=DEFAULT_CHUNK_SIZE, metadata={"help": "Chunk size of the LM head."})
    fp32_lm_head: bool = field(default=True, metadata={"help": "Compute the LM head in fp32."})
    model_dtype: str = field(default="float32", metadata={"help": "dtype for a model given by name."})
    model_init_kwargs: dict | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when the model is given by name (TRL's "
                                        "field); the trainer's model_init_kwargs argument adds to them."})
    chat_template_kwargs: dict | None = field(default=None, metadata={"help": "Extra apply_chat_template kwargs."})

    def __post_init__(self):
        super().__post_init__()
        # TRL's None for these means "off" / "derived": ours are numbers (a TRL config's values pass as they mean)
        if self.min_p is None:
            self.min_p = 0.0
        if self.generation_batch_size is None:
            self.generation_batch_size = 256
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ConfigError(f"max_prompt_length: must be >= 1 or None (no cut), got {self.max_prompt_length}.")
        if self.max_completion_length < 1:
            raise ConfigError(f"max_completion_length: must be >= 1, got {self.max_completion_length}.")
        if not self.reward_timeout > 0:
            raise ConfigError(f"reward_timeout: must be > 0 seconds, got {self.reward_timeout}.")
        if self.reward_max_consecutive_failures < 1:
            raise ConfigError(f"reward_max_consecutive_failures: must be >= 1, got "
                              f"{self.reward_max_consecutive_failures}.")
        if self.logps_chunk_size < 1:
            raise ConfigError(f"logps_chunk_size: must be >= 1, got {self.logps_chunk_size}.")
        registry().get("generation_backend", self.generation_backend, field="generation_backend")
        if self.generation_backend == "transformers":
            from .generation import _check_transformers_backend_kwargs

            _check_transformers_backend_kwargs(self.generation_backend_kwargs)  # before any model loads
        SamplingParams(max_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p,
                       top_k=self.top_k, min_p=self.min_p)  # validates the sampling fields

    def sampling_params(self, eos_token_id: int) -> SamplingParams:
        """The sampler's settings for a tokenizer whose end-of-sequence id is `eos_token_id` (the default stop)."""
        stop = self.stop_token_ids if self.stop_token_ids is not None else [eos_token_id]
        return SamplingParams(max_tokens=self.max_completion_length, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, min_p=self.min_p, stop_token_ids=tuple(stop))
