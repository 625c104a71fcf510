"""Policy losses for the GRPO family, and the one function that turns a per-token term into the loss.

"Change the GRPO loss" means this file. A trainer computes log-probs and hands over a
`PolicyLossInputs`; `policy_objective` does the rest, in this order (each step says why):

1. the per-token term of the chosen `PolicyLoss` (e.g. PPO's clipped surrogate with DAPO's clip-higher);
2. the off-policy sequence mask (DeepSeek-V3.2, `off_policy_mask_threshold`), then truncated or masked
   importance sampling: multiply by min(pi_old / pi_sampler, cap) (or drop what is beyond the cap),
   because the engine that sampled is not exactly the policy the ratio is taken against (kernels, stale
   weights; field note 8);
3. the KL term beta x k3(pi || ref), times pi / pi_old when `kl_bias_correction` (the tokens were sampled
   from pi_old, so this makes it an estimate of KL(pi || ref) and of its gradient);
4. aggregation to a scalar, by the loss's `aggregation` (numerics.aggregate; "micro_batch_token" is TRL's
   bnpo: a token mean per micro-batch divided by the number of micro-batches).

Shapes: B completions (rows), T completion positions (right-padded).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ConfigError, ToolkitDeprecationWarning
from ..numerics import (
    AGGREGATIONS,
    aggregate,
    clipped_surrogate,
    gspo_surrogate,
    importance_weights,
    kl_estimate,
    loglinear_proximal_logps,
    off_policy_sequence_mask,
    second_moment_mask,
)
from .settings import NoSettings, _LegacyConfigSettings, SettingsError, resolve_settings

__all__ = [
    "BUILTIN_POLICY_LOSSES",
    "POLICY_AGGREGATIONS",
    "ClipSettings",
    "DecoupledPPOSettings",
    "M2POSettings",
    "PolicyLoss",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "PolicyObjectiveSettings",
    "SeqMISSettings",
    "clipped_surrogate_term",
    "legacy_policy_loss_inputs",
    "policy_objective",
    "policy_term_of",
    "resolve_policy_loss_settings",
]

#: numerics.AGGREGATIONS plus TRL's bnpo ("micro_batch_token").
POLICY_AGGREGATIONS = (*AGGREGATIONS, "micro_batch_token")


@dataclass
class PolicyLossInputs:
    """Everything a policy loss may read about one micro-batch; no trainer config.

    Tensors are on the model's device; `logps` carries the gradient, everything else does not.
    """

    logps: torch.Tensor                          # [B, T] the policy being trained, per completion token
    old_logps: torch.Tensor                      # [B, T] pi_old: the ratio's denominator (= logps.detach() on-policy)
    advantages: torch.Tensor                     # [B] per completion (GRPO) or [B, T] per token (PPO)
    loss_mask: torch.Tensor                      # [B, T] bool: tokens that count in the loss
    completion_mask: torch.Tensor | None = None  # [B, T] bool: tokens the policy sampled (default: loss_mask)
    sampler_logps: torch.Tensor | None = None    # [B, T] the behaviour policy, as the generation engine reported it
    ref_logps: torch.Tensor | None = None        # [B, T] the reference policy (when beta > 0)
    group_ids: torch.Tensor | None = None        # [B] index of each row's prompt within the step
    step_tokens: float | torch.Tensor | None = None     # tokens in the loss over the whole optimizer step
    step_sequences: float | torch.Tensor | None = None  # completions in the loss over the whole step
    step_prompts: float | torch.Tensor | None = None    # prompts with a completion in the loss over the step
    num_micro_batches: int = 1                   # gradient accumulation steps of this optimizer step
    sampler_versions: torch.Tensor | None = None  # [B, T] long: the policy version that sampled each token
    policy_version: int | None = None             # the version being trained (= optimizer steps taken so far)
    proximal_version: int | None = None           # the version whose weights gave old_logps (None: policy_version)

    def __post_init__(self):
        if self.completion_mask is None:
            self.completion_mask = self.loss_mask


@dataclass(frozen=True)
class PolicyLoss:
    """A named per-token policy loss: `fn(inputs, settings) -> (per_token [B, T], info)`.

    `info` maps metric names to [B, T] bool tensors; "clipped_low" / "clipped_high" are logged as clip
    ratios. `settings` is the loss's settings dataclass (resolved by `resolve_settings`), `aggregation`
    one of `POLICY_AGGREGATIONS`.
    """

    fn: Callable[[PolicyLossInputs, Any], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    settings: type = NoSettings
    aggregation: str = "token"
    description: str = ""
    # True: the loss weighs tokens by pi / pi_behaviour itself (the off-policy objectives), so
    # `policy_objective` must not apply its own sampler correction on top (that would correct twice).
    corrects_behaviour: bool = False

    def __post_init__(self):
        if self.aggregation not in POLICY_AGGREGATIONS:
            raise ValueError(f"PolicyLoss.aggregation: '{self.aggregation}' is not one of {POLICY_AGGREGATIONS}.")
        if not dataclasses.is_dataclass(self.settings):
            raise TypeError(f"PolicyLoss.settings: must be a dataclass type, got {self.settings!r}.")

    def __call__(self, inputs: PolicyLossInputs, settings: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.fn(inputs, settings)


@dataclass(frozen=True)
class ClipSettings:
    """PPO's clip range with DAPO's clip-higher: ratio clipped to [1 - epsilon, 1 + epsilon_high]."""

    epsilon: float = 0.2
    epsilon_high: float | None = None   # None: epsilon (symmetric)

    def __post_init__(self):
        if not 0 < self.epsilon < 1:
            raise SettingsError("epsilon", f"must be in (0, 1) (the ratio is clipped at 1 - epsilon), got {self.epsilon}.")
        if self.epsilon_high is not None and self.epsilon_high <= 0:
            raise SettingsError("epsilon_high", f"must be > 0 or None (= epsilon), got {self.epsilon_high}.")


def clipped_surrogate_term(inputs: PolicyLossInputs, settings: ClipSettings) -> tuple[torch.Tensor, dict]:
    """-min(rho A, clip(rho, 1 - eps, 1 + eps_high) A) per token (PPO, eq. 7 of Schulman et al. 2017)."""
    high = settings.epsilon_high if settings.epsilon_high is not None else settings.epsilon
    return clipped_surrogate(inputs.logps, inputs.old_logps, inputs.advantages, epsilon_low=settings.epsilon,
                             epsilon_high=high)


def gspo_term(inputs: PolicyLossInputs, settings: ClipSettings) -> tuple[torch.Tensor, dict]:
    """GSPO: the clipped surrogate on the length-normalised sequence ratio (numerics.gspo_surrogate)."""
    high = settings.epsilon_high if settings.epsilon_high is not None else settings.epsilon
    # the mean log-ratio over the tokens the loss uses (a row left out of the loss gets ratio 1, harmlessly)
    return gspo_surrogate(inputs.logps, inputs.old_logps, inputs.advantages, inputs.loss_mask,
                          epsilon_low=settings.epsilon, epsilon_high=high)


def gspo_token_term(inputs: PolicyLossInputs, settings: ClipSettings) -> tuple[torch.Tensor, dict]:
    """GSPO-token: the sequence ratio's value with each token's own gradient (numerics.gspo_surrogate)."""
    high = settings.epsilon_high if settings.epsilon_high is not None else settings.epsilon
    return gspo_surrogate(inputs.logps, inputs.old_logps, inputs.advantages, inputs.loss_mask,
                          epsilon_low=settings.epsilon, epsilon_high=high, token_level=True)


def _clip_loss(aggregation: str, description: str) -> PolicyLoss:
    return PolicyLoss(clipped_surrogate_term, settings=ClipSettings, aggregation=aggregation, description=description)


#: The built-in policy losses (registered through the plugin hooks by builtin_plugin). The first five GRPO-family
#: names share one per-token term and differ in how it is averaged (what TRL's `loss_type` selects); the GSPO
#: names clip the sequence ratio instead of each token's.
BUILTIN_POLICY_LOSSES: dict[str, PolicyLoss] = {
    "grpo": _clip_loss("sequence", "clipped surrogate, mean over each completion, then over completions "
                                   "(DeepSeekMath)"),
    "bnpo": _clip_loss("micro_batch_token", "clipped surrogate, token mean per micro-batch (TRL's bnpo)"),
    "dr_grpo": _clip_loss("constant", "clipped surrogate, sum / (completions x max_completion_length) (Dr. GRPO)"),
    "dapo": _clip_loss("token", "clipped surrogate, token mean over the whole optimizer step (DAPO; default)"),
    "ppo": _clip_loss("token", "PPO's clipped surrogate, token mean (the same term and aggregation as dapo; "
                               "PPOTrainer's default, where advantages are per token)"),
    "prompt": _clip_loss("prompt", "clipped surrogate, token mean per prompt's group, then over prompts (ScaleRL)"),
    "gspo": PolicyLoss(gspo_term, ClipSettings, "sequence",
                       "GSPO (Zheng et al. 2025): clipped surrogate on the length-normalised sequence ratio, mean "
                       "per sequence then over sequences (TRL: loss_type='grpo', importance_sampling_level="
                       "'sequence'); use epsilon ~3e-4, epsilon_high ~4e-4"),
    "gspo_token": PolicyLoss(gspo_token_term, ClipSettings, "sequence",
                             "GSPO-token: GSPO's sequence ratio as each token's value, each token's own gradient"),
}


# ------------------------------------------------------------------------------------------------
# Off-policy objectives: samples drawn by older weights (async GRPO's staleness, in-flight updates). Each
# weighs tokens by the behaviour policy itself (`corrects_behaviour`), so the generic sampler correction is
# not applied on top. "Behaviour" is the engine's log-prob of each token as sampled (per token, so a rollout
# whose tokens came from two weight versions carries the right one for each); without sampler log-probs
# (nothing reported) the behaviour policy is pi_old.
# ------------------------------------------------------------------------------------------------


def _behaviour(inputs: PolicyLossInputs) -> torch.Tensor:
    return (inputs.sampler_logps if inputs.sampler_logps is not None else inputs.old_logps).detach()


@dataclass(frozen=True)
class DecoupledPPOSettings:
    """Decoupled PPO (Hilton et al. 2021; AReaL, Fu et al. 2025): trust region around the proximal policy,
    importance weight pi_prox / pi_behaviour for the sampling."""

    epsilon: float = 0.2
    epsilon_high: float | None = None   # None: epsilon
    behaviour_cap: float | None = 5.0   # cap of pi_prox / pi_behaviour (None: uncapped, as in AReaL's paper)
    proximal: str = "exact"             # exact: pi_old (the step's own weights) | loglinear: AReaL's approximation

    def __post_init__(self):
        ClipSettings(self.epsilon, self.epsilon_high)  # the same checks
        if self.behaviour_cap is not None and self.behaviour_cap <= 0:
            raise SettingsError("behaviour_cap", f"must be > 0 or None, got {self.behaviour_cap}.")
        if self.proximal not in ("exact", "loglinear"):
            raise SettingsError("proximal", f"'{self.proximal}' is not exact | loglinear.")


def decoupled_ppo_term(inputs: PolicyLossInputs, settings: DecoupledPPOSettings) -> tuple[torch.Tensor, dict]:
    """-w * min(r A, clip(r) A) with r = pi / pi_prox and w = min(pi_prox / pi_behaviour, behaviour_cap).

    The clip bounds the update around the proximal policy (recent weights), not around the stale sampler, so
    staleness does not shrink the trust region; w corrects for who sampled. "exact": pi_prox = pi_old (with one
    pass per round, the weights of this very step: free, no extra forward). "loglinear": pi_prox interpolated
    from pi_behaviour and pi by policy version (numerics.loglinear_proximal_logps: the proximal version is the
    one that gave old_logps, the current one `policy_version`), which needs `sampler_versions`.

    With one gradient pass per round (async GRPO, num_iterations = 1) pi_prox = pi, so r = 1 and the clip does
    not bind: the term is then -min(pi / pi_behaviour, behaviour_cap) A, truncated importance sampling (AReaL
    masks weights above the cap instead; here they are truncated), and "loglinear" equals "exact". The clip
    and the approximation act with num_iterations > 1 (synchronous GRPO), where pi moves away from pi_prox.
    """
    behaviour = _behaviour(inputs)
    on_policy = inputs.proximal_version is not None and inputs.proximal_version == inputs.policy_version
    if settings.proximal == "exact" or on_policy:  # pi_old is the current weights: nothing to approximate
        proximal = inputs.old_logps.detach()
    else:
        if inputs.sampler_versions is None or inputs.policy_version is None:
            raise ValueError("decoupled_ppo with proximal='loglinear' needs sampler_versions and policy_version (GRPO "
                             "and async GRPO fill them); use proximal='exact'.")
        proximal_version = (inputs.proximal_version if inputs.proximal_version is not None
                            else inputs.policy_version)
        proximal = loglinear_proximal_logps(behaviour, inputs.logps, inputs.sampler_versions,
                                            proximal_version=proximal_version,
                                            current_version=inputs.policy_version)
    high = settings.epsilon_high if settings.epsilon_high is not None else settings.epsilon
    surrogate, info = clipped_surrogate(inputs.logps, proximal, inputs.advantages, epsilon_low=settings.epsilon,
                                        epsilon_high=high)
    weight = torch.exp(proximal - behaviour)
    if settings.behaviour_cap is not None:
        weight = weight.clamp(max=settings.behaviour_cap)
    info["behaviour_weight"] = weight
    return surrogate * weight, info


@dataclass(frozen=True)
class M2POSettings:
    """M2PO (Zheng et al. 2025, "Prosperity before collapse"): a bound on the second moment of the log-ratio."""

    threshold: float = 0.04   # tau_M2: mean (log pi / pi_behaviour)^2 over the kept tokens

    def __post_init__(self):
        if not self.threshold > 0:
            raise SettingsError("threshold", f"must be > 0 (e.g. 0.04), got {self.threshold}.")


def m2po_term(inputs: PolicyLossInputs, settings: M2POSettings) -> tuple[torch.Tensor, dict]:
    """-r A on the tokens `second_moment_mask` keeps, r = pi / pi_behaviour, no clip.

    The M2 bound is over this micro-batch's tokens in the loss (the paper takes it over the training batch).
    Stable with samples far more stale than a per-token clip tolerates: the tokens that carry the drift are
    dropped as a set, the rest keep their full ratio."""
    log_ratio = inputs.logps - _behaviour(inputs)
    keep = second_moment_mask(log_ratio, inputs.loss_mask & inputs.completion_mask, settings.threshold)
    ratio = torch.exp(log_ratio)
    adv = inputs.advantages[:, None] if inputs.advantages.dim() == 1 else inputs.advantages
    per_token = -(ratio * adv) * keep
    return per_token, {"ratio": ratio.detach(), "m2_masked": inputs.completion_mask & ~keep}


@dataclass(frozen=True)
class SeqMISSettings:
    """Sequence-level masked importance sampling around PPO's clipped surrogate."""

    epsilon: float = 0.2
    epsilon_high: float | None = None
    cap: float = 2.0   # C: a completion whose sequence ratio pi_old / pi_behaviour exceeds it drops out

    def __post_init__(self):
        ClipSettings(self.epsilon, self.epsilon_high)
        if not self.cap > 0:
            raise SettingsError("cap", f"must be > 0, got {self.cap}.")


