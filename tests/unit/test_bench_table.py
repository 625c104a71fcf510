"""bench/run_all.py's table says, for each row, whether the code it measured changed after its commit."""

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

RUN_ALL = Path(__file__).resolve().parents[2] / "bench" / "run_all.py"


@pytest.fixture
def run_all(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("run_all_under_test", RUN_ALL)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up while defined
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "ROOT", tmp_path)
    module._CHANGED.clear()
    return module


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                               "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"}).stdout.strip()


def _commit(repo: Path, files: dict[str, str], message: str) -> str:
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", message)
    return _git(repo, "rev-parse", "HEAD")


def test_rows_say_whether_their_code_changed_since_their_commit(tmp_path, run_all):
    _git(tmp_path, "init", "-q")
    measured = _commit(tmp_path, {"toolkit/core/grpo.py": "a = 1\n", "bench/grpo_vs_trl.py": "x\n",
                                  "bench/dpo_vs_trl.py": "y\n", "docs/grpo.md": "text\n"}, "measured here")
    row = {"_bench": "grpo_vs_trl"}
    assert run_all._code_status(row, measured) == "; code unchanged since"

    _commit(tmp_path, {"docs/grpo.md": "more text\n", "bench/README.md": "table\n"}, "docs only")
    run_all._CHANGED.clear()
    assert run_all._code_status(row, measured) == "; code unchanged since"  # docs and the table are not code

    _commit(tmp_path, {"bench/dpo_vs_trl.py": "y2\n"}, "another benchmark's script")
    run_all._CHANGED.clear()
    assert run_all._code_status(row, measured) == "; code unchanged since"
    assert "bench/dpo_vs_trl.py" in run_all._code_status({"_bench": "dpo_vs_trl"}, measured)

    _commit(tmp_path, {"toolkit/core/grpo.py": "a = 2\n"}, "the library")
    run_all._CHANGED.clear()
    assert run_all._code_status(row, measured) == "; **code changed since**: toolkit/core/grpo.py"

    head = _git(tmp_path, "rev-parse", "HEAD")
    run_all._CHANGED.clear()
    assert run_all._code_status(row, head) == "; code unchanged since"
    (tmp_path / "toolkit/core/grpo.py").write_text("a = 3\n")  # uncommitted: the code as it is now counts
    run_all._CHANGED.clear()
    assert run_all._code_status(row, head) == "; **code changed since**: toolkit/core/grpo.py"

    assert run_all._code_status(row, "0" * 40) == ""  # a commit git does not hold: no claim either way
    assert run_all._code_status({"_bench": "not_a_benchmark"}, measured) == ""


def test_a_rows_other_inputs_count_as_its_code(tmp_path, run_all):
    # async_grpo imports bench/async_model.py; learning_vs_trl trains with the main job's configs: a change to
    # either is a change to what the row measured, and to no other row
    _git(tmp_path, "init", "-q")
    measured = _commit(tmp_path, {"bench/async_grpo.py": "x\n", "bench/async_model.py": "m = 1\n",
                                  "bench/grpo_vs_trl.py": "g\n", "examples/arithmetic_pipeline.toml": "a = 1\n",
                                  "bench/learning_vs_trl.py": "l\n"}, "measured here")
    _commit(tmp_path, {"bench/async_model.py": "m = 2\n", "examples/arithmetic_pipeline.toml": "a = 2\n"},
            "the pipeline model and the main job's config")
    assert run_all._code_status({"_bench": "async_grpo"}, measured) == \
        "; **code changed since**: bench/async_model.py"
    assert run_all._code_status({"_bench": "async_grpo_seeds_3_5"}, measured) == \
        "; **code changed since**: bench/async_model.py"
    assert run_all._code_status({"_bench": "learning_vs_trl"}, measured) == \
        "; **code changed since**: examples/arithmetic_pipeline.toml"
    assert run_all._code_status({"_bench": "grpo_vs_trl"}, measured) == "; code unchanged since"
    for b in run_all.BENCHES:  # an input that names no file would never mark anything changed
        for path in b.inputs:
            assert (RUN_ALL.parents[1] / path).is_file(), f"{b.name}: input {path} does not exist"


