"""The objectives room: every built-in policy loss, preference loss and advantage estimator, once.

Each is a named object (`PolicyLoss`, `PreferenceLoss`, `AdvantageEstimator`) holding a pure function of
typed inputs and its own settings dataclass; settings are filled and validated in one generic place
(`resolve_settings`). Trainers build the inputs and call these; plugins register more of the same kind
through the hooks (toolkit.core.hookspecs). The numerics underneath (log-probs, KL estimators, clipping,
aggregation) are `toolkit.core.numerics`.

Layer: above numerics, below data/generation/rewards and every trainer (docs/architecture.md).
"""

from .advantages import (
    BUILTIN_ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    GroupScaleSettings,
    resolve_estimator_settings,
)
from .policy import (
    BUILTIN_POLICY_LOSSES,
    POLICY_AGGREGATIONS,
    ClipSettings,
    DecoupledPPOSettings,
    M2POSettings,
    PolicyLoss,
    PolicyLossInputs,
    PolicyLossOutput,
    PolicyObjectiveSettings,
    SeqMISSettings,
    clipped_surrogate_term,
    policy_objective,
    resolve_policy_loss_settings,
)
from .preference import (
    BUILTIN_PREFERENCE_LOSSES,
    DPOSettings,
    PreferenceLoss,
    PreferenceLossInputs,
    RobustDPOSettings,
    resolve_preference_loss_settings,
)
from .settings import NoSettings, SettingsError, resolve_settings, settings_fields

__all__ = [
    "BUILTIN_ADVANTAGE_ESTIMATORS",
    "BUILTIN_POLICY_LOSSES",
    "BUILTIN_PREFERENCE_LOSSES",
    "POLICY_AGGREGATIONS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "ClipSettings",
    "DPOSettings",
    "DecoupledPPOSettings",
    "GroupScaleSettings",
    "M2POSettings",
    "NoSettings",
    "PolicyLoss",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "PolicyObjectiveSettings",
    "PreferenceLoss",
    "PreferenceLossInputs",
    "RobustDPOSettings",
    "SeqMISSettings",
    "SettingsError",
    "clipped_surrogate_term",
    "policy_objective",
    "resolve_estimator_settings",
    "resolve_policy_loss_settings",
    "resolve_preference_loss_settings",
    "resolve_settings",
    "settings_fields",
]
