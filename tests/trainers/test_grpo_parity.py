"""Parity with TRL's GRPOTrainer loss on the same tiny model, fixed batch of completions and advantages."""

import pytest
import torch

from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.testing import fixed_rollout, tiny_model, tiny_tokenizer, trl_grpo_inputs

trl = pytest.importorskip("trl")

B, G, C = 4, 4, 6


def _reward(prompts, completions, completion_ids, **kw):
    return [0.0] * len(completions)


def _batch(tok):
    g = torch.Generator().manual_seed(0)
    prompt_texts = ["What is 1 + 2?", "The quick brown"]
    prompts = [tok(t).input_ids for t in prompt_texts for _ in range(2)]
    lengths = [6, 4, 5, 3]
    completions = [torch.randint(3, 384, (n,), generator=g).tolist() for n in lengths]
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2])
    old = [(torch.randn(n, generator=g) * 0.1 - 3.0) for n in lengths]
    ref = [(torch.randn(n, generator=g) * 0.1 - 3.0) for n in lengths]
    return prompts, completions, advantages, old, ref


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta, kl_bias_correction", [(0.0, True), (0.04, True), (0.04, False)])
def test_loss_equals_trl(tmp_path, loss_type, beta, kl_bias_correction):
    from datasets import Dataset

    tok = tiny_tokenizer()
    prompts, completions, advantages, old, ref = _batch(tok)
    common = dict(per_device_train_batch_size=B, max_completion_length=C, temperature=0.7, beta=beta,
                  loss_type=loss_type, epsilon=0.2, report_to="none", learning_rate=1e-3)

    tiny_model().save_pretrained(tmp_path / "tiny")  # TRL reads files next to the model
    theirs = trl.GRPOTrainer(
        model=str(tmp_path / "tiny"), reward_funcs=_reward, processing_class=tok,
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=G, use_cpu=True, bf16=False,
                            use_bias_correction_kl=kl_bias_correction,
                            model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"}, **common),
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * 8))
    theirs.model.train()
    if not hasattr(theirs, "current_gradient_accumulation_steps"):
        theirs.current_gradient_accumulation_steps = 1
    trl_loss = theirs._compute_loss(theirs.model, trl_grpo_inputs(prompts, completions, advantages, old, tok.pad_token_id, C,
                                                                    ref_logps=ref))

    ours = GRPOTrainer(tiny_model(), [_reward],
                       GRPOConfig(output_dir=str(tmp_path / "ours"), num_generations=2, importance_sampling_cap=None,
                                  kl_bias_correction=kl_bias_correction,
                                  zero_variance_filter=False, **common),
                       train_dataset=[{"prompt": "hi"}] * 8, processing_class=tok)
    ours.model.train()
    ours.current_gradient_accumulation_steps = 1
    rollout = fixed_rollout(prompts, completions, advantages, old, 2, ref_logps=ref if beta else None)
    micro = ours._split(rollout)[0]
    our_loss = ours.compute_loss(ours.model, micro)
    assert our_loss.item() == pytest.approx(trl_loss.item(), abs=1e-5, rel=1e-5)
    # and the gradients agree
    trl_loss.backward()
    our_loss.backward()
    for (k, p), (_, q) in zip(theirs.model.named_parameters(), ours.model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("beta, kl_bias_correction", [(0.0, True), (0.04, False)])
def test_gspo_equals_trls_sequence_level_importance_sampling(tmp_path, beta, kl_bias_correction):
    """Our loss_type='gspo' is TRL's loss_type='grpo' with importance_sampling_level='sequence' (GSPO). With a KL
    term and bias correction TRL weights the KL by the sequence ratio and we by the token ratio, so parity is
    checked without that correction."""
    from datasets import Dataset

    from toolkit.core.numerics import gspo_surrogate
    from toolkit.core.packing import completion_logps, pack_completions

    tok = tiny_tokenizer()
    prompts, completions, advantages, _, ref = _batch(tok)
    # old log-probs = the model's own, shifted per row so that the sequence log-ratios are +1e-3 (advantage > 0:
    # above 1 + 4e-4, clipped high), -1e-3 (advantage < 0: clipped low), 1e-4 and 0 (inside the range)
    model = tiny_model()
    batch = pack_completions(prompts, completions, pad_token_id=tok.pad_token_id, padding_free=False)
    with torch.no_grad():
        flat = completion_logps(model, batch, temperature=0.7)
    now = list(flat.split([len(c) for c in completions]))
    shift = [1e-3, -1e-3, 1e-4, 0.0]
    old = [lp - s for lp, s in zip(now, shift)]
    padded = lambda rows: torch.stack([torch.nn.functional.pad(r, (0, C - len(r))) for r in rows])  # noqa: E731
    mask = torch.stack([torch.arange(C) < len(c) for c in completions])
    _, info = gspo_surrogate(padded(now), padded(old), advantages, mask, epsilon_low=3e-4, epsilon_high=4e-4)
    assert info["clipped_high"].any() and info["clipped_low"].any() and not info["clipped_high"][2:].any()
    common = dict(per_device_train_batch_size=B, max_completion_length=C, temperature=0.7, beta=beta,
                  epsilon=3e-4, epsilon_high=4e-4, report_to="none", learning_rate=1e-3)
    tiny_model().save_pretrained(tmp_path / "tiny")
    theirs = trl.GRPOTrainer(
        model=str(tmp_path / "tiny"), reward_funcs=_reward, processing_class=tok,
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=G, use_cpu=True, bf16=False,
                            loss_type="grpo", importance_sampling_level="sequence",
                            use_bias_correction_kl=kl_bias_correction,
                            model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"}, **common),
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * 8))
    theirs.model.train()
    if not hasattr(theirs, "current_gradient_accumulation_steps"):
        theirs.current_gradient_accumulation_steps = 1
    trl_loss = theirs._compute_loss(theirs.model, trl_grpo_inputs(prompts, completions, advantages, old,
                                                                    tok.pad_token_id, C, ref_logps=ref))
    ours = GRPOTrainer(tiny_model(), [_reward],
                       GRPOConfig(output_dir=str(tmp_path / "ours"), num_generations=2, importance_sampling_cap=None,
                                  loss_type="gspo", kl_bias_correction=kl_bias_correction, zero_variance_filter=False,
                                  **common),
                       train_dataset=[{"prompt": "hi"}] * 8, processing_class=tok)
    ours.model.train()
    ours.current_gradient_accumulation_steps = 1
    micro = ours._split(fixed_rollout(prompts, completions, advantages, old, 2, ref_logps=ref if beta else None))[0]
    our_loss = ours.compute_loss(ours.model, micro)
    assert our_loss.item() == pytest.approx(trl_loss.item(), abs=1e-5, rel=1e-5)
    trl_loss.backward()
    our_loss.backward()
    for (k, p), (_, q) in zip(theirs.model.named_parameters(), ours.model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=k)
    assert sum(float(q.grad.abs().sum()) for q in ours.model.parameters()) > 0  # not a batch clipped to nothing