def test_the_sync_cell_reads_old_and_new_grpo_vllm_results(run_all):
    # results written before bench/grpo_vllm.py recorded every sync hold only the last one
    old = {"last_weight_sync_s": 1.254}
    assert (run_all._sync_s(old), run_all._sync_cell(old), run_all._sync_kind(old)) == (
        1.254, "1.25", " (the last step's)")
    new = {"last_weight_sync_s": 0.64, "weight_sync_s": 0.65, "weight_sync_max_s": 1.56}
    assert (run_all._sync_s(new), run_all._sync_cell(new), run_all._sync_kind(new)) == (
        0.65, "0.65 (1.56)", " (median (max) of steps 2..N)")
    # a run with a single sync has no median: the last sync stands in, labelled as such
    single = {"last_weight_sync_s": 0.9, "weight_sync_s": None, "weight_sync_max_s": None}
    assert (run_all._sync_s(single), run_all._sync_cell(single), run_all._sync_kind(single)) == (
        0.9, "0.90", " (the last step's)")
    # the target counts every sync, the first included; results from before every sync was recorded say so
    assert run_all._sync_target(new) == "target sync < 1 s: met (one sync recorded)"
    assert run_all._sync_target({"weight_syncs_s": [0.9, 0.7, 0.6], "weight_sync_s": 0.65}) == (
        "target sync < 1 s: met by every sync (3, the first included)")
    slow_first = {"weight_syncs_s": [4.4, 0.7, 0.6], "weight_sync_s": 0.65, "weight_sync_max_s": 0.7}
    assert run_all._sync_target(slow_first) == (
        "target sync < 1 s: not met, 1 of 3 syncs over 1 s (the first included); the median is under 1 s")
    assert run_all._sync_cell(slow_first) == "0.65 (0.70), first 4.40"  # the slow first is shown, not hidden
    assert run_all._sync_target({"weight_syncs_s": [1.4, 1.2, 1.3], "weight_sync_s": 1.25}) == (
        "target sync < 1 s: not met, 3 of 3 syncs over 1 s (the first included)")


def test_a_traced_row_is_judged_on_the_library_files_it_ran(tmp_path, run_all):
    _git(tmp_path, "init", "-q")
    measured = _commit(tmp_path, {"toolkit/core/grpo.py": "a = 1\n", "toolkit/core/vllm_server.py": "s = 1\n",
                                  "toolkit/core/old_name.py": "o = 1\n", "toolkit/core/template.jinja": "t\n",
                                  "plugins/p/pkg/loss.py": "l = 1\n", "bench/grpo_vs_trl.py": "x\n"}, "measured")
    ran = ["toolkit/core/grpo.py", "toolkit/core/old_name.py", "toolkit/core/template.jinja"]
    row = {"_bench": "grpo_vs_trl", "loaded_code": ran, "loaded_code_rules": run_all.TRACE_RULES}
    _commit(tmp_path, {"toolkit/core/vllm_server.py": "s = 2\n", "plugins/p/pkg/loss.py": "l = 2\n"},
            "files the row never loaded")
    assert run_all._code_status(row, measured) == (
        "; code it ran unchanged since (2 library files it never loaded changed: plugins/p/pkg/loss.py, "
        "toolkit/core/vllm_server.py)")
    # without a record, or with one taken under older tracing rules, every file counts
    assert run_all._code_status({"_bench": "grpo_vs_trl"}, measured).startswith("; **code changed since**")
    old = {"_bench": "grpo_vs_trl", "loaded_code": ran, "loaded_code_rules": run_all.TRACE_RULES - 1}
    assert run_all._code_status(old, measured).startswith("; **code changed since**")
    assert run_all._code_status({"_bench": "grpo_vs_trl", "loaded_code": ran}, measured).startswith(
        "; **code changed since**")

    (tmp_path / "toolkit/core/brand_new.py").write_text("n = 1\n")  # untracked: counts as changed
    run_all._CHANGED.clear()
    assert run_all._code_status(row, measured).startswith(  # the row never ran it: named, not counted
        "; code it ran unchanged since (3 library files it never loaded changed: ")
    assert "toolkit/core/brand_new.py" in run_all._changed_since(measured, "grpo_vs_trl.py")
    (tmp_path / "toolkit/core/brand_new.py").unlink()

    _commit(tmp_path, {"toolkit/core/template.jinja": "t2\n"}, "a data file: always counts")
    run_all._CHANGED.clear()
    assert run_all._code_status(row, measured) == "; **code changed since**: toolkit/core/template.jinja"

    at = _git(tmp_path, "rev-parse", "HEAD")
    _git(tmp_path, "mv", "toolkit/core/old_name.py", "toolkit/core/new_name.py")
    _git(tmp_path, "commit", "-qm", "a rename: the file the row ran is gone, under either name it counts")
    assert run_all._code_status(dict(row, loaded_code=ran), at) == (
        "; **code changed since**: toolkit/core/old_name.py")

    # a row that starts from a checkpoint an untraced toolkit run made is judged on every file
    untraced = {"_bench": "learning_vs_trl", "loaded_code": ["toolkit/core/grpo.py"],
                "loaded_code_rules": run_all.TRACE_RULES}
    assert not next(b for b in run_all.BENCHES if b.name == "learning_vs_trl").traced
    assert run_all._code_status(untraced, measured).startswith("; **code changed since**: plugins/p/pkg/loss.py")


