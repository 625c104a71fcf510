"""Exceptions raised for people: each says what was wrong, where, and what to do instead."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DataError",
    "HubPushError",
    "ToolkitDeprecationWarning",
    "ToolkitError",
    "TrainingHealthError",
]


class ToolkitError(Exception):
    """Base class of every error toolkit raises on purpose."""


class ConfigError(ToolkitError, ValueError):
    """A configuration field is missing, mistyped or out of range. The message names the field."""


class DataError(ToolkitError, ValueError):
    """A dataset does not have the shape a trainer needs. The message names the column, the row and the fix."""


class HubPushError(ToolkitError, RuntimeError):
    """A push to the Hugging Face Hub failed after the model was saved locally; the message says where it is."""


class TrainingHealthError(ToolkitError, RuntimeError):
    """Training produced a value that makes further steps meaningless (NaN/inf loss, empty loss mask)."""


class ToolkitDeprecationWarning(FutureWarning):
    """A public name, argument, hook form or default on its way out; the message names the replacement and the
    release that removes it.

    A FutureWarning (shown by default), because the people who must act are users and plugin authors,
    not only toolkit developers. Listed in docs/contributing.md (deprecation policy).
    """
