"""Regenerate bench/results/ and the table in bench/README.md, one benchmark after another.

    python bench/run_all.py                       # the core group (ceiling, SFT, DPO, GRPO, PPO vs TRL, decode): ~40 min
    python bench/run_all.py --group all           # every benchmark whose inputs exist: several hours
    python bench/run_all.py --only ppo_vs_trl     # one (or a few) by name
    python bench/run_all.py --table               # only rebuild bench/README.md from the results as they are
    python bench/run_all.py --list                # the benchmarks, their groups and what they need

Each benchmark runs as its own process with the interpreter it needs (.venv, or .venv-vllm for the
vLLM one). Its stdout becomes bench/results/<name>.txt under a header naming the commit, date,
machine and run time; its JSON gets `provenance` (commit, tree changed or not, date, cores, library
versions), `run_seconds` and `loaded_code` (the toolkit/ and plugins/ .py files its processes ran, traced
by bench/_imports/sitecustomize.py). Nothing in bench/results/ is written by hand. A benchmark whose inputs
are missing (a trained checkpoint, the vLLM environment) is skipped with the command that makes
them, and its earlier result stays, with the commit it was measured at shown in the table. The
table's ceiling column divides a row's tokens/s by bench/results/ceiling.json (bench/ceiling.py:
this machine's measured matmul FLOP/s converted to tokens/s for the model), for rows measured at the
ceiling's commit only (the machine's speed varies over a day).

Do not commit or edit tracked files while it runs: provenance records the tree as it is at the end
of each benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


@dataclass
class Bench:
    name: str
    script: str
    group: str                      # core | vllm | long
    minutes: int                    # about, on 2 cores
    args: list[str] = field(default_factory=list)
    json_flag: bool = True          # takes --json <path>; else the script writes its own results files
    python: str = ".venv"
    needs: list[tuple[str, str]] = field(default_factory=list)  # (path that must exist, command that makes it)
    # what the row's numbers also depend on besides CODE_PATHS and its own script (a helper module it imports, the
    # configs it trains with, the setup of its interpreter): a change to one of these marks the row changed too
    inputs: tuple[str, ...] = ()
    # whether the library files its processes run are all the library code its numbers depend on: False for a
    # row that starts from a checkpoint an earlier toolkit run made (that run was not traced)
    traced: bool = True


BENCHES = [
    Bench("ceiling", "ceiling.py", "core", 1),
    Bench("logps_memory", "logps_memory.py", "core", 1, json_flag=False),
    Bench("sft_vs_trl", "sft_vs_trl.py", "core", 9),  # TRL at its defaults; --trl-no-gc adds the other rows
    Bench("dpo_vs_trl", "dpo_vs_trl.py", "core", 7),
    Bench("grpo_vs_trl", "grpo_vs_trl.py", "core", 19),
    Bench("ppo_vs_trl", "ppo_vs_trl.py", "core", 5, needs=[(".venv/trl-1.8.0", "bash scripts/setup.sh")]),
    Bench("decode_batch", "decode_batch.py", "core", 5),
    # peak tensor memory (allocator-level, what a GPU's max_memory_allocated reports), ours vs TRL, bf16, equal work
    Bench("memory_vs_trl", "memory_vs_trl.py", "core", 30, needs=[(".venv/trl-1.8.0", "bash scripts/setup.sh")]),
    # the memory model's fit table for docs/gpu.md (fake tensors: no model is loaded or allocated)
    Bench("memory_table", "memory_table.py", "core", 8),
    Bench("long_context_memory", "long_context_memory.py", "core", 5, inputs=("bench/memory_table.py",)),
    Bench("grpo_vllm", "grpo_vllm.py", "vllm", 8, python=".venv-vllm",
          needs=[(".venv-vllm/bin/python", "bash scripts/setup-vllm.sh")], inputs=("scripts/setup-vllm.sh",)),
    Bench("multiprocess", "multi_process.py", "long", 8, args=["--steps", "3"]),
    Bench("experimental_vs_trl", "experimental_vs_trl.py", "long", 15),
    Bench("online_vs_trl", "online_vs_trl.py", "long", 16),
    Bench("async_grpo", "async_grpo.py", "long", 16, json_flag=False, inputs=("bench/async_model.py",)),
    # three more seeds of the latency-bound case, in their own file: six seeds in all say how much the ratio varies
    Bench("async_grpo_seeds_3_5", "async_grpo.py", "long", 14, json_flag=False,
          args=["--cases", "latency", "--seeds", "3,4,5", "--out", "async_grpo_seeds_3_5"],
          inputs=("bench/async_model.py",)),
    Bench("async_staleness", "async_staleness.py", "long", 29, json_flag=False),
    # the criterion's bounds (0 and 4) on three more seeds: one seed of the sweep cannot tell a gap from noise
    Bench("async_staleness_seeds", "async_staleness.py", "long", 34, json_flag=False, args=["--seeds", "1,2,3"]),
    # three more: the spread between seeds (sd 10-14 points) is larger than the criterion's 5 points
    Bench("async_staleness_seeds_4_6", "async_staleness.py", "long", 34, json_flag=False,
          args=["--seeds", "4,5,6", "--out", "async_staleness_seeds_4_6"]),
    # the same bounds run three times as long: at 20 steps the reward is still rising, where a 3-4 step delay costs
    # the most; does the gap close when the runs have had time to flatten?
    Bench("async_staleness_60", "async_staleness.py", "long", 60, json_flag=False,
          args=["--steps", "60", "--seeds", "1,2,3", "--out", "async_staleness_60"]),
    # the bounds 0 and 4 on seeds 1-6 with 512 held-out problems instead of 128: on 128, evaluation noise alone
    # (about 6 points between two runs) is larger than the criterion's 5 points
    Bench("async_staleness_512", "async_staleness_512.py", "long", 55, json_flag=False,
          inputs=("bench/async_staleness.py",)),
    # the bounds 0 and 4 with a steadier training signal (4 prompts per step, linearly decaying lr) on seeds 1-10:
    # the spread of the runs above is the training's, too wide to show a 5-point margin with a handful of seeds
    Bench("async_staleness_steady", "async_staleness_steady.py", "long", 95, json_flag=False),
    Bench("learning_vs_trl", "learning_vs_trl.py", "long", 25, json_flag=False, traced=False,
          args=["--minutes", "6", "--eval-every", "1.5"],
          needs=[("outputs/arithmetic/0-sft/final", "toolkit pipeline --config examples/arithmetic_pipeline.toml")],
          inputs=("examples/arithmetic_pipeline.toml", "examples/arithmetic_warmup_sft.toml",
                  "examples/grpo_arithmetic.toml")),
    Bench("agent_rollouts", "agent_rollouts.py", "long", 35, json_flag=False, traced=False,
          needs=[("outputs/tools/0-sft/final", "toolkit pipeline --config examples/tools_pipeline.toml")],
          inputs=("examples/tools_pipeline.toml", "examples/tools_warmup_sft.toml", "examples/grpo_tools.toml")),
    Bench("task_suite", "task_suite.py", "long", 45, json_flag=False,
          inputs=("examples/task_suite_sft.toml", "examples/task_suite_grpo.toml")),
    Bench("distillation", "distillation.py", "long", 1, traced=False,
          needs=[("outputs/grpo-arithmetic/report", "toolkit grpo --config examples/grpo_arithmetic.toml"),
                 ("outputs/gkd-arithmetic/report", "toolkit gkd --config examples/gkd_arithmetic.toml")],
          inputs=("examples/grpo_arithmetic.toml", "examples/gkd_arithmetic.toml")),
]
GROUPS = {"core": ("core",), "vllm": ("vllm",), "long": ("long",), "all": ("core", "vllm", "long")}


def header(script: str, prov: dict, seconds: float) -> str:
    v = prov.get("versions", {})
    libs = ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "trl") if v.get(k))
    changed = " (tree changed)" if prov.get("tree_changed") else " (tree state unknown)" if prov.get(
        "tree_changed") is None else ""
    cpu = _cpu(prov) if prov.get("cpu") else ""
    return (f"# bench/{script} at {prov['commit'][:10]}{changed} ({prov['date']}, {prov['cpu_cores']} cores{cpu}, {libs}); "
            f"run time {seconds / 60:.1f} min; written by bench/run_all.py\n\n")


def run_one(b: Bench) -> dict:
    missing = [(p, cmd) for p, cmd in b.needs if not (ROOT / p).exists()]
    if missing:
        why = "; ".join(f"needs {p} (make it: {cmd})" for p, cmd in missing)
        print(f"== {b.name}: skipped, {why}", flush=True)
        return {"skipped": why}
    python = ROOT / b.python / "bin" / "python"
    cmd = [str(python), str(ROOT / "bench" / b.script), *b.args]
    json_path = RESULTS / f"{b.name}.json"
    if b.json_flag:
        cmd += ["--json", str(json_path)]
    print(f"== {b.name}: {' '.join(cmd[1:])} (about {b.minutes} min)", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    # which .py files its processes run (bench/_imports/sitecustomize.py appends to it)
    trace = Path(tempfile.gettempdir()) / f"toolkit-bench-{b.name}-{os.getpid()}.trace"
    trace.unlink(missing_ok=True)
    if b.traced:
        env["TOOLKIT_BENCH_TRACE"] = str(trace)
        # the checkout first: a worker imports this tree's toolkit, not the one an editable install points at
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TRACER), str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        return _run_traced(b, cmd, env, json_path, trace)
    finally:
        trace.unlink(missing_ok=True)


def _run_traced(b: Bench, cmd: list[str], env: dict, json_path: Path, trace: Path) -> dict:
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # shown as it comes: long benchmarks print their progress
        print("   " + line, end="", flush=True)
        lines.append(line)
    rc = proc.wait()
    seconds = time.perf_counter() - started
    if rc != 0:
        print(f"== {b.name}: FAILED (exit {rc}) after {seconds / 60:.1f} min; its earlier results are kept", flush=True)
        return {"failed": rc, "seconds": seconds}
    prov = provenance()
    fresh = json_path.exists() and json_path.stat().st_mtime > time.time() - seconds - 1  # written by this run
    if fresh and b.json_flag:
        # the script's own record, taken in the interpreter that ran it (.venv-vllm has other versions)
        prov = json.loads(json_path.read_text()).get("provenance", prov)
    if b.json_flag or b.name == "logps_memory":
        # the script's own stdout is the text result; warnings and progress bars are not results
        text = "".join(ln for ln in lines if not _noise(ln))
        (RESULTS / f"{b.name}.txt").write_text(header(b.script, prov, seconds) + text)
    if fresh:
        data = json.loads(json_path.read_text())
        data.setdefault("provenance", prov)
        data["run_seconds"] = round(seconds, 1)
        loaded = _loaded_code(trace) if b.traced else None
        data.pop("loaded_code", None)  # an earlier run's record describes that run only
        data.pop("loaded_code_rules", None)
        if loaded is not None:
            data["loaded_code"], data["loaded_code_rules"] = loaded, TRACE_RULES
        json_path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"== {b.name}: done in {seconds / 60:.1f} min", flush=True)
    return {"seconds": round(seconds, 1)}


TRACER = ROOT / "bench" / "_imports"
# the rules a `loaded_code` record was taken under: a record from older rules (which missed cases the tracer now
# marks UNTRACED) is not trusted, and its row is judged on every file
TRACE_RULES = 2


def _loaded_code(trace: Path) -> list[str] | None:
    """The repository's toolkit/ and plugins/ .py files named in a trace, sorted (relative to the checkout); None
    where the trace cannot be trusted, so the row is judged on every file: no trace, no traced process, a Python
    child that skipped the tracer (UNTRACED), or a library file run from another checkout (an editable plugin
    install pointing elsewhere) whose content differs from this checkout's."""
    if not trace.exists():
        return None
    lines = trace.read_text().splitlines()
    untraced = [line for line in lines if line.startswith("UNTRACED ")]
    if untraced or not any(line.startswith("PROCESS ") for line in lines):
        print(f"   (not traced: {untraced[0] if untraced else 'no process loaded the tracer'}; "
              f"the row is judged on every file)", flush=True)
        return None
    found = set()
    for line in lines:
        if line.startswith("PROCESS "):
            continue
        path = Path(line)
        root = next((d for d in path.parents if (d / "toolkit").is_dir() and (d / "pyproject.toml").is_file()), None)
        if root is None:
            if any(part == "toolkit" or part.startswith("toolkit_") for part in path.parts[:-1]):
                print(f"   (not traced: ran {path}, an installed copy outside any checkout; the row is judged on "
                      f"every file)", flush=True)
                return None
            continue
        rel = path.relative_to(root).as_posix()
        if not rel.startswith(("toolkit/", "plugins/")):
            continue
        if root.resolve() != ROOT.resolve():
            here = ROOT / rel
            if not here.is_file() or here.read_bytes() != path.read_bytes():
                print(f"   (not traced: ran {path}, which differs from this checkout's {rel}; the row is judged on "
                      f"every file)", flush=True)
                return None
        found.add(rel)
    return sorted(found)


