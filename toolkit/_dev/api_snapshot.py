"""The public surface of toolkit.core as data, to be compared with the recorded snapshot.

What is recorded: every name in each public module's `__all__` (toolkit.core.PUBLIC_MODULES plus the
public modules not re-exported), with the signature of each function, class constructor and public
method; the fields of every toolkit dataclass (configs and settings) with their defaults, counting only
fields toolkit declares (TrainingArguments' own fields belong to transformers); the hook specs with their
signatures and options; and HOOKS_VERSION.

    python -m toolkit._dev.api_snapshot            # compare with tests/api_snapshot.json, print the changes
    python -m toolkit._dev.api_snapshot --write    # record the current surface (commit it with a CHANGELOG entry)

tests/unit/test_api_surface.py fails whenever the two differ, so a change to the stable API is always a
visible, reviewed change in the same commit (docs/contributing.md: removals and default changes need a
deprecation cycle first).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

SNAPSHOT = Path(__file__).resolve().parents[2] / "tests" / "api_snapshot.json"
EXTRA_PUBLIC_MODULES = ("toolkit.core.tasks", "toolkit.core.vllm_backend", "toolkit.core.environments",
                        "toolkit.core.sandbox", "toolkit.core.lifecycle", "toolkit.core.rollout_config",
                        "toolkit.core.cli", "toolkit.core.config")


def _clean(text: str) -> str:
    """Reprs without memory addresses, so a snapshot is the same in every process."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def _signature(obj: Any) -> str:
    try:
        return _clean(str(inspect.signature(obj)))
    except (TypeError, ValueError):
        return "(?)"


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return _clean(repr(f.default))
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return _clean(f"factory: {f.default_factory()!r}")  # type: ignore[misc]
    return "required"


def _own_fields(cls: type) -> list[list[str]] | dict[str, dict[str, str]]:
    """The dataclass fields toolkit classes declare (not transformers' TrainingArguments fields).

    Inputs and settings dataclasses may be built positionally, so for them the order is API too: a list of
    [name, type, default] in declaration order. Configs are built by keyword (in Python, run files and the
    CLI), so a new config field anywhere is an addition, not a reordering: a mapping by name.
    """
    from transformers import TrainingArguments

    own: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("toolkit"):
            own.update(getattr(klass, "__annotations__", {}))
    fields = [f for f in dataclasses.fields(cls) if f.name in own]
    if issubclass(cls, TrainingArguments):
        return {f.name: {"type": str(f.type), "default": _default(f)} for f in fields}
    return [[f.name, str(f.type), _default(f)] for f in fields]


def _describe(obj: Any) -> dict[str, Any]:
    if inspect.isclass(obj):
        entry: dict[str, Any] = {"kind": "class", "bases": [b.__name__ for b in obj.__bases__]}
        if issubclass(obj, enum.Enum):
            entry["members"] = [m.name for m in obj]
            return entry
        if dataclasses.is_dataclass(obj):
            # Fields, not the constructor: a config's __init__ also lists every TrainingArguments field, which
            # is transformers' surface, not ours.
            entry["fields"] = _own_fields(obj)
        else:
            entry["init"] = _signature(obj)
        methods = {}
        for name, member in vars(obj).items():
            if name.startswith("_") and name not in ("__call__",):
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if inspect.isfunction(member):
                methods[name] = _signature(member)
            elif isinstance(member, property):
                methods[name] = "property"
        entry["methods"] = dict(sorted(methods.items()))
        return entry
    if callable(obj):
        return {"kind": "function", "signature": _signature(obj)}
    if isinstance(obj, (str, int, float, bool, tuple, type(None))):
        return {"kind": "constant", "value": _clean(repr(obj))}
    if isinstance(obj, dict):
        return {"kind": "mapping", "keys": sorted(map(str, obj))}
    return {"kind": type(obj).__name__}


def current() -> dict[str, Any]:
    """The public surface of the installed toolkit.core, as JSON-ready data."""
    import toolkit.core
    from toolkit.core import hookspecs

    modules = [f"toolkit.core.{m}" for m in toolkit.core.PUBLIC_MODULES] + list(EXTRA_PUBLIC_MODULES)
    surface: dict[str, Any] = {"hooks_version": hookspecs.HOOKS_VERSION, "modules": {}, "hookspecs": {}}
    for name in modules:
        module = importlib.import_module(name)
        surface["modules"][name] = {n: _describe(getattr(module, n)) for n in sorted(module.__all__)}
    surface["toolkit.core.__all__"] = sorted(toolkit.core.__all__)
    for name, spec in inspect.getmembers(hookspecs, inspect.isfunction):
        if name.startswith("toolkit_"):
            opts = getattr(spec, f"{hookspecs.PROJECT_NAME}_spec", {})
            surface["hookspecs"][name] = {"signature": _signature(spec),
                                          "options": {k: v for k, v in sorted(opts.items()) if v}}
    return surface


def diff(recorded: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences: added, removed and changed entries, by dotted path."""
    out: list[str] = []
    if isinstance(recorded, dict) and isinstance(now, dict):
        for key in sorted(set(recorded) | set(now)):
            path = f"{prefix}.{key}" if prefix else key
            if key not in now:
                out.append(f"removed: {path}")
            elif key not in recorded:
                out.append(f"added:   {path}")
            else:
                out += diff(recorded[key], now[key], path)
    elif (isinstance(recorded, list) and isinstance(now, list) and all(isinstance(x, str) for x in recorded + now)
          and (recorded or now)):  # name lists (toolkit.core.__all__): say which names came and went
        out += [f"removed: {prefix}: {n}" for n in sorted(set(recorded) - set(now))]
        out += [f"added:   {prefix}: {n}" for n in sorted(set(now) - set(recorded))]
    elif isinstance(recorded, list) and isinstance(now, list) and recorded and isinstance(recorded[0], list):
        for i in range(max(len(recorded), len(now))):  # field records: [name, type, default], in order
            if i >= len(now):
                out.append(f"removed: {prefix}[{i}]: {recorded[i]!r}")
            elif i >= len(recorded):
                out.append(f"added:   {prefix}[{i}]: {now[i]!r}")
            elif recorded[i] != now[i]:
                out.append(f"changed: {prefix}[{i}]: {recorded[i]!r} -> {now[i]!r}")
    elif recorded != now:
        out.append(f"changed: {prefix}: {recorded!r} -> {now!r}")
    return out


def compare(path: Path = SNAPSHOT) -> list[str]:
    recorded = json.loads(path.read_text()) if path.exists() else {}
    return diff(recorded, json.loads(json.dumps(current())))


def write(path: Path = SNAPSHOT) -> None:
    path.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")


def main(argv: list[str]) -> int:
    if "--write" in argv:
        write()
        print(f"wrote {SNAPSHOT}")
        return 0
    changes = compare()
    for line in changes:
        print(line)
    print(f"{len(changes)} differences from {SNAPSHOT.name}")
    return 1 if changes else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