@pytest.mark.parametrize("scale_rewards", ["batch", "group", "none"])
def test_advantages_equal_trls_for_the_same_rewards(tmp_path, scale_rewards):
    """TRL's own _generate_and_score_completions (it samples with the tiny model) against our advantage
    estimator on the rewards TRL's call received: scale_rewards="batch" divides by the std of the raw batch
    rewards in both (toolkit <= 0.2.0 divided by the std of the group-centred rewards, now "batch_centred")."""
    from datasets import Dataset

    from toolkit.core.numerics import group_advantages

    seen: list[list[float]] = []

    def varied(prompts, completions, **kw):
        # groups of unequal means and spreads, so raw and centred batch stds differ
        out = [float((i * 7) % 5) + 3.0 * (i // G) for i in range(len(completions))]
        seen.append(out)
        return out

    tok = tiny_tokenizer()
    tiny_model().save_pretrained(tmp_path / "tiny")
    theirs = trl.GRPOTrainer(
        model=str(tmp_path / "tiny"), reward_funcs=varied, processing_class=tok,
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=G, per_device_train_batch_size=3 * G,
                            max_completion_length=4, scale_rewards=scale_rewards, use_cpu=True, bf16=False,
                            report_to="none", model_init_kwargs={"dtype": torch.float32}),
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * 12))
    inputs = [{"prompt": p} for p in ("What is 1 + 2?", "The quick brown", "Count to three:") for _ in range(G)]
    trl_adv = theirs._generate_and_score_completions(inputs)["advantages"]
    rewards = torch.tensor(seen[-1])
    ours, _ = group_advantages(rewards, G, scale=scale_rewards)
    torch.testing.assert_close(ours, trl_adv.float(), rtol=1e-5, atol=1e-5)
    if scale_rewards == "batch":
        centred, _ = group_advantages(rewards, G, scale="batch_centred")
        assert not torch.allclose(centred, trl_adv.float(), atol=1e-3)  # the old meaning differs from TRL's


