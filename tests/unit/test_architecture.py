"""The layers of toolkit (pyproject.toml [tool.importlinter]) hold, and a future upward import or circle fails CI."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINT = str(Path(sys.executable).parent / "lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([LINT, "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_layer_contracts_are_kept():
    out = _lint(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 kept, 0 broken" in out.stdout


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "tree"
    shutil.copytree(REPO / "toolkit", root / "toolkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def test_an_import_from_a_lower_layer_up_breaks_the_build(tmp_path):
    root = _copy(tmp_path)
    with open(root / "toolkit" / "core" / "numerics.py", "a") as f:
        f.write("\n\ndef _late():\n    from .grpo import GRPOTrainer  # lazy, still an upward import\n    return GRPOTrainer\n")
    out = _lint(root)
    assert out.returncode != 0
    assert "BROKEN" in out.stdout and "toolkit.core.numerics -> toolkit.core.grpo" in out.stdout


def test_a_trainer_importing_another_trainer_or_core_importing_experimental_breaks_the_build(tmp_path):
    root = _copy(tmp_path)
    with open(root / "toolkit" / "core" / "ppo.py", "a") as f:
        f.write("\nfrom .grpo import GRPOConfig as _G  # noqa\nfrom ..experimental import ToolkitExperimentalWarning"
                " as _W  # noqa\n")
    out = _lint(root)
    assert out.returncode != 0
    assert "toolkit.core.ppo -> toolkit.core.grpo" in out.stdout
    assert "toolkit.core.ppo -> toolkit.experimental" in out.stdout


def test_an_import_circle_among_building_blocks_breaks_the_build(tmp_path):
    root = _copy(tmp_path)
    with open(root / "toolkit" / "core" / "models.py", "a") as f:
        f.write("\n\ndef _late():\n    from . import tasks  # tasks -> generation -> models -> tasks\n    return tasks\n")
    out = _lint(root)
    assert out.returncode != 0 and "BROKEN" in out.stdout


def test_docs_architecture_lists_every_module():
    """docs/architecture.md's module table names every module of the package: `core/x.py` for the core's,
    `toolkit/x.py` otherwise; experimental/ and core/objectives/ are one row each."""
    text = (REPO / "docs" / "architecture.md").read_text()
    missing = []
    for path in sorted((REPO / "toolkit").rglob("*.py")):
        rel = path.relative_to(REPO / "toolkit").as_posix()
        if rel.startswith(("experimental/", "core/objectives/")) or rel == "_dev/__init__.py":
            continue
        shown = rel if rel.startswith("core/") else f"toolkit/{rel}"
        if f"`{shown}`" not in text:
            missing.append(shown)
    assert not missing, f"docs/architecture.md does not list: {missing}"
    assert "`experimental/*.py`" in text and "`core/objectives/`" in text
