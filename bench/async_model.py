"""A model of the async GRPO pipeline: predicted samples/s from per-round times, for deployments we cannot run.

    from async_model import Phases, simulate_async, simulate_sync
    simulate_async(Phases(gen_s=1.0, score_s=1.2, train_s=1.5, sync_s=0.05), rounds=100, max_staleness=2)

It replays the pipeline of toolkit.core.async_grpo / rollout_worker round by round, with the same rules:

* the worker starts generating round r once the weights of step r - max_staleness are published, its
  previous round is generated, and fewer than `scoring_concurrency` rounds are between generation and
  the queue (the worker's scoring threads); with `rounds_per_generation` k > 1 the call also takes rounds
  r+1.. r+k-1 that the weights it holds admit (version + max_staleness >= round); a call of n rounds
  costs `gen_s + (n - 1) * extra_round_s`;
* a round is scored `score_s` after its generation ends (a judge's latency: waiting, not compute), and
  enters the queue in round order once the queue (`queue_size`) has room;
* the trainer takes round r when it is queued and step r - 1 is done, trains `train_s` (everything a step
  costs the trainer besides waiting), then publishes (`sync_s`, trainer side; the worker pays `load_s` when
  it picks new weights up); the worker starts its first round after `startup_s`;
* with `warm_start` (AsyncGRPOConfig's default) the trainer generates, scores and trains rounds itself, as
  synchronous GRPO does, while the worker starts; the worker begins with the round after the last one the
  trainer began before `startup_s` (then the time the worker is ready, not its first round).

The times are inputs: measured on this machine for the thread split in use (bench/async_grpo.py feeds the
async run's own per-round times and checks the prediction against its wall clock), or set for another
deployment (generation on its own device: the generation and training times of each side alone). The model
has no contention term: on shared cores the inputs must be the times measured while both sides run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phases:
    gen_s: float            # worker: generate one round
    train_s: float          # trainer: one optimizer step on one round
    score_s: float = 0.0    # latency from a round's generation to its rewards (a judge; overlapped)
    sync_s: float = 0.0     # trainer: publish weights after a step
    load_s: float = 0.0     # worker: load newer weights before a round
    startup_s: float = 0.0  # worker: start-up (process, model load) before its first round
    extra_round_s: float | None = None  # worker: each further round in the same generate call (None: gen_s)


def simulate_sync(p: Phases, rounds: int) -> float:
    """Wall seconds of synchronous GRPO: generate, score, train, one after another."""
    return rounds * (p.gen_s + p.score_s + p.train_s)


def simulate_async(p: Phases, rounds: int, *, max_staleness: int = 1, queue_size: int = 2,
                   scoring_concurrency: int = 2, sync_every: int = 1, warm_start: bool = False,
                   rounds_per_generation: int = 1) -> float:
    """Wall seconds until the trainer finishes `rounds` steps of async GRPO under the rules above."""
    k, q, c = max_staleness, queue_size, scoring_concurrency
    extra = p.gen_s if p.extra_round_s is None else p.extra_round_s
    publish = {0: 0.0}                       # version -> time it is readable by the worker
    gen_end, delivered, taken, train_end = [], [], [], []
    held = -1
    first = 0
    while warm_start and first < rounds and (train_end[-1] if train_end else 0.0) < p.startup_s:
        # a round of the trainer's own, begun before the worker is ready: synchronous GRPO's step
        begin = train_end[-1] if train_end else 0.0
        delivered.append(begin + p.gen_s + p.score_s)
        taken.append(delivered[-1])
        end = taken[-1] + p.train_s
        if (first + 1) % sync_every == 0:
            end += p.sync_s
            publish[first + 1] = end
        train_end.append(end)
        first += 1
    r = first
    while r < rounds:
        need = max(0, r - k)                 # the worker needs a version >= r - k before round r
        # (trainer progress is simulated lazily: until such a version is published)
        while not any(v >= need for v in publish):
            _train_next(p, publish, delivered, taken, train_end, sync_every)
        start = max(gen_end[-1] if gen_end else p.startup_s, min(t for v, t in publish.items() if v >= need))
        if r - c >= 0:                       # at most c rounds between generation and the queue
            start = max(start, delivered[r - c])
        if rounds_per_generation > 1:
            # the batch's size depends on the newest weights at `start`: let the trainer catch up to that time
            while len(train_end) < min(len(delivered), rounds) and _next_publish(p, delivered, train_end,
                                                                                 sync_every) <= start:
                _train_next(p, publish, delivered, taken, train_end, sync_every)
        newest = max(v for v, t in publish.items() if t <= start)
        load = p.load_s if newest != held else 0.0
        held = newest
        count = max(1, min(rounds_per_generation, newest + k - r + 1, rounds - r))
        end = start + load + p.gen_s + (count - 1) * extra
        for j in range(r, r + count):
            gen_end.append(end)
            ready = end + p.score_s
            room = 0.0
            if j - q >= 0:                   # the queue has room once the trainer took round j - q
                while len(taken) <= j - q:
                    _train_next(p, publish, delivered, taken, train_end, sync_every)
                room = taken[j - q]
            delivered.append(max(ready, delivered[-1] if delivered else 0.0, room))
        r += count
    while len(train_end) < rounds:
        _train_next(p, publish, delivered, taken, train_end, sync_every)
    return train_end[-1]


def _next_publish(p: Phases, delivered: list, train_end: list, sync_every: int) -> float:
    """When the trainer's next step would end (publish included): it cannot be sooner than its round's delivery."""
    r = len(train_end)
    end = max(delivered[r], train_end[-1] if train_end else 0.0) + p.train_s
    return end + p.sync_s if (r + 1) % sync_every == 0 else end


def _train_next(p: Phases, publish: dict, delivered: list, taken: list, train_end: list, sync_every: int) -> None:
    r = len(train_end)
    if r >= len(delivered):
        raise RuntimeError("deadlock: the trainer waits for a round the worker cannot start (check max_staleness "
                           ">= sync_every - 1)")
    start = max(delivered[r], train_end[-1] if train_end else 0.0)
    taken.append(start)
    end = start + p.train_s
    step = r + 1
    if step % sync_every == 0:
        end += p.sync_s
        publish[step] = end
    train_end.append(end)
