"""Preference losses for the DPO family: named objects with their own settings, on typed inputs.

Every loss here reads the implicit rewards' log-ratios z = log pi(y|x) - log pi_ref(y|x), summed over
each answer's tokens (with `reference_free` the reference term is 0), and returns a loss per pair; the
trainer weights (`loss_weights`) and averages. The formulas are `numerics.preference_loss`, whose
docstring cites the papers; this module only names them and checks their settings.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, ToolkitDeprecationWarning
from ..numerics import preference_loss
from .settings import NoSettings, _LegacyConfigSettings, SettingsError, resolve_settings

__all__ = [
    "BUILTIN_PREFERENCE_LOSSES",
    "DPOSettings",
    "PreferenceLoss",
    "PreferenceLossInputs",
    "RobustDPOSettings",
    "resolve_preference_loss_settings",
]


@dataclass
class PreferenceLossInputs:
    """One micro-batch of pairs, [B] each."""

    chosen_logratios: torch.Tensor     # log pi(chosen|x) - log pi_ref(chosen|x), with gradient
    rejected_logratios: torch.Tensor   # the same for the rejected answer
    chosen_lengths: torch.Tensor       # answer token counts (float), for per-token averaging (IPO)
    rejected_lengths: torch.Tensor
    # summed log pi(chosen|x), with gradient: the SFT term's input (None from trainers that do not compute it)
    chosen_logps: torch.Tensor | None = None


@dataclass(frozen=True)
class PreferenceLoss:
    """A named preference loss: `fn(inputs, settings) -> per-pair loss [B]`."""

    fn: Callable[[PreferenceLossInputs, Any], torch.Tensor]
    settings: type = NoSettings
    description: str = ""

    def __post_init__(self):
        if not dataclasses.is_dataclass(self.settings):
            raise TypeError(f"PreferenceLoss.settings: must be a dataclass type, got {self.settings!r}.")

    def __call__(self, inputs: PreferenceLossInputs, settings: Any) -> torch.Tensor:
        return self.fn(inputs, settings)


@dataclass(frozen=True)
class DPOSettings:
    """beta: strength of the implicit KL to the reference (tau for IPO). label_smoothing: cDPO's label noise."""

    beta: float = 0.1
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.beta <= 0:
            raise SettingsError("beta", f"must be > 0, got {self.beta}.")
        # Above 0.5 the smoothed target prefers the rejected answer: DPO would train the opposite preference.
        if not 0 <= self.label_smoothing <= 0.5:
            raise SettingsError("label_smoothing", f"must be in [0, 0.5] (above 0.5 it trains towards the rejected "
                                                   f"answer), got {self.label_smoothing}.")


@dataclass(frozen=True)
class RobustDPOSettings(DPOSettings):
    """rDPO divides by 1 - 2 label_smoothing, so 0.5 is excluded."""

    def __post_init__(self):
        super().__post_init__()
        if self.label_smoothing >= 0.5:
            raise SettingsError("label_smoothing", f"robust DPO needs [0, 0.5), got {self.label_smoothing}.")


@dataclass(frozen=True)
class _BetaSettings:
    beta: float = 0.1

    def __post_init__(self):
        if self.beta <= 0:
            raise SettingsError("beta", f"must be > 0, got {self.beta}.")


def _numerics_loss(kind: str) -> Callable[[PreferenceLossInputs, Any], torch.Tensor]:
    def loss(inputs: PreferenceLossInputs, settings: Any) -> torch.Tensor:
        return preference_loss(kind, inputs.chosen_logratios, inputs.rejected_logratios, beta=settings.beta,
                               label_smoothing=getattr(settings, "label_smoothing", 0.0),
                               chosen_lengths=inputs.chosen_lengths, rejected_lengths=inputs.rejected_lengths)

    loss.__name__ = kind
    return loss


