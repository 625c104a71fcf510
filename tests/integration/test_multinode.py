"""More than one node, on one machine: two `torchrun` agents with `--nnodes 2`, one process each, meeting at a
rendezvous on loopback (static: node 0's address and port), as two machines of a cluster would.

- SFT and GRPO train to the same weights as one process with the whole batch (tests/helpers/ddp_worker.py's
  cases, the same equality the one-node two-process tests check).
- Checkpoints go into one output folder both nodes see (a shared file system): each is written once, by global
  rank 0, complete (its marker) with each rank's RNG state; a run resumed by both nodes from that folder equals an
  uninterrupted one-process run.
- Async GRPO with a trainer rank per node: each starts its rollout worker on its own node, and at max_staleness 0
  the run equals synchronous GRPO on the same two nodes.
- Sequence parallelism inside each node (2 nodes x 2 processes, groups of the 2 ranks of a node): SFT and GRPO
  equal one process with the whole batch.
- Each rank knows its place: global rank, node rank, local rank; global rank 0 is the only world process zero,
  and each node has a local process zero (what node-local I/O would key on; docs/distributed.md).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from builders import HELPERS

pytestmark = pytest.mark.slow

DDP_WORKER = str(HELPERS / "ddp_worker.py")
WORKER = str(HELPERS / "multinode_worker.py")


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true",
            "PYTHONPATH": str(HELPERS) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _free_port() -> int:
    """A port nothing listens on now (a fixed one could meet another run's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(logs: Path, *args: str, nproc: int = 1) -> None:
    """Both nodes' agents at once (each waits at the rendezvous for the other), `nproc` processes per node; each
    agent's output goes to a file (no pipe to fill), and each agent with its workers is its own process group,
    killed whole if the run hangs."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun comes with torch"
    port = _free_port()
    logs.mkdir(parents=True, exist_ok=True)
    files = [open(logs / f"node{node}.log", "w") for node in (0, 1)]
    procs = [subprocess.Popen([torchrun, "--nnodes", "2", "--nproc_per_node", str(nproc), "--node_rank", str(node),
                               "--master_addr", "127.0.0.1", "--master_port", str(port), *args],
                              stdout=f, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
             for node, f in zip((0, 1), files)]
    try:
        for p in procs:
            p.wait(timeout=900)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for f in files:
            f.close()
    for node, p in enumerate(procs):
        assert p.returncode == 0, f"node {node}:\n{(logs / f'node{node}.log').read_text()[-6000:]}"


def _one(*args: str) -> None:
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=_env(), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def _same(p1: dict, p2: dict, what: str) -> None:
    assert p1.keys() == p2.keys()
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-5, atol=1e-5, msg=f"{what}: {k}")


def test_two_nodes_train_sft_and_grpo_to_the_weights_of_one_process(tmp_path):
    cases = "sft,grpo-dapo-group"
    _one(DDP_WORKER, str(tmp_path / "one"), "1", cases)
    _two_nodes(tmp_path / "logs", DDP_WORKER, str(tmp_path / "two"), "2", cases)
    r1, r2 = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("one", "two"))
    for case in cases.split(","):
        assert r1[case]["world_size"] == 1 and r2[case]["world_size"] == 2
        assert r2[case]["losses"] == pytest.approx(r1[case]["losses"], rel=1e-5, abs=2e-6), case
        _same(torch.load(tmp_path / "one" / case / "params.pt"), torch.load(tmp_path / "two" / case / "params.pt"),
              case)


def test_checkpoints_are_written_once_and_both_nodes_resume_from_them(tmp_path):
    from toolkit.core.checkpoint import COMPLETE_MARKER

    one, shared = tmp_path / "one", tmp_path / "shared"
    _one(WORKER, str(one), "1", "4", "fresh")
    _two_nodes(tmp_path / "logs-1", WORKER, str(shared), "2", "2", "fresh")
    # what each rank knew of its place
    ranks = [json.loads((shared / f"rank{k}.json").read_text()) for k in (0, 1)]
    assert [(r["rank"], r["node_rank"], r["local_rank"]) for r in ranks] == [(0, 0, 0), (1, 1, 0)]
    assert [r["world_zero"] for r in ranks] == [True, False] and all(r["local_zero"] for r in ranks)
    assert all(r["world_size"] == 2 for r in ranks)
    # written once, into the one folder: complete, with the model and both ranks' RNG states, nothing half-way
    checkpoints = sorted(p.name for p in shared.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-1", "checkpoint-2"]
    from safetensors.torch import load_file

    for name in checkpoints:
        files = {p.name for p in (shared / name).iterdir()}
        assert {COMPLETE_MARKER, "model.safetensors", "rng_state_0.pth", "rng_state_1.pth"} <= files, files
        # one copy of the weights, the one-process run's at that step
        assert len([f for f in files if f.endswith(".safetensors")]) == 1
        w1, w2 = load_file(str(one / name / "model.safetensors")), load_file(str(shared / name / "model.safetensors"))
        _same(w1, w2, f"{name} as written")
    assert not list((shared / ".staging").iterdir())  # (the staging folder, empty, as after one process's run)
    assert [p.name for p in shared.iterdir() if p.name.startswith(".")] == [".staging"]
    # both nodes resume from the shared folder (the newest complete checkpoint) and train on to step 4: the
    # weights of one process that never stopped
    _two_nodes(tmp_path / "logs-2", WORKER, str(shared), "2", "4", "resume")
    resumed = json.loads((shared / "rank0.json").read_text())
    straight = json.loads((one / "rank0.json").read_text())
    assert resumed["losses"] == pytest.approx(straight["losses"], rel=1e-5, abs=2e-6)
    _same(torch.load(one / "params.pt"), torch.load(shared / "params.pt"), "resumed on two nodes")


def test_async_grpo_starts_a_worker_per_node_and_equals_synchronous_grpo(tmp_path):
    cases = "grpo-tfm,async-0"
    _two_nodes(tmp_path / "logs", DDP_WORKER, str(tmp_path / "two"), "2", cases)
    r = json.loads((tmp_path / "two" / "result.json").read_text())
    assert r["async-0"]["world_size"] == 2 and len(r["async-0"]["losses"]) == 3
    assert r["async-0"]["losses"] == pytest.approx(r["grpo-tfm"]["losses"], rel=1e-5, abs=2e-6)
    _same(torch.load(tmp_path / "two" / "grpo-tfm" / "params.pt"), torch.load(tmp_path / "two" / "async-0" / "params.pt"),
          "async-0 on two nodes")
    rounds = [json.loads((tmp_path / "two" / "async-0" / f"rounds_rank{k}.json").read_text()) for k in (0, 1)]
    assert all(not set(a) & set(b) for a, b in zip(*rounds))  # each node's worker generated its own share


def test_sequence_parallel_groups_inside_each_node_equal_one_process(tmp_path):
    cases = "sft-sp,grpo-sp"
    _one(DDP_WORKER, str(tmp_path / "one"), "1", cases)
    _two_nodes(tmp_path / "logs", DDP_WORKER, str(tmp_path / "four"), "4", cases, nproc=2)
    r1, r4 = (json.loads((tmp_path / d / "result.json").read_text()) for d in ("one", "four"))
    for case in cases.split(","):
        assert r4[case]["world_size"] == 4 and r4[case]["sequence_parallel"] == 2, case
        assert r4[case]["losses"] == pytest.approx(r1[case]["losses"], rel=1e-5, abs=2e-6), case
        _same(torch.load(tmp_path / "one" / case / "params.pt"), torch.load(tmp_path / "four" / case / "params.pt"),
              case)
