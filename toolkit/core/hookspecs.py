"""The plugin hooks of toolkit: part of the semver contract.

A plugin is a module (or object) with functions named like the specs below, marked with
`toolkit.hookimpl`, and announced by its package under the entry-point group `toolkit`:

    [project.entry-points.toolkit]
    cispo = "toolkit_cispo"

The built-in losses, advantage estimators, rewards and generation backends are registered through
these same hooks (`toolkit.core.builtin_plugin`), so a plugin's "cispo" is found exactly the way
the built-in "dapo" is. docs/plugins.md walks through writing one.

Stability. Every spec here is public API from the version in its docstring. A spec is never changed
in place: a new argument is added as optional (implementations may take any subset of a spec's
arguments, so old plugins keep working), and a spec or argument on its way out is marked with
pluggy's `warn_on_impl` / `warn_on_impl_args` carrying a `ToolkitDeprecationWarning` for at least
one minor release before a major release removes it. `HOOKS_VERSION` counts these changes.

Hooks come in two lifecycle groups:

* Registration (called once, when the registry is first built): each returns a mapping from a
  name, which configs use (`loss_type = "cispo"`), to a callable. Two plugins that claim the same
  name in the same kind are an error at load time, naming both; a plugin cannot silently replace
  a built-in either.
* Observation (called while training runs): they receive copies and read-only views, return
  nothing and cannot change training. A failing observer is logged with its plugin name and turned
  off for the rest of the process; it never stops a run.
"""

from __future__ import annotations

__all__ = [
    "HOOKS_VERSION",
    "REGISTRATION_HOOKS",
    "ToolkitDeprecationWarning",
    "hookimpl",
    "hookspec",
]

from collections.abc import Callable, Mapping
from typing import Any

import pluggy

from .errors import ToolkitDeprecationWarning

PROJECT_NAME = "toolkit"
#: Bumped on every added, deprecated or removed hook, hook argument or registered-object form.
#: 1.1 (toolkit 0.2): losses and estimators are registered as objects on typed inputs (PolicyLoss,
#: PreferenceLoss, AdvantageEstimator); the 1.0 callable form still works, with a ToolkitDeprecationWarning,
#: until hooks 2.0 (toolkit 0.3).
#: 1.2 (toolkit 0.2): `toolkit_register_environments` (multi-turn episodes for GRPO).
HOOKS_VERSION = "1.2"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)



# --------------------------------------------------------------------------------------------------
# Registration hooks
# --------------------------------------------------------------------------------------------------


@hookspec
def toolkit_register_policy_losses() -> Mapping[str, Any]:
    """Policy losses for GRPO-family trainers, by `loss_type` name.

    Added in hooks 1.0 (toolkit 0.1); objects on typed inputs since hooks 1.1 (toolkit 0.2).

    Returns:
        {name: toolkit.PolicyLoss}. A `PolicyLoss(fn, settings=<dataclass>, aggregation=...)` wraps
        `fn(inputs: PolicyLossInputs, settings) -> (per_token_loss [B, T], info)`: `inputs` holds the
        trainer's per-token log-probs (with gradient), pi_old's, the sampler's and the reference's,
        advantages, the loss and completion masks, group ids and the step's token/sequence/prompt counts;
        `settings` is an instance of the loss's own settings dataclass, filled from the config's
        `loss_kwargs` and from config fields of the same name (e.g. `epsilon`), validated before any model
        loads. `info` maps metric names to [B, T] bool tensors ("clipped_low", "clipped_high" are logged as
        clip ratios). The trainer config is never passed: the loss depends only on what it declares.
        `toolkit.core.objectives.policy_objective` applies the sampler correction, the KL term and the
        `aggregation` ("token" | "sequence" | "constant" | "prompt" | "micro_batch_token").

        Deprecated (hooks 1.1, removed in 2.0): a plain callable `loss(logps, old_logps, advantages, *,
        config, mask)` with optional `aggregation` / `check_config(config)` attributes still works and
        emits a ToolkitDeprecationWarning naming the plugin.
    """


@hookspec
def toolkit_register_preference_losses() -> Mapping[str, Any]:
    """Preference losses for DPO-family trainers, by `loss_type` name.

    Added in hooks 1.0 (toolkit 0.1); objects on typed inputs since hooks 1.1 (toolkit 0.2).

    Returns:
        {name: toolkit.PreferenceLoss}. `PreferenceLoss(fn, settings=<dataclass>)` wraps
        `fn(inputs: PreferenceLossInputs, settings) -> per-pair loss [B]`; `inputs` holds the chosen and
        rejected log-ratios log pi(y|x) - log pi_ref(y|x) summed over each answer ([B] each; with
        `reference_free` the reference term is 0) and the answers' token counts; `settings` is filled from
        the config's `loss_kwargs` and same-named config fields (`beta`, `label_smoothing`). The trainer
        weights the losses (`loss_weights`) and averages.

        Deprecated (hooks 1.1, removed in 2.0): a plain callable `loss(chosen_logratios,
        rejected_logratios, *, config, chosen_lengths, rejected_lengths)`; it warns.
    """


