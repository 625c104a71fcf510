"""toolkit.core.distributed.exit_process, in real child processes: a process that joined a process group (a real
gloo group, rendezvous through a file) ends without interpreter finalization, where a rank can abort after a run
that finished (see exit_process), yet what a run relies on at exit still happens, in CPython's order; any other
process exits as sys.exit does."""

import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import atexit, logging, sys, threading, time
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from toolkit.core.distributed import exit_process

    out = Path(sys.argv[1])
    mode = sys.argv[2]

    class Finalized:
        def __init__(self, path):
            self.path = path
            self.cycle = self  # kept until the module's globals are cleared and the last collection runs

        def __del__(self, _open=open):  # in interpreter finalization, never after os._exit; names bound now
            with _open(self.path, "w") as f:
                f.write("yes")

    keep = Finalized(str(out / "finalized"))
    if mode == "group":
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + str(out / "rendezvous"), rank=0, world_size=1)
        dist.barrier()

    def slow_write(name):
        time.sleep(1.5)  # far longer than reaching the exit takes: only a join makes the file appear
        (out / name).write_text("done")

    def at_exit():  # CPython's order: threads are joined before atexit handlers run, the group is still there
        import torch.distributed as dist
        seen = [n for n in ("thread", "pool") if (out / n).exists()]
        group = dist.is_available() and dist.is_initialized()
        (out / "atexit").write_text(" ".join(seen) + (" group" if group else ""))

    threading.Thread(target=slow_write, args=("thread",)).start()       # non-daemon: the exit waits for it
    pool = ThreadPoolExecutor(1)
    pool.submit(slow_write, "pool")                                      # a pool's queued work finishes too
    atexit.register(at_exit)
    log = logging.getLogger("exit-test")
    log.propagate = False
    log.addHandler(logging.FileHandler(out / "log.txt", delay=True))
    log.warning("logged")
    sys.stdout.write("printed without a newline")                     # block-buffered: a pipe, not a terminal
    exit_process(None if mode == "none-code" else 3)
    raise AssertionError("exit_process returned")
""")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["group", "single", "none-code"])
def test_exit_process_keeps_what_a_run_needs_and_skips_finalization_only_after_a_process_group(tmp_path, mode):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), mode], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == (0 if mode == "none-code" else 3), proc.stderr[-3000:]
    assert proc.stdout == "printed without a newline"
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "pool").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "thread pool" + (" group" if mode == "group" else "")
    assert (tmp_path / "log.txt").read_text() == "logged\n"
    # the point: after a process group, interpreter finalization (where the abort happens) does not run
    assert (tmp_path / "finalized").exists() == (mode != "group")


def test_exit_process_refuses_another_thread_and_leaves_an_in_process_caller_alone(monkeypatch):
    """From a thread other than the main one it raises (it could not end the process); in this process (no
    group, WORLD_SIZE unset) it raises SystemExit as sys.exit does, with None read as 0 and a message as 1."""
    import threading

    from toolkit.core.distributed import exit_process

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, exit_process, 0)))
    t.start()
    t.join()
    assert "main thread" in str(errors[0].value)
    for code, status in ((None, 0), (4, 4)):
        with pytest.raises(SystemExit) as e:
            exit_process(code)
        assert e.value.code == status
