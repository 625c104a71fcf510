"""GRPOTrainer on tiny models: every loss type, KL, iterations, rewards (weights, None, failing, async), resume."""

import asyncio
import logging
import math
import warnings

import pytest
import torch
from builders import StopAt

from toolkit import ConfigError, DataError, TrainingHealthError
from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.testing import tiny_model, tiny_tokenizer


def prompts(n=16):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(n)]


def length_reward(prompts, completions, completion_ids, **kw):
    """Dense and varied even for a random model: prefers low token ids (and short completions)."""
    return [-sum(ids) / (len(ids) * 384.0) - len(ids) / 100.0 for ids in completion_ids]


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                max_completion_length=8, learning_rate=1e-2, logging_steps=1, save_strategy="no", seed=0,
                disable_tqdm=True, report_to="none")
    base.update(kw)
    return GRPOConfig(**base)


def make(tmp_path, rewards=(length_reward,), rows=None, model=None, **kw):
    return GRPOTrainer(model if model is not None else tiny_model(), list(rewards), cfg(tmp_path, **kw),
                       train_dataset=rows if rows is not None else prompts(), processing_class=tiny_tokenizer())


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "prompt"])
def test_each_loss_type_trains(tmp_path, loss_type):
    t = make(tmp_path, loss_type=loss_type)
    before = {k: v.clone() for k, v in t.model.named_parameters()}
    t.train()
    assert all(math.isfinite(x) for x in logged(t, "loss"))
    assert any(not torch.equal(v, before[k]) for k, v in t.model.named_parameters())
    for key in ("reward", "frac_reward_zero_std", "entropy", "completions/mean_length", "clip_ratio/region_mean",
                "importance_ratio/mean", "time/generation_s", "generation_tokens_per_s", "train_tokens_per_s"):
        assert logged(t, key), key


def test_entropy_from_the_training_forward_equals_a_separate_entropy_pass(tmp_path, monkeypatch):
    # the default token pass takes the logged entropy from its own LM-head product; a forward_tokens override that
    # returns only the hidden states gets it from a separate pass (chunked_entropy): the same numbers
    from toolkit.core.packing import TokenLogps, completion_hidden, completion_logps

    class SeparatePass(GRPOTrainer):
        def forward_tokens(self, model, batch):
            hidden = completion_hidden(model, batch)
            logps = completion_logps(model, batch, temperature=self.args.temperature, hidden=hidden)
            return TokenLogps(logps, hidden=hidden.detach())

    import toolkit.core.packing as packing_module  # completion_entropy's separate pass

    separate_passes = []
    real = packing_module.chunked_entropy
    monkeypatch.setattr(packing_module, "chunked_entropy", lambda *a, **k: separate_passes.append(1) or real(*a, **k))
    fused = make(tmp_path / "a", max_steps=3)
    fused.train()
    assert separate_passes == []  # the default path took it from its own LM-head product
    separate = SeparatePass(tiny_model(), [length_reward], cfg(tmp_path / "b", max_steps=3), train_dataset=prompts(),
                            processing_class=tiny_tokenizer())
    separate.train()
    assert len(separate_passes) == 3  # the override's steps took the separate pass
    assert len(logged(fused, "entropy")) == 3
    assert logged(fused, "entropy") == pytest.approx(logged(separate, "entropy"), rel=1e-5)
    assert logged(fused, "loss") == pytest.approx(logged(separate, "loss"), rel=1e-5)


def test_kl_to_reference(tmp_path):
    t = make(tmp_path, beta=0.1, max_steps=3)
    t.train()
    kl = logged(t, "kl")
    assert len(kl) == 3 and kl[0] == pytest.approx(0.0, abs=1e-6) and kl[-1] > 0
    assert t.ref_model is not None and not any(p.requires_grad for p in t.ref_model.parameters())


