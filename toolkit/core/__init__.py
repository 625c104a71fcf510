"""toolkit.core: the stable, semver-guaranteed API."""

from . import attention as _attention  # noqa: F401  (registers the `toolkit_varlen` attention implementation)
from .async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from .checkpoint import latest_complete_checkpoint
from .data import DatasetFormat, SFTCollator, as_rows, detect_format, normalize_rows, tokenize_for_sft, validate
from .dpo import DPOConfig, DPOTrainer
from .errors import ConfigError, DataError, ToolkitError, TrainingHealthError
from .generation import AsyncGenerationBackend, Completion, GenerationBackend, SamplingParams, TransformersBackend
from .grpo import GRPOConfig, GRPOTrainer
from .hookspecs import HOOKS_VERSION, ToolkitDeprecationWarning, hookimpl
from .models import DEFAULT_MODEL, embedded_model_path, load_model, load_tokenizer
from .numerics import (
    aggregate,
    chunked_entropy,
    chunked_token_logps,
    clipped_surrogate,
    clipped_value_loss,
    explained_variance,
    gae,
    group_advantages,
    kl_estimate,
    masked_mean,
    masked_sum,
    masked_whiten,
    preference_loss,
    rloo_advantages,
    truncated_importance_weights,
)
from .plugins import PluginError, PluginRegistry, register, registry
from .ppo import PPOConfig, PPOTrainer
from .rewards import format_reward, length_penalty, numeric_match, parse_number
from .sft import SFTConfig, SFTTrainer

__all__ = [
    "DEFAULT_MODEL",
    "HOOKS_VERSION",
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "AsyncGenerationBackend",
    "Completion",
    "ConfigError",
    "DPOConfig",
    "DPOTrainer",
    "DataError",
    "DatasetFormat",
    "GRPOConfig",
    "GRPOTrainer",
    "GenerationBackend",
    "PPOConfig",
    "PPOTrainer",
    "PluginError",
    "PluginRegistry",
    "SFTCollator",
    "SFTConfig",
    "SFTTrainer",
    "SamplingParams",
    "ToolkitDeprecationWarning",
    "ToolkitError",
    "TrainingHealthError",
    "TransformersBackend",
    "aggregate",
    "as_rows",
    "chunked_entropy",
    "chunked_token_logps",
    "clipped_surrogate",
    "clipped_value_loss",
    "detect_format",
    "embedded_model_path",
    "explained_variance",
    "format_reward",
    "gae",
    "group_advantages",
    "hookimpl",
    "kl_estimate",
    "latest_complete_checkpoint",
    "length_penalty",
    "load_model",
    "load_tokenizer",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "normalize_rows",
    "numeric_match",
    "parse_number",
    "preference_loss",
    "register",
    "registry",
    "rloo_advantages",
    "tokenize_for_sft",
    "truncated_importance_weights",
    "validate",
]
