"""The objectives room: built-in losses and estimators as named objects, settings checked in one place, and
`policy_objective` (sampler correction, KL, aggregation) against a naive re-implementation."""

import math

import pytest
import torch

from toolkit import (
    ConfigError,
    DPOConfig,
    GRPOConfig,
    PolicyLossInputs,
    PolicyObjectiveSettings,
    PPOConfig,
    ToolkitDeprecationWarning,
    policy_objective,
    registry,
)
from toolkit.core.objectives import BUILTIN_POLICY_LOSSES, ClipSettings, resolve_settings
from toolkit.core.objectives.policy import OFF_POLICY_LOSSES


def _batch(seed=0, B=4, T=5):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    old = logps.detach() + 0.3 * torch.randn(B, T, generator=g)
    sampler = old + 0.2 * torch.randn(B, T, generator=g)
    ref = old + 0.5 * torch.randn(B, T, generator=g)
    lengths = torch.tensor([5, 3, 4, 1])
    mask = torch.arange(T)[None] < lengths[:, None]
    loss_mask = mask & torch.tensor([True, True, False, True])[:, None]
    return PolicyLossInputs(logps=logps, old_logps=old, advantages=torch.tensor([1.0, -0.5, 0.7, 2.0]),
                            loss_mask=loss_mask, completion_mask=mask, sampler_logps=sampler, ref_logps=ref,
                            group_ids=torch.tensor([0, 0, 1, 1]), step_tokens=20.0, step_sequences=6.0,
                            step_prompts=3.0, num_micro_batches=2)


def _naive(inputs, aggregation, *, eps, eps_high, beta, cap, constant, ratio_kind="token"):
    """Token by token, with Python loops: the composition the docstring of objectives/policy.py describes.

    ratio_kind: "token" (PPO's per-token ratio), "sequence" (GSPO: exp of the mean log-ratio over the completion)
    or "sequence_token" (GSPO-token: that value, with each token's own gradient)."""
    B, T = inputs.logps.shape
    terms = [[None] * T for _ in range(B)]
    for b in range(B):
        ts = [t for t in range(T) if inputs.loss_mask[b, t]]  # GSPO's mean runs over the tokens in the loss
        seq = sum((inputs.logps[b, t] - inputs.old_logps[b, t] for t in ts), inputs.logps[b, 0] * 0) / max(len(ts), 1)
        for t in range(T):
            if not inputs.completion_mask[b, t]:
                terms[b][t] = inputs.logps[b, t] * 0
                continue
            ratio = torch.exp(inputs.logps[b, t] - inputs.old_logps[b, t])
            clip_ratio = {"token": ratio, "sequence": torch.exp(seq),
                          "sequence_token": torch.exp(seq.detach() + inputs.logps[b, t] - inputs.logps[b, t].detach())
                          }[ratio_kind]
            a = inputs.advantages[b]
            term = -torch.min(clip_ratio * a, clip_ratio.clamp(1 - eps, 1 + eps_high) * a)
            w = min(math.exp(float(inputs.old_logps[b, t] - inputs.sampler_logps[b, t])), cap)
            term = term * w
            r = inputs.ref_logps[b, t] - inputs.logps[b, t]
            term = term + beta * (torch.exp(r) - r - 1) * ratio
            terms[b][t] = term
    sel = [(b, t) for b in range(B) for t in range(T) if inputs.loss_mask[b, t]]
    if aggregation == "token":
        return sum(terms[b][t] for b, t in sel) / inputs.step_tokens
    if aggregation == "micro_batch_token":
        return sum(terms[b][t] for b, t in sel) / len(sel) / inputs.num_micro_batches
    if aggregation == "constant":
        return sum(terms[b][t] for b, t in sel) / (inputs.step_sequences * constant)
    if aggregation == "sequence":
        total = 0
        for b in range(B):
            ts = [t for t in range(T) if inputs.loss_mask[b, t]]
            if ts:
                total = total + sum(terms[b][t] for t in ts) / len(ts)
        return total / inputs.step_sequences
    if aggregation == "prompt":
        total = 0
        for g in inputs.group_ids.unique().tolist():
            cells = [(b, t) for b, t in sel if inputs.group_ids[b] == g]
            if cells:
                total = total + sum(terms[b][t] for b, t in cells) / len(cells)
        return total / inputs.step_prompts
    raise AssertionError(aggregation)