def _checkout(root: Path, files: dict[str, str]) -> Path:
    for name, text in {"pyproject.toml": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_trace_counts_only_when_it_can_be_trusted(tmp_path, run_all):
    here = _checkout(tmp_path / "here", {"toolkit/__init__.py": "", "plugins/p/pkg/loss.py": "l = 1\n"})
    there = _checkout(tmp_path / "there", {"toolkit/__init__.py": "", "plugins/p/pkg/loss.py": "l = 1\n"})
    run_all.ROOT = here
    trace = tmp_path / "trace"

    def loaded(*lines):
        trace.write_text("".join(line + "\n" for line in lines))
        return run_all._loaded_code(trace)

    ok = "PROCESS 1"
    assert loaded(ok, str(here / "toolkit/__init__.py"), "/usr/lib/python3.11/json/__init__.py") == [
        "toolkit/__init__.py"]
    assert loaded(ok) == []  # a row that ran no library file says so
    assert loaded(str(here / "toolkit/__init__.py")) is None  # no traced process: the hook never ran
    assert loaded(ok, "UNTRACED python -E -c pass") is None
    assert run_all._loaded_code(tmp_path / "missing") is None
    # a plugin run from another checkout (an editable install pointing there) counts only as the same content
    assert loaded(ok, str(there / "plugins/p/pkg/loss.py")) == ["plugins/p/pkg/loss.py"]
    (there / "plugins/p/pkg/loss.py").write_text("l = 2\n")
    assert loaded(ok, str(there / "plugins/p/pkg/loss.py")) is None
    # the library run from an installed copy, outside any checkout
    assert loaded(ok, "/opt/venv/lib/python3.11/site-packages/toolkit/core/grpo.py") is None
    assert loaded(ok, "/opt/venv/lib/python3.11/site-packages/toolkit_cispo/__init__.py") is None


def test_run_one_records_the_library_files_every_process_of_a_row_ran(tmp_path, run_all, monkeypatch):
    # a real run: the script imports a module and starts a child that imports another and is killed with
    # SIGKILL (no exit handlers run)
    _checkout(tmp_path, {"toolkit/__init__.py": "", "toolkit/a.py": "", "toolkit/unused.py": "", "toolkit/c.py": ""})
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "fake.py").write_text(
        "import json, os, signal, subprocess, sys\n"
        "import toolkit.a\n"
        "kid = subprocess.run([sys.executable, '-c', 'import os, signal, toolkit.c; "
        "os.kill(os.getpid(), signal.SIGKILL)'])\n"
        "assert kid.returncode == -signal.SIGKILL, kid.returncode\n"
        "json.dump({'ok': True}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    results = tmp_path / "bench" / "results"
    results.mkdir()
    monkeypatch.setattr(run_all, "RESULTS", results)
    outcome = run_all.run_one(run_all.Bench("fake", "fake.py", "core", 1))
    assert "seconds" in outcome, outcome
    data = json.loads((results / "fake.json").read_text())
    assert data["loaded_code"] == ["toolkit/__init__.py", "toolkit/a.py", "toolkit/c.py"]
    assert data["loaded_code_rules"] == run_all.TRACE_RULES
    assert not list(Path(tempfile.gettempdir()).glob("toolkit-bench-fake-*.trace"))  # the trace is removed

    # a child that skips the tracer could run any library file unseen: the row gets no record, and the one an
    # earlier run left is dropped. -E ignores PYTHONPATH; -I -S runs no site; a fresh environment has no trace
    # file; a PYTHONPATH replaced drops the tracer (bench/ppo_vs_trl.py's TRL worker); a shell hides its command
    for launch in ("[sys.executable, '-E', '-c', 'pass']", "[sys.executable, '-I', '-S', '-c', 'pass']",
                   "[sys.executable, '-c', 'pass'], env={'PATH': '/bin'}",
                   "[sys.executable, '-c', 'pass'], env={**os.environ, 'PYTHONPATH': '/tmp'}",
                   "'true', shell=True"):
        (tmp_path / "bench" / "fake.py").write_text(
            "import json, os, subprocess, sys\n"
            f"subprocess.run({launch}, check=True)\n"
            "json.dump({'ok': True}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n")
        (results / "fake.json").write_text(json.dumps({"loaded_code": ["toolkit/a.py"], "loaded_code_rules": 2}))
        assert "seconds" in run_all.run_one(run_all.Bench("fake", "fake.py", "core", 1))
        data = json.loads((results / "fake.json").read_text())
        assert "loaded_code" not in data and "loaded_code_rules" not in data, launch

    # a child that keeps the environment (git here is not Python) leaves the record intact
    (tmp_path / "bench" / "fake.py").write_text(
        "import json, subprocess, sys\nsubprocess.run(['git', '--version'], capture_output=True)\n"
        "subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
        "json.dump({'ok': True}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n")
    run_all.run_one(run_all.Bench("fake", "fake.py", "core", 1))
    assert json.loads((results / "fake.json").read_text())["loaded_code"] == []


def test_the_tracer_reads_python_flags_and_runs_the_sitecustomize_it_shadows(tmp_path, run_all):
    spec = importlib.util.spec_from_file_location("tracer_under_test", RUN_ALL.parent / "_imports" / "sitecustomize.py")
    tracer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tracer)  # TOOLKIT_BENCH_TRACE unset: installs nothing
    assert tracer._python_flags(["python", "-I", "-S", "x.py"]) == {"I", "S"}
    assert tracer._python_flags(["python", "-IS", "x.py", "-E"]) == {"I", "S"}  # after the script: its own args
    assert tracer._python_flags(["python", "-W", "ignore", "-E", "-c", "pass"]) == {"E"}  # -W takes a value
    assert tracer._python_flags(["python", "-m", "toolkit", "-I"]) == set()
    # an interpreter's own sitecustomize still runs behind the tracer
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("print('the shadowed sitecustomize ran')\n")
    import os

    out = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(run_all.TRACER), str(other)]),
                              "TOOLKIT_BENCH_TRACE": str(tmp_path / "trace")})
    assert "the shadowed sitecustomize ran" in out.stdout
    assert (tmp_path / "trace").read_text().startswith("PROCESS ")
    # a row whose `needs` is a checkpoint a toolkit run made must not be judged on what its own processes ran
    for b in run_all.BENCHES:
        made_by_toolkit = any(not path.startswith(".venv") for path, _ in b.needs)
        assert b.traced is not made_by_toolkit, b.name
