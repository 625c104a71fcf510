"""Packed layouts give the same completion log-probs and gradients as separate sequences."""

import pytest
import torch

from toolkit.core.attention import use_varlen_attention
from toolkit.core.packing import common_start, completion_logps, group_by_prompt, pack_completions, pack_shared_prompts
from toolkit.testing import tiny_model


def _case():
    g = torch.Generator().manual_seed(0)
    p1, p2 = torch.randint(3, 384, (7,), generator=g).tolist(), torch.randint(3, 384, (5,), generator=g).tolist()
    prompts = [p1, p2, p1, p1, p2]  # groups need not be contiguous
    completions = [torch.randint(3, 384, (n,), generator=g).tolist() for n in (4, 1, 6, 3, 5)]
    return prompts, completions


@pytest.fixture(params=["per_segment", "one_call"])
def segment_path(request, monkeypatch):
    """Both ways toolkit_varlen attends packed segments: one sdpa call each (the CPU's path) and a few padded calls
    (every other device's path), forced here on the CPU so both are checked against separate rows."""
    from toolkit.core import attention

    monkeypatch.setattr(attention, "_batched_segments", lambda t: request.param == "one_call")
    real = attention._attend_segments

    def must_run(*args, **kwargs):  # a layout the padded path cannot take would fall back to the loop silently
        out = real(*args, **kwargs)
        assert out is not None, "the padded path fell back to the loop"
        return out

    monkeypatch.setattr(attention, "_attend_segments", must_run)
    return request.param


def _logps_and_grads(model, batch):
    model.zero_grad()
    lp = completion_logps(model, batch, temperature=0.8)
    (lp * torch.linspace(0.5, 1.5, len(lp))).sum().backward()
    return lp.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_shared_prompt_layout_equals_separate_sequences(segment_path):
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


def test_common_prefix_layout_equals_separate_sequences(segment_path):
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


def test_plain_sdpa_mixes_packed_examples_and_varlen_keeps_them_apart(segment_path):
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


def test_off_the_cpu_every_segment_of_a_layer_is_one_sdpa_call(monkeypatch):
    """The one-call path exists for GPUs, where a call per segment is launches and Python (bench/results/gpu):
    a shared-prompt micro-batch makes one sdpa call per layer there, and the device decides which path runs."""
    from toolkit.core import attention

    assert attention._batched_segments(torch.empty(1, device="meta"))
    assert not attention._batched_segments(torch.empty(1))
    prompts, completions = _case()
    batch = pack_shared_prompts(prompts, completions, group_by_prompt(prompts))
    model = tiny_model()
    use_varlen_attention(model)
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    for one_call in (False, True):
        monkeypatch.setattr(attention, "_batched_segments", lambda t, one_call=one_call: one_call)
        calls.clear()
        with torch.no_grad():
            completion_logps(model, batch)
        assert len(calls) == (model.config.num_hidden_layers if one_call else
                              model.config.num_hidden_layers * (2 + len(completions)))  # 2 prompts, 5 completions


def test_segments_that_do_not_tile_the_row_fall_back_to_the_loop():
    from toolkit.core.attention import _segment_plan

    assert _segment_plan(((0, 3, ()), (4, 6, ())), 6, torch.device("cpu")) is None  # a gap at 3
    assert _segment_plan(((0, 3, ()), (3, 6, ())), 7, torch.device("cpu")) is None  # the row is longer
    specs = ((3, 5, ((0, 3),)), (0, 3, ()))
    [(kind, q_idx, k_idx, mask, _)], out_idx = _segment_plan(specs, 5, torch.device("cpu"))
    # shortest keys first: the 3-token segment, then the 2 queries that see it and themselves; keys padded to 16
    assert kind == "padded" and q_idx.tolist() == [0, 1, 2, 3, 4, 4] and mask.shape == (2, 1, 3, 16)
    assert k_idx.tolist() == [0, 1, 2] + [0] * 13 + [0, 1, 2, 3, 4] + [0] * 11 and out_idx.tolist() == [0, 1, 2, 3, 4]
    assert mask[1, 0, :, :6].tolist() == [[True, True, True, True, False, False],
                                          [True, True, True, True, True, False],
                                          [True, False, False, False, False, False]]  # a padded row sees one key
    assert not mask[..., 6:].any()
    # two query heads per key head: the mask comes twice along the queries, one block per head
    [(_, _, _, mask2, _)], _ = _segment_plan(specs, 5, torch.device("cpu"), 2)
    assert mask2.shape == (2, 1, 6, 16) and torch.equal(mask2[:, :, :3], mask) and torch.equal(mask2[:, :, 3:], mask)


