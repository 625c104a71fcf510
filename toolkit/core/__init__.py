"""toolkit.core: the stable, semver-guaranteed API."""

from . import attention as _attention  # noqa: F401  (registers the `toolkit_varlen` attention implementation)
from .checkpoint import latest_complete_checkpoint
from .data import DatasetFormat, SFTCollator, as_rows, detect_format, normalize_rows, tokenize_for_sft, validate
from .dpo import PREFERENCE_LOSSES, DPOConfig, DPOTrainer
from .errors import ConfigError, DataError, ToolkitError, TrainingHealthError
from .generation import Completion, GenerationBackend, SamplingParams, TransformersBackend
from .grpo import POLICY_LOSSES, GRPOConfig, GRPOTrainer
from .models import DEFAULT_MODEL, embedded_model_path, load_model, load_tokenizer
from .numerics import (
    aggregate,
    chunked_entropy,
    chunked_token_logps,
    clipped_surrogate,
    group_advantages,
    kl_estimate,
    masked_mean,
    masked_sum,
    preference_loss,
    truncated_importance_weights,
)
from .rewards import format_reward, length_penalty, numeric_match, parse_number
from .sft import SFTConfig, SFTTrainer

__all__ = [
    "DEFAULT_MODEL",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "DPOConfig",
    "DPOTrainer",
    "preference_loss",
    "Completion",
    "GRPOConfig",
    "GRPOTrainer",
    "GenerationBackend",
    "SamplingParams",
    "TransformersBackend",
    "clipped_surrogate",
    "format_reward",
    "group_advantages",
    "length_penalty",
    "numeric_match",
    "parse_number",
    "truncated_importance_weights",
    "ConfigError",
    "DataError",
    "DatasetFormat",
    "SFTCollator",
    "SFTConfig",
    "SFTTrainer",
    "ToolkitError",
    "TrainingHealthError",
    "aggregate",
    "as_rows",
    "chunked_entropy",
    "chunked_token_logps",
    "detect_format",
    "embedded_model_path",
    "kl_estimate",
    "latest_complete_checkpoint",
    "load_model",
    "load_tokenizer",
    "masked_mean",
    "masked_sum",
    "normalize_rows",
    "tokenize_for_sft",
    "validate",
]