def _noise(line: str) -> bool:
    return any(s in line for s in ("Warning", "warnings.warn", "Loading weights", "it/s]", "kernels-community",
                                   "newly initialized", "MISSING", "UNEXPECTED", "- This IS", "- This IS NOT"))


# ------------------------------------------------------------------------------------------- the table

def _load(name: str) -> dict | None:
    p = RESULTS / f"{name}.json"
    if not p.exists():
        return None
    d = json.loads(p.read_text())
    d["_bench"] = name  # for _when: which script measured it
    return d


# What a result's numbers depend on besides its own script: the library, the example plugins, the dependency pins
# and the benchmarks' shared helpers. A change to any of them after a result's commit may move its numbers.
CODE_PATHS = ("toolkit", "plugins", "pyproject.toml", "constraints.txt", "scripts/setup.sh", "bench/_common.py")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


_CHANGED: dict[tuple[str, str, tuple[str, ...]], list[str] | None] = {}


def _changed_since(commit: str, script: str, inputs: tuple[str, ...] = ()) -> list[str] | None:
    """The files under CODE_PATHS (and the result's own script and other inputs) that differ between `commit` and
    the working tree (HEAD plus uncommitted changes: the code as it is when the table is written); None where git
    cannot tell (no repository, a commit it does not hold). A renamed file counts under both names; an untracked
    file (not ignored) counts as changed."""
    key = (commit, script, inputs)
    if key not in _CHANGED:
        paths = (*CODE_PATHS, f"bench/{script}", *inputs)
        out = _git("diff", "--name-only", "--no-renames", commit, "--", *paths)
        new = _git("ls-files", "--others", "--exclude-standard", "--", *paths)
        _CHANGED[key] = None if out is None or new is None else sorted(
            {line for line in (out + "\n" + new).splitlines() if line})
    return _CHANGED[key]


