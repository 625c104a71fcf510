"""The `toolkit` script: the stable core's commands (toolkit.core.cli) plus the experimental tier's.

The core never imports `toolkit.experimental` (an import-linter contract), so the experimental commands
are added here, one level up, and their modules are imported only when one of them runs (importing the
experimental tier warns that it has no stability promise). `python -m toolkit.core.cli` has the core
commands only.
"""

from __future__ import annotations

__all__ = ["EXPERIMENTAL_COMMANDS", "main", "script"]

from typing import Any

from toolkit.core.cli import main as core_main
from toolkit.core.distributed import exit_process


def _reward(argv: list[str]) -> int:
    from toolkit.experimental.reward import run_reward_command

    return run_reward_command(argv)


def _cpo(argv: list[str]) -> int:
    from toolkit.experimental.cpo import run_cpo_command

    return run_cpo_command(argv)


#: command name -> fn(argv) -> exit code, for the experimental tier (docs/experimental.md)
def _kto(argv: list[str]) -> int:
    from toolkit.experimental.kto import run_kto_command

    return run_kto_command(argv)


def _orpo(argv: list[str]) -> int:
    from toolkit.experimental.orpo import run_orpo_command

    return run_orpo_command(argv)


def _online_dpo(argv: list[str]) -> int:
    from toolkit.experimental.online_dpo import run_online_dpo_command

    return run_online_dpo_command(argv)


def _gkd(argv: list[str]) -> int:
    from toolkit.experimental.gkd import run_gkd_command

    return run_gkd_command(argv)


EXPERIMENTAL_COMMANDS: dict[str, Any] = {"reward": _reward, "cpo": _cpo, "kto": _kto, "orpo": _orpo,
                                         "online-dpo": _online_dpo, "gkd": _gkd}


def main(argv: list[str] | None = None) -> int:
    return core_main(argv, extra_commands=EXPERIMENTAL_COMMANDS)


def script() -> None:
    """The `toolkit` console script: main(), then exit_process (under torchrun a rank that ran to the end must
    not abort in interpreter teardown and fail the job; toolkit.core.distributed.exit_process says why)."""
    exit_process(main())


if __name__ == "__main__":
    script()
