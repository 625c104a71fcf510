"""Exceptions raised for people: each says what was wrong, where, and what to do instead."""

from __future__ import annotations


class ToolkitError(Exception):
    """Base class of every error toolkit raises on purpose."""


class ConfigError(ToolkitError, ValueError):
    """A configuration field is missing, mistyped or out of range. The message names the field."""


class DataError(ToolkitError, ValueError):
    """A dataset does not have the shape a trainer needs. The message names the column, the row and the fix."""


class TrainingHealthError(ToolkitError, RuntimeError):
    """Training produced a value that makes further steps meaningless (NaN/inf loss, empty loss mask)."""
