"""PPOTrainer on tiny models: policy and critic learn, reward model and reward-function paths, critic variants,
PEFT reference, exact resume, early stop, EOS penalty, adaptive KL, and config errors before any model loads."""

import math
import warnings

import pytest
import torch
from builders import StopAt
from transformers import LlamaForSequenceClassification

from toolkit import ConfigError, DataError, TrainingHealthError
from toolkit.core.checkpoint import COMPLETE_MARKER
from toolkit.core.ppo import AdaptiveKLController, PPOConfig, PPOTrainer
from toolkit.testing import tiny_model, tiny_tokenizer


def prompts(n=16):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(n)]


def low_ids(prompts, completions, completion_ids, **kw):
    """Dense and varied even for a random model: prefers low token ids."""
    return [-sum(ids) / (len(ids) * 384.0) for ids in completion_ids]


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_mini_batches=2,
                num_ppo_epochs=2, max_completion_length=6, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                seed=0, disable_tqdm=True, report_to="none")
    base.update(kw)
    return PPOConfig(**base)


def make(tmp_path, rewards=(low_ids,), model=None, **kw):
    extra = {k: kw.pop(k) for k in ("reward_model", "value_model", "peft_config", "callbacks", "ref_model")
             if k in kw}
    return PPOTrainer(model if model is not None else tiny_model(), list(rewards), cfg(tmp_path, **kw),
                      train_dataset=prompts(), processing_class=tiny_tokenizer(), **extra)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


def classifier(seed):
    torch.manual_seed(seed)
    config = tiny_model().config
    config.num_labels, config.pad_token_id = 1, tiny_tokenizer().pad_token_id
    return LlamaForSequenceClassification(config)


