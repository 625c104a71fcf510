"""The off-policy objectives (decoupled PPO, M2PO, sequence-level masked IS) against naive references written
token by token, and through GRPOTrainer by name."""

import math

import pytest
import torch

from toolkit import PolicyLossInputs, PolicyObjectiveSettings, policy_objective, registry
from toolkit.core.numerics import loglinear_proximal_logps, second_moment_mask
from toolkit.core.objectives import DecoupledPPOSettings, M2POSettings, SeqMISSettings, SettingsError
from toolkit.core.objectives.policy import OFF_POLICY_LOSSES


def _batch(seed=0, B=4, T=6, drift=0.4):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    old = logps.detach() + 0.1 * torch.randn(B, T, generator=g)          # pi_old: the step's own weights
    sampler = old + drift * torch.randn(B, T, generator=g)               # the stale behaviour policy
    lengths = torch.tensor([6, 3, 5, 2])
    mask = torch.arange(T)[None] < lengths[:, None]
    loss_mask = mask & torch.tensor([True, True, False, True])[:, None]
    versions = torch.tensor([[3, 3, 3, 4, 4, 4], [2, 2, 2, 0, 0, 0], [5, 5, 4, 4, 4, 0], [1, 3, 0, 0, 0, 0]])
    return PolicyLossInputs(logps=logps, old_logps=old, advantages=torch.tensor([1.0, -0.5, 0.7, -2.0]),
                            loss_mask=loss_mask, completion_mask=mask, sampler_logps=sampler, step_tokens=11.0,
                            sampler_versions=versions, policy_version=5, proximal_version=3)


def _token_mean(inputs, terms):
    cells = [(b, t) for b in range(inputs.logps.shape[0]) for t in range(inputs.logps.shape[1]) if inputs.loss_mask[b, t]]
    return sum(terms[b][t] for b, t in cells) / inputs.step_tokens


def _run(name, settings, inputs, *, objective=None):
    loss = OFF_POLICY_LOSSES[name]
    objective = objective or PolicyObjectiveSettings(importance_sampling_cap=2.0)
    out = policy_objective(inputs, lambda i: loss(i, settings), aggregation=loss.aggregation, settings=objective,
                           corrects_behaviour=loss.corrects_behaviour)
    (grad,) = torch.autograd.grad(out.loss, inputs.logps)
    return out, grad


