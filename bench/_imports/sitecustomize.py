"""Records which of the repository's .py files each Python process of a benchmark runs.

bench/run_all.py puts this folder first on PYTHONPATH and names a trace file in TOOLKIT_BENCH_TRACE for each
benchmark it runs; every process the benchmark starts that inherits that environment (workers, torchrun
ranks, a vLLM server, spawned multiprocessing children) imports this file at start-up. The table then tells
a change to a file the benchmark never ran from a change to one it did (bench/run_all.py, `_code_status`).

Why an audit hook: the "exec" event fires when a module's body (or a script run as __main__) executes, with
the code's file name, so each file is recorded as it loads, and a process killed later keeps its record.
The "subprocess.Popen", "os.exec", "os.posix_spawn" and "os.spawn" events see the children a traced process
starts. A child that will not load this file, or may not, is written to the trace as UNTRACED, and run_all
then judges the row on every file (it fails closed): a Python child started with -I, -E or -S; one whose
environment (given, or inherited) lacks TOOLKIT_BENCH_TRACE or does not put this folder on PYTHONPATH; and
any child started through a shell or `env`, whose command line cannot be read. multiprocessing's spawn
children inherit the environment and load this file themselves. Files of the interpreter and its
site-packages are not recorded, except files of a `toolkit` or `toolkit_*` package installed there: run_all
refuses a trace holding one (the library would have run from a copy outside any checkout).
The cost: one Python call per audit event, about 14 000 events a second in a GRPO test run.
"""

import os
import sys

_TRACE = os.environ.get("TOOLKIT_BENCH_TRACE")
_PYTHONS = ("python", "torchrun", "accelerate", "toolkit", "vllm", "pytest")
_SHELLS = ("sh", "bash", "dash", "zsh", "env")
_HERE = os.path.dirname(os.path.realpath(__file__))


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


def _ours(path: str) -> bool:
    """A file of a toolkit or toolkit_* package, wherever it is installed."""
    return any(part == "toolkit" or part.startswith("toolkit_") for part in path.split(os.sep)[:-1])


def _keeps_tracer(env) -> bool:
    """Whether a child with this environment loads this file into the same trace."""
    entries = [os.path.realpath(p or os.curdir) for p in (env.get("PYTHONPATH") or "").split(os.pathsep)]
    return env.get("TOOLKIT_BENCH_TRACE") == _TRACE and _HERE in entries


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
        if path in seen or (("site-packages" in path or path.startswith(skip)) and not _ours(path)):
            return
        if write(path):
            seen.add(path)

    def child(argv, env) -> None:
        argv = [os.fsdecode(a) for a in (argv if isinstance(argv, (list, tuple)) else [argv])
                if isinstance(a, (str, bytes, os.PathLike))]
        name = os.path.basename(argv[0]) if argv else ""
        if name in _SHELLS:
            write("UNTRACED (through a shell or env) " + " ".join(argv)[:500])
            return
        if not any(n in name for n in _PYTHONS):
            return  # git, a compiler, a tool: not Python
        if _python_flags(argv) & {"I", "E", "S"} or not _keeps_tracer(os.environ if env is None else env):
            write("UNTRACED " + " ".join(argv)[:500])

    def hook(event: str, args: tuple) -> None:
        if event == "exec":
            record(getattr(args[0], "co_filename", "") or "")
        elif event == "subprocess.Popen":  # (executable, args, cwd, env)
            child(args[1], args[3])
        elif event in ("os.exec", "os.posix_spawn"):  # (path, args, env)
            child(args[1], args[2])
        elif event == "os.spawn":  # (mode, path, args, env)
            child(args[2], args[3])

    sys.addaudithook(hook)
    write(f"PROCESS {os.getpid()}")  # the hook runs here: a trace without any such line was not taken


def _chain() -> None:
    """Run the sitecustomize this file shadows, if the interpreter has one."""
    import importlib.machinery
    import importlib.util

    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if _TRACE:
    _install(_TRACE)
_chain()
