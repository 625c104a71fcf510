"""Packed layouts give the same completion log-probs and gradients as separate sequences."""

import pytest
import torch

from toolkit.core.attention import use_varlen_attention
from toolkit.core.packing import (common_start, completion_logps, group_by_prompt, pack_completions,
                                  pack_shared_prompts)
from toolkit.testing import tiny_model


def _case():
    g = torch.Generator().manual_seed(0)
    p1, p2 = torch.randint(3, 384, (7,), generator=g).tolist(), torch.randint(3, 384, (5,), generator=g).tolist()
    prompts = [p1, p2, p1, p1, p2]  # groups need not be contiguous
    completions = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (4, 1, 6, 3, 5)]
    return prompts, completions


def _logps_and_grads(model, batch):
    model.zero_grad()
    lp = completion_logps(model, batch, temperature=0.8)
    (lp * torch.linspace(0.5, 1.5, len(lp))).sum().backward()
    return lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_shared_prompt_layout_equals_separate_sequences():
    prompts, completions = _case()
    model = tiny_model()
    padded = pack_completions(prompts, completions, pad_token_id=0, padding_free=False)
    ref, ref_grads = _logps_and_grads(model, padded)  # plain sdpa, one row per sequence
    use_varlen_attention(model)
    for batch in (pack_completions(prompts, completions, pad_token_id=0),
                  pack_shared_prompts(prompts, completions, group_by_prompt(prompts))):
        lp, grads = _logps_and_grads(model, batch)
        torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-5, msg=k)
    shared = pack_shared_prompts(prompts, completions, group_by_prompt(prompts))
    assert shared["input_ids"].shape[1] == 7 + 5 + sum(map(len, completions))  # each prompt once


def _common_prefix_case():
    """Prompts that start alike (a chat template's system prompt): one is the common start itself (only its last
    token left for its group's span), one has two completions, and a completion of one token."""
    g = torch.Generator().manual_seed(1)
    head = torch.randint(3, 384, (10,), generator=g).tolist()  # worth sharing: (groups - 1) x 10 >= 16 tokens
    p1 = head + torch.randint(3, 384, (4,), generator=g).tolist()
    p2 = head + torch.randint(3, 384, (2,), generator=g).tolist()
    prompts = [p1, p2, head, p1, p2]
    completions = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (3, 1, 4, 2, 5)]
    return head, prompts, completions


def test_common_prefix_layout_equals_separate_sequences():
    head, prompts, completions = _common_prefix_case()
    model = tiny_model()
    padded = pack_completions(prompts, completions, pad_token_id=0, padding_free=False)
    ref, ref_grads = _logps_and_grads(model, padded)
    use_varlen_attention(model)
    for groups in (group_by_prompt(prompts), [[i] for i in range(len(prompts))]):  # PPO: every row its own group
        batch = pack_shared_prompts(prompts, completions, groups, common_prefix=True)
        shared = len(head) - 1  # the prompt that is all head keeps its last token in its own span
        assert batch["shared_context"] == (0, shared)
        flat = batch["input_ids"][0].tolist()
        assert flat[:shared] == head[:shared] and batch["input_ids"].shape[1] == shared + sum(
            len(prompts[g[0]]) - shared for g in groups) + sum(map(len, completions))  # the head once
        # each sequence's last token, where a reward model reads its score
        assert [flat[e] for e in batch["sequence_ends"].tolist()] == [c[-1] for c in completions]
        lp, grads = _logps_and_grads(model, batch)
        torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)
        for k in ref_grads:
            torch.testing.assert_close(grads[k], ref_grads[k], rtol=1e-4, atol=1e-5, msg=k)
    # nothing in common, one group, or too little in common to be worth it: no context
    assert "shared_context" not in pack_shared_prompts([[5, 6], [7, 6]], [[1], [2]], [[0], [1]], common_prefix=True)
    assert "shared_context" not in pack_shared_prompts([[5, 6], [5, 6]], [[1], [2]], [[0, 1]], common_prefix=True)
    assert "shared_context" not in pack_shared_prompts([[5, 6], [5, 7]], [[1], [2]], [[0], [1]], common_prefix=True)


def test_common_start_keeps_each_prompts_last_token_and_pays_off():
    head = list(range(30, 50))
    assert common_start([head + [1], head + [2]]) == 20
    assert common_start([head, head + [2]]) == 19  # the shorter prompt keeps its last token
    assert common_start([head[:8] + [1], head[:8] + [2]]) == 0  # saves 8 < 16 tokens
    assert common_start([head[:8] + [1], head[:8] + [2], head[:8] + [3]]) == 8  # saves 16
    assert common_start([head + [1]]) == 0


