"""toolkit.core: the stable, semver-guaranteed API.

The public surface is what the modules below list in their `__all__`, re-exported here (and as
`toolkit`); nothing else is promised. `tests/api_snapshot.json` records it (names, signatures, config
fields with defaults, hook specs) and `tests/unit/test_api_surface.py` fails on any change that is not
recorded in the same commit: see docs/contributing.md for the deprecation rules.

Layers (low to high; a module imports only from its own layer or below, checked by import-linter in
the test suite, see pyproject.toml and docs/architecture.md, which lists every module):

    numerics, errors, defaults       the numbers every trainer agrees on; exceptions; light constants
    objectives/                      losses, advantage estimators, their settings and composition
    data, packing, attention,        data layer, packed forwards, generation backends, rewards,
    generation, rewards, models,     model loading, checkpoints, rollouts, hook specs
    checkpoint, rollout, hookspecs,
    tasks, vllm_backend, ...
    plugins, builtin_plugin          the registry (built-ins through the same hooks as plugins)
    model_card
    lifecycle, rollout_config        what every trainer shares (checkpoints, metrics, card; sampling fields)
    sft, dpo, grpo, ppo, rollout_worker, report
    worker_handle, async_grpo_config
    async_grpo                       (extends grpo)
    cli, config, runs, vllm_server,      entry points (runs: run files from Python, toolkit.load_run)
    pipeline

Imports are lazy: `import toolkit` loads nothing heavy (the command line's `--help` answers in well under two
seconds); the first public name used imports the public modules, as an eager import did.

Modules not re-exported here (attention, packing, builtin_plugin, cli, config, report, rollout_worker,
vllm_server, ...) are internal: importable, with no stability promise. `tasks` and `vllm_backend` are public
but not re-exported (`vllm_backend` would be heavy to import by default).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

#: The modules whose `__all__` make up `toolkit.core` (and `toolkit`), in layer order.
PUBLIC_MODULES = ("errors", "numerics", "objectives", "data", "generation", "rewards", "models", "checkpoint",
                  "rollout", "hookspecs", "plugins", "sft", "dpo", "grpo", "ppo", "async_grpo", "runs")

_public: dict[str, object] | None = None


def _collect() -> dict[str, object]:
    global _public
    if _public is None:
        importlib.import_module(".attention", __name__)  # registers the `toolkit_varlen` attention implementation
        names: dict[str, object] = {}
        for module_name in PUBLIC_MODULES:
            module = importlib.import_module(f".{module_name}", __name__)
            for name in module.__all__:
                obj = getattr(module, name)
                if name in names and names[name] is not obj:
                    raise ImportError(f"toolkit.core: '{name}' is exported by two modules as different objects "
                                      f"(the second is {module.__name__}); rename one.")
                names[name] = obj
        _public = names
    return _public


def __getattr__(name: str) -> Any:
    if name == "__all__":
        return sorted(_collect())
    if name.startswith("__"):
        raise AttributeError(name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule: toolkit.core.grpo, .cli, ...
        return importlib.import_module(f".{name}", __name__)
    public = _collect()
    if name in public:
        return public[name]
    raise AttributeError(f"module 'toolkit.core' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_collect()))
