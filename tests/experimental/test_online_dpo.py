"""toolkit.experimental.online_dpo: DPO on pairs the policy samples. Pair selection against a naive loop; loss,
gradients and metrics equal TRL's OnlineDPOTrainer on the same sampled pairs (TRL's own training step, its
generation replaced by our completions); ties; exact resume; errors named before any model loads."""

import dataclasses
import math
import os

import pytest
import torch
from builders import StopAt

from toolkit.core.errors import ConfigError, DataError
from toolkit.core.generation import Completion
from toolkit.testing import tiny_model, tiny_tokenizer

os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")
from toolkit.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer, select_pairs  # noqa: E402

U = lambda c: {"role": "user", "content": c}  # noqa: E731


def prompts(n=16):
    return [{"prompt": [U(f"What is {i} + 1?")]} for i in range(n)]


def by_ids(completions, completion_ids, **kw):
    """A reward that separates most pairs: the sum of the completion's token ids modulo 3."""
    return [float(sum(ids) % 3) for ids in completion_ids]


def cfg(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3,
                max_completion_length=8, logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True,
                report_to="none")
    base.update(kw)
    return OnlineDPOConfig(**base)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


def test_select_pairs_matches_a_naive_loop():
    nan = float("nan")
    rewards = torch.tensor([1.0, 0.0, 0.5,   2.0, 2.0, 2.0,   nan, 1.0, 3.0,   nan, nan, 1.0,   0.0, 1.0, 1.0])
    for keep_ties in (False, True):
        chosen, rejected, valid = select_pairs(rewards, 3, keep_ties=keep_ties)
        for g in range(5):
            r = rewards[3 * g:3 * g + 3].tolist()
            scored = [j for j in range(3) if r[j] == r[j]]
            if len(scored) < 2:
                assert not valid[g]
                continue
            best = max(scored, key=lambda j: (r[j], -j))    # first of the best
            worst = min(scored, key=lambda j: (r[j], j))    # first of the worst
            if r[best] == r[worst]:
                assert bool(valid[g]) == keep_ties
                best, worst = scored[0], scored[1]
            else:
                assert valid[g]
            assert (chosen[g], rejected[g]) == (3 * g + best, 3 * g + worst)


@pytest.mark.slow
def test_a_few_steps_train_and_log_trl_metric_names(tmp_path):
    t = OnlineDPOTrainer(tiny_model(), [by_ids], cfg(tmp_path, max_steps=4), train_dataset=prompts(),
                         processing_class=tiny_tokenizer())
    assert t.ref_model is not None  # a frozen copy: DPO's implicit reward is relative to it
    t.train()
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "objective/kl", "objective/scores_margin", "frac_pairs_in_loss"):
        assert logged(t, key), key
    assert all(0.0 <= f <= 1.0 for f in logged(t, "frac_pairs_in_loss"))
    assert all(m > 0 for m in logged(t, "objective/scores_margin"))  # chosen always scored above rejected


def _pairs(tok):
    """Two prompts, each with two completions of different lengths (ending with EOS) and rewards that pick the
    second completion of prompt 0 and the first of prompt 1 as chosen."""
    eos = tok.eos_token_id
    groups = [[Completion([5, 6, 7, eos], [0.0] * 4, "stop"), Completion([8, 9, eos], [0.0] * 3, "stop")],
              [Completion([10, 11, eos], [0.0] * 3, "stop"), Completion([12, 13, 14, 15, 16, eos], [0.0] * 6, "stop")]]
    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0]])  # [F, R], prompt-major
    return groups, rewards