def snapshot(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def changed(before, module):
    return any(not torch.equal(before[k], v) for k, v in module.state_dict().items())


def test_a_few_updates_change_policy_and_critic_and_log_what_a_person_needs(tmp_path):
    t = make(tmp_path)
    p0, c0, r0 = snapshot(t.model), snapshot(t.critic), snapshot(t.ref_model)
    t.train()
    assert changed(p0, t.model) and changed(c0, t.critic) and not changed(r0, t.ref_model)
    assert len(logged(t, "loss")) == 2 and all(math.isfinite(x) for x in logged(t, "loss"))
    for key in ("objective/scores", "objective/kl", "objective/rlhf_reward", "objective/reward_per_token",
                "objective/kl_per_token", "val/mean", "val/returns_mean", "val/explained_variance",
                "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/clipfrac_avg",
                "policy/entropy_avg", "completions/mean_length", "kl_coef", "sampler/logp_abs_diff_mean",
                "time/generation_s", "rewards/low_ids/mean", "ppo_epochs_done"):
        assert logged(t, key), key
    assert logged(t, "ppo_epochs_done") == [2.0, 2.0]
    # the rollout used the transformers sampler at temperature 1, so pi_old equals the sampler's log-probs
    assert max(logged(t, "sampler/logp_abs_diff_max")) < 1e-4


@pytest.mark.parametrize("critic", ["head", "separate"])
def test_the_update_logs_entropy_from_its_own_forward_not_a_second_pass(tmp_path, monkeypatch, critic):
    import toolkit.core.packing as packing_module  # completion_entropy's separate pass

    separate_passes = []
    real = packing_module.chunked_entropy
    monkeypatch.setattr(packing_module, "chunked_entropy", lambda *a, **k: separate_passes.append(1) or real(*a, **k))
    t = make(tmp_path / "fused", critic=critic)
    t.train()
    entropy = logged(t, "policy/entropy_avg")
    assert len(entropy) == 2 and all(math.isfinite(e) and e > 0 for e in entropy)
    assert separate_passes == []  # the fused chunked_token_logps_and_entropy gave it

    # the positive control: an override that returns log-probs only leaves the entropy to completion_entropy's
    # separate pass, with the same numbers
    from toolkit.core.packing import completion_logps

    class LogpsOnly(PPOTrainer):
        def compute_token_logps(self, model, batch, hidden=None):
            return completion_logps(model, batch, temperature=self.args.temperature, hidden=hidden)

    o = LogpsOnly(tiny_model(), [low_ids], cfg(tmp_path / "override", critic=critic), train_dataset=prompts(),
                  processing_class=tiny_tokenizer())
    o.train()
    assert len(separate_passes) > 0
    assert logged(o, "policy/entropy_avg") == pytest.approx(entropy, rel=1e-5)


def test_the_critic_learns_the_returns(tmp_path):
    """A constant reward is easy to predict: explained variance must rise as the value loss falls."""
    t = make(tmp_path, rewards=(lambda prompts, completions, completion_ids, **kw: [1.0] * len(completions),),
             max_steps=6, learning_rate=3e-3, beta=0.0, whiten_advantages=False)
    t.train()
    losses = logged(t, "loss/value_avg")
    assert losses[-1] < 0.2 * losses[0]


def test_reward_model_path_and_given_value_model(tmp_path):
    rm, vm = classifier(1), classifier(2)
    rm0, vm0 = snapshot(rm), snapshot(vm)
    t = make(tmp_path, rewards=(), reward_model=rm, value_model=vm)
    t.train()
    assert logged(t, "rewards/reward_model/mean")
    assert not changed(rm0, rm)          # frozen
    assert changed(vm0, vm)              # the given value model is the critic and trains
    # the reward model's score lands on the last token: scores equal the reward model on prompt+completion
    r = t.generate_rollout(list(range(8)), 0)
    seq = r.prompt_ids[0] + r.completion_ids[0]
    with torch.no_grad():
        direct = rm(input_ids=torch.tensor([seq])).logits[0, 0].item()
    assert r.scores[0].item() == pytest.approx(direct, abs=1e-4)


def test_both_reward_sources_add_up(tmp_path):
    rm = classifier(3)
    t = make(tmp_path, reward_model=rm, reward_weights=[2.0], reward_model_weight=0.5)
    rows = [t.rows[i] for i in range(4)]
    prompt_ids = [t.prompt_ids[i] for i in range(4)]
    completions = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]]
    total = t.compute_rewards(rows, prompt_ids, completions)
    with torch.no_grad():
        rm_scores = torch.tensor([rm(input_ids=torch.tensor([p + c])).logits[0, 0].item()
                                  for p, c in zip(prompt_ids, completions)])
    expected = 2.0 * torch.tensor(low_ids(None, None, completions)) + 0.5 * rm_scores
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("critic", ["head", "separate"])
def test_critic_variants_train(tmp_path, critic):
    t = make(tmp_path, critic=critic)
    c0 = snapshot(t.critic)
    t.train()
    assert changed(c0, t.critic)
    assert (t.critic.backbone is None) == (critic == "head")


def test_the_default_critic_is_a_shared_head_and_a_given_value_model_is_a_separate_critic(tmp_path):
    config = cfg(tmp_path)
    t = PPOTrainer(tiny_model(), [low_ids], config, train_dataset=prompts(), processing_class=tiny_tokenizer())
    assert t.critic_kind == "head" and t.critic.backbone is None
    vm = LlamaForSequenceClassification(tiny_model().config.__class__(**{**tiny_model().config.to_dict(), "num_labels": 1}))
    t = PPOTrainer(tiny_model(), [low_ids], config, train_dataset=prompts(), processing_class=tiny_tokenizer(),
                   value_model=vm)  # the same config object: the first trainer did not write its choice into it
    assert t.critic_kind == "separate" and t.critic.backbone is not None and config.critic is None


def test_peft_uses_the_adapter_free_base_as_reference_and_critic_backbone(tmp_path):
    from peft import LoraConfig

    t = make(tmp_path, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                              task_type="CAUSAL_LM"), critic="base", learning_rate=1e-2)
    assert t.ref_model is None
    base0 = {k: v.clone() for k, v in t.model.named_parameters() if "lora" not in k}
    head0 = snapshot(t.critic)
    t.train()
    assert changed(head0, t.critic)
    assert all(torch.equal(v, base0[k]) for k, v in t.model.named_parameters() if "lora" not in k)
    kls = logged(t, "objective/kl")
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and abs(kls[1]) > 0  # adapters start as identity, then move


