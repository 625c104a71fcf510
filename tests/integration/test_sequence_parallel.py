"""Sequence parallelism (Ulysses) with real torchrun processes on gloo, one thread each.

- The losses' numerics: a group of 2 ranks, each holding half of every packed row, gives the loss and gradients of
  one rank with the whole row (1e-5), for SFT (packed rows), DPO (chosen and rejected sharing the prompt) and GRPO
  (the shared-prompt layout, 4 completions per prompt, a common start laid out once); with and without FSDP2; and 2
  data-parallel x 2 sequence-parallel ranks (4 processes) equal one process with both replicas' batches.
- The trainers: SFT, DPO and GRPO with `sequence_parallel_size=2` on 2 processes (and on 4, and under FSDP2) train to the
  weights of one process with the whole batch.
- Memory: the peak tensor memory of a rank holding half of a 4096-token row is at most 0.6x one rank's with the
  whole row (CPU tensor tally, `toolkit.core.memory`).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import HELPERS

WORKER = str(HELPERS / "sequence_parallel_worker.py")
TRAINERS = str(HELPERS / "ddp_worker.py")

pytestmark = pytest.mark.slow


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true",
            "PYTHONPATH": os.pathsep.join([str(HELPERS), str(Path(__file__).parent),
                                           os.environ.get("PYTHONPATH", "")])}


def _torchrun(nproc: int, port: int, *args: str, env: dict | None = None) -> None:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun comes with torch"
    proc = subprocess.run([torchrun, "--nproc_per_node", str(nproc), "--master_port", str(port), *args],
                          capture_output=True, text=True, env=env or _env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


@pytest.mark.parametrize("nproc,fsdp2", [(2, False), (2, True), (4, False)], ids=["2sp", "2sp-fsdp2", "2dp-x-2sp"])
def test_split_rows_give_the_whole_rows_loss_and_gradients(tmp_path, nproc, fsdp2):
    out = tmp_path / "result.json"
    _torchrun(nproc, 29641 + nproc + int(fsdp2), WORKER, str(out), "2", "sft,dpo,grpo", *(["fsdp2"] if fsdp2 else []))
    result = json.loads(out.read_text())
    assert result["sp_size"] == 2 and result["dp_size"] == nproc // 2
    for case in ("sft", "dpo", "grpo"):
        r = result[case]
        assert r["row_tokens"] % 2 == 1 or case == "dpo", (case, r)  # an odd row: the last rank's share is padded
        assert r["loss_diff"] <= 1e-5 * max(1.0, abs(r["loss"])), (case, r)
        assert r["grad_diff"] <= 1e-5, (case, r)
        assert r["grad_scale"] > 1e-3, (case, r)  # gradients that are not all ~0 (the comparison means something)


def test_a_rank_holding_half_the_row_needs_at_most_0_6x_the_tensor_memory(tmp_path):
    out = tmp_path / "result.json"
    _torchrun(2, 29651, WORKER, str(out), "2", "memory-4096")
    mem = json.loads(out.read_text())["memory"]
    assert mem["split"] <= 0.6 * mem["whole"], mem


@pytest.mark.parametrize("nproc,fsdp2", [(2, False), (4, False), (2, True)], ids=["2sp", "2dp-x-2sp", "2sp-fsdp2"])
def test_trainers_with_sequence_parallelism_equal_one_process(tmp_path, nproc, fsdp2):
    cases = "sft-sp,dpo-sp,grpo-sp"
    env = _env()
    one, many = tmp_path / "one", tmp_path / "many"
    proc = subprocess.run([sys.executable, TRAINERS, str(one), "1", cases], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    _torchrun(nproc, 29655 + nproc + int(fsdp2), TRAINERS, str(many), str(nproc), cases,
              env={**env, "TOOLKIT_TEST_FSDP2": "1"} if fsdp2 else env)
    r1, rn = json.loads((one / "result.json").read_text()), json.loads((many / "result.json").read_text())
    for case in cases.split(","):
        assert r1[case]["sequence_parallel"] == 1 and rn[case]["sequence_parallel"] == 2, case
        assert rn[case]["world_size"] == nproc and rn[case]["sharded"] == fsdp2, case
        assert rn[case]["losses"] == pytest.approx(r1[case]["losses"], rel=1e-5, abs=2e-6), case
        p1, pn = torch.load(one / case / "params.pt"), torch.load(many / case / "params.pt")
        for k in p1:
            torch.testing.assert_close(p1[k], pn[k], rtol=1e-5, atol=1e-5, msg=f"{case}: {k}")