def sharp_reference():
    ref = tiny_model(seed=7)
    with torch.no_grad():
        ref.get_output_embeddings().weight.mul_(3.0)
    return ref


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_loss_gradients_and_metrics_equal_trl(tmp_path, beta):
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl.experimental.online_dpo import OnlineDPOConfig as TRLConfig
    from trl.experimental.online_dpo import OnlineDPOTrainer as TRLTrainer

    tok = tiny_tokenizer()
    rows = prompts(2)
    ours = OnlineDPOTrainer(tiny_model(), [by_ids], cfg(tmp_path / "ours", beta=beta, per_device_train_batch_size=4),
                            train_dataset=rows, processing_class=tok, ref_model=sharp_reference())
    groups, rewards = _pairs(tok)
    rollout = ours.build_rollout([0, 1], groups, rewards, 0.0, 0.0)
    micro = ours._split(rollout)[0]
    ours.model.train()
    our_loss = ours.compute_loss(ours.model, micro)

    # TRL's own training step on the same ids: its generation returns our completions, its reward function our
    # rewards. TRL orders rows as every prompt's first completion, then every prompt's second.
    pad = tok.pad_token_id
    prompt_ids = [ours.prompt_ids[0], ours.prompt_ids[1]]
    width = max(map(len, prompt_ids))
    p_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt_ids] * 2)  # TRL repeats the prompts
    p_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids] * 2)
    completions = [groups[0][0].token_ids, groups[1][0].token_ids, groups[0][1].token_ids, groups[1][1].token_ids]
    cwidth = max(map(len, completions))
    c_ids = torch.tensor([c + [pad] * (cwidth - len(c)) for c in completions])
    c_mask = torch.tensor([[1] * len(c) + [0] * (cwidth - len(c)) for c in completions])
    trl_rewards = [0.0, 1.0, 1.0, 0.0]  # rows (p0 c0, p1 c0, p0 c1, p1 c1)

    def trl_reward(prompts, completions, completion_ids, **kw):
        return list(trl_rewards)

    theirs = TRLTrainer(model=tiny_model(), ref_model=sharp_reference(), reward_funcs=[trl_reward],
                        args=TRLConfig(output_dir=str(tmp_path / "trl"), beta=beta, per_device_train_batch_size=2,
                                       use_cpu=True, bf16=False, report_to="none", max_new_tokens=8),
                        train_dataset=Dataset.from_list(rows), processing_class=tok)
    theirs._generate = lambda model, prompts, images=None: (p_ids, p_mask, c_ids, c_mask, None)
    theirs.model.train()
    trl_loss = theirs.training_step(theirs.model, {"prompt": [r["prompt"] for r in rows]})  # backward inside
    assert our_loss.item() == pytest.approx(trl_loss.item(), abs=1e-5, rel=1e-5)
    assert our_loss.item() != pytest.approx(0.6931, abs=1e-3)  # the reference differs: not a trivial log 2
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected"):
        assert ours.recorded_metrics()[key][-1] == pytest.approx(theirs.stats[key][-1], abs=1e-5), key
    assert rollout.metrics["objective/scores_margin"] == pytest.approx(theirs.stats["objective/scores_margin"][-1])
    our_loss.backward()
    for (k, p), (_, q) in zip(theirs.model.named_parameters(), ours.model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=k)


def test_tied_pairs_leave_the_loss_unless_asked(tmp_path):
    tok = tiny_tokenizer()
    groups, _ = _pairs(tok)
    tied = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # prompt 0's pair tied
    for keep in (False, True):
        t = OnlineDPOTrainer(tiny_model(), [by_ids], cfg(tmp_path / str(keep), zero_variance_filter=not keep),
                             train_dataset=prompts(2), processing_class=tok)
        r = t.build_rollout([0, 1], groups, tied, 0.0, 0.0)
        assert r.metrics["frac_pairs_in_loss"] == (1.0 if keep else 0.5)
        assert r.included.tolist() == ([True] * 4 if keep else [False, False, True, True])
        if keep:  # TRL's rule: the first completion is "chosen"
            assert r.pairs.tolist() == [[0, 1], [2, 3]]