@pytest.mark.parametrize("critic", ["head", "separate"])
def test_exact_resume_equals_uninterrupted(tmp_path, critic):
    full = make(tmp_path / "a", max_steps=3, critic=critic)
    full.train()
    first = make(tmp_path / "b", max_steps=3, save_strategy="steps", save_steps=1, callbacks=[StopAt(2)], critic=critic)
    first.train()
    assert (tmp_path / "b" / "out" / "checkpoint-2" / COMPLETE_MARKER).exists()
    other = "head" if critic == "separate" else "separate"
    refused = make(tmp_path / "b", max_steps=3, critic=other)
    before = {k: v.clone() for k, v in refused.model.state_dict().items()}
    with pytest.raises(ConfigError, match=f"trained with critic='{critic}', but this trainer's critic is '{other}'"):
        refused.train(resume_from_checkpoint=True)
    for k, v in refused.model.state_dict().items():  # refused before anything was loaded
        assert torch.equal(v, before[k]), k
    resumed = make(tmp_path / "b", max_steps=3, save_strategy="steps", save_steps=1, critic=critic)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    for a, b in ((full.model, resumed.model), (full.critic, resumed.critic)):
        for (k, v), (_, w) in zip(a.state_dict().items(), b.state_dict().items()):
            torch.testing.assert_close(w, v, rtol=0, atol=0, msg=k)
    assert logged(resumed, "loss") == pytest.approx(logged(full, "loss"), abs=0)


def test_a_toolkit_0_1_checkpoint_is_refused_before_anything_loads(tmp_path):
    make(tmp_path / "a", max_steps=1, save_strategy="steps", save_steps=1).train()
    folder = tmp_path / "a" / "out" / "checkpoint-1"
    (folder / "ppo_state.json").unlink()  # 0.1 pickled its loop state and critic (critic.pt)
    (folder / "critic.safetensors").rename(folder / "critic.pt")
    fresh = make(tmp_path / "a", max_steps=2)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(ConfigError, match="written by toolkit 0.1"):
        fresh.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(v, before[k]) for k, v in fresh.model.state_dict().items())


@pytest.mark.parametrize("critic", ["head", "separate"])
def test_gradient_accumulation_takes_the_step_of_one_micro_batch(tmp_path, critic):
    """The loss divides token sums by the mini-batch's token count, so micro-batches of 4 x accumulation 2 are
    the same optimisation as one micro-batch of 8 (completions of unequal length: a mean of the micro-batches'
    means would differ). Several processes rely on the same count (tests/integration/test_multiprocess.py)."""
    sgd = dict(optim="sgd", learning_rate=0.1, max_grad_norm=0.0, num_mini_batches=1, max_steps=2,
               stop_token_ids=list(range(0, 384, 4)), critic=critic)
    one = make(tmp_path / "one", per_device_train_batch_size=8, **sgd)
    one.train()
    two = make(tmp_path / "two", per_device_train_batch_size=4, gradient_accumulation_steps=2, **sgd)
    two.train()
    assert logged(two, "loss") == pytest.approx(logged(one, "loss"), rel=1e-5, abs=2e-6)  # logged rounded to 6 decimals
    for a, b in ((one.model, two.model), (one.critic, two.critic)):
        for (k, v), (_, w) in zip(a.state_dict().items(), b.state_dict().items()):
            torch.testing.assert_close(w, v, rtol=1e-5, atol=1e-6, msg=k)


def test_own_checkpoints_honour_save_total_limit_and_hold_no_pickle(tmp_path):
    import json
    import pickle

    t = make(tmp_path, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=1)
    t.train()
    out = tmp_path / "out"
    assert sorted(c.name for c in out.glob("checkpoint-*")) == ["checkpoint-3"]
    folder = out / "checkpoint-3"
    assert (folder / COMPLETE_MARKER).exists() and (folder / "critic.safetensors").exists()
    assert json.loads((folder / "ppo_state.json").read_text())["global_step"] == 3
    torch.load(folder / "ppo_state.pt", weights_only=True)  # tensors and plain types only

    # A crafted state file that would run code when unpickled is refused, never executed.
    class Boom:
        def __reduce__(self):
            return (exec, ("open(%r, 'w').write('pwned')" % str(tmp_path / "pwned"),))

    (folder / "ppo_state.pt").write_bytes(pickle.dumps({"optimizer": Boom()}))
    resumed = make(tmp_path, max_steps=4, save_strategy="no")
    with pytest.raises(pickle.UnpicklingError):
        resumed.train(resume_from_checkpoint=str(folder))
    assert not (tmp_path / "pwned").exists()


