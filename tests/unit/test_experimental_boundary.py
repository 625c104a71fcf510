"""The experimental tier builds on the stable core through its public API only.

toolkit.experimental may change in any release; toolkit.core may not. An experimental trainer that overrides or
reads a private name of the core (`GRPOTrainer._setup_objective`, `self._health`, `cli._run_online`) ties the
core's internals to it: a refactor of the core would break it silently, and the core could not change what it
never promised. This test reads the experimental package's source (AST) and fails on any such access, naming the
file, line and name, so the seam it needed is made public instead.

A "core-private name" is a single-underscore name the core defines (a module-level function, class or constant,
a method, a class attribute, or an attribute a core method assigns on `self`), other than names the frameworks
the trainers subclass define themselves (transformers' Trainer and TrainingArguments, torch's Module): those are
transformers' seams, which a trainer on Trainer legitimately overrides.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

import toolkit

PACKAGE = Path(toolkit.__file__).parent
# `_tag_names`: the class attribute transformers' Trainer reads (getattr) for the tags of the model it pushes
FRAMEWORK_NAMES = set(dir(Trainer)) | set(dir(TrainingArguments)) | set(dir(torch.nn.Module)) | {"_tag_names"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def core_private_names(core: Path = PACKAGE / "core") -> set[str]:
    names: set[str] = set()
    for path in core.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Name):
                            names.add(t.id)
                        elif isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            names.add(t.attr)
    return {n for n in names if _private(n)} - FRAMEWORK_NAMES


def private_accesses(source: str, core_private: set[str]) -> list[tuple[int, str]]:
    """(line, what) for every use of a core-private name in `source`: imports from toolkit.core, attribute reads or
    writes (`x._name`), and definitions that would override one (`def _name`, `_name = ...` in a class)."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("toolkit.core"):
            found += [(node.lineno, f"imports {node.module}.{a.name}") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Attribute) and node.attr in core_private:
            found.append((node.lineno, f"uses .{node.attr}"))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in core_private:
                    found.append((item.lineno, f"overrides {item.name}"))
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    found += [(item.lineno, f"overrides {t.id}") for t in targets
                              if isinstance(t, ast.Name) and t.id in core_private]
    return sorted(found)


def test_the_experimental_tier_uses_no_private_name_of_the_core():
    core_private = core_private_names()
    assert len(core_private) > 100  # the core's private names were found (a broken scan would pass vacuously)
    problems = []
    for path in sorted((PACKAGE / "experimental").rglob("*.py")):
        problems += [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
                     for line, what in private_accesses(path.read_text(), core_private)]
    assert not problems, ("toolkit.experimental reaches into private names of toolkit.core; make the seam public "
                          "(docs/architecture.md) instead:\n" + "\n".join(problems))


def test_the_check_catches_each_kind_of_private_access():
    core_private = {"_run_online", "_health", "_setup_objective", "_needs_rewards"}
    source = '''
from toolkit.core.cli import _run_online
class T(Base):
    _needs_rewards = False
    def _setup_objective(self, args):
        self._health.check_finite()
    def public(self):
        return self._own_thing
'''
    found = private_accesses(source, core_private)
    assert [what for _, what in found] == ["imports toolkit.core.cli._run_online", "overrides _needs_rewards",
                                           "overrides _setup_objective", "uses ._health"]
    assert "_save_checkpoint" not in core_private_names()  # transformers' seam, not the core's
