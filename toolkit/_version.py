"""The one place toolkit's version is read: the installed package's metadata (pyproject.toml's `version`)."""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("toolkit")
except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
