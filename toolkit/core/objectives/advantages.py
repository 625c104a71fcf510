"""Advantage estimators for the GRPO family: total rewards of a step's groups -> per-completion advantages.

An estimator returns `(advantages [R], zero_std [R] bool)`; `zero_std` marks rows whose group carries no
learning signal (all rewards equal, or fewer than two rewarded rows), which `zero_variance_filter` drops.
The formulas live in numerics (group_advantages, rloo_advantages) with their naive references in tests.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ToolkitDeprecationWarning
from ..numerics import SCALE_REWARDS, group_advantages, rloo_advantages
from .settings import NoSettings, _LegacyConfigSettings, SettingsError, resolve_settings

__all__ = [
    "BUILTIN_ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "GroupScaleSettings",
    "resolve_estimator_settings",
]


@dataclass
class AdvantageInputs:
    """The rewards of one optimizer step: [R] totals, groups of `group_size` contiguous rows; NaN = no reward."""

    rewards: torch.Tensor
    group_size: int


@dataclass(frozen=True)
class AdvantageEstimator:
    """A named estimator: `fn(inputs, settings) -> (advantages [R], zero_std [R] bool)`."""

    fn: Callable[[AdvantageInputs, Any], tuple[torch.Tensor, torch.Tensor]]
    settings: type = NoSettings
    description: str = ""

    def __post_init__(self):
        if not dataclasses.is_dataclass(self.settings):
            raise TypeError(f"AdvantageEstimator.settings: must be a dataclass type, got {self.settings!r}.")

    def __call__(self, inputs: AdvantageInputs, settings: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(inputs, settings)


@dataclass(frozen=True)
class GroupScaleSettings:
    """scale_rewards: group (divide by the group's std) | batch (by the std of the batch's raw rewards, as TRL) |
    batch_centred (by the batch std of the group-centred rewards; ScaleRL) | none (Dr. GRPO)."""

    scale_rewards: str = "group"

    def __post_init__(self):
        if self.scale_rewards not in SCALE_REWARDS:
            raise SettingsError("scale_rewards", f"'{self.scale_rewards}' is not one of {list(SCALE_REWARDS)}.")


def _grpo(inputs: AdvantageInputs, settings: GroupScaleSettings) -> tuple[torch.Tensor, torch.Tensor]:
    return group_advantages(inputs.rewards, inputs.group_size, scale=settings.scale_rewards)


def _rloo(inputs: AdvantageInputs, settings: Any) -> tuple[torch.Tensor, torch.Tensor]:
    return rloo_advantages(inputs.rewards, inputs.group_size)


#: The built-in estimators (registered through the plugin hooks by builtin_plugin).
BUILTIN_ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "grpo": AdvantageEstimator(_grpo, GroupScaleSettings, "group mean baseline, scaled per scale_rewards"),
    "rloo": AdvantageEstimator(_rloo, NoSettings, "leave-one-out baseline, no scaling (ignores scale_rewards)"),
}



def resolve_estimator_settings(estimator: AdvantageEstimator, config: Any, *, name: str) -> Any:
    """Settings of estimator `name` from `config.advantage_estimator_kwargs` and same-named config fields."""
    if estimator.settings is _LegacyConfigSettings:
        return _LegacyConfigSettings(config)
    return resolve_settings(estimator.settings, config, kwargs=getattr(config, "advantage_estimator_kwargs", None),
                            kwargs_field="advantage_estimator_kwargs", owner=f"advantage_estimator '{name}'")


def legacy_advantage_estimator(fn: Callable[..., Any], *, name: str, origin: str) -> AdvantageEstimator:
    """Adapt a hooks-1.0 estimator `fn(rewards, *, group_size, config)` (deprecated in hooks 1.1)."""
    warnings.warn(
        f"advantage estimator '{name}' from {origin} uses the hooks-1.0 callable form fn(rewards, *, group_size, "
        "config), deprecated in hooks 1.1 (toolkit 0.2) and removed in hooks 2.0 (toolkit 0.3): register a "
        "toolkit.AdvantageEstimator(fn(inputs, settings), settings=<dataclass>) instead (docs/plugins.md).",
        ToolkitDeprecationWarning, stacklevel=2)

    def adapted(inputs: AdvantageInputs, settings: _LegacyConfigSettings):
        return fn(inputs.rewards, group_size=inputs.group_size, config=settings.config)

    return AdvantageEstimator(adapted, settings=_LegacyConfigSettings, description=(fn.__doc__ or "").strip()[:80])
