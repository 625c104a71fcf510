"""Settings of a loss or estimator: one frozen dataclass each, filled and validated in one generic place.

A settings dataclass declares what its loss reads, with defaults. `resolve_settings` fills it from two
sources, in this order of precedence:

1. the trainer config's `*_kwargs` field (e.g. `loss_kwargs = {epsilon_max = 5.0}`) for settings that are
   the loss's own;
2. a top-level config field of the same name, for the settings those fields already name
   (`CONFIG_FIELDS`: TRL's `epsilon`, `epsilon_high`, `beta`, `label_smoothing`, `scale_rewards`, and
   the sampler-correction fields): these are read from the config and may not be repeated in
   `*_kwargs`, so one value never has two places. Only these names are read from the config: a plugin
   setting called `temperature` or `seed` is the plugin's own, never the trainer's.

Unknown keys, wrong types and out-of-range values are a `ConfigError` naming the field, the value and what
is allowed, raised when the config is built: before any model loads. A settings class checks its ranges in
`__post_init__` by raising `SettingsError(field, message)`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigError

__all__ = ["CONFIG_FIELDS", "NoSettings", "SettingsError", "resolve_settings", "settings_fields"]

#: The config fields a settings dataclass may share (read from the config, not from `*_kwargs`).
CONFIG_FIELDS = frozenset({
    "beta", "epsilon", "epsilon_high", "label_smoothing", "scale_rewards", "kl_bias_correction",
    "importance_sampling_cap", "importance_sampling_level", "importance_sampling_mode", "importance_sampling_min",
    "off_policy_mask_threshold",
})


class SettingsError(ValueError):
    """Raised by a settings dataclass's `__post_init__`: `field` is the setting, `message` what is wrong and the fix."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclasses.dataclass(frozen=True)
class NoSettings:
    """For losses and estimators that take no settings."""


def settings_fields(settings_cls: type) -> list[str]:
    """The names a settings dataclass declares."""
    return [f.name for f in dataclasses.fields(settings_cls)]


def _type_ok(value: Any, annotation: Any) -> bool:
    """A deliberately small check: bool/int/float/str/None and their unions; anything else is accepted."""
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    return True


def resolve_settings(settings_cls: type, config: Any, *, kwargs: Mapping[str, Any] | None, kwargs_field: str,
                     owner: str, allow_unknown: bool = False) -> Any:
    """Build `settings_cls` from `kwargs` (the loss's own settings) and same-named fields of `config`.

    Args:
        settings_cls: a (frozen) dataclass; `NoSettings` for none.
        config: the trainer config, read only for fields that `settings_cls` declares (getattr by name).
        kwargs: the user's `*_kwargs` mapping (None = empty).
        kwargs_field: that mapping's field name, for messages ("loss_kwargs").
        owner: what the settings belong to, for messages ("loss_type 'cispo'").
        allow_unknown: keys `settings_cls` does not declare are left for another loss (DPO's loss lists).
    """
    kwargs = dict(kwargs or {})
    hints = typing.get_type_hints(settings_cls)
    declared = {f.name: f for f in dataclasses.fields(settings_cls) if f.init}
    shared = [n for n in declared if n in CONFIG_FIELDS and config is not None and hasattr(config, n)]
    own = [n for n in declared if n not in shared]
    values: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in shared:
            raise ConfigError(f"{kwargs_field}.{key}: {owner} reads '{key}' from the config field of that name; set "
                              f"`{key} = {value!r}` there instead of in {kwargs_field}.")
        if key not in declared:
            if allow_unknown:
                continue
            if not own:
                raise ConfigError(f"{kwargs_field}: {owner} takes no settings, got {sorted(kwargs)}"
                                  + (f" (it reads {shared} from the config)." if shared else "."))
            raise ConfigError(f"{kwargs_field}: {owner} does not know {key!r}; it takes {own}.")
        values[key] = value
    for name in shared:
        values[name] = getattr(config, name)
    for name, value in values.items():
        if not _type_ok(value, hints.get(name, Any)):
            where = name if name in shared else f"{kwargs_field}.{name}"
            expected = getattr(hints.get(name), "__name__", str(hints.get(name))).replace("typing.", "")
            raise ConfigError(f"{where}: {owner} expects {expected}, got {value!r} ({type(value).__name__}).")
    try:
        return settings_cls(**values)
    except SettingsError as e:
        where = e.field if e.field in shared or e.field not in declared else f"{kwargs_field}.{e.field}"
        raise ConfigError(f"{where}: {e.message.rstrip('.')} ({owner}).") from None


@dataclasses.dataclass(frozen=True)
class _LegacyConfigSettings:
    """A hooks-1.0 loss's or estimator's "settings": the whole trainer config, which that form received."""

    config: Any = None
