"""The package's promises: stable re-exports, the experimental warning, checked copies."""

import pytest
import subprocess
import sys
import textwrap

import toolkit
import toolkit.core
from toolkit._dev.copies import check_tree


def test_top_level_reexports_the_stable_core():
    for name in toolkit.core.__all__:
        assert getattr(toolkit, name) is getattr(toolkit.core, name)


def _run(code, env_extra=None):
    import os

    env = dict(os.environ)
    env.pop("TOOLKIT_EXPERIMENTAL_SILENCE", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, env=env)


@pytest.mark.slow
def test_experimental_warns_with_its_own_class_and_env_var_silences_it():
    code = textwrap.dedent("""
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import toolkit.experimental as ex
        hits = [x for x in w if issubclass(x.category, ex.ToolkitExperimentalWarning)]
        print(len(hits))
    """)
    assert _run(code).stdout.strip() == "1"
    assert _run(code, {"TOOLKIT_EXPERIMENTAL_SILENCE": "1"}).stdout.strip() == "0"


def test_copied_blocks_in_the_package_match_their_sources():
    found, problems = check_tree(toolkit.__path__[0])
    print(f"{found} 'Copied from' blocks verified")  # shown with -rP / in the CI log of a failure
    assert not problems, "\n".join(map(str, problems))
    # The deliberate copy between trainers (PPO's prompt preparation, from GRPO) is a marker the checker must find:
    # a marker lost in a refactor would turn this test into one that checks nothing. (What trainers on
    # transformers.Trainer share is written once in toolkit.core.lifecycle; per-token rows in numerics.)
    assert found >= 1, f"only {found} 'Copied from' markers found in the package"


def _write_pkg(tmp_path, copy_body, marker="# Copied from pkg_src.mod.Source.method with Source->Copy"):
    pkg = tmp_path / "pkg_src"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mod.py").write_text(textwrap.dedent("""
        class Source:
            def method(self, x):
                # a comment the copy may drop
                y = Source.helper(x)
                return y + 1
    """))
    body = textwrap.indent(textwrap.dedent(copy_body).strip("\n"), " " * 8)
    (pkg / "copy.py").write_text(f"class Copy:\n    {marker}\n    def method(self, x):\n{body}\n\n"
                                 "    def other(self):\n        return 0\n")
    return pkg


def test_copy_checker_accepts_a_faithful_copy_with_renames(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = _write_pkg(tmp_path, """
        y   =   Copy.helper(x)
        return y + 1
    """)
    found, problems = check_tree(pkg)
    assert found == 1 and problems == []


def test_copy_checker_catches_drift(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = _write_pkg(tmp_path, """
        y = Copy.helper(x)
        return y + 2
    """)
    found, problems = check_tree(pkg)
    assert found == 1 and len(problems) == 1
    assert "no longer matches its source" in str(problems[0])


def test_copy_checker_reports_a_missing_source(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    pkg = _write_pkg(tmp_path, "return 1\n", marker="# Copied from pkg_src.mod.Source.gone")
    _, problems = check_tree(pkg)
    assert len(problems) == 1 and "source cannot be found" in str(problems[0])