def test_early_stop_on_approximate_kl(tmp_path):
    t = make(tmp_path, early_stop_approx_kl=1e-9, num_ppo_epochs=4, learning_rate=1e-2)
    t.train()
    assert logged(t, "early_stopped") == [1.0, 1.0]
    assert logged(t, "ppo_epochs_done") == [1.0, 1.0]


def test_missing_eos_penalty(tmp_path):
    t = make(tmp_path, missing_eos_penalty=1.5, max_steps=1)
    t.train()
    (h,) = [h for h in t.state.log_history if "objective/scores" in h]
    expected = h["rewards/low_ids/mean"] - 1.5 * h["completions/clipped_ratio"]
    assert h["objective/scores"] == pytest.approx(expected, abs=1e-6)
    assert h["completions/clipped_ratio"] > 0


def test_adaptive_kl_controller_moves_toward_the_target():
    c = AdaptiveKLController(0.1, target=1.0, horizon=100)
    c.update(3.0, n_steps=10)      # KL too high: coefficient up by the capped 20% x 10/100
    assert c.value == pytest.approx(0.1 * 1.02)
    c.update(0.5, n_steps=10)      # too low: down by 50% x 10/100... capped at 20%
    assert c.value == pytest.approx(0.1 * 1.02 * 0.98)
    fixed = AdaptiveKLController(0.1, target=None, horizon=100)
    fixed.update(3.0, n_steps=10)
    assert fixed.value == 0.1


def test_a_reward_function_that_fails_stops_with_its_name(tmp_path):
    def broken(prompts, completions, completion_ids, **kw):
        raise RuntimeError("judge offline")

    t = make(tmp_path, rewards=(broken,))
    with pytest.raises(TrainingHealthError, match="reward function 'broken' gave no finite reward"):
        t.train()


def test_config_errors_name_the_field_before_any_model_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"rollout_batch_size: 10 completions cannot be split into num_mini_batches=2"):
        cfg(tmp_path, rollout_batch_size=10)
    with pytest.raises(ConfigError, match="use rollout_batch_size=8, or num_mini_batches=3"):
        cfg(tmp_path, rollout_batch_size=12)
    with pytest.raises(ConfigError, match="kl_estimator: 'k2'"):
        cfg(tmp_path, kl_estimator="k2")
    with pytest.raises(ConfigError, match="critic: 'shared'"):
        cfg(tmp_path, critic="shared")
    with pytest.raises(ConfigError, match="num_ppo_epochs: must be >= 1"):
        cfg(tmp_path, num_ppo_epochs=0)
    # a model name that cannot load proves these fail before loading it
    with pytest.raises(ConfigError, match="PPO needs a reward source"):
        PPOTrainer("no-such/model", [], cfg(tmp_path), train_dataset=prompts(), processing_class=tiny_tokenizer())
    with pytest.raises(ConfigError, match="critic: 'base' .* needs peft_config"):
        PPOTrainer("no-such/model", [low_ids], cfg(tmp_path, critic="base"), train_dataset=prompts(),
                   processing_class=tiny_tokenizer())
    with pytest.raises(ConfigError, match="value_model: given, but critic='head'"):
        PPOTrainer("no-such/model", [low_ids], cfg(tmp_path, critic="head"), train_dataset=prompts(),
                   processing_class=tiny_tokenizer(), value_model="x")
    with pytest.raises(DataError, match="PPO needs a 'prompt' column"):
        PPOTrainer("no-such/model", [low_ids], cfg(tmp_path), train_dataset=[{"text": "hi"}] * 8,
                   processing_class=tiny_tokenizer())
    with pytest.raises(ConfigError, match="fsdp: PPOTrainer does not shard its models"):
        PPOTrainer("no-such/model", [low_ids], cfg(tmp_path, fsdp=True), train_dataset=prompts(),
                   processing_class=tiny_tokenizer())
    with pytest.raises(ConfigError, match="train_dataset: 4 prompts, fewer than one update needs"):
        PPOTrainer("no-such/model", [low_ids], cfg(tmp_path), train_dataset=prompts(4),
                   processing_class=tiny_tokenizer())