# the off-policy objectives weigh by the behaviour policy themselves: tests/unit/test_off_policy_objectives.py
@pytest.mark.parametrize("loss_type", sorted(set(BUILTIN_POLICY_LOSSES) - set(OFF_POLICY_LOSSES)))
def test_policy_objective_equals_a_naive_composition_for_every_builtin(loss_type):
    loss = BUILTIN_POLICY_LOSSES[loss_type]
    kind = {"gspo": "sequence", "gspo_token": "sequence_token"}.get(loss_type, "token")
    # GSPO's sequence ratios of this batch lie within 2% of 1: a tight range makes both clip sides bind
    eps, eps_high = (0.005, 0.001) if kind != "token" else (0.2, 0.28)
    settings = ClipSettings(epsilon=eps, epsilon_high=eps_high)
    objective = PolicyObjectiveSettings(beta=0.04, importance_sampling_cap=1.5, aggregation_constant=7)
    inputs = _batch()
    out = policy_objective(inputs, lambda i: loss(i, settings), aggregation=loss.aggregation, settings=objective)
    (grad,) = torch.autograd.grad(out.loss, inputs.logps)
    if kind != "token":
        assert out.info["clipped_low"].any() and out.info["clipped_high"].any()
    inputs2 = _batch()
    want = _naive(inputs2, loss.aggregation, eps=eps, eps_high=eps_high, beta=0.04, cap=1.5, constant=7,
                  ratio_kind=kind)
    (want_grad,) = torch.autograd.grad(want, inputs2.logps)
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert out.kl is not None and out.importance_weights is not None and out.importance_weights.max() <= 1.5


def test_no_correction_and_no_kl_leave_the_term_alone():
    inputs = _batch()
    term = torch.ones_like(inputs.logps) * inputs.logps
    out = policy_objective(inputs, lambda i: (term, {}), aggregation="token",
                           settings=PolicyObjectiveSettings(beta=0.0, importance_sampling_cap=None))
    assert out.kl is None and out.importance_weights is None
    torch.testing.assert_close(out.per_token, term)


def test_every_builtin_is_registered_as_an_object_with_settings():
    reg = registry()
    for kind in ("policy_loss", "preference_loss", "advantage_estimator"):
        for name in reg.names(kind):
            entry = reg.tables()[kind][name]
            if entry.plugin == "toolkit.builtin":
                assert hasattr(entry.obj, "settings") and entry.obj.description, (kind, name)


def test_settings_errors_name_the_field_value_and_range(tmp_path):
    base = dict(output_dir=str(tmp_path), num_generations=2, per_device_train_batch_size=2)
    with pytest.raises(ConfigError, match=r"^epsilon: must be in \(0, 1\).*got -0.2 \(loss_type 'dapo'\)"):
        GRPOConfig(**base, epsilon=-0.2)
    with pytest.raises(ConfigError, match=r"^epsilon_high: must be > 0"):
        GRPOConfig(**base, epsilon_high=0.0)
    with pytest.raises(ConfigError, match=r"^scale_rewards: 'groups' is not one of"):
        GRPOConfig(**base, scale_rewards="groups")
    with pytest.raises(ConfigError, match=r"^importance_sampling_level: 'seq' is not token \| sequence"):
        GRPOConfig(**base, importance_sampling_level="seq")
    with pytest.raises(ConfigError, match=r"^beta: must be >= 0"):
        GRPOConfig(**base, beta=-1.0)
    with pytest.raises(ConfigError, match=r"advantage_estimator_kwargs: advantage_estimator 'rloo' takes no settings"):
        GRPOConfig(**base, advantage_estimator="rloo", advantage_estimator_kwargs={"x": 1})
    # label_smoothing above 0.5 would train towards the rejected answers
    with pytest.raises(ConfigError, match=r"^label_smoothing: must be in \[0, 0.5\].*got 0.9 \(loss_type 'sigmoid'\)"):
        DPOConfig(output_dir=str(tmp_path), label_smoothing=0.9)
    with pytest.raises(ConfigError, match=r"^label_smoothing: robust DPO needs \[0, 0.5\)"):
        DPOConfig(output_dir=str(tmp_path), loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ConfigError, match=r"loss_kwargs: no loss in loss_type \['hinge', 'sigmoid'\] takes \['margin'\]"):
        DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "hinge"], loss_kwargs={"margin": 1.0})


def test_resolve_settings_type_check_and_precedence():
    class Cfg:
        epsilon = 0.3

    s = resolve_settings(ClipSettings, Cfg(), kwargs={"epsilon_high": 0.4}, kwargs_field="loss_kwargs", owner="x")
    assert s == ClipSettings(epsilon=0.3, epsilon_high=0.4)
    with pytest.raises(ConfigError, match=r"loss_kwargs.epsilon_high: x expects"):
        resolve_settings(ClipSettings, Cfg(), kwargs={"epsilon_high": "high"}, kwargs_field="loss_kwargs", owner="x")
    with pytest.raises(ConfigError, match=r"^epsilon: x expects float, got True"):
        Cfg.epsilon = True
        resolve_settings(ClipSettings, Cfg(), kwargs=None, kwargs_field="loss_kwargs", owner="x")


def test_ppo_uses_grpo_names_and_keeps_the_old_ones_as_deprecated_aliases(tmp_path):
    cfg = PPOConfig(output_dir=str(tmp_path), beta=0.1, epsilon=0.3)
    assert (cfg.beta, cfg.epsilon) == (0.1, 0.3)
    with pytest.warns(ToolkitDeprecationWarning, match=r"PPOConfig.kl_coef is deprecated.*use beta"):
        old = PPOConfig(output_dir=str(tmp_path), kl_coef=0.02)
    assert old.beta == 0.02 and old.kl_coef is None
    with pytest.warns(ToolkitDeprecationWarning, match=r"PPOConfig.cliprange is deprecated.*use epsilon"):
        old = PPOConfig(output_dir=str(tmp_path), cliprange=0.1)
    assert old.epsilon == 0.1
    with pytest.raises(ConfigError, match=r"^epsilon: must be in \(0, 1\)"):
        PPOConfig(output_dir=str(tmp_path), epsilon=1.5)


