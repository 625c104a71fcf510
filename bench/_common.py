"""Pieces both benchmarks use."""

from __future__ import annotations

import time


def step_timer():
    """A TrainerCallback recording the wall time at the end of every optimizer step in `.ends`."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    return StepTimer()


def run_in_subprocess(script: str, args: list[str], env: dict[str, str] | None = None) -> dict:
    """Run `script --worker ...` in a fresh process (peak RSS is per process) and return its RESULT json."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stdout[-3000:], proc.stderr[-6000:])
        raise SystemExit(f"{script} {' '.join(args)} failed")
    return json.loads(line[len("RESULT "):])