def test_checkpointing_asked_for_by_its_old_name_reaches_policy_and_critic(tmp_path):
    # PPOConfig(gradient_checkpointing=True) used to come out off, and the settings given were never used.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' note on the old name
        t = make(tmp_path, max_steps=1, value_model=classifier(1), gradient_checkpointing=True,
                 gradient_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False})
    t.train()
    for m in (t.model, t.critic.backbone):
        assert m.is_gradient_checkpointing
        layer = next(x for x in m.modules() if getattr(x, "gradient_checkpointing", False))
        assert layer._gradient_checkpointing_func.keywords == {"use_reentrant": False, "preserve_rng_state": False}


def test_checkpointing_settings_ppo_cannot_honour_are_refused_before_the_first_update(tmp_path):
    # transformers' Trainer reads every_n_layers itself; handed on to torch.utils.checkpoint it would raise mid-step.
    t = make(tmp_path, max_steps=1, activation_checkpointing=True,
             activation_checkpointing_kwargs={"use_reentrant": False, "every_n_layers": 2})
    with pytest.raises(ConfigError, match="activation_checkpointing_kwargs: 'every_n_layers' is not supported"):
        t.train()
    assert t.state.global_step == 0


def test_reference_critic_reward_model_and_batches_go_to_the_training_device(tmp_path, monkeypatch):
    # Trainer places only the policy. On a GPU, PPO's reference, critic, reward model and the batches it packs for
    # its own forwards must follow, or the first rollout mixes devices. No GPU here: the training device is made
    # the meta device (every tensor moved there loses its data, so nothing runs; where each one lands is the test).
    from transformers import TrainingArguments

    monkeypatch.setattr(TrainingArguments, "device", property(lambda self: (self._setup_devices, torch.device("meta"))[1]))
    for critic, extra in (("head", {}), ("separate", {"value_model": classifier(1)})):
        t = make(tmp_path / critic, critic=critic, reward_model=classifier(2), **extra)
        modules = {"policy": t.model, "reference": t.ref_model, "critic": t.critic, "reward model": t.reward_model}
        for name, module in modules.items():
            devices = {p.device.type for p in module.parameters()}
            assert devices == {"meta"}, f"critic={critic}: the {name} is on {devices}"
        batch = t._pack([[5, 6, 7], [5, 6]], [[8, 9], [10]])
        placed = {k: v.device.type for k, v in batch.items() if torch.is_tensor(v)}
        assert placed and set(placed.values()) == {"meta"}, placed


@pytest.mark.parametrize("bf16", [False, True])
def test_bf16_runs_every_forward_of_rollout_and_update_under_autocast(tmp_path, bf16):
    # PPO owns its loop, outside the accelerate wrap that gives other trainers their autocast: bf16=True used to
    # train in float32, silently.
    seen = []
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a GPU machine checks CUDA's autocast

    class Spy(PPOTrainer):
        def compute_token_logps(self, model, batch, hidden=None):
            seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled(device)))
            return super().compute_token_logps(model, batch, hidden=hidden)

    # one epoch of one mini-batch: the update's only step is taken at the rollout's weights, so the ratio is 1 up
    # to the rounding of packing 8 rows at once against micro-batches of 4 (same autocast on both sides)
    t = Spy(tiny_model(), [low_ids], cfg(tmp_path, max_steps=1, bf16=bf16, use_cpu=device == "cpu", num_ppo_epochs=1,
                                         num_mini_batches=1, gradient_accumulation_steps=2),
            train_dataset=prompts(), processing_class=tiny_tokenizer())
    t.train()
    assert {grad for grad, _ in seen} == {False, True}  # rollout scoring and the update's forwards
    assert {autocast for _, autocast in seen} == {bf16}
    assert math.isfinite(logged(t, "loss")[-1])
    assert logged(t, "policy/approxkl_avg")[0] < (1e-4 if bf16 else 1e-10), logged(t, "policy/approxkl_avg")