@pytest.mark.parametrize("proximal", ["exact", "loglinear"])
def test_decoupled_ppo_equals_a_naive_reference(proximal):
    """pi_old from step 3's weights (the rollout's step), the current weights at step 5 (num_iterations > 1)."""
    settings = DecoupledPPOSettings(epsilon=0.2, epsilon_high=0.28, behaviour_cap=1.5, proximal=proximal)
    inputs = _batch()
    out, grad = _run("decoupled_ppo", settings, inputs)
    assert out.importance_weights is None  # the objective's own weight replaces the generic sampler correction

    ref = _batch()
    B, T = ref.logps.shape
    terms = [[None] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            beh = float(ref.sampler_logps[b, t])
            if proximal == "exact":
                prox = float(ref.old_logps[b, t])
            else:  # AReaL: alpha = (v_prox - v_behave) / (v_theta - v_behave), proximal = step 3, theta = step 5
                v = int(ref.sampler_versions[b, t])
                alpha = min(max((3 - v) / (5 - v), 0.0), 1.0) if v < 5 else 1.0  # sampled by the current weights
                prox = beh + alpha * (float(ref.logps[b, t].detach()) - beh)
            r = torch.exp(ref.logps[b, t] - prox)
            a = ref.advantages[b]
            w = min(math.exp(prox - beh), 1.5)
            terms[b][t] = -torch.min(r * a, r.clamp(0.8, 1.28) * a) * w
    want = _token_mean(ref, terms)
    (want_grad,) = torch.autograd.grad(want, ref.logps)
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert out.info["clipped_low"].any() or out.info["clipped_high"].any()  # the clip really binds here


def test_loglinear_equals_exact_with_one_pass_per_round():
    """Async GRPO: pi_old is the current weights (old_logps = logps, proximal version = policy version), so the
    approximation must give the exact proximal policy whatever each token's version."""
    inputs = _batch()
    inputs.old_logps = inputs.logps.detach().clone()
    inputs.proximal_version = inputs.policy_version
    inputs.sampler_versions = torch.full_like(inputs.sampler_versions, inputs.policy_version)  # staleness 0 too
    inputs.sampler_versions[0, :3] = 2
    exact, g_exact = _run("decoupled_ppo", DecoupledPPOSettings(proximal="exact"), inputs)
    approx, g_approx = _run("decoupled_ppo", DecoupledPPOSettings(proximal="loglinear"), inputs)
    torch.testing.assert_close(approx.loss, exact.loss)
    torch.testing.assert_close(g_approx, g_exact)


def test_loglinear_proximal_is_exact_for_tokens_the_proximal_or_current_weights_sampled():
    beh, cur = torch.tensor([[-1.0, -2.0, -3.0, -0.7]]), torch.tensor([[-1.5, -1.0, -2.0, -0.9]])
    prox = loglinear_proximal_logps(beh, cur, torch.tensor([[4, 3, 0, 5]]), proximal_version=4, current_version=5)
    torch.testing.assert_close(prox, torch.tensor([[-1.0, -2.0 + 0.5 * 1.0, -3.0 + 0.8 * 1.0, -0.9]]))


def _naive_m2_keep(log_ratio, mask, tau):
    """Drop the largest squared log-ratio, one at a time, until the mean over the rest is <= tau."""
    cells = [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    kept = sorted(cells, key=lambda c: (float(log_ratio[c]) ** 2, cells.index(c)))
    while kept and sum(float(log_ratio[c]) ** 2 for c in kept) / len(kept) > tau:
        kept.pop()
    out = torch.zeros_like(mask)
    for c in kept:
        out[c] = True
    return out


@pytest.mark.parametrize("tau", [0.01, 0.04, 0.2, 10.0])
def test_second_moment_mask_equals_dropping_outliers_one_by_one(tau):
    g = torch.Generator().manual_seed(1)
    lr = torch.randn(5, 7, generator=g) * 0.3
    mask = torch.rand(5, 7, generator=g) > 0.3
    keep = second_moment_mask(lr, mask, tau)
    assert torch.equal(keep, _naive_m2_keep(lr, mask, tau))
    assert not (keep & ~mask).any()
    if keep.any():
        assert float((lr[keep] ** 2).mean()) <= tau + 1e-12


def test_m2po_equals_a_naive_reference():
    settings = M2POSettings(threshold=0.05)
    inputs = _batch(drift=0.3)
    out, grad = _run("m2po", settings, inputs)
    ref = _batch(drift=0.3)
    log_ratio = (ref.logps - ref.sampler_logps).detach()
    keep = _naive_m2_keep(log_ratio, ref.loss_mask & ref.completion_mask, 0.05)
    assert 0 < int(keep.sum()) < int(ref.loss_mask.sum())  # some tokens dropped, some kept: the bound binds
    B, T = ref.logps.shape
    terms = [[(-torch.exp(ref.logps[b, t] - ref.sampler_logps[b, t]) * ref.advantages[b]) * float(keep[b, t])
              for t in range(T)] for b in range(B)]
    want = _token_mean(ref, terms)
    (want_grad,) = torch.autograd.grad(want, ref.logps)
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert torch.equal(out.info["m2_masked"], ref.completion_mask & ~keep)


def test_seq_mis_equals_a_naive_reference():
    settings = SeqMISSettings(epsilon=0.2, cap=1.0)
    inputs = _batch(drift=0.3)
    out, grad = _run("seq_mis", settings, inputs)
    ref = _batch(drift=0.3)
    B, T = ref.logps.shape
    terms, dropped = [[None] * T for _ in range(B)], 0
    for b in range(B):
        ts = [t for t in range(T) if ref.completion_mask[b, t]]
        rho = math.exp(sum(float(ref.old_logps[b, t] - ref.sampler_logps[b, t]) for t in ts))
        w = rho if rho <= 1.0 else 0.0
        dropped += w == 0.0
        for t in range(T):
            r = torch.exp(ref.logps[b, t] - ref.old_logps[b, t])
            a = ref.advantages[b]
            terms[b][t] = -torch.min(r * a, r.clamp(0.8, 1.2) * a) * w
    assert 0 < dropped < B  # the cap really drops a completion and keeps others
    want = _token_mean(ref, terms)
    (want_grad,) = torch.autograd.grad(want, ref.logps)
    torch.testing.assert_close(out.loss, want)
    torch.testing.assert_close(grad, want_grad)


def test_off_policy_objectives_are_registered_and_check_their_settings():
    names = set(registry().names("policy_loss"))
    assert {"decoupled_ppo", "m2po", "seq_mis"} <= names
    with pytest.raises(SettingsError, match="threshold"):
        M2POSettings(threshold=0)
    with pytest.raises(SettingsError, match="proximal"):
        DecoupledPPOSettings(proximal="recompute")
    with pytest.raises(SettingsError, match="cap"):
        SeqMISSettings(cap=-1)


def test_loglinear_without_versions_says_what_is_missing():
    inputs = _batch()
    inputs.sampler_versions = None
    with pytest.raises(ValueError, match="sampler_versions"):
        _run("decoupled_ppo", DecoupledPPOSettings(proximal="loglinear"), inputs)


@pytest.mark.parametrize("loss_type,kwargs,metric", [
    ("decoupled_ppo", {"behaviour_cap": 3.0}, "loss/behaviour_weight_mean"),
    ("m2po", {"threshold": 0.04}, "loss/m2_masked_frac"),
    ("seq_mis", {"cap": 2.0}, "loss/seq_masked_frac")])
def test_grpo_trains_with_each_off_policy_objective_by_name(tmp_path, loss_type, kwargs, metric):
    from test_grpo import logged, make

    t = make(tmp_path, loss_type=loss_type, loss_kwargs=kwargs)
    before = {k: v.clone() for k, v in t.model.named_parameters()}
    t.train()
    assert all(math.isfinite(x) for x in logged(t, "loss"))
    assert any(not torch.equal(v, before[k]) for k, v in t.model.named_parameters())
    assert logged(t, metric)  # the objective's own diagnostic is logged
    assert not logged(t, "importance_ratio/mean")  # and no generic sampler correction on top of it