@pytest.mark.parametrize("is_mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_off_policy_mask_and_importance_sampling_modes_equal_trl(tmp_path, is_mode):
    """DeepSeek-V3.2's off-policy sequence mask and the four sampler-correction modes (TIS/MIS x token/sequence,
    with a lower bound) through the whole loss, against TRL's _compute_loss on the same batch. TRL computes its
    sampler ratio while generating with vLLM, which it cannot do here; the test gives TRL that ratio computed
    by TRL's documented rule, written out below, and lets TRL's loss do the rest."""
    from datasets import Dataset

    tok = tiny_tokenizer()
    prompts, completions, advantages, old, ref = _batch(tok)
    level, mode = is_mode.split("_")
    g = torch.Generator().manual_seed(3)
    noise = 0.5 if level == "token" else 0.3
    sampler = [o + noise * torch.randn(len(o), generator=g) for o in old]
    cap, floor, threshold = 1.3, 0.7, 0.05
    common = dict(per_device_train_batch_size=B, max_completion_length=C, temperature=0.7, beta=0.04,
                  loss_type="dapo", epsilon=0.2, report_to="none", learning_rate=1e-3)
    tiny_model().save_pretrained(tmp_path / "tiny")
    theirs = trl.GRPOTrainer(
        model=str(tmp_path / "tiny"), reward_funcs=_reward, processing_class=tok,
        args=trl.GRPOConfig(output_dir=str(tmp_path / "trl"), num_generations=G, use_cpu=True, bf16=False,
                            off_policy_mask_threshold=threshold, vllm_importance_sampling_mode=is_mode,
                            vllm_importance_sampling_clip_max=cap, vllm_importance_sampling_clip_min=floor,
                            model_init_kwargs={"dtype": torch.float32, "attn_implementation": "sdpa"}, **common),
        train_dataset=Dataset.from_list([{"prompt": "hi"}] * 8))
    theirs.model.train()
    theirs.current_gradient_accumulation_steps = getattr(theirs, "current_gradient_accumulation_steps", 1)
    inputs = trl_grpo_inputs(prompts, completions, advantages, old, tok.pad_token_id, C, ref_logps=ref)
    samp = torch.zeros(B, C)
    for i, s in enumerate(sampler):
        samp[i, :len(s)] = s
    diff = (inputs["old_per_token_logps"] - samp) * inputs["completion_mask"]
    ratio = torch.exp(diff.sum(-1, keepdim=True) if level == "sequence" else diff)
    ratio = ratio.clamp(floor, cap) if mode == "truncate" else ratio.masked_fill((ratio < floor) | (ratio > cap), 0.0)
    inputs.update(sampling_per_token_logps=samp, importance_sampling_ratio=ratio)
    theirs.use_vllm, theirs.vllm_importance_sampling_correction = True, True  # read the ratio given above
    trl_loss = theirs._compute_loss(theirs.model, inputs)

    ours = GRPOTrainer(tiny_model(), [_reward],
                       GRPOConfig(output_dir=str(tmp_path / "ours"), num_generations=2, importance_sampling_cap=cap,
                                  importance_sampling_min=floor, importance_sampling_level=level,
                                  importance_sampling_mode=mode, off_policy_mask_threshold=threshold,
                                  zero_variance_filter=False, **common),
                       train_dataset=[{"prompt": "hi"}] * 8, processing_class=tok)
    ours.model.train()
    ours.current_gradient_accumulation_steps = 1
    rollout = fixed_rollout(prompts, completions, advantages, old, 2, ref_logps=ref)
    rollout.sampler_logps = [s.tolist() for s in sampler]
    our_loss = ours.compute_loss(ours.model, ours._split(rollout)[0])
    masked = ours.recorded_metrics()["off_policy_mask/masked_frac"][-1]
    assert 0 < masked < 1  # the mask dropped some completions and kept others
    if mode == "mask":
        assert 0 < ours.recorded_metrics()["importance_ratio/masked_frac"][-1] < 1
    assert our_loss.item() == pytest.approx(trl_loss.item(), abs=1e-5, rel=1e-5)
    trl_loss.backward()
    our_loss.backward()
    for (k, p), (_, q) in zip(theirs.model.named_parameters(), ours.model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=k)
