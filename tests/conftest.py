import importlib.util
import os

import pytest
import torch

# Tests never touch the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# The vLLM tests run in their own environment (.venv-vllm, CI stage 4); elsewhere they are not collected
# rather than reported as skipped.
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["integration/test_vllm.py"]


@pytest.fixture
def tok():
    from toolkit.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture
def model():
    from toolkit.testing import tiny_model

    return tiny_model()
