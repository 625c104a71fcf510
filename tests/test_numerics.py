"""Each shared numeric function against a naive reference."""

import pytest
import torch

from toolkit.core.numerics import aggregate, chunked_entropy, chunked_token_logps, kl_estimate, masked_mean, masked_sum


def _naive_logps(hidden, weight, targets, bias=None, temperature=1.0):
    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, targets[:, None]).squeeze(-1)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_logps_match_naive_values_and_grads(chunk_size, temperature, with_bias):
    g = torch.Generator().manual_seed(0)
    n, h, v = 37, 16, 101
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)

    # fp64 inputs: the fp32 internals are compared at fp32 tolerance
    ours = chunked_token_logps(hidden, weight, targets, bias=bias, temperature=temperature, chunk_size=chunk_size)
    (ours.double() * upstream).sum().backward()
    grads = [hidden.grad.clone(), weight.grad.clone()] + ([bias.grad.clone()] if with_bias else [])
    for t in [hidden, weight] + ([bias] if with_bias else []):
        t.grad = None
    ref = _naive_logps(hidden, weight, targets, bias, temperature)
    (ref.double() * upstream).sum().backward()
    ref_grads = [hidden.grad, weight.grad] + ([bias.grad] if with_bias else [])

    torch.testing.assert_close(ours.double(), ref.double(), rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4)


def test_one_chunk_keeps_its_log_softmax_for_backward_and_backward_can_run_twice():
    # n <= chunk_size: backward uses the forward's log-softmax instead of a second LM-head product and releases
    # it; a retained graph's second backward recomputes and must give the same gradients, as must the
    # recomputing path (two chunks)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(12, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(30, 8, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 30, (12,), generator=g)
    from toolkit.core.numerics import chunked_token_logps_and_entropy

    def kept_logps(chunk):
        return chunked_token_logps_and_entropy(hidden, weight, targets, temperature=0.7, chunk_size=chunk,
                                               keep_for_backward=True)[0]

    grads = []
    for chunk in (12, 6):
        out = kept_logps(chunk)
        for _ in range(2):
            hidden.grad = weight.grad = None
            out.sum().backward(retain_graph=True)
            grads.append((hidden.grad.clone(), weight.grad.clone()))
    # and the kept path really skips the product: 2 matmuls in backward (grads of hidden and weight), not 3
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm_.default):
                CountMatmuls.n += 1
            return func(*args, **(kwargs or {}))

    cases = ((kept_logps, 12, 2), (kept_logps, 6, 6),
             # not asked for (the plain function, or another forward before backward): recomputed
             (lambda c: chunked_token_logps(hidden, weight, targets, temperature=0.7, chunk_size=c), 12, 3))
    for fn, chunk, expected in cases:
        out = fn(chunk)
        CountMatmuls.n = 0
        with CountMatmuls():
            out.sum().backward()
        assert CountMatmuls.n == expected, chunk
    for a, b in zip(grads[1:], grads[:1] * 3):
        torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-6)


def test_no_positions_give_zero_head_gradients_not_none():
    # a micro-batch with nothing to score: every rank's head gradient must exist (DDP / FSDP2 wait for it)
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(30, 8, requires_grad=True)
    bias = torch.randn(30, requires_grad=True)
    out = chunked_token_logps(hidden, weight, torch.zeros(0, dtype=torch.long), bias=bias)
    (out.sum() + 0 * weight.sum()).backward()
    assert out.shape == (0,)
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


def test_chunked_logps_bf16_upcasts_the_head():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 8, generator=g).bfloat16()
    weight = torch.randn(50, 8, generator=g).bfloat16()
    targets = torch.randint(0, 50, (9,), generator=g)
    ours = chunked_token_logps(hidden, weight, targets, chunk_size=4, upcast=True)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, _naive_logps(hidden.float(), weight.float(), targets), rtol=1e-5, atol=1e-5)


