"""Shared test builders: small datasets of each format, a callback that interrupts a run, where the helpers live.

Importable from every test folder (pyproject.toml: [tool.pytest.ini_options] pythonpath).
"""

from pathlib import Path

from transformers import TrainerCallback

#: this folder: worker scripts run as subprocesses (torchrun, crash and hang tests), episode_envs, the wrappers
HELPERS = Path(__file__).resolve().parent
#: the repository's root
REPO = HELPERS.parents[1]


def conv_pc(n=16, start=0):
    """Conversational prompt-completion rows."""
    return [{"prompt": [{"role": "user", "content": f"What is {i} + {i + 1}?"}],
             "completion": [{"role": "assistant", "content": str(2 * i + 1)}]} for i in range(start, start + n)]


def plain_pc(n=16):
    return [{"prompt": f"What is {i} + {i + 1}? ", "completion": str(2 * i + 1)} for i in range(n)]


def messages_rows(n=16):
    return [{"messages": [{"role": "system", "content": "You are a helpful assistant."},
                          {"role": "user", "content": f"What is {i} + 2?"},
                          {"role": "assistant", "content": str(i + 2)},
                          {"role": "user", "content": "And times 2?"},
                          {"role": "assistant", "content": str(2 * (i + 2))}]} for i in range(n)]


def text_rows(n=16):
    return [{"text": ("The quick brown fox jumps over the lazy dog. " * (1 + i % 4)).strip()} for i in range(n)]


class StopAt(TrainerCallback):
    """Stops training after `step` optimizer steps, as an interrupted run would."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True
