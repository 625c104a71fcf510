"""First contact: `import toolkit` and the command line's help are quiet and fast.

Each check runs a fresh interpreter, as a person's first command does. Speed is checked through what it rests on
(nothing heavy imported: torch alone takes 1-2 s to import on these machines), not with a stopwatch; the measured
times are in the CHANGELOG.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit._dev import cli_help

TOOLKIT = str(Path(sys.executable).with_name("toolkit"))


def run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TOOLKIT_")} | env
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=environ)


@pytest.mark.parametrize("code", [
    "import toolkit",
    "import toolkit.cli",
    # the first use of a trainer imports torch, transformers, peft (and with them bitsandbytes): still no noise
    pytest.param("from toolkit import SFTTrainer, GRPOTrainer, DPOTrainer, PPOTrainer", marks=pytest.mark.slow),
])
def test_importing_toolkit_writes_nothing_to_stderr(code):
    out = run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", f"`{code}` wrote to stderr:\n{out.stderr}"


@pytest.mark.parametrize("argv", [["--help"], ["sft", "--help"], ["grpo", "-h"], ["async-grpo", "--help"],
                                  ["pipeline", "--help"], ["gkd", "--help"]])
def test_help_is_quiet_and_imports_nothing_heavy(argv):
    out = run([TOOLKIT, *argv])
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "toolkit sft --config" in out.stdout or "toolkit pipeline" in out.stdout
    # the same in-process: what --help imported
    code = (f"import sys; from toolkit.cli import main; main({argv!r}); "
            "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'datasets', 'peft') if m in sys.modules))")
    probe = run([sys.executable, "-c", code])
    assert probe.stdout.strip().endswith("HEAVY []"), probe.stdout[-300:]


def test_a_trainer_commands_help_lists_its_config_fields():
    out = run([TOOLKIT, "grpo", "--help"])
    for key in ("--loss_type (default 'dapo')", "--num_generations (default 8)", "--lora_r (default 0)"):
        assert key in out.stdout, key


def test_the_shipped_help_matches_the_config_classes():
    shipped, now = cli_help.shipped(), cli_help.current()
    changed = sorted(c for c in set(now) | set(shipped) if now.get(c) != shipped.get(c))
    assert not changed, (f"toolkit/cli_help.json is out of date for {changed}; run `python -m toolkit._dev.cli_help "
                         "--write` and commit it")
    assert json.loads(cli_help.HELP_FILE.read_text()) == now


@pytest.mark.slow
def test_the_lazy_package_exposes_the_same_public_names():
    code = ("import toolkit, toolkit.core as c; import importlib; "
            "names = {n for m in c.PUBLIC_MODULES for n in importlib.import_module('toolkit.core.' + m).__all__}; "
            "assert set(c.__all__) == names, names ^ set(c.__all__); "
            "assert set(toolkit.__all__) == names | {'__version__'}; "
            "assert toolkit.GRPOTrainer is c.grpo.GRPOTrainer; print('ok')")
    out = run([sys.executable, "-c", code])
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
