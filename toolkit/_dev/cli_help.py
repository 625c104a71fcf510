"""The command line's per-command help (`toolkit <command> --help`), written to toolkit/cli_help.json.

Every trainer command's help lists the keys of its run file: `RunArgs` and the trainer's config dataclass with
their defaults and help texts. Reading those fields means importing the config class, hence torch and
transformers (5-8 s on a 2-core machine); the help a person asks for should not take that long. So the text is
generated from the live classes here and shipped with the package; `toolkit <command> --help` prints it without
importing anything heavy, and tests/unit/test_cli_startup.py fails when the shipped text differs from what the
classes say now.

    python -m toolkit._dev.cli_help            # compare, print the commands whose help changed
    python -m toolkit._dev.cli_help --write    # regenerate toolkit/cli_help.json (commit it)
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

HELP_FILE = Path(__file__).resolve().parents[1] / "cli_help.json"

#: command -> (module, config class): the core's trainers, then toolkit.experimental's (toolkit/cli.py adds those)
COMMANDS = {
    "sft": ("toolkit.core.sft", "SFTConfig"),
    "dpo": ("toolkit.core.dpo", "DPOConfig"),
    "grpo": ("toolkit.core.grpo", "GRPOConfig"),
    "async-grpo": ("toolkit.core.async_grpo", "AsyncGRPOConfig"),
    "ppo": ("toolkit.core.ppo", "PPOConfig"),
    "reward": ("toolkit.experimental.reward", "RewardConfig"),
    "cpo": ("toolkit.experimental.cpo", "CPOConfig"),
    "kto": ("toolkit.experimental.kto", "KTOConfig"),
    "orpo": ("toolkit.experimental.orpo", "ORPOConfig"),
    "online-dpo": ("toolkit.experimental.online_dpo", "OnlineDPOConfig"),
    "gkd": ("toolkit.experimental.gkd", "GKDConfig"),
}


def current() -> dict[str, str]:
    """Each command's field listing, from the classes as they are now."""
    os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")
    from toolkit.core.config import RunArgs, describe_fields

    return {command: describe_fields(RunArgs, getattr(importlib.import_module(module), cls))
            for command, (module, cls) in COMMANDS.items()}


def shipped() -> dict[str, str]:
    return json.loads(HELP_FILE.read_text()) if HELP_FILE.exists() else {}


def main(argv: list[str]) -> int:
    now = current()
    if "--write" in argv:
        HELP_FILE.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"wrote {HELP_FILE} ({len(now)} commands)")
        return 0
    old = shipped()
    changed = sorted(c for c in set(now) | set(old) if now.get(c) != old.get(c))
    print("\n".join(f"changed: {c}" for c in changed) or "toolkit/cli_help.json is current")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