def test_kl_with_peft_uses_the_adapter_free_base(tmp_path):
    from peft import LoraConfig

    t = GRPOTrainer(tiny_model(), [length_reward], cfg(tmp_path, beta=0.1, max_steps=2),
                    train_dataset=prompts(), processing_class=tiny_tokenizer(),
                    peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert t.ref_model is None
    t.train()
    assert len(logged(t, "kl")) == 2


def test_num_iterations_reuses_rollouts_with_old_logps(tmp_path):
    calls = []
    t = make(tmp_path, num_iterations=2, max_steps=4)
    original = t.generate_rollout

    def counting(rows):
        calls.append(list(rows))
        return original(rows)

    t.generate_rollout = counting
    t.train()
    assert len(calls) == 2  # 4 steps, 2 per rollout
    ratios = logged(t, "clip_ratio/region_mean")
    assert len(ratios) == 4


def test_multiple_rewards_with_weights_and_none(tmp_path):
    def only_even(prompts, completions, completion_ids, **kw):
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

    t = make(tmp_path, rewards=(length_reward, only_even), reward_weights=[1.0, 0.5])
    rollout = t.generate_rollout(list(range(2)))
    per_func = rollout.rewards_per_func
    assert torch.isnan(per_func[1, 1::2]).all()
    expected = per_func[0] + 0.5 * torch.nan_to_num(per_func[1], nan=0.0)
    torch.testing.assert_close(rollout.rewards, expected)


def test_a_row_no_function_judges_is_excluded(tmp_path):
    def judge_none(prompts, completions, completion_ids, **kw):
        return [None] * len(completions)

    t = make(tmp_path, rewards=(judge_none,))
    rollout = t.generate_rollout([0, 1])
    assert torch.isnan(rollout.rewards).all() and not rollout.included.any()


def test_failing_reward_is_counted_logged_once_and_does_not_stop_the_run(tmp_path, caplog):
    def broken(prompts, completions, completion_ids, **kw):
        raise RuntimeError("reward server unreachable")

    t = make(tmp_path, rewards=(length_reward, broken), max_steps=3, reward_max_consecutive_failures=4)
    with caplog.at_level(logging.ERROR, logger="toolkit.core.rewards"):
        t.train()
    assert logged(t, "rewards/broken/failures")[-1] == 3
    errors = [r for r in caplog.records if "reward function 'broken' failed" in r.getMessage()]
    assert len(errors) == 1 and "reward server unreachable" in errors[0].getMessage()
    assert all(math.isfinite(x) for x in logged(t, "loss"))


def test_a_reward_that_fails_every_batch_stops_the_run_naming_it_its_error_and_the_columns(tmp_path):
    def broken(prompts, completions, completion_ids, **kw):  # reads a column the dataset does not have
        return [float(a) for a in kw["answr"]]

    t = make(tmp_path, rewards=(length_reward, broken), max_steps=5)
    with pytest.raises(TrainingHealthError, match=r"reward function 'broken' failed on 3 batches in a row \(last: "
                                                   r"KeyError: .*answr.*\).*columns \['answer'\]"):
        t.train()
    assert t.state.global_step == 2  # stopped at the third batch, not after training on without it


def test_a_reward_whose_signature_needs_a_missing_column_is_refused_before_any_model_loads(tmp_path):
    from toolkit import DataError

    def misspelt(prompts, completions, completion_ids, answr, **kw):  # the dataset's column is 'answer'
        return [1.0] * len(completions)

    with pytest.raises(DataError, match=r"reward function 'misspelt' needs the column\(s\) \['answr'\], which the "
                                        r"dataset does not have \(its columns: \['answer', 'prompt'\]\)"):
        GRPOTrainer("/nonexistent/model", [length_reward, misspelt], cfg(tmp_path), train_dataset=prompts(),
                    processing_class=tiny_tokenizer())


def test_async_rewards_run_concurrently_and_time_out(tmp_path):
    async def slow_ok(prompts, completions, completion_ids, **kw):
        await asyncio.sleep(0.3)
        return [1.0 if len(ids) % 2 else 0.0 for ids in completion_ids]

    async def slow_too(prompts, completions, completion_ids, **kw):
        await asyncio.sleep(0.3)
        return [0.5] * len(completions)

    async def hangs(prompts, completions, completion_ids, **kw):
        await asyncio.sleep(30)

    import time

    t = make(tmp_path, rewards=(slow_ok, slow_too, hangs), reward_timeout=1.0)
    start = time.perf_counter()
    rollout = t.generate_rollout([0, 1])
    assert time.perf_counter() - start < 5  # concurrent, and the hanging one is cut at 1 s
    assert torch.isnan(rollout.rewards_per_func[2]).all()
    assert not torch.isnan(rollout.rewards_per_func[0]).any()
    assert t.reward_runner.failures["hangs"] == 1


def test_numeric_match_reward_reads_the_answer_column(tmp_path):
    t = make(tmp_path, rewards=("numeric_match",))
    rollout = t.generate_rollout([0, 1])
    assert set(rollout.rewards.tolist()) <= {0.0, 1.0}


def test_zero_variance_groups_are_dropped_and_reported(tmp_path):
    def constant(prompts, completions, completion_ids, **kw):
        return [1.0] * len(completions)

    t = make(tmp_path, rewards=(constant,), max_steps=1)
    t.train()
    assert logged(t, "frac_reward_zero_std") == [1.0]
    assert logged(t, "frac_rows_in_loss") == [0.0]
    assert logged(t, "loss") == [0.0]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "prompt"])
