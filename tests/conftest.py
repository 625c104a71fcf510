import importlib.util
import os

import pytest
import torch
from transformers import TrainerCallback

# Tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# The vLLM tests run in their own environment (.venv-vllm, CI stage 4); elsewhere they are not collected
# rather than reported as skipped.
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["test_vllm.py"]


@pytest.fixture
def tok():
    from toolkit.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture
def model():
    from toolkit.testing import tiny_model

    return tiny_model()


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