def test_chunked_logps_upcast_holds_under_autocast():
    """A wrapper's bf16 autocast region must not take the promised float32 LM head back to bfloat16."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 64, generator=g)
    weight = torch.randn(500, 64, generator=g)
    targets = torch.randint(0, 500, (9,), generator=g)
    reference = _naive_logps(hidden, weight, targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        upcast = chunked_token_logps(hidden, weight, targets, chunk_size=4, upcast=True)
        entropy = chunked_entropy(hidden, weight, chunk_size=4, upcast=True)
        low = chunked_token_logps(hidden, weight, targets, chunk_size=4, upcast=False)
    torch.testing.assert_close(upcast, reference, rtol=1e-5, atol=1e-5)
    p = torch.softmax(hidden @ weight.t(), -1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-5)
    # without upcast autocast applies as the caller asked: the bfloat16 product is visibly different
    assert (low - reference).abs().max() > 1e-3
    # backward() called inside the region too (its LM-head products recomputed and multiplied): float32 gradients
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    _naive_logps(h_ref, w_ref, targets).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chunked_token_logps(h, w, targets, chunk_size=4, upcast=True).sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-4, atol=1e-4)  # bfloat16 products: errors near 1e-2
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-4, atol=1e-4)
    # a float32 hidden state before a bfloat16 head: upcast covers the head too
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = chunked_token_logps(hidden, weight.bfloat16(), targets, chunk_size=4, upcast=True)
    torch.testing.assert_close(mixed, _naive_logps(hidden, weight.bfloat16().float(), targets), rtol=1e-5, atol=1e-5)


def test_chunked_logps_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"hidden \[N, H\]"):
        chunked_token_logps(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        chunked_token_logps(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, dtype=torch.long), temperature=0)


def test_chunked_entropy_matches_naive():
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(23, 8, generator=g), torch.randn(40, 8, generator=g)
    for temp in (1.0, 0.5):
        p = torch.softmax(hidden @ weight.t() / temp, -1)
        naive = -(p * p.log()).sum(-1)
        torch.testing.assert_close(chunked_entropy(hidden, weight, temperature=temp, chunk_size=5), naive,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 5, 1000])
def test_logps_and_entropy_in_one_pass_match_the_two_functions_values_and_grads(chunk_size):
    from toolkit.core.numerics import chunked_token_logps_and_entropy

    g = torch.Generator().manual_seed(3)
    n, h, v = 23, 8, 40
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g, dtype=torch.float64)
    logps, entropy = chunked_token_logps_and_entropy(hidden, weight, targets, temperature=0.7, chunk_size=chunk_size)
    assert not entropy.requires_grad  # a metric
    (logps.double() * upstream).sum().backward()
    grads = [hidden.grad.clone(), weight.grad.clone()]
    hidden.grad = weight.grad = None
    ref = chunked_token_logps(hidden, weight, targets, temperature=0.7, chunk_size=chunk_size)
    (ref.double() * upstream).sum().backward()
    torch.testing.assert_close(logps, ref, rtol=0, atol=0)
    for a, b in zip(grads, [hidden.grad, weight.grad]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    p = torch.softmax(hidden.detach() @ weight.detach().t() / 0.7, -1)
    torch.testing.assert_close(entropy.double(), -(p * p.log()).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, chunked_entropy(hidden.detach(), weight.detach(), temperature=0.7,
                                                        chunk_size=chunk_size), rtol=1e-6, atol=1e-6)


def test_masked_sum_and_mean():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert masked_sum(v, m).item() == 3.0
    assert masked_mean(v, m).item() == 1.5
    torch.testing.assert_close(masked_mean(v, m, dim=1), torch.tensor([1.5, 0.0]))  # empty row -> 0, not NaN
    assert masked_mean(v, torch.zeros_like(m)).item() == 0.0


def _naive_aggregate(per_token, mask, mode, constant=None, group_ids=None):
    B, T = per_token.shape
    if mode == "token":
        s = n = 0.0
        for b in range(B):
            for t in range(T):
                if mask[b, t]:
                    s += per_token[b, t].item()
                    n += 1
        return s / n
    if mode == "sequence":
        out = []
        for b in range(B):
            vals = [per_token[b, t].item() for t in range(T) if mask[b, t]]
            out.append(sum(vals) / max(len(vals), 1))
        return sum(out) / B
    if mode == "constant":
        return sum(per_token[b, t].item() for b in range(B) for t in range(T) if mask[b, t]) / (B * constant)
    if mode == "prompt":
        groups = {}
        for b in range(B):
            groups.setdefault(int(group_ids[b]), []).extend(per_token[b, t].item() for t in range(T) if mask[b, t])
        return sum(sum(v) / max(len(v), 1) for v in groups.values()) / len(groups)


@pytest.mark.parametrize("mode", ["token", "sequence", "constant", "prompt"])
def test_aggregate_matches_naive(mode):
    g = torch.Generator().manual_seed(3)
    per_token = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.3).int()
    mask[:, 0] = 1
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2])
    ours = aggregate(per_token, mask, mode, constant=5, group_ids=group_ids)
    assert ours.item() == pytest.approx(_naive_aggregate(per_token, mask, mode, 5, group_ids), rel=1e-6)


@pytest.mark.parametrize("mode", ["token", "sequence", "constant", "prompt"])
def test_aggregate_with_global_counts_is_split_invariant(mode):
    """Micro-batches normalised by global counts add up to the full-batch value (8x1 == 4x2)."""
    g = torch.Generator().manual_seed(4)
    per_token = torch.randn(8, 5, generator=g)
    mask = (torch.rand(8, 5, generator=g) > 0.3).int()
    mask[:, 0] = 1
    group_ids = torch.arange(8) // 2
    full = aggregate(per_token, mask, mode, constant=5, group_ids=group_ids)
    kw = {"num_items": mask.sum(), "num_sequences": 8 if mode != "prompt" else 4}
    halves = sum(aggregate(per_token[s], mask[s], mode, constant=5, group_ids=group_ids[s], **kw)
                 for s in (slice(0, 4), slice(4, 8)))
    torch.testing.assert_close(halves, full)


def test_aggregate_errors_are_explicit():
    with pytest.raises(ValueError, match="constant > 0"):
        aggregate(torch.zeros(2, 2), torch.ones(2, 2), "constant")
    with pytest.raises(ValueError, match="group_ids"):
        aggregate(torch.zeros(2, 2), torch.ones(2, 2), "prompt")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(torch.zeros(2, 2), torch.ones(2, 2), "mean")


def test_kl_estimators_formulas_and_monte_carlo():
    g = torch.Generator().manual_seed(5)
    p_logits, q_logits = torch.randn(10, generator=g), torch.randn(10, generator=g)
    logp, logq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    true_kl = (logp.exp() * (logp - logq)).sum()
    samples = torch.multinomial(logp.exp(), 200_000, replacement=True, generator=g)
    lp, lq = logp[samples], logq[samples]
    k1, k2, k3 = (kl_estimate(lp, lq, k) for k in ("k1", "k2", "k3"))
    torch.testing.assert_close(k1, lp - lq)
    torch.testing.assert_close(k2, 0.5 * (lq - lp) ** 2)
    torch.testing.assert_close(k3, torch.exp(lq - lp) - (lq - lp) - 1)
    assert (k3 >= 0).all()
    # k1 and k3 are unbiased estimators of KL(p || q)
    assert k1.mean().item() == pytest.approx(true_kl.item(), abs=0.02)
    assert k3.mean().item() == pytest.approx(true_kl.item(), abs=0.02)
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_estimate(lp, lq, "k4")
