"""Records which of the repository's .py files each Python process of a benchmark runs.

bench/run_all.py puts this folder first on PYTHONPATH and names a trace file in TOOLKIT_BENCH_TRACE for each
benchmark it runs; every process the benchmark starts (workers, torchrun ranks, a vLLM server, spawned
multiprocessing children) inherits both and imports this file at start-up. The table then tells a change to a
file the benchmark never ran from a change to one it did (bench/run_all.py, `_changed_since`).

Why an audit hook: the "exec" event fires when a module's body (or a script run as __main__) executes, with
the code's file name, so each file is recorded as it loads, and a process killed later keeps its record.
A process started with `python -I` or `-S` skips this file; the parent's "subprocess.Popen" event records any
.py file on such a command line, so the script it runs is counted too. Files of the interpreter and its
site-packages are not recorded (they are not the repository's code).
"""

import os
import sys

_TRACE = os.environ.get("TOOLKIT_BENCH_TRACE")


def _install(trace: str) -> None:
    seen: set[str] = set()
    skip = tuple({sys.base_prefix, sys.prefix})

    def record(path: str) -> None:
        if not path.endswith(".py") or "site-packages" in path or path.startswith(skip):
            return
        path = os.path.abspath(path)
        if path in seen:
            return
        seen.add(path)
        try:
            with open(trace, "a") as f:  # one short line per file, appended: processes may share the file
                f.write(path + "\n")
        except OSError:
            pass  # the trace is best effort; a row without one is judged on every file (run_all)

    def hook(event: str, args: tuple) -> None:
        if event == "exec":
            record(getattr(args[0], "co_filename", "") or "")
        elif event == "subprocess.Popen":
            for arg in args[1] or ():
                if isinstance(arg, (str, os.PathLike)):
                    record(os.fspath(arg))

    sys.addaudithook(hook)


if _TRACE:
    _install(_TRACE)