def test_rows_out_of_the_loss_are_not_trained_and_the_gradients_are_the_same(tmp_path, loss_type):
    """Tied groups (and unjudged rows) leave the forward: same loss and gradients as training every row."""
    def half_tied(prompts, completions, completion_ids, **kw):  # prompts 1 and 3 tied at 1; the others vary
        tied = ["What is 1 " in str(p) or "What is 3 " in str(p) for p in prompts]
        return [1.0 if t else [0.0, 1.0, None, 1.0][i % 4] for i, t in enumerate(tied)]

    class TrainsEveryRow(GRPOTrainer):
        @staticmethod
        def _trained_rows(rollout, rows):
            return list(rows)

    grads = {}
    for name, cls in (("skipping", GRPOTrainer), ("every row", TrainsEveryRow)):
        torch.manual_seed(0)
        t = cls(tiny_model(), [half_tied], cfg(tmp_path / name, loss_type=loss_type, per_device_train_batch_size=4,
                                             gradient_accumulation_steps=2),
                train_dataset=prompts(4), processing_class=tiny_tokenizer())
        t.model.train()
        t.current_gradient_accumulation_steps = 2
        rollout = t.generate_rollout([1, 3])  # both groups tied: no row in the loss
        rollout2 = t.generate_rollout([0, 1])  # one micro-batch varied (some rows unjudged), one tied
        for r in (rollout, rollout2):
            t.model.zero_grad()
            micro = t._split(r)
            total = sum(t.compute_loss(t.model, m) for m in micro)
            total.backward()
            grads[(name, id(r) == id(rollout))] = (float(total), [p.grad.clone() for p in t.model.parameters()
                                                                 if p.grad is not None],
                                                   sum(int(m["input_ids"].numel()) for m in micro))
    for first in (True, False):
        (loss_a, g_a, _), (loss_b, g_b, _) = grads[("skipping", first)], grads[("every row", first)]
        assert loss_a == pytest.approx(loss_b, abs=1e-6)
        assert len(g_a) == len(g_b) and all(torch.allclose(x, y, atol=1e-6) for x, y in zip(g_a, g_b))
    assert grads[("skipping", True)][2] < grads[("every row", True)][2]  # the tied prompts' rows were not run


