"""The categorical draw behind every sampled token (`inverse_cdf_sample`, used by `sample_tokens`)."""

import torch

from toolkit.core.generation import SamplingParams, inverse_cdf_sample, sample_tokens


def test_draws_follow_the_distribution_and_never_pick_a_zero_probability_token():
    probs = torch.tensor([0.0, 0.1, 0.0, 0.6, 0.3, 0.0])  # zeros first, between and last
    g = torch.Generator().manual_seed(0)
    n = 200_000
    draws = inverse_cdf_sample(probs.expand(n, -1).contiguous(), g)
    counts = torch.bincount(draws, minlength=6).double() / n
    assert counts[[0, 2, 5]].sum() == 0
    # binomial standard error at p=0.6, n=2e5 is 0.0011: 5 standard errors
    torch.testing.assert_close(counts, probs.double(), atol=0.0055, rtol=0)


def test_a_one_hot_row_and_unnormalised_rows_are_drawn_right():
    g = torch.Generator().manual_seed(1)
    one_hot = torch.zeros(4, 49152)
    one_hot[:, 49151] = 1.0  # the last token of a large vocabulary: float error in the cdf must not move it
    assert inverse_cdf_sample(one_hot, g).tolist() == [49151] * 4
    scaled = torch.tensor([[0.0, 2.0, 6.0]]).expand(100_000, -1).contiguous()  # sums to 8, not 1
    counts = torch.bincount(inverse_cdf_sample(scaled, g), minlength=3).double() / 100_000
    torch.testing.assert_close(counts, torch.tensor([0.0, 0.25, 0.75], dtype=torch.float64), atol=0.007, rtol=0)


def test_the_same_seed_draws_the_same_tokens_and_log_probs_match_the_softmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(max_tokens=1, temperature=0.7, top_k=10)
    a = sample_tokens(logits, params, torch.Generator().manual_seed(3))
    b = sample_tokens(logits, params, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0])
    top10 = logits.topk(10, dim=-1).indices
    assert all(int(t) in top10[i].tolist() for i, t in enumerate(a[0]))  # top_k respected
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, a[0][:, None]).squeeze(-1)
    torch.testing.assert_close(a[1], expected)


def test_given_uniforms_are_the_draws_the_generator_would_have_made_and_a_row_draws_only_its_own():
    """The decode loop draws one uniform per sequence of the whole batch and samples the rows still decoding with
    theirs: given uniforms must be used exactly as drawn ones, row by row."""
    import pytest

    logits = torch.randn(6, 700, generator=torch.Generator().manual_seed(8))  # over _CDF_BLOCK: two-level cdf
    params = SamplingParams(max_tokens=1, temperature=0.9)
    drawn = sample_tokens(logits, params, torch.Generator().manual_seed(9))
    u = torch.rand((6, 1), generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    given = sample_tokens(logits, params, None, uniforms=u)
    assert torch.equal(given[0], drawn[0]) and torch.equal(given[1], drawn[1])
    some = torch.tensor([1, 4, 5])  # a batch that lost rows 0, 2 and 3
    part = sample_tokens(logits[some], params, None, uniforms=u[some].squeeze(-1))
    assert torch.equal(part[0], drawn[0][some])
    with pytest.raises(ValueError, match="5 uniforms for 6 rows"):
        inverse_cdf_sample(torch.softmax(logits, -1), None, uniforms=u[:5])


def test_rows_that_are_not_a_distribution_stop_with_the_reason_not_a_token():
    import pytest

    from toolkit import TrainingHealthError

    g = torch.Generator().manual_seed(4)
    for bad in (torch.tensor([[0.2, float("nan"), 0.8]]), torch.zeros(1, 3), torch.tensor([[0.5, float("inf"), 0.1]])):
        rows = torch.cat([torch.tensor([[0.1, 0.2, 0.7]]), bad])
        with pytest.raises(TrainingHealthError, match=r"row\(s\) \[1\] are not finite or sum to 0"):
            inverse_cdf_sample(rows, g)
    logits = torch.tensor([[1.0, float("nan"), 0.0]])  # a diverged model's logits, through sample_tokens
    with pytest.raises(TrainingHealthError, match="model diverged"):
        sample_tokens(logits, SamplingParams(max_tokens=1), g)


def test_the_two_level_cdf_picks_what_a_flat_cdf_picks_from_the_same_uniforms():
    # a vocabulary that is not a multiple of the block (padded), with a whole zero block and zeros at the ends
    g = torch.Generator().manual_seed(5)
    rows, vocab = 1024, 49152 + 77
    probs = torch.rand(rows, vocab, generator=g) ** 8  # peaked rows, many near-zero masses
    probs[:, 100:300] = 0.0  # part of block 0 and of block 1 (block 0 keeps mass: its branch is drawn too)
    probs[:, 5120:5632] = 0.0  # two whole blocks
    probs[:, -5:] = 0.0
    probs[::7, 40000] = 1e4  # some rows almost one-hot
    probs[1::5, 50] = 1e3  # and some drawing from block 0 most of the time
    got = inverse_cdf_sample(probs, torch.Generator().manual_seed(6))
    # the flat reference with the same uniform per row
    cdf = probs.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    flat = torch.searchsorted(cdf, x, right=True).squeeze(-1)
    assert torch.equal(got, flat)
    assert bool((probs.gather(-1, got[:, None]) > 0).all())
    assert bool((got < 256).any()) and bool((got >= 256).any())  # picks in the first block and in later ones


def test_untruncated_log_probs_match_log_softmax_and_degenerate_inputs():
    logits = torch.randn(16, 3000, generator=torch.Generator().manual_seed(7)) * 4
    tokens, logps = sample_tokens(logits, SamplingParams(max_tokens=1, temperature=0.7),
                                  torch.Generator().manual_seed(8))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logps, expected, rtol=0, atol=2e-6)
    assert inverse_cdf_sample(torch.empty(0, 3000), None).shape == (0,)