def _not_loaded(path: str, loaded: frozenset[str]) -> bool:
    """A library .py file the row's processes never ran: a change to it cannot have moved the row's numbers.
    Everything else (data files under toolkit/, a plugin's pyproject.toml, the pins, the script) always counts."""
    return path.startswith(("toolkit/", "plugins/")) and path.endswith(".py") and path not in loaded


def _code_status(d: dict, commit: str) -> str:
    """"; code unchanged since" or "; code changed since: <files>" against the commit the table is rendered at.
    A row that recorded the library files its processes ran (`loaded_code`) is judged on those (and on every
    file that is not a library .py file); the files left out are counted in the cell, so the judgement shows."""
    bench = next((b for b in BENCHES if b.name == d.get("_bench")), None)
    if bench is None:
        return ""
    changed = _changed_since(commit, bench.script, bench.inputs)
    if changed is None:
        return ""
    unloaded = []
    if "loaded_code" in d and d.get("loaded_code_rules") == TRACE_RULES and bench.traced:
        loaded = frozenset(d["loaded_code"])
        unloaded = [f for f in changed if _not_loaded(f, loaded)]
        changed = [f for f in changed if not _not_loaded(f, loaded)]
    if not changed:
        if unloaded:
            return (f"; code it ran unchanged since ({len(unloaded)} library file{'s' * (len(unloaded) > 1)} it "
                    f"never loaded changed: {', '.join(unloaded[:2])}{' and more' if len(unloaded) > 2 else ''})")
        return "; code unchanged since"
    shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return f"; **code changed since**: {shown}"


