"""Nothing is lost: SIGKILL a training process inside its checkpoint writes (staging, marker, swap into place,
rotation with save_total_limit=1), check that a complete checkpoint always exists once the first save is done,
resume, and check that the resumed run's per-step losses equal an uninterrupted run's, for SFT, DPO, GRPO and PPO.

The kill points come from TOOLKIT_FAULT_AT (toolkit/core/checkpoint.py), so each kill lands exactly where a
real crash would hurt most; two more kills per trainer come from outside, at timed moments (a timer).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from builders import HELPERS

from toolkit.core.checkpoint import STAGING_DIR, latest_complete_checkpoint

WORKER = (HELPERS / "crash_worker.py")
# (point, step): killed after staging (no marker yet), after the marker (before the swap), right after the swap
# (before the old checkpoint is deleted), and inside rotation (the old folder renamed out of the checkpoint
# namespace, not yet deleted). The kill between the two renames of a re-save is in tests/unit/test_checkpoint.py.
KILLS = [("staged", 2), ("marked", 3), ("swapped", 2), ("rotating", 3)]


class Runs:
    """A crash_worker.py server: imports once, forks one real process per training run."""

    def __init__(self):
        env = dict(os.environ, PYTHONPATH=str(WORKER.parent), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env.pop("TOOLKIT_FAULT_AT", None)
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def start(self, kind, out, losses, fault=None) -> int:
        self.proc.stdin.write(json.dumps({"kind": kind, "out": str(out), "losses": str(losses), "fault": fault}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["pid"]

    def wait(self) -> int:
        return json.loads(self.proc.stdout.readline())["status"]

    def run(self, kind, out, losses, fault=None) -> int:
        self.start(kind, out, losses, fault)
        return self.wait()

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def runs():
    r = Runs()
    yield r
    r.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo", "ppo"])
def test_sigkill_inside_checkpoint_writes_then_resume_equals_uninterrupted(tmp_path, kind, runs):
    assert runs.run(kind, tmp_path / "ref", tmp_path / "ref.json") == 0
    expected = json.loads((tmp_path / "ref.json").read_text())
    assert len(expected) == 4
    report = []
    for point, step in KILLS:
        out = tmp_path / f"{point}-{step}"
        status = runs.run(kind, out, tmp_path / "unused.json", fault=f"{point}:{step}")
        assert status == -signal.SIGKILL, (point, status)
        latest = latest_complete_checkpoint(out)
        assert latest is not None, f"{kind} killed at {point}:{step}: no complete checkpoint in {list(out.iterdir())}"
        assert runs.run(kind, out, tmp_path / f"{point}.json") == 0
        got = json.loads((tmp_path / f"{point}.json").read_text())
        assert got == expected, f"{kind} killed at {point}:{step} (resumed from {latest}): {got} != {expected}"
        assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-4"]  # save_total_limit=1, leftovers gone
        assert not any((out / STAGING_DIR).glob("checkpoint-*"))
        report.append(f"{point}:{step} -> resumed from {Path(latest).name}")
    # Kills from outside at moments nobody chose: right after the first checkpoint appears, and a little later.
    for k, delay in enumerate((0.0, 0.25)):
        out = tmp_path / f"timer{k}"
        pid = runs.start(kind, out, tmp_path / "t.json")
        deadline = time.time() + 240
        while time.time() < deadline and latest_complete_checkpoint(out) is None:
            time.sleep(0.01)
        time.sleep(delay)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it had finished: resuming must then train nothing more
        runs.wait()
        latest = latest_complete_checkpoint(out)
        assert latest is not None
        assert runs.run(kind, out, tmp_path / "t.json") == 0
        got = json.loads((tmp_path / "t.json").read_text())
        assert got == expected, f"{kind} killed by a timer, resumed from {latest}: {got} != {expected}"
        report.append(f"timer kill -> resumed from {Path(latest).name}")
    print(f"{kind}: {len(report)} kills, all resumes exact: " + "; ".join(report))
