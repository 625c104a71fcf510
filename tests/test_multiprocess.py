"""A real two-process (gloo) run: 2 ranks x batch 4 equals 1 process x batch 8, loss and update."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = str(Path(__file__).with_name("ddp_worker.py"))


def _run(cmd, env):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun comes with torch"
    # ACCELERATE_USE_CPU: what `accelerate launch --cpu` sets; without it Trainer stays single-process on CPU.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true",
           "PYTHONPATH": str(Path(__file__).parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    _run([sys.executable, WORKER, str(one), "8"], env)
    _run([torchrun, "--nproc_per_node", "2", "--master_port", "29533", WORKER, str(two), "4"], env)
    r1, r2 = json.loads((one / "result.json").read_text()), json.loads((two / "result.json").read_text())
    assert r2["world_size"] == 2
    assert r2["loss"] == pytest.approx(r1["loss"], rel=1e-5)
    p1, p2 = torch.load(one / "params.pt"), torch.load(two / "params.pt")
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-5, atol=1e-6, msg=k)
