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