@hookspec
def toolkit_register_advantage_estimators() -> Mapping[str, Any]:
    """Advantage estimators for GRPO-family trainers, by `advantage_estimator` name.

    Added in hooks 1.0 (toolkit 0.1); objects on typed inputs since hooks 1.1 (toolkit 0.2).

    Returns:
        {name: toolkit.AdvantageEstimator}. `AdvantageEstimator(fn, settings=<dataclass>)` wraps
        `fn(inputs: AdvantageInputs, settings) -> (advantages [R], zero_std [R] bool)`: `inputs.rewards` is
        the total reward of every completion [R] (groups of `inputs.group_size` contiguous rows; NaN marks a
        row without a reward); `zero_std` marks rows whose group carries no learning signal (dropped when
        `zero_variance_filter` is on). Settings come from `advantage_estimator_kwargs` and same-named
        config fields (`scale_rewards`).

        Deprecated (hooks 1.1, removed in 2.0): a plain callable `estimator(rewards, *, group_size,
        config)`; it warns.
    """


@hookspec
def toolkit_register_rewards() -> Mapping[str, Callable[..., Any]]:
    """Reward functions by the name configs use in `reward_funcs`.

    Added in hooks 1.0 (toolkit 0.1).

    Returns:
        {name: reward}. `reward(prompts, completions, completion_ids, **columns)` returns one float
        (or None: no reward for that row) per completion; `async def` rewards are awaited. Extra
        dataset columns arrive as keyword arguments (see docs/grpo.md).
    """


@hookspec(firstresult=True)
def toolkit_make_reward(spec: str) -> Callable[..., Any] | None:
    """Build a reward function from a parameterised spec such as "format:<regex>".

    Added in hooks 1.0 (toolkit 0.1). `firstresult`: the first implementation that returns
    something other than None wins, so return None for specs that are not yours.

    Args:
        spec: the string from `reward_funcs` that matched no registered name.
    """


@hookspec
def toolkit_register_generation_backends() -> Mapping[str, Callable[..., Any]]:
    """Generation backends by the name configs use in `generation_backend`.

    Added in hooks 1.0 (toolkit 0.1).

    Returns:
        {name: factory}. `factory(model, tokenizer, config)` returns an object implementing
        `toolkit.GenerationBackend` (generate + sync_weights); `config.generation_backend_kwargs`
        holds the backend's own settings. Import heavy dependencies inside the factory, so that
        listing plugins stays cheap and a missing optional dependency fails only when used.
    """


@hookspec
def toolkit_register_environments() -> Mapping[str, Callable[..., Any]]:
    """Environments for multi-turn episodes, by the name configs use in `environment`.

    Added in hooks 1.2 (toolkit 0.2).

    Returns:
        {name: factory}. `factory(**environment_kwargs)` returns a fresh object implementing
        `toolkit.core.environments.Environment` (`reset(row) -> messages`, `step(text) -> EnvResponse`,
        optional `tools`); the trainer calls it once per episode, so an environment may keep per-episode
        state. Environment protocol version: `ENVIRONMENT_PROTOCOL_VERSION` (docs/agents.md).
    """


# --------------------------------------------------------------------------------------------------
# Observation hooks
# --------------------------------------------------------------------------------------------------


@hookspec
def toolkit_on_step_metrics(trainer: str, step: int, metrics: Mapping[str, float]) -> None:
    """Called each time a trainer logs (train and eval), after the metrics are final.

    Added in hooks 1.0 (toolkit 0.1).

    Args:
        trainer: "sft" | "dpo" | "grpo" | ... (the trainer's kind).
        step: the optimizer step the metrics belong to.
        metrics: a read-only copy of what the trainer logs.
    """


@hookspec
def toolkit_on_checkpoint_saved(trainer: str, step: int, path: str) -> None:
    """Called after a checkpoint folder is complete (its completion marker is on disk).

    Added in hooks 1.0 (toolkit 0.1).

    Args:
        trainer: the trainer's kind.
        step: the optimizer step of the checkpoint.
        path: the checkpoint folder; copy from it, do not modify it.
    """


#: Registration hook name -> the kind of thing it registers (used by the registry and `toolkit plugins`).
REGISTRATION_HOOKS: dict[str, str] = {
    "toolkit_register_policy_losses": "policy_loss",
    "toolkit_register_preference_losses": "preference_loss",
    "toolkit_register_advantage_estimators": "advantage_estimator",
    "toolkit_register_rewards": "reward",
    "toolkit_register_generation_backends": "generation_backend",
    "toolkit_register_environments": "environment",
}
