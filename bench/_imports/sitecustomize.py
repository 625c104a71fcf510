"""Records which of the repository's .py files each Python process of a benchmark runs.

bench/run_all.py puts this folder first on PYTHONPATH and names a trace file in TOOLKIT_BENCH_TRACE for each
benchmark it runs; every process the benchmark starts that inherits that environment (workers, torchrun
ranks, a vLLM server, spawned multiprocessing children) imports this file at start-up. The table then tells
a change to a file the benchmark never ran from a change to one it did (bench/run_all.py, `_code_status`).

Why an audit hook: the "exec" event fires when a module's body (or a script run as __main__) executes, with
the code's file name, so each file is recorded as it loads, and a process killed later keeps its record.
The "subprocess.Popen" event sees every child a traced process starts. A Python child that will not load
this file (started with -I, -E or -S, or given an environment without TOOLKIT_BENCH_TRACE) is written to the
trace as UNTRACED, and run_all then judges the row on every file (it fails closed); the one exception is
`python -I -S script.py`, which can run only its script and the standard library, so the script is recorded.
Files of the interpreter and its site-packages are not recorded (they are not the repository's code).
The cost: one Python call per audit event, about 14 000 events a second in a GRPO test run.
"""

import os
import sys

_TRACE = os.environ.get("TOOLKIT_BENCH_TRACE")
_PYTHONS = ("python", "torchrun", "accelerate", "toolkit", "vllm", "pytest")


def _python_flags(argv: list[str]) -> set[str]:
    """The one-letter flags given to a Python interpreter before its script / -c / -m (e.g. {"I", "S"})."""
    flags: set[str] = set()
    args = iter(argv[1:])
    for arg in args:
        if not arg.startswith("-") or arg.startswith("--") or len(arg) < 2 or arg[1] in "cm":
            break
        if arg in ("-W", "-X"):  # these take a value: the next argument
            next(args, None)
        elif arg[1] not in "WX":
            flags.update(arg[1:])
    return flags


def _install(trace: str) -> None:
    seen: set[str] = set()
    skip = tuple(os.path.abspath(p) + os.sep for p in {sys.base_prefix, sys.prefix})

    def write(line: str) -> bool:
        try:
            with open(trace, "a") as f:  # one short line, appended: the processes of a row share the file
                f.write(line + "\n")
            return True
        except OSError as e:
            print(f"bench trace: cannot write {trace}: {e}", file=sys.stderr)
            return False

    def record(path: str, cwd: str | None = None) -> None:
        if not path.endswith(".py"):
            return
        path = os.path.abspath(os.path.join(cwd, path) if cwd else path)
        if path in seen or "site-packages" in path or path.startswith(skip):
            return
        if write(path):
            seen.add(path)

    def child(args: tuple) -> None:
        _, argv, cwd, env = args
        argv = [os.fspath(a) for a in (argv if isinstance(argv, (list, tuple)) else [argv])
                if isinstance(a, (str, os.PathLike))]
        if not argv or not any(n in os.path.basename(argv[0]) for n in _PYTHONS):
            return  # git, a shell tool: not Python
        flags = _python_flags(argv)
        scripts = [a for a in argv[1:] if a.endswith(".py")]
        if {"I", "S"} <= flags:  # isolated and no site: only the script and the standard library can run
            for script in scripts:
                record(script, os.fspath(cwd) if cwd else None)
        elif flags & {"I", "E", "S"} or (env is not None and "TOOLKIT_BENCH_TRACE" not in env):
            write("UNTRACED " + " ".join(argv)[:500])

    def hook(event: str, args: tuple) -> None:
        if event == "exec":
            record(getattr(args[0], "co_filename", "") or "")
        elif event == "subprocess.Popen":
            child(args)

    sys.addaudithook(hook)
    write(f"PROCESS {os.getpid()}")  # the hook runs here: a trace without any such line was not taken


def _chain() -> None:
    """Run the sitecustomize this file shadows, if the interpreter has one."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if _TRACE:
    _install(_TRACE)
_chain()
