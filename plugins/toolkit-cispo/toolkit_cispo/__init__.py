"""CISPO: Clipped IS-weight Policy Optimization, as a toolkit policy loss (`loss_type = "cispo"`).

MiniMax-M1 (arXiv:2506.13585) and ScaleRL (arXiv:2510.13786): instead of clipping the importance
ratio inside PPO's surrogate (which zeroes the gradient of every token whose ratio left the clip
range, often the rare "fork" tokens that matter most), clip the importance-sampling *weight* and
stop its gradient, so every token keeps a REINFORCE gradient, only re-weighted:

    loss_t = - sg(clip(r_t, epsilon_min, epsilon_max)) * A * log pi(y_t),   r_t = pi(y_t) / pi_old(y_t)

On-policy (r = 1) its gradient equals the clipped surrogate's; it differs exactly where PPO clips.
Token-level aggregation over the whole optimizer step (as DAPO), which is what both papers use.

Settings (`CISPOSettings`) go in the GRPO config's `loss_kwargs`, checked before any model loads:
    epsilon_max: upper bound of the IS weight (default 5.0, ScaleRL's recommendation);
    epsilon_min: lower bound (default None: no lower bound, as in MiniMax-M1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from toolkit import PolicyLoss, PolicyLossInputs, SettingsError, hookimpl

__version__ = "0.2.0"


@dataclass(frozen=True)
class CISPOSettings:
    epsilon_max: float = 5.0
    epsilon_min: float | None = None

    def __post_init__(self):
        if self.epsilon_max <= 0:
            raise SettingsError("epsilon_max", f"must be a number > 0, got {self.epsilon_max!r}.")
        if self.epsilon_min is not None and not 0 <= self.epsilon_min < self.epsilon_max:
            raise SettingsError("epsilon_min", f"must be in [0, epsilon_max={self.epsilon_max}) or None, got "
                                               f"{self.epsilon_min!r}.")


def cispo_term(inputs: PolicyLossInputs, settings: CISPOSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token CISPO loss [B, T] and clip masks for the trainer's metrics."""
    ratio = torch.exp(inputs.logps.detach() - inputs.old_logps)
    weight = ratio.clamp(min=settings.epsilon_min, max=settings.epsilon_max)  # clamp accepts None for "no bound"
    adv = inputs.advantages[:, None]
    loss = -weight * adv * inputs.logps
    info = {
        "clipped_high": (ratio > settings.epsilon_max) & (adv > 0),
        "clipped_low": ((ratio < settings.epsilon_min) & (adv < 0)) if settings.epsilon_min is not None
        else torch.zeros_like(ratio, dtype=torch.bool),
    }
    return loss, info


CISPO = PolicyLoss(cispo_term, settings=CISPOSettings, aggregation="token",
                   description="CISPO: clipped, stop-gradient IS weight x advantage x log-prob (MiniMax-M1, ScaleRL)")


@hookimpl
def toolkit_register_policy_losses():
    return {"cispo": CISPO}
