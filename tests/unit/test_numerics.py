"""Each shared numeric function against a naive reference: log-probs and entropy by chunks, masked sums,
aggregation, KL estimators (first part); group advantages, the clipped surrogate, truncated importance weights,
GAE and whitening (second part, the RL numerics)."""

import math

import pytest
import torch

from toolkit.core.numerics import (
    aggregate,
    chunked_entropy,
    chunked_token_logps,
    clipped_surrogate,
    clipped_value_loss,
    explained_variance,
    gae,
    group_advantages,
    kl_estimate,
    masked_mean,
    masked_sum,
    masked_whiten,
    rloo_advantages,
    truncated_importance_weights,
)


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


# ----------------------------------------------------------------------------------------------------
# RL numerics against naive loops: group advantages, clipped surrogate, truncated IS weights.
# ----------------------------------------------------------------------------------------------------


def _naive_adv(rewards, G, scale, eps=1e-4):
    out, zero = [], []
    groups = [rewards[i:i + G] for i in range(0, len(rewards), G)]
    centred_all = []
    for g in groups:
        vals = [r for r in g if not math.isnan(r)]
        mean = sum(vals) / len(vals) if vals else 0.0
        std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
        centred_all += [r - mean for r in vals]
        for r in g:
            zero.append(len(vals) < 2 or std < 1e-8)
    bstd_centred = torch.tensor(centred_all).std().item()
    raw = [r for r in rewards if not math.isnan(r)]
    raw_mean = sum(raw) / len(raw)
    bstd_raw = (sum((r - raw_mean) ** 2 for r in raw) / (len(raw) - 1)) ** 0.5
    for gi, g in enumerate(groups):
        vals = [r for r in g if not math.isnan(r)]
        mean = sum(vals) / len(vals) if vals else 0.0
        std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else 0.0
        for r in g:
            if math.isnan(r) or zero[gi * G]:
                out.append(0.0)
            elif scale == "group":
                out.append((r - mean) / (std + eps))
            elif scale == "batch":  # TRL: the std of the raw rewards
                out.append((r - mean) / (bstd_raw + eps))
            elif scale == "batch_centred":  # ScaleRL: the std of the group-centred rewards
                out.append((r - mean) / (bstd_centred + eps))
            else:
                out.append(r - mean)
    return out, zero


@pytest.mark.parametrize("scale", ["group", "batch", "batch_centred", "none"])
def test_group_advantages_match_naive(scale):
    nan = float("nan")
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, nan, 0.0, 1.0, nan, nan, nan, 3.0]
    adv, zero = group_advantages(torch.tensor(rewards), 4, scale=scale)
    ref_adv, ref_zero = _naive_adv(rewards, 4, scale)
    torch.testing.assert_close(adv, torch.tensor(ref_adv), rtol=1e-5, atol=1e-6)
    assert zero.tolist() == ref_zero
    assert zero[4:8].all() and zero[12:].all() and not zero[:4].any()


def test_clipped_surrogate_matches_naive():
    g = torch.Generator().manual_seed(0)
    logps, old = torch.randn(3, 5, generator=g) * 0.3, torch.randn(3, 5, generator=g) * 0.3
    adv = torch.tensor([1.0, -0.5, 0.0])
    loss, info = clipped_surrogate(logps, old, adv, epsilon_low=0.2, epsilon_high=0.28)
    for b in range(3):
        for t in range(5):
            r = math.exp(logps[b, t] - old[b, t])
            a = adv[b].item()
            ref = -min(r * a, min(max(r, 0.8), 1.28) * a)
            assert loss[b, t].item() == pytest.approx(ref, abs=1e-6)
            assert info["clipped_high"][b, t].item() == (r > 1.28 and a > 0)
            assert info["clipped_low"][b, t].item() == (r < 0.8 and a < 0)


def test_truncated_importance_weights():
    trainer = torch.tensor([[0.0, -1.0, -2.0]])
    sampler = torch.tensor([[-1.0, -1.0, 0.0]])
    w = truncated_importance_weights(trainer, sampler, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, math.exp(-2.0)]]))
    seq = truncated_importance_weights(trainer, sampler, cap=10.0, level="sequence", mask=torch.tensor([[1, 1, 0]]))
    torch.testing.assert_close(seq, torch.full((1, 3), math.e))


