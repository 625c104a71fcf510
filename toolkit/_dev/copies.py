"""Check "duplicated by design" code: every `# Copied from <dotted.path>` block must still match its source.

Trainers are self-contained on purpose, so a block shared by two trainers may be copied, but the
copy carries a marker and this check fails as soon as the two drift apart:

    | # Copied from toolkit.core.grpo.GRPOTrainer._generate with GRPO->PPO, grpo->ppo
    | def _generate(self, ...):
    |     ...

The block is the `def`/`class` right below the marker (decorators included), up to the end of its
indented body. The source is the object the dotted path names (imported and read with `inspect`).
Comparison ignores whitespace and comment lines, after applying the declared `A->B` renames to
the source. Run `python -m toolkit._dev.copies` to check the package; tests call `check_tree`.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

MARKER = re.compile(r"^(?P<indent>\s*)# Copied from (?P<path>[\w.]+)(?:\s+with\s+(?P<renames>.+))?\s*$")


@dataclass
class CopyProblem:
    file: str
    line: int
    source: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: copy of {self.source}: {self.message}"


def _normalize(code: str) -> str:
    lines = []
    for raw in textwrap.dedent(code).splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#") or MARKER.match(raw):
            continue
        lines.append(re.sub(r"\s+", "", stripped))
    return "\n".join(lines)


def _block_after(lines: list[str], start: int) -> str:
    """The decorated def/class starting at lines[start], through its indented body."""
    i = start
    while i < len(lines) and not lines[i].strip():
        i += 1
    if i >= len(lines) or not re.match(r"\s*(@|async\s+def\b|def\b|class\b)", lines[i]):
        return ""
    head_indent = len(lines[i]) - len(lines[i].lstrip())
    block = []
    while i < len(lines) and lines[i].lstrip().startswith("@"):
        block.append(lines[i])
        i += 1
    # The signature may span lines (its closing `):` sits at the head's indent): read to the colon
    # that closes it, at bracket depth 0.
    depth = 0
    while i < len(lines):
        line = lines[i]
        block.append(line)
        i += 1
        code = line.split("#", 1)[0]
        depth += sum(code.count(c) for c in "([{") - sum(code.count(c) for c in ")]}")
        if depth <= 0 and code.rstrip().endswith(":"):
            break
    while i < len(lines):
        line = lines[i]
        if line.strip() and (len(line) - len(line.lstrip())) <= head_indent:
            break
        block.append(line)
        i += 1
    while block and not block[-1].strip():
        block.pop()
    return "\n".join(block)


def _resolve(path: str):
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _apply_renames(code: str, renames: str | None) -> str:
    if not renames:
        return code
    for pair in renames.split(","):
        pair = pair.strip()
        if "->" not in pair:
            continue
        old, new = (p.strip() for p in pair.split("->", 1))
        code = code.replace(old, new)
    return code


def check_file(path: Path) -> list[CopyProblem]:
    problems: list[CopyProblem] = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        src_path = m.group("path")
        copy = _block_after(lines, i + 1)
        if not copy:
            problems.append(CopyProblem(str(path), i + 1, src_path, "marker is not followed by a def or class"))
            continue
        try:
            source = inspect.getsource(_resolve(src_path))
        except (ImportError, AttributeError, TypeError, OSError) as e:
            problems.append(CopyProblem(str(path), i + 1, src_path, f"source cannot be found ({e})"))
            continue
        if _normalize(_apply_renames(source, m.group("renames"))) != _normalize(copy):
            problems.append(CopyProblem(
                str(path), i + 1, src_path,
                "no longer matches its source (renames applied, whitespace and comments ignored); "
                "change both, or drop the marker if the copy is meant to differ",
            ))
    return problems


def check_tree(root: str | Path) -> tuple[int, list[CopyProblem]]:
    """Return (number of markers found, problems) for every .py file under `root`."""
    found, problems = 0, []
    for path in sorted(Path(root).rglob("*.py")):
        text = path.read_text()
        found += sum(1 for line in text.splitlines() if MARKER.match(line))
        problems += check_file(path)
    return found, problems


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    found, problems = check_tree(root)
    for p in problems:
        print(p)
    print(f"{found} 'Copied from' blocks checked, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
