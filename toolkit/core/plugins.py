"""The plugin registry: loads plugins, checks them, and answers "which loss is called 'cispo'?".

One `PluginRegistry` per process (`registry()`), built on first use:

1. toolkit's own `builtin_plugin` is registered first (built-ins use the public hooks);
2. unless `TOOLKIT_DISABLE_PLUGIN_AUTOLOAD` is set, every entry point of the group `toolkit` is
   imported and registered under its entry-point name;
3. modules named in `TOOLKIT_PLUGINS` (comma-separated) are imported and registered, autoload or not;
4. pluggy's `check_pending` rejects implementations of hooks that do not exist (a misspelt hook
   name would otherwise never run), and registration rejects implementations that ask for an
   argument their spec does not have;
5. the registration hooks are called, one plugin at a time so that every name keeps its origin;
   a name claimed twice in the same kind is an error naming both plugins and packages.

Every failure is a `PluginError` that names the plugin, its package and the fix. Trainers look
names up with `registry().get(kind, name)` and validate configs with `registry().names(kind)`.
"""

from __future__ import annotations

__all__ = [
    "AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV",
    "PluginError",
    "PluginRegistry",
    "Registered",
    "notify_checkpoint_saved",
    "notify_step_metrics",
    "register",
    "registry",
    "reset_registry",
    "resolve_reward",
]

import difflib
import importlib
import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import pluggy

from . import hookspecs
from .errors import ConfigError, ToolkitError
from .objectives import AdvantageEstimator, PolicyLoss, PreferenceLoss
from .objectives.advantages import legacy_advantage_estimator
from .objectives.policy import legacy_policy_loss
from .objectives.preference import legacy_preference_loss

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "toolkit"
AUTOLOAD_ENV = "TOOLKIT_DISABLE_PLUGIN_AUTOLOAD"
PLUGINS_ENV = "TOOLKIT_PLUGINS"
BUILTIN_NAME = "toolkit.builtin"

#: Human names of the kinds, for messages and `toolkit plugins`.
KIND_TITLES = {
    "policy_loss": "policy loss (GRPO loss_type)",
    "preference_loss": "preference loss (DPO loss_type)",
    "advantage_estimator": "advantage estimator (GRPO advantage_estimator)",
    "reward": "reward function (reward_funcs)",
    "generation_backend": "generation backend (generation_backend)",
    "environment": "environment (environment)",
}


class PluginError(ToolkitError):
    """A plugin failed to import, does not match the hook specs, or clashes with another plugin."""


@dataclass(frozen=True)
class Registered:
    """One named entry of the registry and where it came from."""

    kind: str
    name: str
    obj: Any
    plugin: str     # the plugin's registered name (entry-point name, module name or toolkit.builtin)
    package: str    # "toolkit-cispo 0.1.0", "toolkit 0.1.0 (built-in)" or "(not from a package)"