def seq_mis_term(inputs: PolicyLossInputs, settings: SeqMISSettings) -> tuple[torch.Tensor, dict]:
    """Clipped surrogate times rho(y) = prod_t pi_old / pi_behaviour when rho(y) <= cap, else 0 (the completion
    drops out entirely): an unbiased-where-kept sequence correction, without the token level's bias and without
    letting one far-off completion dominate (Liu, Li et al. 2025, "When speed kills stability"). It is the
    generic correction's importance_sampling_level="sequence", mode="mask" as a named objective."""
    high = settings.epsilon_high if settings.epsilon_high is not None else settings.epsilon
    surrogate, info = clipped_surrogate(inputs.logps, inputs.old_logps, inputs.advantages,
                                        epsilon_low=settings.epsilon, epsilon_high=high)
    weight = importance_weights(inputs.old_logps, _behaviour(inputs), cap=settings.cap, level="sequence",
                                mode="mask", mask=inputs.completion_mask)
    info["seq_masked"] = (weight == 0) & inputs.completion_mask
    return surrogate * weight, info


#: The off-policy objectives (async GRPO with stale or mixed-version samples); registered like the others.
OFF_POLICY_LOSSES: dict[str, PolicyLoss] = {
    "decoupled_ppo": PolicyLoss(decoupled_ppo_term, DecoupledPPOSettings, "token",
                                "decoupled PPO (AReaL): clip around the proximal policy, weight pi_prox / "
                                "pi_behaviour; proximal='loglinear' for AReaL's approximation",
                                corrects_behaviour=True),
    "m2po": PolicyLoss(m2po_term, M2POSettings, "token",
                       "M2PO: ratio to the behaviour policy, tokens dropped until the second moment of the "
                       "log-ratio is <= threshold", corrects_behaviour=True),
    "seq_mis": PolicyLoss(seq_mis_term, SeqMISSettings, "token",
                          "clipped surrogate with sequence-level masked importance sampling (completions whose "
                          "sequence ratio exceeds cap drop out)", corrects_behaviour=True),
}
BUILTIN_POLICY_LOSSES.update(OFF_POLICY_LOSSES)