@pytest.mark.parametrize("skip, ga", [(True, 1), (False, 1), (True, 2)])
def test_a_step_without_signal_leaves_weights_and_optimizer_alone(tmp_path, skip, ga):
    """Step 1 has signal; steps 2 and 3 are all-tied (no row in the loss, zero gradient). Skipped, they leave the
    weights and Adam's state as step 1 left them, while the learning rate schedule advances and the step's
    metrics are logged; run on zeros (the old behaviour, skip False), Adam's momentum moves the weights anyway:
    the drift that collapsed async runs."""
    from transformers import TrainerCallback

    calls = []

    def signal_once(prompts, completions, completion_ids, **kw):
        calls.append(1)
        return length_reward(prompts, completions, completion_ids) if len(calls) == 1 else [0.5] * len(completions)

    snapshots = []

    class Snapshot(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, optimizer=None, **kw):
            snapshots.append(([p.detach().clone() for p in model.parameters()],
                              {k: {n: v.clone() for n, v in st.items()}
                               for k, st in optimizer.state_dict()["state"].items()}))

    t = make(tmp_path, rewards=(signal_once,), max_steps=3, skip_steps_without_signal=skip,
             per_device_train_batch_size=8 // ga, gradient_accumulation_steps=ga)
    t.add_callback(Snapshot())
    t.train()
    assert len(calls) == 3  # one rollout per optimizer step
    assert logged(t, "frac_rows_in_loss")[0] > 0 and logged(t, "frac_rows_in_loss")[1:] == [0.0, 0.0]
    assert logged(t, "update_skipped") == ([0.0, 1.0, 1.0] if skip else [0.0, 0.0, 0.0])
    assert len(logged(t, "sampler/logp_abs_diff_mean")) == 3 and len(logged(t, "time/train_s")) == 3
    lrs = logged(t, "learning_rate")
    assert lrs[0] > lrs[1] > lrs[2]  # the (linear) schedule advances through skipped steps
    (w1, s1), (w3, s3) = snapshots[0], snapshots[2]
    assert len(s1) > 0
    moved = max(float((a - b).abs().max()) for a, b in zip(w1, w3))
    if skip:
        assert moved == 0.0
        assert s1.keys() == s3.keys()
        assert all(torch.equal(s1[k][n], s3[k][n]) for k in s1 for n in s1[k])  # exp_avg, exp_avg_sq, step
    else:
        assert moved > 1e-4  # momentum alone moved the weights
        assert logged(t, "grad_norm")[1:] == [0.0, 0.0]


def test_no_learning_signal_is_said_loudly(tmp_path, caplog):
    def constant(prompts, completions, completion_ids, **kw):
        return [0.0] * len(completions)

    t = make(tmp_path, rewards=(constant,), max_steps=3, no_signal_warn_steps=2)
    with caplog.at_level(logging.WARNING, logger="toolkit.core.grpo"):
        t.train()
    assert any("NO LEARNING SIGNAL" in r.getMessage() for r in caplog.records)


def test_mask_truncated_completions(tmp_path):
    t = make(tmp_path, mask_truncated_completions=True, max_completion_length=2)
    rollout = t.generate_rollout([0, 1])
    assert not (rollout.included & rollout.truncated).any()


@pytest.mark.slow
def test_exact_resume_equals_uninterrupted(tmp_path):
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2)
    straight = make(tmp_path / "a", **kw)
    straight.train()
    first = GRPOTrainer(tiny_model(), [length_reward], cfg(tmp_path / "b", **kw), train_dataset=prompts(),
                        processing_class=tiny_tokenizer(), callbacks=[StopAt(2)])
    first.train()
    second = make(tmp_path / "b", model=tiny_model(seed=99), **kw)
    second.train(resume_from_checkpoint=True)
    for key in ("loss", "reward", "completions/mean_length"):
        assert logged(second, key)[2:] == pytest.approx(logged(straight, key)[2:], rel=1e-5), key


def test_skip_solved_prompts(tmp_path):
    def always_right(prompts, completions, completion_ids, **kw):
        return [1.0] * len(completions)

    t = make(tmp_path, rewards=(always_right,), skip_solved_threshold=0.9, max_steps=2)
    t.train()
    assert len(t.solved) == 4  # 2 steps x 2 prompts, all solved, never drawn again this run
    order = t._round_sampler.order()
    assert not set(order) & t.solved


def test_nan_reward_stops_with_the_tensor_named(tmp_path):
    def inf_reward(prompts, completions, completion_ids, **kw):
        return [float("inf")] + [0.0] * (len(completions) - 1)

    t = make(tmp_path, rewards=(inf_reward,), max_steps=1)
    with pytest.raises(TrainingHealthError, match="reward function 'inf_reward' returned inf for 1 rows"):
        t.train()


@pytest.mark.parametrize("name", ["gradient_checkpointing", "activation_checkpointing"])
@pytest.mark.parametrize("config", ["GRPOConfig", "PPOConfig", "SFTConfig", "DPOConfig", "AsyncGRPOConfig"])
def test_checkpointing_asked_for_under_either_name_is_kept(tmp_path, config, name):
    # PPOConfig(gradient_checkpointing=True) came out False: PPO's default overwrote the old name.
    import toolkit
    for value in (True, False):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # transformers' note on the old name
            c = getattr(toolkit, config)(output_dir=str(tmp_path), **{name: value})
        assert c.activation_checkpointing is value and c.gradient_checkpointing is value
    # and so are its settings: transformers copies the new name's over the old one's, so ours must not fill it in
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        c = getattr(toolkit, config)(output_dir=str(tmp_path), **{name: True, f"{name}_kwargs": {"use_reentrant": True}})
    assert c.activation_checkpointing_kwargs == c.gradient_checkpointing_kwargs == {"use_reentrant": True}