def test_fp16_is_refused_before_any_model_loads(tmp_path):
    # fp16 needs a loss scaler between backward and the step; PPO's own loop has none (gradients would underflow)
    args = cfg(tmp_path)
    args.fp16 = True  # transformers refuses fp16=True on a machine without a GPU; set as a GPU machine would
    with pytest.raises(ConfigError, match="fp16: PPOTrainer does not support fp16"):
        PPOTrainer(tiny_model(), [low_ids], args, train_dataset=prompts(), processing_class=tiny_tokenizer())


# ------------------------------------------------------------------------------------------------ the loss registry


def test_the_default_loss_is_the_registered_ppo_clip_and_equals_it_by_hand(tmp_path):
    """loss_type 'ppo' (the registry's clipped surrogate, token mean) is what PPO trains with: its per-token value
    equals the clipped surrogate written out, for per-token advantages."""
    from toolkit.core.objectives import PolicyLossInputs

    t = make(tmp_path)
    assert t.args.loss_type == "ppo" and t.policy_loss.aggregation == "token"
    g = torch.Generator().manual_seed(0)
    logps, old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    adv, mask = torch.randn(3, 5, generator=g), torch.ones(3, 5, dtype=torch.bool)
    per_token, _ = t.compute_policy_loss(PolicyLossInputs(logps, old, adv, loss_mask=mask))
    ratio = torch.exp(logps - old)
    expected = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    torch.testing.assert_close(per_token, expected)


def test_a_registered_token_loss_trains_ppo_and_others_are_refused(tmp_path):
    t = make(tmp_path, loss_type="m2po", loss_kwargs={"threshold": 0.5})  # the registry's, not PPO's own
    before = snapshot(t.model)
    t.train()
    assert changed(before, t.model) and all(math.isfinite(x) for x in logged(t, "loss"))
    with pytest.raises(ConfigError, match=r"loss_type: 'grpo' averages by 'sequence', and PPO takes a token mean"):
        cfg(tmp_path, loss_type="grpo")
    with pytest.raises(ConfigError, match="loss_kwargs"):
        cfg(tmp_path, loss_type="m2po", loss_kwargs={"threshold": -1.0})
    # PPO keeps no sampler versions: the interpolated proximal policy would silently equal the exact one
    with pytest.raises(ConfigError, match="loss_kwargs.proximal: 'loglinear'.*use proximal='exact'"):
        cfg(tmp_path, loss_type="decoupled_ppo", loss_kwargs={"proximal": "loglinear"})


class _LegacySeamPPO(PPOTrainer):
    """A wrapper written against PPO's toolkit 0.1 seam (logps, old_logps, advantages, mask), calling the base the
    same way."""

    def compute_policy_loss(self, logps, old_logps, advantages, mask):
        self.legacy_calls = getattr(self, "legacy_calls", 0) + 1
        return super().compute_policy_loss(logps, old_logps, advantages, mask)


def test_a_wrapper_on_ppos_old_policy_loss_seam_still_works_and_warns(tmp_path):
    from toolkit import ToolkitDeprecationWarning

    with pytest.warns(ToolkitDeprecationWarning, match=r"_LegacySeamPPO.compute_policy_loss\(logps, old_logps"):
        t = _LegacySeamPPO(tiny_model(), [low_ids], cfg(tmp_path, max_steps=1), train_dataset=prompts(),
                           processing_class=tiny_tokenizer())
    reference = make(tmp_path / "new", max_steps=1)
    reference.train()
    with pytest.warns(ToolkitDeprecationWarning, match="removed in 0.3"):  # the 0.1-style super() call
        t.train()
    assert t.legacy_calls > 0
    # the same loss either way: the old form is an adapter, not another computation
    assert logged(t, "loss") == pytest.approx(logged(reference, "loss"), abs=1e-6)