@dataclass(frozen=True)
class PolicyObjectiveSettings:
    """What `policy_objective` adds around the loss's term; the GRPO config fields of the same names."""

    beta: float = 0.0                              # KL coefficient to the reference; 0: no KL term
    kl_bias_correction: bool = True
    importance_sampling_cap: float | None = 2.0    # None: no sampler correction
    importance_sampling_level: str = "token"       # token | sequence
    importance_sampling_mode: str = "truncate"     # truncate (TIS) | mask (MIS)
    importance_sampling_min: float | None = None   # lower bound of the ratio (None: none)
    off_policy_mask_threshold: float | None = None  # DeepSeek-V3.2's off-policy sequence mask (None: off)
    aggregation_constant: float | None = None      # the "constant" aggregation's normaliser (max_completion_length)

    def __post_init__(self):
        if self.beta < 0:
            raise SettingsError("beta", f"must be >= 0, got {self.beta}.")
        if self.importance_sampling_cap is not None and self.importance_sampling_cap <= 0:
            raise SettingsError("importance_sampling_cap", f"must be > 0 or None, got {self.importance_sampling_cap}.")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise SettingsError("importance_sampling_level",
                                f"'{self.importance_sampling_level}' is not token | sequence.")
        if self.importance_sampling_mode not in ("truncate", "mask"):
            raise SettingsError("importance_sampling_mode", f"'{self.importance_sampling_mode}' is not truncate | mask.")
        if self.importance_sampling_mode == "mask" and self.importance_sampling_cap is None \
                and self.importance_sampling_min is None:
            raise SettingsError("importance_sampling_mode", "'mask' drops ratios outside [importance_sampling_min, "
                                "importance_sampling_cap], and both are None, so nothing would be masked; set one.")
        if self.importance_sampling_min is not None:
            cap = self.importance_sampling_cap
            if not 0 <= self.importance_sampling_min < (cap if cap is not None else float("inf")):
                raise SettingsError("importance_sampling_min", f"must be >= 0 and below importance_sampling_cap "
                                    f"({cap}), got {self.importance_sampling_min}.")
        if self.off_policy_mask_threshold is not None and self.off_policy_mask_threshold < 0:
            raise SettingsError("off_policy_mask_threshold",
                                f"must be >= 0 (a KL in nats, e.g. 0.5) or None, got {self.off_policy_mask_threshold}.")


