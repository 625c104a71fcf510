"""The stable API is an explicit, checked contract: every core module says what it exports, toolkit.core is
derived from those lists, and the recorded snapshot (tests/api_snapshot.json) changes only on purpose."""

import dataclasses
import importlib
import importlib.metadata
import pkgutil
import re
from pathlib import Path

import toolkit
import toolkit.core
from toolkit._dev import api_snapshot

REPO = Path(__file__).resolve().parents[2]
FIX = ("If the change is intended, run `python -m toolkit._dev.api_snapshot --write`, commit tests/api_snapshot.json "
       "in the same commit with a CHANGELOG entry; a removal or a changed default needs a deprecation cycle first "
       "(docs/contributing.md).")


def test_the_public_surface_matches_the_recorded_snapshot():
    changes = api_snapshot.compare()
    assert not changes, "the public API changed:\n  " + "\n  ".join(changes[:40]) + "\n" + FIX


def test_an_unrecorded_change_is_caught(monkeypatch):
    """The test of the test: a changed signature, a changed config default and a removed name all show up."""
    from toolkit.core import numerics
    from toolkit.core.grpo import GRPOConfig

    def masked_mean(values, mask, dim=None, *, eps=0.0):  # one new keyword
        return values

    monkeypatch.setattr(numerics, "masked_mean", masked_mean)
    monkeypatch.setattr(GRPOConfig.__dataclass_fields__["epsilon"], "default", 0.3)
    monkeypatch.setattr(numerics, "__all__", [n for n in numerics.__all__ if n != "gae"])
    changes = api_snapshot.compare()
    text = "\n".join(changes)
    assert "changed: modules.toolkit.core.numerics.masked_mean.signature" in text
    assert "changed: modules.toolkit.core.grpo.GRPOConfig.fields.epsilon.default: '0.2' -> '0.3'" in text
    assert "removed: modules.toolkit.core.numerics.gae" in text
    # AsyncGRPOConfig inherits the field, so its default moved too: four changes, nothing else
    assert "changed: modules.toolkit.core.async_grpo.AsyncGRPOConfig.fields.epsilon.default" in text
    assert len(changes) == 4, text


def test_reordering_fields_is_a_change(monkeypatch):
    """Inputs and settings dataclasses may be built positionally, so field order is part of the API."""
    from toolkit.core.objectives import ClipSettings

    fields = dict(ClipSettings.__dataclass_fields__)
    monkeypatch.setattr(ClipSettings, "__dataclass_fields__", {k: fields[k] for k in reversed(fields)})
    text = "\n".join(api_snapshot.compare())
    assert "changed: modules.toolkit.core.objectives.ClipSettings.fields[0]" in text


def test_every_core_module_declares_its_exports_and_core_is_derived_from_them():
    for info in pkgutil.walk_packages(toolkit.core.__path__, "toolkit.core."):
        module = importlib.import_module(info.name)
        assert isinstance(getattr(module, "__all__", None), list), f"{info.name} has no __all__"
        for name in module.__all__:
            assert hasattr(module, name), f"{info.name}.__all__ lists '{name}', which it does not define"
    derived = {n for m in toolkit.core.PUBLIC_MODULES for n in importlib.import_module(f"toolkit.core.{m}").__all__}
    assert set(toolkit.core.__all__) == derived
    for name in toolkit.core.__all__:
        assert getattr(toolkit, name) is getattr(toolkit.core, name)


def test_configs_document_every_field_they_declare():
    """Every config field has help text (the CLI's --help and docs/configuration.md are built from it)."""
    from toolkit import AsyncGRPOConfig, DPOConfig, GRPOConfig, PPOConfig, SFTConfig

    for cls in (SFTConfig, DPOConfig, GRPOConfig, PPOConfig, AsyncGRPOConfig):
        own = {n for k in cls.__mro__ if k.__module__.startswith("toolkit") for n in getattr(k, "__annotations__", {})}
        for f in dataclasses.fields(cls):
            if f.name in own:
                assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"


def test_version_comes_from_package_metadata_in_one_place():
    assert toolkit.__version__ == importlib.metadata.version("toolkit")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(toolkit.__version__)}"$', pyproject, re.M)
    literal = re.compile(r"^__version__\s*=\s*['\"]", re.M)
    assert [p for p in (REPO / "toolkit").rglob("*.py") if literal.search(p.read_text())] == []


def test_every_public_module_is_in_the_api_reference():
    """docs/api/*.md renders each module toolkit.core re-exports (and tasks, vllm_backend): a public name
    without a reference page is a name users find only by reading the source."""
    from pathlib import Path

    import toolkit.core as core

    pages = "".join(p.read_text() for p in Path("docs/api").glob("*.md"))
    missing = [m for m in (*core.PUBLIC_MODULES, "tasks", "vllm_backend") if f"::: toolkit.core.{m}\n" not in pages
               and f"::: toolkit.core.{m}." not in pages]  # a package: its modules
    assert not missing, f"add `::: toolkit.core.<module>` for {missing} to a page under docs/api/"