def _when(d: dict) -> str:
    prov = d.get("provenance")
    if prov:
        return (f"{prov['commit'][:8]}{' (tree changed)' if prov.get('tree_changed') else ''}, {prov['date'][:10]}"
                f"{_cpu(prov)}{_code_status(d, prov['commit'])}")
    if d.get("commit"):
        return f"{str(d['commit'])[:8]}, {d.get('date', 'date not recorded')}"
    return "not recorded (before run_all.py)"


def _cpu_kind(prov: dict | None) -> str | None:
    """"AVX-512", "AVX2" or "other" where a result recorded its CPU flags; None where it did not."""
    flags = (prov or {}).get("cpu_flags")
    if flags is None:
        return None
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "other"


def _cpu(prov: dict) -> str:
    """Which kind of CPU a result was measured on, where recorded: the machines here differ up to 4x in matmul.
    Its model name too: an Intel Xeon and an AMD EPYC, both with AVX-512, have measured up to 400 and 140-200 GFLOP/s."""
    kind = _cpu_kind(prov)
    name = prov.get("cpu") or ""
    name = "Intel Xeon " if "Xeon" in name else "AMD EPYC " if "EPYC" in name else ""
    return {None: "", "AVX-512": f", {name}AVX-512 CPU", "AVX2": f", {name}AVX2 CPU (no AVX-512)"}.get(
        kind, ", CPU without AVX2")


def _recomputes(ours: dict, theirs: dict) -> str:
    """Which side recomputed activations in backward (each at its own default), where the results say."""
    if "activation_checkpointing" not in ours:
        return ""
    said = {True: "on", False: "off"}
    return (f"; activation checkpointing {said[bool(ours['activation_checkpointing'])]} vs "
            f"{said[bool(theirs.get('activation_checkpointing'))]}")