def test_only_the_named_config_fields_are_shared_with_a_loss():
    """A plugin setting that happens to share a name with a TrainingArguments attribute stays the plugin's."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Sampling:
        temperature: float = 0.5
        seed: int = 3

    cfg = GRPOConfig(output_dir="/tmp/unused", num_generations=2, per_device_train_batch_size=2, temperature=0.9)
    assert resolve_settings(Sampling, cfg, kwargs=None, kwargs_field="loss_kwargs", owner="x") == Sampling()
    assert resolve_settings(Sampling, cfg, kwargs={"temperature": 0.7}, kwargs_field="loss_kwargs",
                            owner="x") == Sampling(temperature=0.7)


def test_ppo_refuses_both_a_name_and_its_alias_and_what_its_loop_does_not_do(tmp_path):
    with pytest.raises(ConfigError, match=r"kl_coef: the deprecated alias of beta; both are set"):
        PPOConfig(output_dir=str(tmp_path), beta=0.1, kl_coef=0.2)
    with pytest.raises(ConfigError, match=r"save_strategy: PPO saves every save_steps updates"):
        PPOConfig(output_dir=str(tmp_path), save_strategy="epoch")
    with pytest.raises(ConfigError, match=r"save_steps: PPO counts updates, so save_steps must be a whole number"):
        PPOConfig(output_dir=str(tmp_path), save_strategy="steps", save_steps=0.5)


def test_complete_checkpoint_callback_names_the_0_1_form():
    from toolkit.core.checkpoint import CompleteCheckpointCallback

    with pytest.raises(TypeError, match=r"toolkit 0.1's CompleteCheckpointCallback\(trainer_kind\) is gone"):
        CompleteCheckpointCallback("grpo")


def test_gspo_token_has_gspos_value_and_each_tokens_own_gradient():
    """The GSPO paper's property: with one advantage per sequence GSPO-token equals GSPO in value and gradient;
    with per-token advantages the values stay GSPO's sequence ratio but each token's gradient follows its own."""
    from toolkit.core.numerics import gspo_surrogate

    def both(advantages):
        inputs = _batch()
        mask = inputs.completion_mask
        out = []
        for token_level in (False, True):
            loss, _ = gspo_surrogate(inputs.logps, inputs.old_logps, advantages, mask, epsilon_low=0.2,
                                     epsilon_high=0.28, token_level=token_level)
            (grad,) = torch.autograd.grad((loss * mask).sum(), inputs.logps)
            out.append((loss.detach(), grad))
        return out, mask

    (seq, g_seq), (tok, g_tok) = both(torch.tensor([1.0, -0.5, 0.7, 2.0]))[0]
    torch.testing.assert_close(seq, tok)
    torch.testing.assert_close(g_seq, g_tok)
    row = seq[0, _batch().completion_mask[0]]
    assert torch.allclose(row, row[0].expand_as(row))  # one ratio per completion
    per_token = torch.linspace(-1.0, 1.0, 20).reshape(4, 5)
    ((seq, g_seq), (tok, g_tok)), mask = both(per_token)
    torch.testing.assert_close(seq, tok)  # values: still the sequence ratio
    assert not torch.allclose(g_seq * mask, g_tok * mask)


def test_a_lower_bound_alone_still_corrects_the_sampler():
    """importance_sampling_cap=None with importance_sampling_min set is a correction with a floor only (TRL allows
    clip_max=None), not a silently dropped setting."""
    from toolkit.core.objectives import PolicyLossInputs, PolicyObjectiveSettings, policy_objective

    g = torch.Generator().manual_seed(0)
    logps = torch.randn(2, 4, generator=g)
    sampler = logps + torch.tensor([[0.9, 0.0, 0.0, 0.0], [0.0, 0.0, -0.9, 0.0]])
    inputs = PolicyLossInputs(logps=logps.clone().requires_grad_(), old_logps=logps, advantages=torch.tensor([1.0, -1.0]),
                              loss_mask=torch.ones(2, 4, dtype=torch.bool), sampler_logps=sampler)
    term = lambda i: (-(i.logps - i.old_logps.detach()).exp() * i.advantages[:, None], {})  # noqa: E731
    for mode, expect in (("truncate", 0.8), ("mask", 0.0)):
        out = policy_objective(inputs, term, aggregation="token", settings=PolicyObjectiveSettings(
            importance_sampling_cap=None, importance_sampling_min=0.8, importance_sampling_mode=mode))
        assert out.importance_weights is not None
        assert out.importance_weights[0, 0].item() == pytest.approx(expect, abs=1e-6)  # exp(-0.9) = 0.41 < 0.8
        assert out.importance_weights[1, 2].item() == pytest.approx(2.4596, rel=1e-3)   # exp(0.9): no upper bound
