"""Pieces both benchmarks use."""

from __future__ import annotations

import time


def step_timer():
    """A TrainerCallback recording the wall time at the end of every optimizer step in `.ends`."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kw):
            self.ends.append(time.perf_counter())

    return StepTimer()


def run_in_subprocess(script: str, args: list[str], env: dict[str, str] | None = None) -> dict:
    """Run `script --worker ...` in a fresh process (peak RSS is per process) and return its RESULT json."""
    import json
    import os
    import re
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        print(proc.stdout[-3000:], proc.stderr[-6000:])
        # the failure's own last line (e.g. "AttributeError: ..."), so a results file can say why by itself
        errors = [m.group(1) for ln in proc.stderr.splitlines()  # torchrun-style lines carry a "[rank0]: " prefix
                  if (m := re.match(r"^(?:\[rank\d+\]:\s*)?([\w.]+(?:Error|Exception|Exit)\b.*)", ln.strip()))]
        reason = errors[-1][:300] if errors else f"exit {proc.returncode}"
        raise SystemExit(f"{os.path.basename(script)} {' '.join(args)} failed: {reason}")
    return json.loads(line[len("RESULT "):])


def bench_args(doc: str, worker, *, default_steps: int):
    """Parse --steps/--worker/--json. In worker mode run `worker(kind, steps)`, print its RESULT line and exit."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=default_steps)
    ap.add_argument("--worker", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.steps)), flush=True)
        raise SystemExit(0)
    return args


def run_each(script: str, kinds, steps: int, describe, *, env: dict | None = None,
             env_for: dict | None = None, keep_going: bool = False) -> dict:
    """Run every kind's worker in its own process, in order; print `describe(result)` after each.

    `env`: extra environment for every worker; `env_for`: {kind: extra environment}. With
    keep_going, a failed worker is recorded as {"failed": reason} and the others still run.
    """
    results = {}
    for kind in kinds:
        print(f"running {kind} ...", flush=True)
        started = time.perf_counter()
        extra = {**(env or {}), **((env_for or {}).get(kind) or {})}
        try:
            results[kind] = run_in_subprocess(script, ["--steps", str(steps), "--worker", kind], env=extra)
        except SystemExit as e:
            if not keep_going:
                raise
            results[kind] = {"kind": kind, "failed": str(e)}
            print(f"  FAILED: {e}", flush=True)
            continue
        print(f"  {describe(results[kind])} ({time.perf_counter() - started:.0f} s)", flush=True)
    return results


def provenance() -> dict:
    """What a results file needs to be rerun: the commit (and whether the tree had changes), the date, the
    machine's cores and the versions of the libraries both sides run on."""
    import datetime
    import os
    import platform
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo, wherever the script is run from

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", root, *args], capture_output=True, text=True)
        except OSError:  # no git: the results still get written, with the commit unknown
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    versions = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    # Which CPU, and whether it has AVX-512: these 2-core machines differ by up to 4x in matmul throughput
    # (bench/ceiling.py measured 399 GFLOP/s on one with AVX-512 and about 96 on one with AVX2 only).
    cpu, flags = None, set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and cpu is None:
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:  # not Linux: the processor string is what the platform says
        cpu = platform.processor() or None
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_tile", "avx2", "fma") if f in flags]
    # results and the table are what benchmarks write: they do not make the measured code differ from the commit
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results", ":!bench/README.md")
    return {"commit": git("rev-parse", "HEAD") or "unknown", "tree_changed": None if changed is None else bool(changed),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu_cores": os.cpu_count(), "machine": platform.machine(), "cpu": cpu, "cpu_flags": isa,
            "python": platform.python_version(),
            "versions": versions}
