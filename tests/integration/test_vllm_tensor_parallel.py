"""A colocated vLLM engine shared by tensor-parallel ranks (vLLM's external_launcher), run by 2 real torchrun
processes over gloo with a recording stand-in for vllm.LLM (no GPU here; the engine itself is not run, see
docs/vllm.md): the engine is asked for external_launcher and tp 2, every rank of the group gives it the same
requests (each rank's prompts with that rank's sampling settings, in rank order), each rank gets its own share
back, and a rank with nothing to generate still takes part."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
from builders import HELPERS

from toolkit.core.errors import ConfigError
from toolkit.core.vllm_backend import tensor_parallel_groups
from toolkit.testing import tiny_model, tiny_tokenizer


def test_tensor_parallel_groups_are_neighbouring_ranks():
    assert tensor_parallel_groups(4, 2) == [[0, 1], [2, 3]]
    assert tensor_parallel_groups(8, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tensor_parallel_groups(2, 1) == [[0], [1]]
    with pytest.raises(ConfigError, match="3 does not divide the 4 training processes"):
        tensor_parallel_groups(4, 3)
    with pytest.raises(ConfigError, match="at least 1, got 0"):
        tensor_parallel_groups(4, 0)


def test_two_ranks_share_one_engine_and_each_gets_its_share(tmp_path):
    folder = tmp_path / "m"
    tiny_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(HELPERS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = tmp_path / "rank"
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(port),
                           str(HELPERS / "vllm_tp_worker.py"), str(folder), str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank.{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["kwargs"] == {"distributed_executor_backend": "external_launcher", "tensor_parallel_size": 2,
                               "gpu_memory_utilization": 0.3} and r["lockstep"]
        # the same requests on both ranks, rank 0's first, each with its own rank's settings and a seed per request
        assert r["seen"][0] == {"prompts": [[10, 11, 12], [20, 21, 22], [30, 31, 32]], "n": [2, 2, 2],
                                "temperature": [0.5, 0.5, 0.9], "seed": [100, 101, 200]}
        assert r["seen"][1]["prompts"] == [[40, 41]] and r["seen"][1]["seed"][0] is not None
    assert ranks[0]["seen"] == ranks[1]["seen"]
    assert ranks[0]["first"] == [[[10, 11], [10, 11]], [[20, 21], [20, 21]]]
    assert ranks[1]["first"] == [[[30, 31], [30, 31]]]
    assert ranks[0]["second"] == [[[40, 41], [40, 41]]] and ranks[1]["second"] == []


def test_tensor_parallelism_on_the_cpu_engine_is_refused_with_the_alternative(tmp_path, monkeypatch):
    from toolkit.core import vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_build", lambda: None)
    monkeypatch.setattr(vllm_backend, "require_vllm", lambda: None)
    monkeypatch.setattr(vllm_backend, "_engine_on_gpu", lambda: False)
    with pytest.raises(ConfigError, match="tensor parallelism needs GPUs"):
        vllm_backend.VLLMBackend(str(tmp_path), tensor_parallel_size=2)
