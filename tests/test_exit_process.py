"""toolkit.core.distributed.exit_process, in real child processes: a process that joined a process group (a real
gloo group over TCP on loopback) ends without interpreter finalization, where a rank can abort after a run that
finished (see exit_process), yet everything a run relies on at exit still happens; any other process exits as
sys.exit does."""

import socket
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import atexit, logging, os, sys, threading, time
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
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=1)
        dist.barrier()

    def slow_write(name):
        time.sleep(0.5)
        (out / name).write_text("done")

    threading.Thread(target=slow_write, args=("thread",)).start()       # non-daemon: the exit waits for it
    pool = ThreadPoolExecutor(1)
    pool.submit(slow_write, "pool")                                      # a pool's queued work finishes too
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    handler = logging.FileHandler(out / "log.txt", delay=True)
    logging.getLogger().addHandler(handler)
    logging.getLogger().warning("logged")
    sys.stdout.write("printed without a newline")                     # block-buffered: a pipe, not a terminal
    exit_process(3)
    raise AssertionError("exit_process returned")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("mode", ["group", "single"])
def test_exit_process_keeps_what_a_run_needs_and_skips_finalization_only_after_a_process_group(tmp_path, mode):
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), mode, str(_free_port())],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stdout == "printed without a newline"
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "pool").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "log.txt").read_text() == "logged\n"
    # the point: after a process group, interpreter finalization (where the abort happens) does not run
    assert (tmp_path / "finalized").exists() == (mode == "single")
