"""toolkit.core: the stable, semver-guaranteed API.

The public surface is what the modules below list in their `__all__`, re-exported here (and as
`toolkit`); nothing else is promised. `tests/api_snapshot.json` records it (names, signatures, config
fields with defaults, hook specs) and `tests/test_api_surface.py` fails on any change that is not
recorded in the same commit: see docs/contributing.md for the deprecation rules.

Layers (low to high; a module imports only from its own layer or below, checked by import-linter in
the test suite, see pyproject.toml and docs/architecture.md):

    numerics, errors                 the numbers every trainer agrees on; exceptions
    objectives/                      losses, advantage estimators, their settings and composition
    data, packing, attention,        data layer, packed forwards, generation backends, rewards,
    generation, rewards, models,     model loading, checkpoints, rollouts, hook specs
    checkpoint, rollout, hookspecs,
    tasks, vllm_backend
    plugins, builtin_plugin          the registry (built-ins through the same hooks as plugins)
    sft, dpo, grpo, ppo, rollout_worker, report
    async_grpo                       (extends grpo)
    cli, config, vllm_server         entry points

Modules not re-exported here (attention, packing, builtin_plugin, cli, config, report, rollout_worker,
vllm_server) are internal: importable, with no stability promise. `tasks` and `vllm_backend` are public
but not re-exported (`vllm_backend` would be heavy to import by default).
"""

from __future__ import annotations

from . import attention as _attention  # noqa: F401  (registers the `toolkit_varlen` attention implementation)
from . import (
    async_grpo,
    checkpoint,
    data,
    dpo,
    errors,
    generation,
    grpo,
    hookspecs,
    models,
    numerics,
    objectives,
    plugins,
    ppo,
    rewards,
    rollout,
    sft,
)

#: The modules whose `__all__` make up `toolkit.core` (and `toolkit`), in layer order.
PUBLIC_MODULES = (errors, numerics, objectives, data, generation, rewards, models, checkpoint, rollout, hookspecs,
                  plugins, sft, dpo, grpo, ppo, async_grpo)


def _collect() -> dict[str, object]:
    names: dict[str, object] = {}
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            obj = getattr(module, name)
            if name in names and names[name] is not obj:
                raise ImportError(f"toolkit.core: '{name}' is exported by two modules as different objects "
                                  f"(the second is {module.__name__}); rename one.")
            names[name] = obj
    return names


_PUBLIC = _collect()
globals().update(_PUBLIC)
__all__ = sorted(_PUBLIC)  # noqa: PLE0605 (derived from the modules' __all__)