def _autoload_disabled() -> bool:
    return os.environ.get(AUTOLOAD_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _toolkit_version() -> str:
    from .._version import __version__

    return __version__


def _coerce(kind: str, name: str, obj: Any, origin: str) -> Any:
    """Registered objects as the hooks-1.1 types; hooks-1.0 plain callables adapted (with a deprecation warning)."""
    if kind == "policy_loss" and not isinstance(obj, PolicyLoss):
        return legacy_policy_loss(obj, name=name, origin=origin)
    if kind == "preference_loss" and not isinstance(obj, PreferenceLoss):
        return legacy_preference_loss(obj, name=name, origin=origin)
    if kind == "advantage_estimator" and not isinstance(obj, AdvantageEstimator):
        return legacy_advantage_estimator(obj, name=name, origin=origin)
    return obj


class PluginRegistry:
    """Plugins loaded through pluggy plus the name tables built from their registration hooks."""

    def __init__(self, *, autoload: bool | None = None, extra_modules: list[str] | None = None):
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._packages: dict[str, str] = {}
        self._failed_observers: set[str] = set()
        self._tables: dict[str, dict[str, Registered]] | None = None
        from . import builtin_plugin

        self._register(builtin_plugin, BUILTIN_NAME, f"toolkit {_toolkit_version()} (built-in)")
        if autoload if autoload is not None else not _autoload_disabled():
            self._load_entry_points()
        env_modules = [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]
        for module in list(extra_modules or []) + env_modules:
            self.load_module(module)
        self._check_pending()

    # ---------------------------------------------------------------------------------- loading

    def _register(self, plugin: Any, name: str, package: str) -> None:
        if self.pm.has_plugin(name):
            raise PluginError(f"plugin '{name}' ({package}) is registered twice; plugin names must be unique.")
        try:
            self.pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginError(
                f"plugin '{name}' ({package}) does not match toolkit's hook specs: {e}. Hook implementations may "
                f"take only arguments their spec declares (see toolkit/core/hookspecs.py, hooks "
                f"{hookspecs.HOOKS_VERSION}).") from e
        self._packages[name] = package
        self._tables = None

    def _load_entry_points(self) -> None:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = getattr(ep, "dist", None)
            package = f"{dist.name} {dist.version}" if dist is not None else "(unknown package)"
            if self.pm.has_plugin(ep.name):
                continue  # the same distribution seen twice on sys.path
            try:
                plugin = ep.load()
            except Exception as e:
                raise PluginError(
                    f"plugin '{ep.name}' from {package} failed to import ({type(e).__name__}: {e}). Fix or uninstall "
                    f"that package, or set {AUTOLOAD_ENV}=1 to start without plugins.") from e
            self._register(plugin, ep.name, package)

    def load_module(self, module: str) -> None:
        """Import a module by dotted name and register it as a plugin (what `TOOLKIT_PLUGINS` does)."""
        try:
            plugin = importlib.import_module(module)
        except Exception as e:
            raise PluginError(f"plugin module '{module}' (from {PLUGINS_ENV} or load_module) failed to import "
                              f"({type(e).__name__}: {e}).") from e
        if not self.pm.is_registered(plugin):
            self._register(plugin, module, "(not from a package)")
            self._check_pending()

    def register(self, plugin: Any, name: str | None = None) -> None:
        """Register a plugin object or module in this process (notebooks, wrappers, tests)."""
        name = name or getattr(plugin, "__name__", None) or f"{type(plugin).__name__}-{id(plugin)}"
        self._register(plugin, name, "(not from a package)")
        self._check_pending()
        self.tables()  # clashes surface here, at registration, not later in a trainer

    def unregister(self, name: str) -> None:
        if name == BUILTIN_NAME:
            raise PluginError("the built-in plugin cannot be unregistered.")
        self.pm.unregister(name=name)
        self._packages.pop(name, None)
        self._tables = None

    def _check_pending(self) -> None:
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError as e:
            plugin = self.pm.get_name(e.plugin) or repr(e.plugin)
            raise PluginError(
                f"plugin '{plugin}' ({self._packages.get(plugin, '?')}) implements a hook toolkit does not have: {e}. "
                f"Check the spelling against toolkit/core/hookspecs.py.") from e

    # --------------------------------------------------------------------------------- the tables

    def tables(self) -> dict[str, dict[str, Registered]]:
        if self._tables is not None:
            return self._tables
        tables: dict[str, dict[str, Registered]] = {kind: {} for kind in hookspecs.REGISTRATION_HOOKS.values()}
        for hook_name, kind in hookspecs.REGISTRATION_HOOKS.items():
            # get_hookimpls() lists in registration order: built-ins first, so a clash names the built-in first.
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                plugin = impl.plugin_name
                package = self._packages.get(plugin, "?")
                try:
                    entries = impl.function()
                except Exception as e:
                    raise PluginError(f"plugin '{plugin}' ({package}): {hook_name}() raised "
                                      f"{type(e).__name__}: {e}") from e
                if not isinstance(entries, Mapping):
                    raise PluginError(f"plugin '{plugin}' ({package}): {hook_name}() must return a mapping of name "
                                      f"-> callable, got {type(entries).__name__}.")
                for name, obj in entries.items():
                    if not isinstance(name, str) or not name or name != name.strip() or " " in name:
                        raise PluginError(f"plugin '{plugin}' ({package}): {hook_name}() returned the name {name!r}; "
                                          "names are non-empty strings without spaces.")
                    if not callable(obj):
                        raise PluginError(f"plugin '{plugin}' ({package}): {KIND_TITLES[kind]} '{name}' is not "
                                          f"callable ({type(obj).__name__}).")
                    if name in tables[kind]:
                        first = tables[kind][name]
                        raise PluginError(
                            f"{KIND_TITLES[kind]} '{name}' is registered twice: by plugin '{first.plugin}' "
                            f"({first.package}) and by plugin '{plugin}' ({package}). Names must be unique; "
                            f"uninstall one of the packages, or set {AUTOLOAD_ENV}=1 and load the one you want "
                            f"with {PLUGINS_ENV}=<module>.")
                    obj = _coerce(kind, name, obj, f"plugin '{plugin}' ({package})")
                    tables[kind][name] = Registered(kind, name, obj, plugin, package)
        self._tables = tables
        return tables

    def names(self, kind: str) -> list[str]:
        return sorted(self.tables()[kind])

    def get(self, kind: str, name: str, *, field: str | None = None) -> Any:
        """The object registered as `name`; a ConfigError naming the field and close names otherwise."""
        table = self.tables()[kind]
        if name in table:
            return table[name].obj
        close = difflib.get_close_matches(str(name), list(table), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"{field or kind}: '{name}' is not a registered {KIND_TITLES[kind]}; registered: "
                          f"{sorted(table)}.{hint} Plugins add names (run `toolkit plugins` to list them).")

    def entries(self) -> list[Registered]:
        return [r for kind in self.tables().values() for r in kind.values()]

    def plugins(self) -> list[tuple[str, str]]:
        """(plugin name, package) of every registered plugin, built-in first."""
        return [(name, self._packages.get(name, "?")) for name, _ in self.pm.list_name_plugin()]

    def make_reward(self, spec: str) -> Callable[..., Any] | None:
        return self.pm.hook.toolkit_make_reward(spec=spec)

    # ------------------------------------------------------------------------------ observation

    def notify(self, hook_name: str, **kwargs: Any) -> None:
        """Call an observation hook on every plugin; a failing observer is logged and switched off."""
        if "metrics" in kwargs:
            kwargs["metrics"] = MappingProxyType(dict(kwargs["metrics"]))
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            key = f"{impl.plugin_name}:{hook_name}"
            if key in self._failed_observers:
                continue
            try:
                impl.function(**{a: kwargs[a] for a in impl.argnames})
            except Exception:
                self._failed_observers.add(key)
                logger.exception("plugin '%s' (%s) failed in %s; this observer is off for the rest of the run "
                                 "(training goes on).", impl.plugin_name, self._packages.get(impl.plugin_name, "?"),
                                 hook_name)


_REGISTRY: PluginRegistry | None = None
_LOCK = threading.Lock()


def registry() -> PluginRegistry:
    """The process-wide registry, built (plugins loaded and checked) on first use."""
    global _REGISTRY
    with _LOCK:
        if _REGISTRY is None:
            _REGISTRY = PluginRegistry()
        return _REGISTRY


def reset_registry(new: PluginRegistry | None = None) -> PluginRegistry | None:
    """Replace the process-wide registry (None: rebuilt on next use); returns the old one. For tests."""
    global _REGISTRY
    with _LOCK:
        old, _REGISTRY = _REGISTRY, new
        return old


def register(plugin: Any, name: str | None = None) -> None:
    """Register a plugin object or module with the process-wide registry (no packaging needed)."""
    registry().register(plugin, name)


def resolve_reward(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """A callable as is; a name from the plugin registry (built-ins included); else a parameterised spec."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"reward_funcs: got {spec!r} ({type(spec).__name__}); each reward is a callable "
                          "f(prompts, completions, completion_ids, **columns) or a registered name such as "
                          "'numeric_match'.")
    reg = registry()
    if spec in reg.names("reward"):
        return reg.get("reward", spec)
    made = reg.make_reward(spec) if isinstance(spec, str) else None
    if made is not None:
        return made
    module, colon, name = spec.partition(":")
    if colon and name.isidentifier() and all(part.isidentifier() for part in module.split(".")):
        return _import_reward(spec, module, name)
    raise ConfigError(f"reward_funcs: unknown reward '{spec}'. Registered: {reg.names('reward')}, plus "
                      "'format:<regex>', 'reward_model:<path>', 'judge:<url>', or an import path "
                      "'package.module:function'; or pass a callable. Plugins add names (`toolkit plugins` lists "
                      "them).")


def _import_reward(spec: str, module: str, name: str) -> Callable[..., Any]:
    """A reward function by import path, TRL's way of naming a custom reward in a config (`my_rewards:brevity`):
    the module imported (from the current directory too), its attribute checked to be callable."""
    import inspect
    import sys

    # a module in the current directory, as `python -m` would find it; the path is put back afterwards, so a local
    # file cannot shadow later imports
    added = os.getcwd() not in sys.path and "" not in sys.path
    if added:
        sys.path.append(os.getcwd())
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"reward_funcs: '{spec}': module '{module}' does not import ({e}); it must be importable "
                          "from the current directory or the environment.") from e
    finally:
        if added:
            sys.path.remove(os.getcwd())
    func = getattr(mod, name, None)
    if not callable(func) or inspect.isclass(func):
        raise ConfigError(f"reward_funcs: '{spec}': module '{module}' has no function '{name}'"
                          + (" (it is a class: name a function, or an instance at module level)."
                             if inspect.isclass(func) else "."))
    return func


def notify_step_metrics(trainer: str, step: int, metrics: Mapping[str, float]) -> None:
    registry().notify("toolkit_on_step_metrics", trainer=trainer, step=step, metrics=metrics)


def notify_checkpoint_saved(trainer: str, step: int, path: str) -> None:
    registry().notify("toolkit_on_checkpoint_saved", trainer=trainer, step=step, path=path)