def test_unscored_rows_are_never_paired(tmp_path):
    tok = tiny_tokenizer()
    groups, _ = _pairs(tok)
    t = OnlineDPOTrainer(tiny_model(), [by_ids], cfg(tmp_path), train_dataset=prompts(2), processing_class=tok)
    r = t.build_rollout([0, 1], groups, torch.tensor([[float("nan"), 1.0, 0.0, 1.0]]), 0.0, 0.0)
    # prompt 0 has one scored completion: no pair; prompt 1's pair is (row 3, row 2)
    assert r.included.tolist() == [False, False, True, True] and r.pairs.tolist() == [[3, 2]]
    micro = t._split(r)[0]
    t.model.train()
    loss = t.compute_loss(t.model, micro)
    assert torch.isfinite(loss) and loss.item() == pytest.approx(0.6931, abs=0.05)  # one pair, near log 2 at start


def test_accumulated_micro_batches_take_the_step_of_one(tmp_path):
    """Two micro-batches of one pair each give the gradient of one micro-batch holding both pairs (the loss
    divides by the step's pair count, not each micro-batch's)."""
    tok = tiny_tokenizer()
    groups, rewards = _pairs(tok)
    grads = []
    for B, GA in ((4, 1), (2, 2)):
        t = OnlineDPOTrainer(tiny_model(), [by_ids], cfg(tmp_path / f"{B}", per_device_train_batch_size=B,
                                                            gradient_accumulation_steps=GA),
                             train_dataset=prompts(2), processing_class=tok, ref_model=sharp_reference())
        rollout = t.build_rollout([0, 1], groups, rewards, 0.0, 0.0)
        t.model.train()
        for micro in t._split(rollout):
            t.compute_loss(t.model, micro).backward()
        grads.append([p.grad.clone() for p in t.model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_family_settings_work_for_online_dpo(tmp_path):
    # num_iterations (rollout reuse) and skip_solved_threshold are GroupRolloutConfig's, run by GRPO's machinery
    t = OnlineDPOTrainer(tiny_model(), [by_ids], cfg(tmp_path, max_steps=2, num_iterations=2, skip_solved_threshold=1.0,
                                                   solved_reward=2.0),
                         train_dataset=prompts(), processing_class=tiny_tokenizer())
    t.train()
    losses = logged(t, "loss")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


@pytest.mark.slow
def test_exact_resume_equals_uninterrupted(tmp_path):
    def make(out, callbacks=(), **kw):
        return OnlineDPOTrainer(tiny_model(), [by_ids], cfg(out, max_steps=4, **kw), train_dataset=prompts(),
                                processing_class=tiny_tokenizer(), callbacks=list(callbacks))

    full = make(tmp_path / "a")
    full.train()
    first = make(tmp_path / "b", callbacks=[StopAt(2)], save_strategy="steps", save_steps=2)
    first.train()
    resumed = make(tmp_path / "b", save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    assert logged(resumed, "loss") == pytest.approx(logged(full, "loss"), abs=1e-6)
    for (k, v), (_, w) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        torch.testing.assert_close(w, v, rtol=0, atol=1e-6, msg=k)


def test_errors_name_the_field_before_any_model_loads(tmp_path):
    with pytest.raises(ConfigError, match="loss_type"):
        cfg(tmp_path, loss_type="dapo")  # a GRPO policy loss is not a preference loss
    with pytest.raises(ConfigError, match="beta: DPO's beta must be > 0"):
        cfg(tmp_path, beta=0.0)
    # GRPO's objective fields are not online DPO's: its config does not have them (GroupRolloutConfig is the base)
    names = {f.name for f in dataclasses.fields(OnlineDPOConfig)}
    assert not names & {"advantage_estimator", "scale_rewards", "epsilon", "mask_truncated_completions",
                        "off_policy_mask_threshold", "importance_sampling_cap"}
    with pytest.raises(ConfigError, match="num_generations: must be >= 2"):
        cfg(tmp_path, num_generations=1)
    # data is checked before the model: a model path that does not exist is never reached
    with pytest.raises(DataError, match="no known format in columns \\['question'\\]"):
        OnlineDPOTrainer("/nonexistent/model", [by_ids], cfg(tmp_path), train_dataset=[{"question": "hi"}] * 4,
                         processing_class=tiny_tokenizer())