def _sft_loss(inputs: PreferenceLossInputs, settings: Any) -> torch.Tensor:
    """The chosen answers' negative log-likelihood, averaged over all their tokens in the micro-batch (RPO's and
    MPO's SFT term; TRL's loss_type "sft"), as a per-pair tensor whose mean is that average."""
    if inputs.chosen_logps is None:
        raise SettingsError("loss_type", "'sft' needs the policy's chosen log-probs, which this trainer does not "
                                         "pass (PreferenceLossInputs.chosen_logps).")
    nll = -inputs.chosen_logps.sum() / inputs.chosen_lengths.sum().clamp(min=1.0)
    return nll.expand(inputs.chosen_logps.shape[0])


#: The built-in preference losses (registered through the plugin hooks by builtin_plugin).
BUILTIN_PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "sigmoid": PreferenceLoss(_numerics_loss("sigmoid"), DPOSettings, "DPO (Rafailov et al. 2023), cDPO smoothing"),
    "robust": PreferenceLoss(_numerics_loss("robust"), RobustDPOSettings, "rDPO (Chowdhury et al. 2024)"),
    "hinge": PreferenceLoss(_numerics_loss("hinge"), _BetaSettings, "SLiC hinge (Zhao et al. 2023)"),
    "ipo": PreferenceLoss(_numerics_loss("ipo"), _BetaSettings, "IPO (Azar et al. 2023), per-token averaged"),
    # Combined with a preference loss (loss_type = ["sigmoid", "sft"]) it keeps the chosen answers likely while
    # DPO moves the margin: DPO alone can lower both likelihoods (docs/dpo.md has the measured example).
    "sft": PreferenceLoss(_sft_loss, NoSettings, "NLL of the chosen answer per token (RPO, Pang et al. 2024)"),
}



def resolve_preference_loss_settings(loss: PreferenceLoss, config: Any, *, name: str) -> Any:
    """Settings of preference loss `name` from `config.loss_kwargs` (keys other losses of the list may take are
    left to them) and same-named config fields."""
    if loss.settings is _LegacyConfigSettings:
        check = getattr(loss.fn, "check_config", None)
        if check is not None:
            check(config)
        return _LegacyConfigSettings(config)
    return resolve_settings(loss.settings, config, kwargs=getattr(config, "loss_kwargs", None),
                            kwargs_field="loss_kwargs", owner=f"loss_type '{name}'", allow_unknown=True)


def legacy_preference_loss(fn: Callable[..., Any], *, name: str, origin: str) -> PreferenceLoss:
    """Adapt a hooks-1.0 preference loss `fn(chosen, rejected, *, config, chosen_lengths, rejected_lengths)`."""
    warnings.warn(
        f"preference loss '{name}' from {origin} uses the hooks-1.0 callable form fn(chosen_logratios, "
        "rejected_logratios, *, config, chosen_lengths, rejected_lengths), deprecated in hooks 1.1 (toolkit 0.2) and "
        "removed in hooks 2.0 (toolkit 0.3): register a toolkit.PreferenceLoss(fn(inputs, settings), settings=<dataclass>) "
        "instead (docs/plugins.md).", ToolkitDeprecationWarning, stacklevel=2)

    def adapted(inputs: PreferenceLossInputs, settings: _LegacyConfigSettings) -> torch.Tensor:
        return fn(inputs.chosen_logratios, inputs.rejected_logratios, config=settings.config,
                  chosen_lengths=inputs.chosen_lengths, rejected_lengths=inputs.rejected_lengths)

    if hasattr(fn, "check_config"):
        adapted.check_config = fn.check_config  # type: ignore[attr-defined]
    return PreferenceLoss(adapted, settings=_LegacyConfigSettings, description=(fn.__doc__ or "").strip()[:80])


def check_loss_kwargs_used(losses: dict[str, PreferenceLoss], config: Any) -> None:
    """A `loss_kwargs` key that no loss of the list declares is a typo: say so."""
    given = set(getattr(config, "loss_kwargs", None) or {})
    if not given or any(loss.settings is _LegacyConfigSettings for loss in losses.values()):
        return
    known = {f.name for loss in losses.values() for f in dataclasses.fields(loss.settings)}
    unknown = sorted(given - known)
    if unknown:
        raise ConfigError(f"loss_kwargs: no loss in loss_type {sorted(losses)} takes {unknown}.")