@pytest.mark.parametrize("gpu", [False, True])
def test_checkpointing_default_follows_the_micro_batch(tmp_path, monkeypatch, gpu):
    """GRPO's rule holds on a CPU and a GPU alike (a GPU's memory is the scarcer: bench/results/gpu); the other
    trainers keep theirs (SFT: on without a GPU, off with one; PPO: off)."""
    from toolkit import AsyncGRPOConfig, PPOConfig, SFTConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # transformers' own setup needs a real one
    monkeypatch.setattr("toolkit.core.models._has_gpu", lambda: gpu)
    out = str(tmp_path)
    assert not GRPOConfig(output_dir=out).activation_checkpointing  # 8 completions x 64 tokens
    assert not GRPOConfig(output_dir=out, per_device_train_batch_size=64, max_completion_length=64).activation_checkpointing
    assert GRPOConfig(output_dir=out, per_device_train_batch_size=128, max_completion_length=64).activation_checkpointing
    assert AsyncGRPOConfig(output_dir=out, per_device_train_batch_size=128,
                           max_completion_length=64).activation_checkpointing
    assert not PPOConfig(output_dir=out, per_device_train_batch_size=128, max_completion_length=64).activation_checkpointing
    assert SFTConfig(output_dir=out).activation_checkpointing == (not gpu)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ConfigError, match="per_device_train_batch_size: counts completions"):
        cfg(tmp_path, per_device_train_batch_size=6)
    with pytest.raises(ConfigError, match="loss_type: 'ppo_clip'"):
        cfg(tmp_path, loss_type="ppo_clip")
    with pytest.raises(ConfigError, match="num_generations: must be >= 2"):
        cfg(tmp_path, num_generations=1, per_device_train_batch_size=1)
    with pytest.raises(ConfigError, match="save_steps: with num_iterations=2"):
        cfg(tmp_path, num_iterations=2, save_strategy="steps", save_steps=3)
    with pytest.raises(ConfigError, match="reward_weights: 2 weights for 1 reward"):
        make(tmp_path, reward_weights=[1.0, 2.0])
    with pytest.raises(ConfigError, match="unknown reward 'exact'"):
        make(tmp_path, rewards=("exact",))


