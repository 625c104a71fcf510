"""RL numerics against naive loops: group advantages, clipped surrogate, truncated IS weights."""

import math

import pytest
import torch

from toolkit.core.numerics import (
    clipped_surrogate,
    clipped_value_loss,
    explained_variance,
    gae,
    group_advantages,
    masked_whiten,
    rloo_advantages,
    truncated_importance_weights,
)


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
