"""bench/async_model.py, the pipeline model docs/async_grpo.md uses for deployments we cannot run: the cases
whose answer is known in closed form."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
from async_model import Phases, simulate_async, simulate_sync  # noqa: E402


def test_staleness_zero_is_synchronous():
    p = Phases(gen_s=1.0, train_s=1.5, score_s=0.7)
    assert simulate_async(p, 20, max_staleness=0) == pytest.approx(simulate_sync(p, 20))


def test_the_steady_state_is_the_slowest_stage_when_staleness_allows_overlap():
    # generation 1 s, judge 1.2 s (overlapped), training 1.5 s: one step per 1.5 s after the pipeline fills
    p = Phases(gen_s=1.0, train_s=1.5, score_s=1.2)
    n = 200
    per_step = (simulate_async(p, n, max_staleness=2) - simulate_async(p, n // 2, max_staleness=2)) / (n - n // 2)
    assert per_step == pytest.approx(1.5)
    # the worker is the bottleneck when generation is slower than training
    q = Phases(gen_s=2.0, train_s=0.5)
    per_step = (simulate_async(q, n, max_staleness=2) - simulate_async(q, n // 2, max_staleness=2)) / (n - n // 2)
    assert per_step == pytest.approx(2.0)


def test_more_staleness_never_slows_the_pipeline_and_scoring_concurrency_hides_latency():
    p = Phases(gen_s=1.0, train_s=1.0, score_s=2.5, sync_s=0.1, load_s=0.05)
    walls = [simulate_async(p, 60, max_staleness=k, queue_size=4, scoring_concurrency=4) for k in range(6)]
    assert all(b <= a + 1e-9 for a, b in zip(walls, walls[1:]))
    one = simulate_async(p, 60, max_staleness=4, queue_size=4, scoring_concurrency=1)
    four = simulate_async(p, 60, max_staleness=4, queue_size=4, scoring_concurrency=4)
    assert four < 0.5 * one  # with one round scored at a time the judge's 2.5 s is the step


def test_publishing_every_second_step_runs_on_the_newest_version_at_hand():
    p = Phases(gen_s=1.0, train_s=1.0)
    # max_staleness 1 with sync_every 2: the worker needs version >= r - 1 and finds the even ones only
    wall = simulate_async(p, 20, max_staleness=1, sync_every=2)
    assert simulate_async(p, 20, max_staleness=1, sync_every=1) <= wall < simulate_sync(p, 20)


def test_an_impossible_schedule_is_reported():
    """The guard behind AsyncGRPOConfig's check (sync_every <= max_staleness + 1): the model says why it stops."""
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_async(Phases(gen_s=1, train_s=1), 10, max_staleness=0, sync_every=3)


def test_warm_start_is_synchronous_until_the_worker_is_ready_and_never_slower():
    p = Phases(gen_s=1.0, train_s=1.5, score_s=1.2, startup_s=12.0)
    # a worker that never becomes ready: every round is the trainer's own, synchronous GRPO
    never = Phases(gen_s=1.0, train_s=1.5, score_s=1.2, startup_s=1e9)
    assert simulate_async(never, 20, max_staleness=2, warm_start=True) == pytest.approx(simulate_sync(never, 20))
    # the trainer's rounds fill the start-up instead of waiting through it
    for k in (0, 1, 2):
        assert simulate_async(p, 30, max_staleness=k, warm_start=True) < simulate_async(p, 30, max_staleness=k)
    # a worker ready at once: nothing for the trainer to do itself
    instant = Phases(gen_s=1.0, train_s=1.5, score_s=1.2)
    assert simulate_async(instant, 30, warm_start=True) == pytest.approx(simulate_async(instant, 30))


def test_several_rounds_per_generate_call_pay_only_when_the_extra_round_is_cheap():
    # a generation-bound worker (2 s a round, training 0.5 s); a second round in the same call costs 0.3 s more
    cheap = Phases(gen_s=2.0, train_s=0.5, score_s=1.0, extra_round_s=0.3)
    knobs = dict(max_staleness=2, queue_size=2, scoring_concurrency=4)
    one = simulate_async(cheap, 60, **knobs)
    two = simulate_async(cheap, 60, **knobs, rounds_per_generation=2)
    assert two < 0.8 * one
    # at staleness 0 no second round is ever admissible: nothing changes
    assert simulate_async(cheap, 60, max_staleness=0, rounds_per_generation=3) == pytest.approx(
        simulate_async(cheap, 60, max_staleness=0))
    # a second round that costs a whole round gains nothing: every round ends no earlier than one at a time
    full = Phases(gen_s=2.0, train_s=0.5, score_s=1.0, extra_round_s=2.0)
    assert simulate_async(full, 60, **knobs, rounds_per_generation=2) >= simulate_async(full, 60, **knobs) - 1e-9