def test_data_errors_before_the_model_loads(tmp_path):
    with pytest.raises(DataError, match="GRPO needs a 'prompt' column"):
        GRPOTrainer("no-such/model", [length_reward], cfg(tmp_path), train_dataset=[{"text": "hi"}],
                    processing_class=tiny_tokenizer())
    with pytest.raises(DataError, match="the prompt ends with an assistant turn"):
        GRPOTrainer("no-such/model", [length_reward], cfg(tmp_path), processing_class=tiny_tokenizer(),
                    train_dataset=[{"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}])


def test_padded_fallback_gives_the_same_logps_as_packed_rows(tmp_path):
    """Attention that cannot run packed rows gets right-padded batches; the log-probs must not change."""
    packed = make(tmp_path)
    padded = make(tmp_path, model=tiny_model(attn_implementation="eager"))
    padded.padding_free, padded.packed_layout = False, "padded"
    rollout = packed.generate_rollout([0, 1])
    a = packed.compute_token_logps(packed.model, packed._split(rollout)[0])
    b = padded.compute_token_logps(padded.model, padded._split(rollout)[0])
    assert "attention_mask" in padded._split(rollout)[0]
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_health_warnings_truncation_kl_and_rate_limit(caplog):
    from toolkit.core.grpo import TrainingHealth

    health = TrainingHealth(GRPOConfig(output_dir="/tmp/h", warn_every=5))
    bad = {"completions/clipped_ratio": 1.0, "entropy": 0.01, "kl": 3.0, "reward": 0.5, "frac_reward_zero_std": 0.2}
    with caplog.at_level(logging.WARNING, logger="toolkit.core.grpo"):
        for step in range(1, 8):
            health.observe(step, bad)
    messages = [r.getMessage() for r in caplog.records]
    for cause in ("every completion hit max_completion_length", "KL to the reference is 3.000"):
        hits = [m for m in messages if cause in m]
        assert len(hits) == 2, cause  # steps 1 and 6: at most once per cause per warn_every=5 steps
    # low entropy with a steady reward is what a task with one right answer looks like: no warning
    assert not any("entropy" in m or "REWARD FALLING" in m for m in messages)


def _observe(health, rewards, **extra):
    for step, r in enumerate(rewards, 1):
        health.observe(step, {"reward": r, "frac_reward_zero_std": 0.3, **extra})


def _bernoulli_curve(seed, means, completions=32):
    """Step rewards as a GRPO run logs them: the mean of `completions` 0/1 rewards with the given success rates."""
    import random

    rng = random.Random(seed)
    return [sum(rng.random() < p for _ in range(completions)) / completions for p in means]


def _warned(rewards, **extra):
    from toolkit.core.grpo import TrainingHealth

    health = TrainingHealth(GRPOConfig(output_dir="/tmp/h"))
    logger = logging.getLogger("toolkit.core.grpo")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        _observe(health, rewards, **extra)
    finally:
        logger.removeHandler(handler)
    return [m for m in seen if "REWARD FALLING" in m]


def test_a_falling_reward_warns_and_names_collapsed_entropy():
    """A rise to 0.6 and a fall to 0.35 (what the issue saw on the main job) is caught in every seed tried."""
    rise_then_fall = [0.3 + 0.3 * min(t, 40) / 40 if t < 45 else 0.6 - 0.25 * min(t - 45, 20) / 20 for t in range(80)]
    for seed in range(10):
        warnings = _warned(_bernoulli_curve(seed, rise_then_fall), entropy=0.01)
        assert warnings, seed
        assert "entropy at 0.0100" in warnings[0] and "narrowed onto worse answers" in warnings[0]


def test_a_flat_noisy_curve_and_a_solved_task_do_not_warn(caplog):
    """Noise at the main job's batch shape (32 completions of p=0.5 per step, 80 steps) is not a falling reward:
    the simulation behind the threshold gives 0.5% false warnings; these 40 seeds give none."""
    from toolkit.core.grpo import TrainingHealth

    flat = [sum(1 for w in _warned(_bernoulli_curve(seed, [0.5] * 80))) for seed in range(40)]
    assert sum(1 for n in flat if n) == 0
    rising = [min(0.95, 0.2 + 0.01 * t) for t in range(80)]
    assert not _warned(_bernoulli_curve(0, rising))
    with caplog.at_level(logging.WARNING, logger="toolkit.core.grpo"):
        health = TrainingHealth(GRPOConfig(output_dir="/tmp/h", no_signal_warn_steps=2))
        for step in range(1, 6):  # every group tied at the top: solved, not stuck
            health.observe(step, {"reward": 1.0, "frac_reward_zero_std": 1.0})
    assert not caplog.records, [r.getMessage() for r in caplog.records]

def test_objective_settings_are_resolved_once_and_again_only_when_a_field_they_read_changes(tmp_path, monkeypatch):
    """The loss's settings are resolved in one place (resolved_objective): not again at every micro-step, but a
    callback that schedules epsilon or beta still takes effect at the next step."""
    import toolkit.core.grpo as grpo_module
    from transformers import TrainerCallback

    calls = []
    real = grpo_module.resolve_policy_loss_settings
    monkeypatch.setattr(grpo_module, "resolve_policy_loss_settings", lambda *a, **k: calls.append(1) or real(*a, **k))

    seen = []

    class Schedule(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                args.epsilon_high = 0.5  # a schedule: clip-higher opens at step 2
            seen.append(trainer.resolved_objective().loss_settings.epsilon_high)

    trainer = make(tmp_path, max_steps=4, gradient_accumulation_steps=2)
    at_start = len(calls)  # the config's own check and the start-up line's resolution
    trainer.add_callback(Schedule())
    trainer.train()
    assert seen == [0.2, 0.2, 0.5, 0.5]
    # 4 steps x 2 micro-steps read the settings; they were resolved again once only, when epsilon_high changed
    assert len(calls) - at_start == 1


def test_log_completions_prints_the_table_and_sends_it_to_tensorboard(tmp_path, capsys):
    """TRL's log_completions: at each logging step a table of prompt, completion, each reward, the total and the
    advantage, printed and written as a TensorBoard text summary (read back here)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = make(tmp_path, log_completions=True, num_completions_to_print=3, report_to="tensorboard")
    t.train()
    out = capsys.readouterr().out
    assert "completions at step 1 (3 of 8):" in out and "completions at step 2 (3 of 8):" in out
    header = "| prompt | completion | length_reward | reward | advantage |"
    assert header in out
    table = out.split("completions at step 2 (3 of 8):\n", 1)[1].splitlines()
    assert table[0] == header and len(table) >= 5 and all(line.startswith("| ") for line in table[2:5])
    events = [p for p in tmp_path.rglob("events.out.tfevents.*")]
    assert events
    texts = []
    for path in events:
        acc = EventAccumulator(str(path), size_guidance={"tensors": 0})
        acc.Reload()
        for tag in acc.Tags().get("tensors", []):
            if tag.startswith("completions"):
                texts += [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(tag)]
    assert len(texts) == 2 and all(header in text for text in texts)


def test_eval_dataset_is_evaluated_as_trl_does(tmp_path):
    """GRPOTrainer(eval_dataset=...) with eval_strategy: sampled completions of the held-out prompts scored by the
    reward functions, logged as eval_reward & co at each evaluation; the same seed each time."""
    rows = prompts()
    with pytest.raises(ConfigError, match="eval_strategy: 'steps' needs held-out prompts"):
        make(tmp_path, rows=rows, eval_strategy="steps", eval_steps=1)
    t = GRPOTrainer(tiny_model(), [length_reward], cfg(tmp_path, eval_strategy="steps", eval_steps=1),
                    train_dataset=rows, eval_dataset=rows[:3], processing_class=tiny_tokenizer())
    t.train()
    evals = [h for h in t.state.log_history if "eval_reward" in h]
    assert len(evals) == 2 and all(math.isfinite(h["eval_reward"]) for h in evals)
    assert all(h["eval_completions/mean_length"] > 0 and "eval_rewards/length_reward/mean" in h for h in evals)
    again = t.evaluate()
    assert again["eval_reward"] == pytest.approx(t.evaluate()["eval_reward"])  # same seed, same weights
    with pytest.raises(DataError, match="eval_dataset"):  # a column a reward needs, missing from the eval rows
        GRPOTrainer(tiny_model(), [lambda prompts, completions, completion_ids, answer, **kw: [0.0] * len(completions)],
                    cfg(tmp_path), train_dataset=[{"prompt": "y", "answer": "2"}] * 8,
                    eval_dataset=[{"prompt": "x"}] * 2, processing_class=tiny_tokenizer())


def test_evaluation_scores_held_out_rows_in_their_own_format_and_keeps_the_training_failure_count(tmp_path):
    """The eval set may be plain text where training is conversational (and lack training's `answer`): it is scored
    in its own format, by a runner of its own, so an evaluation neither stops the run nor resets the training
    runner's consecutive failures. A best-model setting that would read eval_loss is refused up front."""
    seen = []

    def reward(prompts, completions, completion_ids, **kw):
        seen.append(type(completions[0]).__name__)
        return [float(len(ids)) for ids in completion_ids]

    chat = [{"prompt": "What is 2 + 2?"}, {"prompt": "What is 3 + 5?"}]  # plain text; training rows are chat
    t = GRPOTrainer(tiny_model(), [reward], cfg(tmp_path, max_steps=1), train_dataset=prompts(),
                    eval_dataset=chat, processing_class=tiny_tokenizer())
    t.train()
    t.reward_runner.consecutive["reward"] = 2  # as if training's last two batches had failed
    metrics = t.evaluate()
    assert "list" in seen and "str" in seen  # training rows conversational, held-out rows plain text
    assert math.isfinite(metrics["eval_reward"]) and t._eval_runner is not t.reward_runner
    assert t.reward_runner.consecutive["reward"] == 2  # the evaluation's successes did not reset it
    with pytest.raises(ConfigError, match="metric_for_best_model = 'reward'"):
        GRPOTrainer(tiny_model(), [reward], cfg(tmp_path, eval_strategy="steps", load_best_model_at_end=True,
                                                save_strategy="steps"),
                    train_dataset=prompts(), eval_dataset=chat, processing_class=tiny_tokenizer())
