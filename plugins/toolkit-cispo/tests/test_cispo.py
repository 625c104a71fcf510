"""toolkit-cispo: the loss's gradients, its config checks, parity with TRL, and a GRPO run through the entry point."""

import pytest
import torch
from toolkit_cispo import CISPO, CISPOSettings

import toolkit
from toolkit import ConfigError, GRPOConfig, GRPOTrainer
from toolkit.core.numerics import clipped_surrogate
from toolkit.testing import fixed_rollout, tiny_model, tiny_tokenizer, trl_grpo_inputs


def test_registered_through_the_installed_entry_point():
    entry = toolkit.registry().tables()["policy_loss"]["cispo"]
    assert entry.obj is CISPO                            # a hooks-1.1 PolicyLoss: no deprecation shim
    assert entry.plugin == "cispo"                       # the entry-point name
    assert entry.package == "toolkit-cispo 0.2.0"        # found through the package's metadata


def cispo_loss(logps, old, adv, *, settings=CISPOSettings()):
    """The loss on typed inputs, as the trainer calls it."""
    return CISPO(toolkit.PolicyLossInputs(logps, old, adv, loss_mask=torch.ones_like(logps, dtype=torch.bool)),
                 settings)


def _grads(loss_fn, logps0, old, adv, **kw):
    logps = logps0.clone().requires_grad_(True)
    loss, info = loss_fn(logps, old, adv, **kw)
    loss.sum().backward()
    return logps.grad, info


def test_keeps_the_gradient_where_ppo_clips():
    logps = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]])
    # token ratios pi/pi_old: row 0 = [e^0.5, 1, e^2.5] (A>0), row 1 = [e^-0.5, 1, e^1] (A<0)
    old = logps - torch.tensor([[0.5, 0.0, 2.5], [-0.5, 0.0, 1.0]])
    adv = torch.tensor([1.0, -2.0])
    ratio = torch.exp(logps - old)

    g_cispo, info = _grads(cispo_loss, logps, old, adv)
    g_ppo, _ = _grads(lambda lp, o, a: clipped_surrogate(lp, o, a, epsilon_low=0.2, epsilon_high=0.2), logps, old,
                      adv)
    # CISPO: d/dlogp of -w A logp with w = sg(min(ratio, 5)) is -w A, on every token.
    expected = -ratio.clamp(max=5.0) * adv[:, None]
    torch.testing.assert_close(g_cispo, expected)
    # PPO's clip zeroes exactly the tokens whose ratio left [0.8, 1.2] on the side the advantage pushes ...
    assert g_ppo[0, 0] == 0 and g_ppo[0, 2] == 0 and g_ppo[1, 0] == 0
    assert (g_cispo[0, [0, 2]] != 0).all() and g_cispo[1, 0] != 0
    # ... and both agree on-policy (ratio 1), where the clip is inactive.
    torch.testing.assert_close(g_cispo[:, 1], g_ppo[:, 1])
    assert info["clipped_high"].tolist() == [[False, False, True], [False, False, False]]


def test_epsilon_settings_and_bad_kwargs_fail_before_any_model():
    cfg = GRPOConfig(output_dir="/tmp/unused", loss_type="cispo", num_generations=2, per_device_train_batch_size=2,
                     loss_kwargs={"epsilon_max": 2.0, "epsilon_min": 0.5})
    from toolkit.core.objectives import resolve_policy_loss_settings

    settings = resolve_policy_loss_settings(CISPO, cfg, name="cispo")
    assert settings == CISPOSettings(epsilon_max=2.0, epsilon_min=0.5)
    logps = torch.tensor([[0.0, 0.0]])
    old = torch.tensor([[-3.0, 3.0]])  # ratios e^3 and e^-3
    g, _ = _grads(cispo_loss, logps, old, torch.tensor([1.0]), settings=settings)
    torch.testing.assert_close(g, torch.tensor([[-2.0, -0.5]]))
    with pytest.raises(ConfigError, match=r"loss_kwargs: loss_type 'cispo' does not know 'eps_max'"):
        GRPOConfig(output_dir="/tmp/unused", loss_type="cispo", num_generations=2, per_device_train_batch_size=2,
                   loss_kwargs={"eps_max": 3.0})
    with pytest.raises(ConfigError, match="epsilon_min"):
        GRPOConfig(output_dir="/tmp/unused", loss_type="cispo", num_generations=2, per_device_train_batch_size=2,
                   loss_kwargs={"epsilon_min": 9.0})