def test_rloo_advantages_match_a_leave_one_out_loop():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(24, generator=g)
    rewards[[1, 9, 10]] = float("nan")         # unrewarded rows leave their groups' baselines
    rewards[16:20] = 0.5                       # a zero-variance group
    rewards[20:23] = float("nan")              # a group with a single rewarded row
    adv, zero = rloo_advantages(rewards, 4)
    for k in range(6):
        group = rewards[4 * k:4 * k + 4].tolist()
        valid = [i for i, r in enumerate(group) if not math.isnan(r)]
        no_signal = len(valid) < 2 or max(group[i] for i in valid) - min(group[i] for i in valid) < 1e-8
        for i in range(4):
            assert bool(zero[4 * k + i]) == no_signal
            if no_signal or i not in valid:
                assert adv[4 * k + i] == 0
            else:
                others = [group[j] for j in valid if j != i]
                assert adv[4 * k + i].item() == pytest.approx(group[i] - sum(others) / len(others), abs=1e-6)


# ------------------------------------------------------------------------------------------- PPO


def _ragged(seed, B=5, T=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 4, 6, 3])[:B]
    mask = torch.arange(T)[None, :] < lengths[:, None]
    return (torch.randn(B, T, generator=g, dtype=torch.float64) * mask,
            torch.randn(B, T, generator=g, dtype=torch.float64) * mask, mask, lengths)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0)])
def test_gae_matches_a_per_row_loop(gamma, lam):
    rewards, values, mask, lengths = _ragged(0)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    for b, n in enumerate(lengths.tolist()):
        last = 0.0
        for t in reversed(range(n)):
            next_value = values[b, t + 1].item() if t + 1 < n else 0.0
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            last = delta + gamma * lam * last
            assert adv[b, t].item() == pytest.approx(last, abs=1e-10)
            assert ret[b, t].item() == pytest.approx(last + values[b, t].item(), abs=1e-10)
        assert (adv[b, n:] == 0).all() and (ret[b, n:] == 0).all()


def test_gae_ignores_whatever_sits_in_the_padding():
    rewards, values, mask, _ = _ragged(1)
    noisy_r = rewards + (~mask) * 100.0
    noisy_v = values + (~mask) * -50.0
    a1, r1 = gae(rewards, values, mask, gamma=0.97, lam=0.9)
    a2, r2 = gae(noisy_r, noisy_v, mask, gamma=0.97, lam=0.9)
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(r1, r2)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_naive(shift_mean):
    x, _, mask, _ = _ragged(2)
    out = masked_whiten(x, mask, shift_mean=shift_mean)
    sel = x[mask]
    expected = (sel - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + 1e-8) + (0 if shift_mean else sel.mean())
    torch.testing.assert_close(out[mask], expected)
    assert (out[~mask] == 0).all()
    with pytest.raises(ValueError, match="at least two"):
        one = torch.zeros_like(mask)
        one[0, 0] = True
        masked_whiten(x, one)


class _ThreadSum:
    """An all-reduce (sum) between threads: each thread is one "process" holding a shard of the batch."""

    def __init__(self, parties: int):
        import threading

        self.parties, self.lock, self.barrier = parties, threading.Lock(), threading.Barrier(parties)
        self.parts: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.parts.append(t.clone())
        self.barrier.wait()
        total = sum(self.parts[-self.parties:][1:], self.parts[-self.parties:][0].clone())
        self.barrier.wait()  # everyone has read this round before the next one appends
        return total


def _over_two_shards(fn, *tensors):
    """fn(*shard, reduce=...) run on the two row halves of `tensors` at once (threads), results by shard."""
    import threading

    reduce, out = _ThreadSum(2), [None, None]
    halves = [[t[:2] for t in tensors], [t[2:] for t in tensors]]

    def run(k):
        out[k] = fn(*halves[k], reduce=reduce)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    return out


def test_whitening_and_explained_variance_over_shards_equal_the_whole_batch():
    """PPO with several processes whitens advantages over every rank's tokens: the shards, reduced, must give
    what one process holding the whole (ragged) batch gives."""
    x, returns, mask, _ = _ragged(4)
    assert mask[:2].sum() != mask[2:].sum()  # unequal token counts: an average of shard statistics would differ
    for shift in (True, False):
        whole = masked_whiten(x, mask, shift_mean=shift)
        parts = _over_two_shards(lambda a, m, reduce: masked_whiten(a, m, shift_mean=shift, reduce=reduce), x, mask)
        torch.testing.assert_close(torch.cat(parts), whole)
        # and not what whitening each shard alone gives
        assert not torch.allclose(torch.cat([masked_whiten(x[:2], mask[:2]), masked_whiten(x[2:], mask[2:])]), whole)
    values = returns * 0.5 + x
    parts = _over_two_shards(lambda v, r, m, reduce: explained_variance(v, r, m, reduce=reduce), values, returns, mask)
    assert parts[0] == parts[1] == pytest.approx(explained_variance(values, returns, mask), rel=1e-9)