@dataclass
class PolicyLossOutput:
    """The scalar loss and what a trainer logs about it."""

    loss: torch.Tensor                                    # scalar
    per_token: torch.Tensor                               # [B, T] after correction and KL, before aggregation
    info: dict[str, torch.Tensor] = field(default_factory=dict)  # the loss's own per-token masks
    importance_weights: torch.Tensor | None = None        # [B, T] TIS/MIS weights (None: no correction)
    kl: torch.Tensor | None = None                        # [B, T] k3 estimate (None: beta = 0)
    off_policy_mask: torch.Tensor | None = None           # [B, 1] 1 kept, 0 masked (None: off)


def policy_objective(
    inputs: PolicyLossInputs,
    term: Callable[[PolicyLossInputs], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    *,
    aggregation: str,
    settings: PolicyObjectiveSettings,
    corrects_behaviour: bool = False,
) -> PolicyLossOutput:
    """The policy loss of one micro-batch: the per-token `term`, sampler correction, KL, aggregation.

    `term` is usually `lambda i: loss(i, loss_settings)`; trainers pass their `compute_policy_loss` seam.
    `corrects_behaviour` (the loss's own flag): the term already weighs by the behaviour policy, so the
    sampler correction of step 2 is skipped.
    """
    per_token, info = term(inputs)
    keep = None
    if settings.off_policy_mask_threshold is not None:
        # drift measured from the policy that sampled (the engine's log-probs when there are any), as TRL does
        behaviour = inputs.sampler_logps if inputs.sampler_logps is not None else inputs.old_logps
        keep = off_policy_sequence_mask(inputs.logps, behaviour, inputs.advantages, inputs.completion_mask,
                                        settings.off_policy_mask_threshold)
        per_token = per_token * keep
    weights = None
    bounded = settings.importance_sampling_cap is not None or settings.importance_sampling_min is not None
    if bounded and inputs.sampler_logps is not None and not corrects_behaviour:
        weights = importance_weights(inputs.old_logps, inputs.sampler_logps, cap=settings.importance_sampling_cap,
                                     floor=settings.importance_sampling_min, level=settings.importance_sampling_level,
                                     mode=settings.importance_sampling_mode, mask=inputs.completion_mask)
        per_token = per_token * weights
    kl = None
    if settings.beta > 0:
        if inputs.ref_logps is None:
            raise ValueError("policy_objective: beta > 0 needs inputs.ref_logps")
        kl = kl_estimate(inputs.logps, inputs.ref_logps, "k3")
        kl_term = kl * torch.exp(inputs.logps - inputs.old_logps) if settings.kl_bias_correction else kl
        per_token = per_token + settings.beta * kl_term
    mask = inputs.loss_mask
    if aggregation == "micro_batch_token":
        loss = aggregate(per_token, mask, "token") / inputs.num_micro_batches
    else:
        loss = aggregate(per_token, mask, aggregation, constant=settings.aggregation_constant,
                         group_ids=inputs.group_ids, num_items=inputs.step_tokens,
                         num_sequences=inputs.step_prompts if aggregation == "prompt" else inputs.step_sequences)
    return PolicyLossOutput(loss=loss, per_token=per_token, info=info, importance_weights=weights, kl=kl,
                            off_policy_mask=keep)


# ------------------------------------------------------------------------------------------------
# Settings resolution and the hooks-1.0 callable form
# ------------------------------------------------------------------------------------------------



def resolve_policy_loss_settings(loss: PolicyLoss, config: Any, *, name: str) -> Any:
    """The settings of policy loss `name` from `config.loss_kwargs` and same-named config fields."""
    if loss.settings is _LegacyConfigSettings:
        check = getattr(loss.fn, "check_config", None)
        if check is not None:
            check(config)
        elif getattr(config, "loss_kwargs", None):
            raise ConfigError(f"loss_kwargs: loss_type '{name}' takes no settings, got {config.loss_kwargs}.")
        return _LegacyConfigSettings(config)
    return resolve_settings(loss.settings, config, kwargs=getattr(config, "loss_kwargs", None),
                            kwargs_field="loss_kwargs", owner=f"loss_type '{name}'")


def legacy_policy_loss(fn: Callable[..., Any], *, name: str, origin: str) -> PolicyLoss:
    """Adapt a hooks-1.0 policy loss `fn(logps, old_logps, advantages, *, config, mask)` (deprecated in hooks 1.1)."""
    warnings.warn(
        f"policy loss '{name}' from {origin} uses the hooks-1.0 callable form fn(logps, old_logps, advantages, *, "
        "config, mask), deprecated in hooks 1.1 (toolkit 0.2) and removed in hooks 2.0 (toolkit 0.3): register a "
        "toolkit.PolicyLoss(fn(inputs, settings), settings=<dataclass>, aggregation=...) instead (docs/plugins.md).",
        ToolkitDeprecationWarning, stacklevel=2)

    def adapted(inputs: PolicyLossInputs, settings: _LegacyConfigSettings):
        return fn(inputs.logps, inputs.old_logps, inputs.advantages, config=settings.config, mask=inputs.loss_mask)

    adapted.check_config = getattr(fn, "check_config", None)  # type: ignore[attr-defined]
    if adapted.check_config is None:
        del adapted.check_config
    return PolicyLoss(adapted, settings=_LegacyConfigSettings, aggregation=getattr(fn, "aggregation", "token"),
                      description=(fn.__doc__ or "").strip().split("\n")[0])


# ------------------------------------------------------------------------------------------------
# The trainers' `compute_policy_loss` seam and its toolkit 0.1 form (GRPO and PPO)
# ------------------------------------------------------------------------------------------------

_LEGACY_SEAM_MESSAGE = (
    "{cls}.compute_policy_loss(logps, old_logps, advantages, mask) is the toolkit 0.1 seam, deprecated in 0.2 and "
    "removed in 0.3: override compute_policy_loss(self, inputs: PolicyLossInputs) and read inputs.logps, "
    "inputs.old_logps, inputs.advantages, inputs.loss_mask.")


def legacy_policy_loss_inputs(cls_name: str, logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor,
                              mask: torch.Tensor) -> PolicyLossInputs:
    """`compute_policy_loss(logps, old_logps, advantages, mask)` called in the toolkit 0.1 form (a subclass's
    `super()` call): the same inputs as a `PolicyLossInputs`, with a deprecation warning."""
    warnings.warn(_LEGACY_SEAM_MESSAGE.format(cls=cls_name), ToolkitDeprecationWarning, stacklevel=3)
    return PolicyLossInputs(logps=logps, old_logps=old_logps, advantages=advantages, loss_mask=mask)


def policy_term_of(trainer: Any, base: type) -> Callable[[PolicyLossInputs], tuple[torch.Tensor, dict]]:
    """The per-token term `policy_objective` calls: `trainer.compute_policy_loss`, in either form.

    `base` is the trainer class that defines the seam (GRPOTrainer, PPOTrainer). An override with four positional
    tensor parameters is the toolkit 0.1 form: it is called that way (with a deprecation warning once, here),
    without touching the user's class.
    """
    import inspect

    method = trainer.compute_policy_loss
    params = [p for p in inspect.signature(method).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if type(trainer).compute_policy_loss is base.compute_policy_loss or len(params) < 4:
        return method
    warnings.warn(_LEGACY_SEAM_MESSAGE.format(cls=type(trainer).__name__), ToolkitDeprecationWarning, stacklevel=3)
    return lambda inputs: method(inputs.logps, inputs.old_logps, inputs.advantages, inputs.loss_mask)