def test_sequence_ends_in_every_layout():
    prompts, completions = _case()
    for batch in (pack_completions(prompts, completions, pad_token_id=0),
                  pack_completions(prompts, completions, pad_token_id=0, padding_free=False),
                  pack_shared_prompts(prompts, completions, group_by_prompt(prompts))):
        flat = batch["input_ids"].reshape(-1).tolist()
        assert [flat[e] for e in batch["sequence_ends"].tolist()] == [c[-1] for c in completions]


def test_shared_layout_rejects_bad_groups():
    prompts, completions = _case()
    with pytest.raises(ValueError, match="identical prompts"):
        pack_shared_prompts(prompts, completions, [[0, 1], [2, 3, 4]])
    with pytest.raises(ValueError, match="prompt of row 1 is empty"):
        pack_shared_prompts([[5], []], [[1], [2]], [[0], [1]], common_prefix=True)
    with pytest.raises(ValueError, match="every row exactly once"):
        pack_shared_prompts(prompts, completions, [[0, 2], [1, 4]])


def test_plain_sdpa_mixes_packed_examples_and_varlen_keeps_them_apart():
    """Why toolkit_varlen exists (attention.py's docstring): position_ids alone do not separate packed rows."""
    import torch

    from toolkit.core.attention import use_varlen_attention, varlen_kwargs
    from toolkit.testing import tiny_model

    model = tiny_model().eval()
    model.config._attn_implementation = "sdpa"
    a, b = torch.tensor([[5, 9, 11, 13]]), torch.tensor([[7, 8, 21]])
    packed, pos = torch.cat([a, b], 1), torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    with torch.no_grad():
        alone = model(input_ids=b).logits[0]
        mixed = model(input_ids=packed, position_ids=pos).logits[0, 4:]
        use_varlen_attention(model)
        apart = model(input_ids=packed, position_ids=pos, **varlen_kwargs(torch.tensor([0, 4, 7]))).logits[0, 4:]
    assert not torch.allclose(mixed, alone, atol=1e-4)
    torch.testing.assert_close(apart, alone, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("keep_for_backward", [False, True])
def test_logps_with_entropy_equal_logps_and_a_separate_entropy(keep_for_backward, monkeypatch):
    """completion_logps_and_entropy (GRPO's and PPO's training forward) gives completion_logps' values and
    gradients, and the entropy of the same softmax that completion_entropy (their fallback) and a plain
    log_softmax give."""
    from toolkit.core.packing import completion_entropy, completion_hidden, completion_logps_and_entropy

    prompts, completions = _case()
    model = tiny_model()
    batch = pack_completions(prompts, completions, pad_token_id=0, padding_free=False)
    ref, ref_grads = _logps_and_grads(model, batch)
    model.zero_grad()
    import toolkit.core.numerics as numerics

    products = []  # LM-head products: the kept path makes one in forward and none in backward
    real = numerics._chunk_logits
    monkeypatch.setattr(numerics, "_chunk_logits", lambda *a: products.append(1) or real(*a))
    # keep_for_backward acts only when every position fits one chunk (19 here): otherwise chunks of 4
    lp, ent = completion_logps_and_entropy(model, batch, temperature=0.8, chunk_size=64 if keep_for_backward else 4,
                                           keep_for_backward=keep_for_backward)
    assert not ent.requires_grad and ent.shape == lp.shape == (sum(map(len, completions)),)
    in_forward = len(products)
    (lp * torch.linspace(0.5, 1.5, len(lp))).sum().backward()
    assert (in_forward, len(products) - in_forward) == ((1, 0) if keep_for_backward else (5, 5))
    torch.testing.assert_close(lp.detach(), ref, rtol=1e-5, atol=1e-6)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[k], rtol=1e-4, atol=1e-6, msg=k)
    with torch.no_grad():
        hidden = completion_hidden(model, batch)
        logits = model.get_output_embeddings()(hidden).float() / 0.8
        expected = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(ent, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(completion_entropy(model, hidden, temperature=0.8, chunk_size=3), expected,
                               rtol=1e-5, atol=1e-5)
    assert expected.min() > 0.1  # a tiny random model is far from one-hot: the comparison is not of zeros