def test_clipped_value_loss_matches_naive():
    g = torch.Generator().manual_seed(4)
    v, old, ret = (torch.randn(4, 6, generator=g, dtype=torch.float64) for _ in range(3))
    loss, clipped = clipped_value_loss(v, old, ret, clip_range=0.2)
    for i in range(4):
        for j in range(6):
            vc = min(max(v[i, j].item(), old[i, j].item() - 0.2), old[i, j].item() + 0.2)
            a, b = (v[i, j].item() - ret[i, j].item()) ** 2, (vc - ret[i, j].item()) ** 2
            assert loss[i, j].item() == pytest.approx(0.5 * max(a, b), abs=1e-12)
            assert bool(clipped[i, j]) == (b > a)


def test_explained_variance():
    _, returns, mask, _ = _ragged(5)
    assert explained_variance(returns + 3.0, returns, mask) == pytest.approx(1.0)   # a constant offset explains all
    assert explained_variance(torch.zeros_like(returns), returns, mask) == pytest.approx(0.0, abs=1e-12)
    assert explained_variance(-returns, returns, mask) == pytest.approx(-3.0)       # Var(2R) / Var(R) = 4


def test_clipped_surrogate_takes_per_token_advantages():
    g = torch.Generator().manual_seed(6)
    logps, old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    adv = torch.randn(3, generator=g)
    per_seq, _ = clipped_surrogate(logps, old, adv, epsilon_low=0.2, epsilon_high=0.3)
    per_tok, _ = clipped_surrogate(logps, old, adv[:, None].expand(3, 5), epsilon_low=0.2, epsilon_high=0.3)
    torch.testing.assert_close(per_seq, per_tok)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("cap, floor", [(1.1, None), (1.1, 0.8), (None, 0.8)])
def test_importance_weights_match_naive(level, mode, cap, floor):
    """TIS and MIS at token and sequence level against a loop over tokens (TRL's four
    vllm_importance_sampling_mode values, with C_max and C_min)."""
    from toolkit.core.numerics import importance_weights

    trainer, sampler, mask, lengths = _ragged(9)
    noise = 0.4 if level == "token" else 0.08  # a sequence's ratio multiplies its tokens': keep some inside
    sampler = trainer + noise * torch.randn(trainer.shape, generator=torch.Generator().manual_seed(1),
                                            dtype=torch.float64)
    out = importance_weights(trainer, sampler, cap=cap, floor=floor, level=level, mode=mode, mask=mask)
    hi, lo = cap if cap is not None else math.inf, floor if floor is not None else -math.inf
    seen = set()
    for b, n in enumerate(lengths.tolist()):
        seq = math.exp(sum(trainer[b, t].item() - sampler[b, t].item() for t in range(n)))
        for t in range(n):
            w = seq if level == "sequence" else math.exp(trainer[b, t].item() - sampler[b, t].item())
            if mode == "truncate":
                expected = min(max(w, lo), hi)
            else:
                expected = 0.0 if (w > hi or w < lo) else w
            seen.add("cut" if expected != w else "kept")
            assert out[b, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert seen == {"cut", "kept"}  # the data exercises both sides


def test_off_policy_sequence_mask_matches_naive():
    """DeepSeek-V3.2 eq. 9: drop a completion iff its advantage is negative and its mean KL from the behaviour
    policy exceeds the threshold."""
    from toolkit.core.numerics import off_policy_sequence_mask

    logps, _, mask, lengths = _ragged(11)
    drift = torch.tensor([0.9, 0.9, 0.1, 0.9, 0.0], dtype=torch.float64)[:, None]
    behaviour = (logps + drift) * mask
    advantages = torch.tensor([-1.0, 0.5, -0.3, -2.0, -1.0], dtype=torch.float64)
    keep = off_policy_sequence_mask(logps, behaviour, advantages, mask, threshold=0.5)
    for b, n in enumerate(lengths.tolist()):
        kl = sum(behaviour[b, t].item() - logps[b, t].item() for t in range(n)) / n
        assert keep[b, 0].item() == (0.0 if advantages[b] < 0 and kl > 0.5 else 1.0)
    assert keep[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]