def test_a_long_segment_goes_alone_and_does_not_pad_the_short_ones():
    """Packed SFT rows of one long example and many short ones: the long one alone with no mask (the kernel that
    needs none stays usable), the short ones in one padded call; every position lands in exactly one slot."""
    from toolkit.core.attention import _ALONE_KEYS, _segment_plan

    long = _ALONE_KEYS + 500
    bounds = [(0, long)] + [(long + 20 * i, long + 20 * (i + 1)) for i in range(50)]
    calls, out_idx = _segment_plan(tuple((a, b, ()) for a, b in bounds), long + 1000, torch.device("cpu"))
    assert [c[0] for c in calls] == ["padded", "alone"] and calls[0][3].shape == (50, 1, 20, 32)
    assert calls[1][1] == (0, long, ())
    assert sorted(out_idx.tolist()) == list(range(long + 1000))  # a permutation: each slot once


def _shared_layout_specs():
    """A context, two groups of a prompt and completions of uneven length, one completion long enough to go
    alone: varlen_sdpa's toolkit_shared_prefix / toolkit_shared_context arguments."""
    from toolkit.core.attention import _ALONE_KEYS

    groups, pos = [], 6  # context 0..6
    for prompt, completions in ((9, (1, 30, 4, 200)), (3, (7, _ALONE_KEYS, 2))):
        p0, pos = pos, pos + prompt
        spans = []
        for n in completions:
            spans.append((pos, pos + n))
            pos += n
        groups.append((p0, p0 + prompt, spans))
    return groups, (0, 6), pos


@pytest.mark.parametrize("layout", ["packed_examples", "shared_prompt"])
def test_the_padded_path_equals_the_loop_on_uneven_segments(monkeypatch, layout):
    """Uneven segments (buckets, a bucket of one, a segment alone) through both paths, grouped-query heads (4 query
    heads on 2 kv heads): the same values and gradients of query, key and value."""
    from toolkit.core import attention

    g = torch.Generator().manual_seed(3)
    if layout == "packed_examples":
        lengths = [1, 3, 40, 2, 90, 7, 7, 1, 300, 5, attention._ALONE_KEYS + 1]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
        kwargs, T = {"cu_seq_lens_q": cu}, int(cu[-1])
        specs = tuple((a, b, ()) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()))
    else:
        groups, context, T = _shared_layout_specs()
        kwargs = {"toolkit_shared_prefix": groups, "toolkit_shared_context": context}
        specs = attention._shared_prefix_specs(groups, context)
    kinds = [c[0] for c in attention._segment_plan(specs, T, torch.device("cpu"))[0]]
    assert kinds.count("alone") >= 1 and kinds.count("padded") >= 2, kinds
    base = [torch.randn(1, h, T, 16, generator=g) for h in (4, 2, 2)]
    weights = torch.randn(1, T, 4, 16, generator=g)
    results = []
    for one_call in (False, True):
        monkeypatch.setattr(attention, "_batched_segments", lambda t, one_call=one_call: one_call)
        q, k, v = (t.clone().requires_grad_(True) for t in base)
        out, _ = attention.varlen_sdpa(None, q, k, v, None, scaling=0.3, **kwargs)
        assert out.shape == (1, T, 4, 16)
        (out * weights).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_padded_path_under_bf16_autocast_matches_the_loop(monkeypatch):
    """bf16=True training runs the forward under autocast, where the rotary embedding hands float32 queries to
    attention: the padded path's additive bias must be in the dtype autocast runs the kernel in."""
    from toolkit.core import attention

    prompts, completions = _case()
    batch = pack_shared_prompts(prompts, completions, group_by_prompt(prompts))
    model = tiny_model()
    use_varlen_attention(model)
    results = []
    for padded in (False, True):
        monkeypatch.setattr(attention, "_batched_segments", lambda t, padded=padded: padded)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = completion_logps(model, batch)
        lp.sum().backward()
        results.append((lp.detach(), model.model.layers[0].self_attn.q_proj.weight.grad.clone()))
    (lp_loop, g_loop), (lp_padded, g_padded) = results
    torch.testing.assert_close(lp_padded, lp_loop, atol=5e-3, rtol=0)  # the loop attends small segments in fp32
    assert ((g_padded - g_loop).norm() / g_loop.norm()).item() < 0.03


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
