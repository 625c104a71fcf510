"""CISPO: Clipped IS-weight Policy Optimization, as a toolkit policy loss (`loss_type = "cispo"`).

MiniMax-M1 (arXiv:2506.13585) and ScaleRL (arXiv:2510.13786): instead of clipping the importance
ratio inside PPO's surrogate (which zeroes the gradient of every token whose ratio left the clip
range, often the rare "fork" tokens that matter most), clip the importance-sampling *weight* and
stop its gradient, so every token keeps a REINFORCE gradient, only re-weighted:

    loss_t = - sg(clip(r_t, epsilon_min, epsilon_max)) * A * log pi(y_t),   r_t = pi(y_t) / pi_old(y_t)

On-policy (r = 1) its gradient equals the clipped surrogate's; it differs exactly where PPO clips.
Token-level aggregation over the whole optimizer step (as DAPO), which is what both papers use.

Settings go in the GRPO config's `loss_kwargs`:
    epsilon_max: upper bound of the IS weight (default 5.0, ScaleRL's recommendation);
    epsilon_min: lower bound (default None: no lower bound, as in MiniMax-M1).
"""

from __future__ import annotations

import torch

from toolkit import ConfigError, hookimpl

__version__ = "0.1.0"

DEFAULTS = {"epsilon_max": 5.0, "epsilon_min": None}


def _settings(config) -> dict:
    return {**DEFAULTS, **(getattr(config, "loss_kwargs", None) or {})}


def cispo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, *, config, mask=None, **_):
    """Per-token CISPO loss [B, T] and clip masks for the trainer's metrics."""
    s = _settings(config)
    ratio = torch.exp(logps.detach() - old_logps)
    weight = ratio.clamp(min=s["epsilon_min"], max=s["epsilon_max"])  # clamp accepts None for "no bound"
    adv = advantages[:, None]
    loss = -weight * adv * logps
    info = {
        "clipped_high": (ratio > s["epsilon_max"]) & (adv > 0),
        "clipped_low": ((ratio < s["epsilon_min"]) & (adv < 0)) if s["epsilon_min"] is not None
        else torch.zeros_like(ratio, dtype=torch.bool),
    }
    return loss, info


def check_config(config) -> None:
    """Unknown or inconsistent loss_kwargs fail when the config is built, before any model loads."""
    given = getattr(config, "loss_kwargs", None) or {}
    unknown = sorted(set(given) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"loss_kwargs: cispo does not know {unknown}; it takes {sorted(DEFAULTS)}.")
    s = _settings(config)
    if not isinstance(s["epsilon_max"], (int, float)) or s["epsilon_max"] <= 0:
        raise ConfigError(f"loss_kwargs.epsilon_max: must be a number > 0, got {s['epsilon_max']!r}.")
    if s["epsilon_min"] is not None and not 0 <= s["epsilon_min"] < s["epsilon_max"]:
        raise ConfigError(f"loss_kwargs.epsilon_min: must be in [0, epsilon_max={s['epsilon_max']}) or None, got "
                          f"{s['epsilon_min']!r}.")


cispo_loss.aggregation = "token"
cispo_loss.check_config = check_config


@hookimpl
def toolkit_register_policy_losses():
    return {"cispo": cispo_loss}