def _f(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def _tokens(ours: dict, ref: dict) -> str:
    """"; generated tokens A vs B" where both sides recorded how many tokens they generated (equal work)."""
    a, b = ours.get("generated_tokens"), ref.get("generated_tokens")
    return "" if a is None or b is None else f"; generated tokens {a} vs {b}"


def table_rows() -> list[list[str]]:
    """[benchmark, what, ours, reference, ours vs reference, fraction of ceiling, measured at]."""
    ceiling = _load("ceiling")
    rows = []

    def comparable(d):
        """Whether a result and the ceiling were measured at the same commit on the same kind of CPU. The same
        commit, because one machine's speed varies over a day (its measured matmul peak has halved for hours at
        a time): a ceiling from another run would misstate the fraction."""
        p, c = d.get("provenance") or {}, ceiling.get("provenance") or {}
        return (_cpu_kind(p) == _cpu_kind(c) and p.get("cpu") == c.get("cpu") and p.get("commit") is not None
                and p.get("commit") == c.get("commit"))

    def ceil_train(tokens_per_s, seq_len, d):
        if not ceiling:
            return "-"
        if not comparable(d):
            return "- (ceiling measured at another commit or on another CPU kind)"
        return f"{tokens_per_s / ceiling['train_tokens_per_s'][str(seq_len)]:.2f}"

    d = _load("sft_vs_trl")
    if d:
        by = {(r["kind"], r["packing"]): r for r in d["results"]}
        # results before run_all.py: "trl" was TRL with gradient checkpointing off, "trl_gc" its default
        ref_kind = "trl_gc" if ("trl_gc", False) in by else "trl"
        for packing, seq in ((False, 512), (True, 1024)):
            o, t = by.get(("toolkit", packing)), by.get((ref_kind, packing))
            if o and t:
                gc = t.get("gradient_checkpointing", ref_kind == "trl_gc")
                rows.append(["sft_vs_trl", f"SFT tokens/s, packing {'on' if packing else 'off'}; peak RSS",
                             f"{o['tokens_per_s']:.0f}; {o['peak_rss_mb']:.0f} MB",
                             f"{t['tokens_per_s']:.0f}; {t['peak_rss_mb']:.0f} MB (TRL defaults: gradient "
                             f"checkpointing {'on' if gc else 'off'})",
                             f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}x speed, {o['peak_rss_mb'] / t['peak_rss_mb']:.2f}x memory",
                             ceil_train(o["tokens_per_s"], seq, d), _when(d)])
    d = _load("dpo_vs_trl")
    if d:
        o, t = d["results"]["toolkit"], d["results"]["trl"]
        frac = "-"  # our DPO packs each prompt once and TRL twice: no one token count describes both
        rows.append(["dpo_vs_trl", "DPO s/step; peak RSS", f"{o['sec_per_step']:.1f}; {o['peak_rss_mb']:.0f} MB",
                     f"{t['sec_per_step']:.1f}; {t['peak_rss_mb']:.0f} MB",
                     f"{t['sec_per_step'] / o['sec_per_step']:.2f}x speed, {o['peak_rss_mb'] / t['peak_rss_mb']:.2f}x memory",
                     frac, _when(d)])
    d = _load("memory_vs_trl")
    if d:
        for key, r in d["ratios"].items():
            kind, model = key.split(":")
            base = kind.removesuffix("-checkpointing")
            o, t = d["results"][f"{kind}:toolkit:{model}"], d["results"][f"{base}:trl:{model}"]
            rows.append(["memory_vs_trl", f"{kind} peak tensor memory, bf16, {model}; step s",
                         f"{o['peak_mib']:.0f} MiB; {o['step3_s']:.1f}", f"{t['peak_mib']:.0f} MiB; {t['step3_s']:.1f}",
                         f"{r['memory']:.2f}x memory (target <= {d['targets'][kind]}), {r['speedup']:.2f}x speed",
                         "-", _when(d)])
    d = _load("grpo_vs_trl")
    if d:
        o, t = d["results"]["toolkit"], d["results"]["trl"]
        frac = "-"
        if ceiling and o.get("generation_tokens_per_s"):
            frac = (f"decode {o['generation_tokens_per_s'] / ceiling['decode_batch32']['tokens_per_s']:.2f}"
                    if comparable(d) else "- (ceiling measured at another commit or on another CPU kind)")

        def spread(kind: str) -> str:
            """The paired runs' speed-up (TRL/ours): median and range, and the completions each side trained."""
            r = (d.get("ratios") or {}).get(kind)
            if not r:
                return ""
            sp = r["speed"]
            return (f" (median of {d.get('repeats', 1)} paired runs, range {1 / sp['max']:.2f}-{1 / sp['min']:.2f}x); "
                    f"completions trained/step {d['results'][kind].get('rows_trained_per_step', 0):.1f} vs "
                    f"{d['results'][r['against']].get('rows_trained_per_step', 0):.0f}")

        def row(kind: str, against: str, label: str, frac_: str = "-") -> None:
            m, tt = d["results"].get(kind), d["results"].get(against)
            if not (m and tt):
                return
            r = (d.get("ratios") or {}).get(kind)
            speed = 1 / r["speed"]["median"] if r else tt["sec_per_step"] / m["sec_per_step"]
            memory = r["memory"]["median"] if r else m["peak_rss_mb"] / tt["peak_rss_mb"]
            rows.append(["grpo_vs_trl", label, f"{m['sec_per_step']:.1f}; {m['peak_rss_mb']:.0f} MB",
                         f"{tt['sec_per_step']:.1f}; {tt['peak_rss_mb']:.0f} MB",
                         f"{speed:.2f}x speed, {memory:.2f}x memory{spread(kind)}", frac_, _when(d)])

        equal = " at equal work (every completion trained, every step taken)" if d.get("equal_work") else ""
        row("toolkit", "trl", f"GRPO s/step; peak RSS{equal}", frac)
        row("toolkit-checkpointing", "trl", "GRPO s/step; peak RSS at equal work, activation checkpointing on both "
            "sides (TRL's default)")
        row("toolkit-filters-on", "trl", "GRPO s/step; peak RSS, ours as shipped (tied groups out of forward and "
            "backward, steps without signal skipped): not equal work, the filter's effect")
        row("toolkit-bf16-generation", "trl", "GRPO s/step; peak RSS, ours generating in bfloat16 (training in "
            "float32; TRL has no such setting on its transformers path)")
        row("toolkit-bf16", "trl-bf16", "GRPO s/step; peak RSS, both in bfloat16 mixed precision (bf16=True, TRL's "
            "default; ours generating on its bfloat16 copy)")
    d = _load("ppo_vs_trl")
    if d:
        t = d["results"]["trl"]
        for kind in ("toolkit", "toolkit-separate"):
            o = d["results"].get(kind)
            if not o:
                continue
            tokens = (f"; generated tokens {o['generated_tokens']} vs {t['generated_tokens']}"
                      if o.get("generated_tokens") is not None else "")
            rows.append(["ppo_vs_trl", f"PPO s/update; peak RSS (ours: critic={o.get('critic', 'separate')})",
                         f"{o['sec_per_update']:.1f}; {o['peak_rss_mb']:.0f} MB",
                         f"{t['sec_per_update']:.1f}; {t['peak_rss_mb']:.0f} MB (TRL 1.8)",
                         f"{t['sec_per_update'] / o['sec_per_update']:.2f}x speed, "
                         f"{o['peak_rss_mb'] / t['peak_rss_mb']:.2f}x memory{tokens}", "-", _when(d)])
    d = _load("decode_batch")
    if d:
        for cap, r in d["results"].items():
            o, k, t = r.get("dropped"), r.get("kept"), r.get("transformers")
            if not (o and k and t):
                continue
            rows.append(["decode_batch", f"generation tokens/s (prefill included), 3 batches of 4 prompts x 8, max {cap} "
                         f"new tokens; ours drops finished rows (keeping them: {k['tokens_per_s']:.0f} tokens/s, "
                         f"so dropping is {k['seconds'] / o['seconds']:.2f}x); ours also prefills shared starts once",
                         f"{o['tokens_per_s']:.0f}", f"{t['tokens_per_s']:.0f} (transformers generate)",
                         f"{o['tokens_per_s'] / t['tokens_per_s']:.2f}x tokens/s; generated tokens "
                         f"{o['generated_tokens']} vs {t['generated_tokens']}", "-", _when(d)])
    d = _load("grpo_vllm")
    if d:
        res = d["results"]
        base = res.get("transformers", {}).get("steps_per_min")
        for kind in ("vllm", "vllm-server"):
            r = res.get(kind, {})
            if "steps_per_min" in r and base:
                mb = f" ({r['last_weight_sync_mb']:.0f} MB)" if r.get("last_weight_sync_mb") else ""
                rows.append(["grpo_vllm", f"GRPO steps/min, {kind} backend; weight sync s{_sync_kind(r)}",
                             f"{r['steps_per_min']:.2f}; {_sync_cell(r)}{mb}", f"{base:.2f} (our transformers backend)",
                             f"{r['steps_per_min'] / base:.2f}x{_tokens(r, res.get('transformers', {}))}",
                             _sync_target(r) if kind == "vllm-server" else "-",
                             _when(d)])
        r = res.get("vllm-server-lora", {})
        if "steps_per_min" in r:
            rows.append(["grpo_vllm", "GRPO with LoRA (r=16, all linear), vllm-server backend: steps/min; weight sync s"
                         + _sync_kind(r),
                         f"{r['steps_per_min']:.2f}; {_sync_cell(r)} "
                         f"({r['last_weight_sync_mb']:.0f} MB: the blocks holding adapters)", "-", "-",
                         _sync_target(r), _when(d)])
        merged, adapter = res.get("vllm-lora-merged", {}), res.get("vllm-lora-adapter", {})
        if "steps_per_min" in merged and "steps_per_min" in adapter and adapter.get("weight_sync_s"):
            rows.append(["grpo_vllm", "GRPO with LoRA (r=16, all linear), colocated vllm: weight sync s (MB), adapter "
                         "alone vs merged blocks; steps/min",
                         f"{adapter['weight_sync_s']:.2f} s ({adapter['last_weight_sync_mb']:.1f} MB); "
                         f"{adapter['steps_per_min']:.2f}",
                         f"{merged['weight_sync_s']:.2f} s ({merged['last_weight_sync_mb']:.0f} MB); "
                         f"{merged['steps_per_min']:.2f} (merged sync)",
                         f"{merged['weight_sync_s'] / adapter['weight_sync_s']:.1f}x faster sync, "
                         f"{adapter['last_weight_sync_mb'] / merged['last_weight_sync_mb']:.1%} of the bytes",
                         "bytes <= 5%", _when(d)])
    d = _load("experimental_vs_trl")
    if d:
        for name in ("reward", "simpo", "kto", "orpo"):
            o, t = d["results"].get(f"{name}-toolkit"), d["results"].get(f"{name}-trl")
            if o and t:
                rows.append(["experimental_vs_trl", f"{name} s/step; peak RSS", f"{o['sec_per_step']:.1f}; {o['peak_rss_mb']:.0f} MB",
                             f"{t['sec_per_step']:.1f}; {t['peak_rss_mb']:.0f} MB",
                             f"{t['sec_per_step'] / o['sec_per_step']:.2f}x speed, "
                             f"{o['peak_rss_mb'] / t['peak_rss_mb']:.2f}x memory", "-", _when(d)])
    d = _load("online_vs_trl")
    if d:
        for name in ("online_dpo", "gkd"):
            o, t = d["results"].get(f"{name}-toolkit"), d["results"].get(f"{name}-trl")
            if o and t:
                rows.append(["online_vs_trl", f"{name} s/step; peak RSS", f"{o['sec_per_step']:.1f}; {o['peak_rss_mb']:.0f} MB",
                             f"{t['sec_per_step']:.1f}; {t['peak_rss_mb']:.0f} MB",
                             f"{t['sec_per_step'] / o['sec_per_step']:.2f}x speed, {o['peak_rss_mb'] / t['peak_rss_mb']:.2f}x "
                             f"memory; generated tokens/step {_f(o.get('generated_tokens_per_step'), 0)} vs "
                             f"{_f(t.get('generated_tokens_per_step'), 0)}{_recomputes(o, t)}", "-", _when(d)])
    d = _load("multiprocess")
    if d:
        by = {(r["kind"], r["world"]): r for r in d["results"]}
        for kind in ("sft", "grpo"):
            a, b = by.get((kind, 2)), by.get((kind, 1))
            if a and b:
                rows.append(["multiprocess", f"{kind} tokens/s, 2 processes x 1 thread vs 1 x 2",
                             f"{a['tokens_per_s']:.0f}", f"{b['tokens_per_s']:.0f}",
                             f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x", "-", _when(d)])
    for name in ("async_grpo", "async_grpo_seeds_3_5"):
        d = _load(name)
        if not d:
            continue
        for case, what in (("latency", "latency-bound (HTTP judge 0.5-2 s)"), ("compute", "compute-bound")):
            c = d.get("summary", {}).get(case)
            if not c:
                continue
            whole, steady = c["ratio_per_seed"], c["steady_ratio_per_seed"]
            seeds = d.get("settings", {}).get("cases", {}).get(case, {}).get("seeds")
            which = f" (seeds {', '.join(map(str, seeds))})" if seeds else ""
            rows.append([name, f"async vs sync GRPO samples/s, {what}{which}, whole run; steady state",
                         f"{sum(c['async_samples_per_s']) / len(c['async_samples_per_s']):.2f}",
                         f"{sum(c['sync_samples_per_s']) / len(c['sync_samples_per_s']):.2f} (sync GRPO)",
                         f"{sum(whole) / len(whole):.2f}x; {sum(steady) / len(steady):.2f}x (mean of {len(whole)} seed{'s' if len(whole) > 1 else ''})",
                         "-", _when(d)])
    d = _load("agent_rollouts")
    if d and d.get("ratios"):
        r = d["ratios"]
        res = d["results"]

        def per_token(k):  # runs that learn differently sample different work per episode: show it beside
            a, s = res[k], res["sync"]
            if "sampled_tokens" not in a:
                return ""
            rate = (a["sampled_tokens"] / a["seconds"]) / (s["sampled_tokens"] / s["seconds"])
            return f"; per sampled token {rate:.2f}x ({a['sampled_tokens']} vs {s['sampled_tokens']} tokens)"

        def idle():  # the sync run's waits with nothing decoding: what overlapping them can win back, at most
            share = res["sync"].get("environment_share_of_training")
            return "" if share is None else (f"; sync waited on environments {share:.0%} of its training time: "
                                             f"overlapping the waits alone, at equal work, gains at most "
                                             f"{1 / max(1 - share, 1e-9):.2f}x")

        rows.append(["agent_rollouts", "GRPO episodes/s on a tool environment (waits 0.2-1 s): async vs sync",
                     f"{res['async']['episodes_per_s']:.2f}", f"{res['sync']['episodes_per_s']:.2f}",
                     f"{r['async/sync']:.2f}x{per_token('async')} (sync vs sequential env steps "
                     f"{r['sync/sync-sequential']:.2f}x{idle()})", "-", _when(d)])
        if "async-2rounds/sync" in r:
            rows.append(["agent_rollouts", "the same, async with up to 2 rounds per generate call (max_staleness 2, "
                         "64 environment threads against sync's 32, scoring_concurrency 3)",
                         f"{res['async-2rounds']['episodes_per_s']:.2f}", f"{res['sync']['episodes_per_s']:.2f}",
                         f"{r['async-2rounds/sync']:.2f}x{per_token('async-2rounds')}", "-", _when(d)])
    for name, what in (("async_staleness", "held-out accuracy at max_staleness 0-8 per off-policy objective"),
                       ("async_staleness_seeds", "held-out accuracy at max_staleness 4 against 0, seeds 1-3"),
                       ("async_staleness_seeds_4_6", "held-out accuracy at max_staleness 4 against 0, seeds 4-6"),
                       ("async_staleness_60", "held-out accuracy at max_staleness 4 against 0 after 60 steps, "
                                              "seeds 1-3"),
                       ("async_staleness_512", "held-out accuracy at max_staleness 4 against 0 on 512 held-out "
                                               "problems, seeds 1-6"),
                       ("async_staleness_steady", "held-out accuracy at max_staleness 4 against 0, 4 prompts per "
                                                  "step and a decaying lr, seeds 1-10"),
                       ("learning_vs_trl", "held-out accuracy per training minute vs TRL GRPO"),
                       ("distillation", "GKD student vs GRPO teacher, accuracy per training minute"),
                       ("task_suite", "one SFT-then-GRPO recipe on 8 reasoning-gym tasks: held-out accuracy before, "
                                      "after SFT, after RL")):
        d = _load(name)
        if d:
            rows.append([name, what, f"see results/{name}.txt", "", "", "-", _when(d)])
    return rows


def _sync_kind(r: dict) -> str:
    # results written before bench/grpo_vllm.py recorded every step's sync hold only the last one
    return " (median (max) of steps 2..N)" if r.get("weight_sync_s") is not None else " (the last step's)"


def _sync_s(r: dict):
    return r["weight_sync_s"] if r.get("weight_sync_s") is not None else r.get("last_weight_sync_s")


def _sync_cell(r: dict) -> str:
    # the median of steps 2..N with their max beside it, so that one slow sync is not hidden, and the first sync
    # (left out of the median: a LoRA run's first sends every weight), which the target counts
    if r.get("weight_sync_max_s") is not None and r.get("weight_sync_s") is not None:
        every = r.get("weight_syncs_s") or []
        first = f", first {_f(every[0], 2)}" if every else ""
        return f"{_f(r['weight_sync_s'], 2)} ({_f(r['weight_sync_max_s'], 2)}){first}"
    return _f(r.get("last_weight_sync_s"), 2)


def _sync_target(r: dict) -> str:
    """Issue 20's target for a server weight sync of the 135M model on loopback, against the measured syncs:
    met where every sync of the run (the first included) is under 1 s; otherwise not met, with how many were
    over and whether the median is under."""
    every = r.get("weight_syncs_s")
    if not every:
        seconds = _sync_s(r)
        if seconds is None:
            return "target sync < 1 s: not measured"
        return f"target sync < 1 s: {'met' if seconds < 1 else 'not met'} (one sync recorded)"
    over = [t for t in every if t >= 1]
    if not over:
        return f"target sync < 1 s: met by every sync ({len(every)}, the first included)"
    median = _sync_s(r)
    below = "; the median is under 1 s" if median is not None and median < 1 else ""
    return f"target sync < 1 s: not met, {len(over)} of {len(every)} syncs over 1 s (the first included){below}"


def write_table(run_info: dict | None) -> None:
    ceiling = _load("ceiling")
    lines = ["# Benchmarks", "",
             "Written by `bench/run_all.py` from the files in `bench/results/` (never by hand). Each row names the",
             "commit and date its numbers were measured at; rows measured before run_all.py existed say so.",
             "Ratios are from one run on this machine (2 CPU cores); timings here are noisy, ratios within one",
             "run are what we trust. The reference (TRL) runs at its own defaults unless the row says otherwise,",
             "and one exception holds for every row but one: TRL's default is bf16=True (mixed precision), and",
             "the benchmarks set bf16=False so that both sides train in float32, the same work (ours defaults to",
             "float32). The grpo_vs_trl row marked bfloat16 mixed precision runs both sides with bf16=True.",
             "The machines differ: an Intel Xeon with AVX-512 (fp32 matmul about 400 GFLOP/s on 2 threads at its best),",
             "an AMD EPYC with AVX-512 (about 140-200), an AVX2-only kind (about 100); TRL's step and ours do not scale",
             "alike between them, so a ratio moves with the machine. Where a result recorded its CPU, the last column",
             "says which. A machine's speed also varies over a day (the Intel Xeon has measured half its usual",
             "matmul peak for hours at a time), and a ratio moves with it. Compare ratios within a row, and absolute",
             "numbers only between rows measured at the same commit; the ceiling column is shown only for rows",
             "measured at the ceiling's commit on the same CPU.",
             "",
             f"The last column also says whether the code a row measured has changed between its commit and the "
             f"tree this table was written from (at {(_git('rev-parse', 'HEAD') or 'unknown')[:10]}, uncommitted "
             f"changes and untracked files included): `git diff` over {', '.join(CODE_PATHS)}, the row's own script and the other inputs "
             f"it names in bench/run_all.py (a helper module, its configs, its interpreter's setup). For a row that "
             f"recorded which library files its processes ran (bench/_imports/sitecustomize.py traces every Python "
             f"process of the row that keeps the trace file and the tracer on PYTHONPATH; no record is kept for a "
             f"row with a child that did not, or that was started through a shell, with a trace with no traced "
             f"process, with a library file run from another checkout whose content differs or from an installed "
             f"copy, or that starts from a checkpoint an earlier toolkit run made; a record taken under older "
             f"tracing rules is not used), a changed toolkit/ or plugins/ .py file it never loaded does not count, "
             f"and the cell says how many there were and names up to two (\"code it ran unchanged since\"); "
             f"rows without a record are judged on every file. run_all.py and the tracer count toward no row: "
             f"they measure, they are not the library. A row marked "
             f"**code changed since** was measured before such a change, and its numbers may not hold for the code "
             f"as it is now. A row marked (tree changed) was measured with uncommitted changes, which its commit "
             f"does not hold; its code status compares the commit.",
             ""]
    if run_info:
        lines += [f"Last run: `python bench/run_all.py {run_info['argv']}` at {run_info['commit'][:10]}, "
                  f"{run_info['date']}, {run_info['minutes']:.0f} minutes "
                  f"({', '.join(f'{k} {v}' for k, v in run_info['outcome'].items())}).", ""]
    if ceiling:
        lines += [f"Ceiling (bench/ceiling.py): fp32 matmul peak {ceiling['peak_matmul_flops'] / 1e9:.0f} GFLOP/s on "
                  f"{ceiling['threads']} threads, copy bandwidth {ceiling['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; "
                  f"for SmolLM2-135M training "
                  + ", ".join(f"{v:.0f} tokens/s at length {k}" for k, v in ceiling["train_tokens_per_s"].items())
                  + f"; decoding at batch 32 {ceiling['decode_batch32']['tokens_per_s']:.0f} tokens/s "
                  f"({ceiling['decode_batch32']['bound']}-bound), where our decode loop measured "
                  f"{ceiling['our_decode_batch32_tokens_per_s']:.0f}. The ceiling column is a row's tokens/s over "
                  f"that ceiling (SFT: length 512 packing off, 1024 packing on; "
                  f"GRPO: its generation tokens/s over the decode ceiling; rows without tokens/s show -).", ""]
    lines += ["| benchmark | what | ours | reference | ours vs reference | fraction of ceiling | measured at |",
              "|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows()]
    lines += ["", "Commands, run times and what each measures: the docstring at the top of each script; "
              "`python bench/run_all.py --list`.", ""]
    (ROOT / "bench" / "README.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group", default="core", choices=sorted(GROUPS))
    ap.add_argument("--only", nargs="+", default=None, choices=[b.name for b in BENCHES])
    ap.add_argument("--table", action="store_true", help="only rebuild bench/README.md")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        for b in BENCHES:
            needs = "; ".join(f"needs {p}" for p, _ in b.needs)
            print(f"{b.name:26s} {b.group:5s} ~{b.minutes:3d} min  bench/{b.script} {' '.join(b.args)}  {needs}")
        return
    info_path = RESULTS / "run_all.json"
    if args.table:
        write_table(json.loads(info_path.read_text()) if info_path.exists() else None)
        return
    chosen = [b for b in BENCHES if (b.name in args.only if args.only else b.group in GROUPS[args.group])]
    print(f"run_all: {len(chosen)} benchmarks, about {sum(b.minutes for b in chosen)} minutes", flush=True)
    started = time.perf_counter()
    outcome = {b.name: run_one(b) for b in chosen}
    prov = provenance()
    argv = " ".join(sys.argv[1:])
    summary = {k: ("skipped" if "skipped" in v else "failed" if "failed" in v else f"{v['seconds'] / 60:.0f} min")
               for k, v in outcome.items()}
    info = {"argv": argv, "commit": prov["commit"], "tree_changed": prov["tree_changed"],
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "minutes": (time.perf_counter() - started) / 60, "outcome": summary, "details": outcome,
            "provenance": prov}
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    write_table(info)
    print(f"run_all: {info['minutes']:.0f} minutes; " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    print(f"wrote bench/README.md and {info_path.relative_to(ROOT)}")
    if any("failed" in v for v in outcome.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
