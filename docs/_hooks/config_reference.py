"""mkdocs hook: docs/configuration.md's tables are generated from the config dataclasses' help text at build time.

Every field a toolkit config declares has `metadata["help"]` (tests/unit/test_api_surface.py checks it); the CLI's
`--help` reads the same text, so the three never disagree.
"""

from __future__ import annotations

import dataclasses

MARKER = "<!-- config-reference -->"


def _row(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        default = repr(f.default)
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        default = repr(f.default_factory())  # type: ignore[misc]
    else:
        default = "(required)"
    help_text = " ".join(f.metadata.get("help", "").split()).replace("|", "\\|")
    return f"| `{f.name}` | `{default}` | {help_text} |"


def _table(cls: type) -> str:
    own = {n for k in cls.__mro__ if k.__module__.startswith("toolkit") for n in getattr(k, "__annotations__", {})}
    rows = [_row(f) for f in dataclasses.fields(cls) if f.name in own and not f.name.startswith("_")]
    first = (cls.__doc__ or "").strip().split("\n")[0]
    return (f"## {cls.__name__}\n\n{first}\n\n| field | default | meaning |\n|---|---|---|\n" + "\n".join(rows)
            + "\n")


def on_page_markdown(markdown: str, page, config, files):  # noqa: ARG001 (mkdocs hook signature)
    if MARKER not in markdown:
        return markdown
    from toolkit import AsyncGRPOConfig, DPOConfig, GRPOConfig, PPOConfig, SFTConfig
    from toolkit.core.config import RunArgs

    tables = "\n".join(_table(c) for c in (RunArgs, SFTConfig, DPOConfig, GRPOConfig, AsyncGRPOConfig, PPOConfig))
    return markdown.replace(MARKER, tables)