def _reward(prompts, completions, completion_ids, **kw):
    return [float(sum(ids) % 3) for ids in completion_ids]


def test_grpo_trains_with_cispo_end_to_end(tmp_path):
    model = tiny_model()
    before = {k: v.clone() for k, v in model.named_parameters()}
    cfg = GRPOConfig(output_dir=str(tmp_path), loss_type="cispo", num_generations=4, per_device_train_batch_size=8,
                     max_completion_length=8, max_steps=2, learning_rate=1e-2, save_strategy="no", num_iterations=2,
                     loss_kwargs={"epsilon_max": 1.05})
    trainer = GRPOTrainer(model, _reward, cfg, train_dataset=[{"prompt": f"Count {i}"} for i in range(8)],
                          processing_class=tiny_tokenizer())
    assert trainer.policy_loss is CISPO and trainer.loss_aggregation == "token"
    assert trainer.loss_settings == CISPOSettings(epsilon_max=1.05)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert "clip_ratio/high_mean" in logs[0]
    # The second step of a rollout is off-policy, so with epsilon_max 1.05 some weights clip.
    assert logs[1]["clip_ratio/high_mean"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())


def test_loss_equals_trl_cispo(tmp_path):
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    tok = tiny_tokenizer()
    B, C = 4, 6
    g = torch.Generator().manual_seed(0)
    prompts = [tok(t).input_ids for t in ("What is 1 + 2?", "The quick brown") for _ in range(2)]
    lengths = [6, 4, 5, 3]
    completions = [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2])
    # old log-probs far below the tiny model's (~ -6) on some tokens, so ratios exceed epsilon_max there
    old = [torch.where(torch.rand(n, generator=g) < 0.5, torch.full((n,), -8.0), torch.full((n,), -5.5))
           for n in lengths]

    tiny_model().save_pretrained(tmp_path / "tiny")
    theirs = trl.GRPOTrainer(
        model=str(tmp_path / "tiny"), reward_funcs=_reward, processing_class=tok,
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=2, use_cpu=True, bf16=False,
                            per_device_train_batch_size=B, max_completion_length=C, temperature=0.7, beta=0.0,
                            loss_type="cispo", epsilon_high=5.0, report_to="none",
                            model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"}),
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * 8))
    theirs.model.train()
    if not hasattr(theirs, "current_gradient_accumulation_steps"):
        theirs.current_gradient_accumulation_steps = 1
    inputs = trl_grpo_inputs(prompts, completions, advantages, old, tok.pad_token_id, C)
    trl_loss = theirs._compute_loss(theirs.model, inputs)

    ours = GRPOTrainer(tiny_model(), _reward,
                       GRPOConfig(output_dir=str(tmp_path / "ours"), num_generations=2, per_device_train_batch_size=B,
                                  max_completion_length=C, temperature=0.7, loss_type="cispo",
                                  loss_kwargs={"epsilon_max": 5.0}, importance_sampling_cap=None,
                                  zero_variance_filter=False),
                       train_dataset=[{"prompt": "hi"}] * 8, processing_class=tok)
    ours.model.train()
    ours.current_gradient_accumulation_steps = 1
    rollout = fixed_rollout(prompts, completions, advantages, old, 2)
    our_loss = ours.compute_loss(ours.model, ours._split(rollout)[0])
    assert our_loss.item() == pytest.approx(trl_loss.item(), abs=1e-5, rel=1e-5)
    trl_loss.backward()
    our_loss.backward()
    for (k, p), (_, q) in zip(theirs.model.named_parameters(), ours.model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=k)
