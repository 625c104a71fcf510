"""The async GRPO rollout worker: a spawned process that generates and scores rounds for the trainer.

It runs the very rollout code GRPOTrainer runs (toolkit.core.rollout: the same prompt order, the same
per-round seed, `generate_and_score`; toolkit.core.rewards.score_completions for scoring), so round r
in the worker is GRPO's step r. What it adds is the process plumbing: weights read from shared memory
when their version moves, a bounded queue of scored rounds, a heartbeat, and the traceback sent back
on failure. The trainer side (staleness, restarts, checkpoints) is toolkit.core.async_grpo.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .errors import TrainingHealthError
from .generation import TransformersBackend
from .rewards import RewardRunner, score_completions
from .rollout import RoundSampler, generation_seed

__all__ = ["Progress", "ScoredRound", "worker_main"]


@dataclass
class ScoredRound:
    """What the worker sends: one round, generated with weights `version`, scored."""

    round: int
    version: int
    row_indices: list[int]
    completions: list[list[tuple[list[int], list[float], str]]]
    rewards_per_func: list[list[float]]
    failures: dict[str, int]
    gen_s: float
    score_s: float
    wait_s: float
    tokens: int
    episodes: list[Any] | None = None  # multi-turn rounds: the finished Episodes (completions/rewards then unused)
    # per group, per completion: the policy version of each token (in-flight weight updates); None: all `version`
    token_versions: list[list[list[int]]] | None = None


def _load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load the published weights; any key mismatch is an error (a silent mismatch would sample from random weights).

    Only a tied LM head may be absent from the published state (it is the embedding); an untied one may not."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = ({"lm_head.weight"} | set(getattr(model, "_tied_weights_keys", None) or [])
            if getattr(model.config, "tie_word_embeddings", False) else set())
    really_missing = [k for k in missing if k not in tied]
    if unexpected or really_missing:
        raise TrainingHealthError(f"async GRPO worker: the published weights do not match the worker's model "
                                  f"(missing {really_missing[:3]}, unexpected {unexpected[:3]}).")


class Progress:
    """Liveness from the worker's main loop, not from a side thread.

    The main loop calls `tick()` whenever it moves (each decode step, each wait-loop turn, each queue attempt);
    the heartbeat thread turns ticks into heartbeats and stops beating when they stop, so a main loop stuck
    anywhere (a deadlock, a C call that never returns) goes silent and the trainer's `heartbeat_timeout` fires,
    while the process and its other threads are alive. Inside a call bounded by its own timeout (reward scoring,
    at most `reward_timeout`) the loop declares that bound with `bounded(seconds)`; past it, silence again counts.
    """

    def __init__(self) -> None:
        self.count = 0
        self.bounded_until = 0.0

    def tick(self) -> None:
        self.count += 1

    @contextmanager
    def bounded(self, seconds: float):
        """Nestable: an inner bound (scoring inside a vLLM round) never shortens or ends an outer one."""
        outer = self.bounded_until
        self.bounded_until = max(outer, time.time() + seconds)
        try:
            yield
        finally:
            self.bounded_until = outer
            self.tick()


class StopFlag:
    """The trainer's "stop" to its worker, without a lock (multiprocessing.Event takes a semaphore in is_set() and
    set(); a worker frozen or killed while holding it made the trainer's set() wait forever)."""

    def __init__(self, ctx):
        self._flag = ctx.Value("b", 0, lock=False)

    def set(self) -> None:
        self._flag.value = 1

    def is_set(self) -> bool:
        return bool(self._flag.value)


def _beat_while_progressing(progress: Progress, heartbeat, stop, parent: int, every: float = 0.5) -> None:
    """`parent`: the trainer's pid, as the trainer said it (the worker may be adopted before this thread starts)."""
    last = -1
    while not stop.is_set():
        if os.getppid() != parent:
            # The trainer died without stopping us (SIGKILL, OOM killer): nobody will read our rounds, and a
            # daemon process is only reaped by a parent that exits normally. Leave now rather than spin on.
            os._exit(3)
        if progress.count != last or time.time() < progress.bounded_until:
            heartbeat.value = time.time()
            last = progress.count
        time.sleep(every)


def worker_main(spec: dict[str, Any], shared: dict[str, torch.Tensor], version, lock, out_q, err_q, heartbeat, stop,
                start_round: int) -> None:
    """The rollout worker's process: generate and score rounds until told to stop."""
    try:
        torch.set_num_threads(spec["threads"])
        progress = Progress()
        # Until the first round the trainer waits up to worker_start_timeout (imports, model build, first
        # generation), so start-up is covered by a bound of that length rather than by ticks.
        progress.bounded_until = time.time() + spec["start_timeout"]
        threading.Thread(target=_beat_while_progressing, args=(progress, heartbeat, stop, spec["parent_pid"]),
                         daemon=True).start()
        from transformers import AutoModelForCausalLM

        held = [-1]  # the version of the weights the backend holds (a list: refresh_weights updates it)
        runner = RewardRunner(spec["reward_funcs"], timeout=spec["reward_timeout"],
                              max_consecutive_failures=spec["reward_max_failures"],
                              allow_empty=spec.get("episodes") is not None)
        if spec["backend"] == "transformers":
            model = AutoModelForCausalLM.from_config(spec["config"]).eval()
            if spec["varlen"]:
                from .attention import use_varlen_attention

                use_varlen_attention(model)  # the trainer's attention, so both sides compute the same numbers
            def refresh_weights() -> int | None:
                """Between decode steps (in-flight updates): newer weights if published and the lock is free now
                (the trainer is not mid-copy); never waits, so decoding is not held up by a publish."""
                if version.value == held[0] or not lock.acquire(block=False):
                    return None
                try:
                    load_weights()
                    held[0] = version.value
                finally:
                    lock.release()
                progress.tick()
                return held[0]

            backend = TransformersBackend(model, pad_token_id=spec["pad_token_id"],
                                          max_batch_size=spec["max_batch_size"], on_decode_step=progress.tick,
                                          refresh_weights=refresh_weights if spec.get("inflight") else None)

            def load_weights():
                _load_strict(model, shared)
        else:
            # vLLM (in this worker process) or a vLLM server: weights go in through the backend's own sync.
            from .vllm_backend import VLLMBackend, VLLMServerBackend

            kwargs = dict(spec["backend_kwargs"])
            backend = (VLLMBackend(kwargs.pop("model_path"), **kwargs) if spec["backend"] == "vllm"
                       else VLLMServerBackend(**kwargs))

            def load_weights():
                # vLLM reports no per-step progress; a weight upload counts as bounded by worker_start_timeout
                with progress.bounded(spec["start_timeout"]):
                    backend.load_weights(list(shared.items()))

        episodes_spec = spec.get("episodes")
        if episodes_spec is not None:
            # Multi-turn episodes: the environment by its registered name (this process builds its own registry,
            # plugins included), the template delta for the trainer's tokenizer and stop token.
            from .environments import TemplateDelta, group_sampler, run_episodes
            from .plugins import registry

            make_env = registry().get("environment", episodes_spec["name"], field="environment")
            env_kwargs = dict(episodes_spec["kwargs"])
            delta = TemplateDelta(spec["tokenizer"], end_text=episodes_spec["end_text"],
                                  tools=getattr(make_env(**env_kwargs), "tools", None),
                                  chat_template_kwargs=episodes_spec["chat_template_kwargs"])

            def generate_episodes(idx: list[int], seed: int) -> tuple[list[Any], float]:
                G = spec["num_generations"]
                rows_ = [rows[i] for i in idx for _ in range(G)]
                started = time.perf_counter()
                sample = group_sampler(backend, spec["sampling"], seed=seed, n_rows=len(rows_), group_size=G)
                # decode steps tick (transformers backend), and so does the wait for environments (every ~0.1 s,
                # while the main loop is in that wait): a main loop stuck anywhere else goes silent
                eps = run_episodes([make_env(**env_kwargs) for _ in rows_], rows_, sample, delta,
                                   max_turns=episodes_spec["max_turns"], max_tokens=episodes_spec["max_tokens"],
                                   stop_token_ids=spec["sampling"].stop_token_ids,
                                   concurrency=episodes_spec["concurrency"], step_timeout=episodes_spec["step_timeout"],
                                   on_wait=progress.tick)
                return eps, time.perf_counter() - started

        rows = spec["rows"]
        # With several trainer processes each rank has its own worker, which generates that rank's share of
        # every round with that rank's seed: the rows and samples synchronous GRPO's rank would draw.
        rank = spec.get("rank", 0)
        sampler = RoundSampler(len(rows), spec["per_round"], 1, seed=spec["seed"],
                               num_processes=spec.get("num_processes", 1))
        # Latency-aware scoring: a round's rewards (an HTTP judge, a sandbox) are awaited on a scoring thread
        # while this loop generates the next round; up to `scoring_concurrency` rounds are in flight (being
        # scored, or scored and waiting for room in the queue). A delivery thread puts them into the queue in
        # round order the moment each is scored. The staleness gate is unchanged (at max_staleness 0 there is
        # nothing to overlap, so the updates still equal synchronous GRPO's).
        concurrency = max(1, int(spec.get("scoring_concurrency", 1)))
        outbox: queue.Queue = queue.Queue()   # (future, delivered) in round order, for the delivery thread
        inflight: deque = deque()             # the same, with the submission time, for this loop's bookkeeping
        delivery_error: list[BaseException] = []

        def score_async(fn, *args) -> Future:
            """fn(*args) on its own daemon thread (a pool's threads are joined at exit: a round still waiting for a
            judge would hold the worker's exit for up to reward_timeout)."""
            fut: Future = Future()

            def run() -> None:
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 (raised from the future by the main loop)
                    fut.set_exception(e)

            threading.Thread(target=run, name="toolkit-scoring", daemon=True).start()
            return fut

        def deliver_in_order() -> None:
            # No progress ticks here: liveness is this process's main loop's, which waits on these rounds.
            while True:
                got = outbox.get()
                if got is None:
                    return
                fut, delivered = got
                try:
                    item = fut.result()
                except BaseException:  # noqa: BLE001 (the main loop raises it from the future)
                    delivered.set()
                    return
                try:
                    while not stop.is_set():
                        try:
                            out_q.put(item, timeout=0.2)
                            break
                        except queue.Full:
                            continue
                except BaseException as e:  # noqa: BLE001 (a queue that cannot take the round: the main loop raises)
                    delivery_error.append(e)
                    delivered.set()
                    return
                delivered.set()

        delivery = threading.Thread(target=deliver_in_order, name="toolkit-delivery", daemon=True)
        delivery.start()

        def submit(fut: Future) -> None:
            pair = (fut, threading.Event())
            inflight.append((*pair, time.time()))
            outbox.put(pair)

        def scoring_overdue() -> bool:
            """A round has been scoring past reward_timeout (+5 s): scoring is stuck, not the trainer slow."""
            limit = time.time() - spec["reward_timeout"] - 5.0
            return any(not fut.done() and since < limit for fut, _, since in inflight)

        def settle(limit: float) -> None:
            """Forget delivered rounds and raise a scoring failure; wait while `limit` or more are in flight."""
            while inflight and not stop.is_set():
                fut, delivered, _ = inflight[0]
                if fut.done() and fut.exception() is not None:
                    raise fut.exception()  # the scoring's own error (a reward that failed too often, named)
                if delivered.is_set():
                    inflight.popleft()
                    continue
                if delivery_error:
                    raise RuntimeError("async GRPO worker: a scored round could not be put into the queue") \
                        from delivery_error[0]
                if not delivery.is_alive():
                    raise RuntimeError("async GRPO worker: the delivery thread stopped; no round can reach the trainer")
                if len(inflight) < limit:
                    return
                if not fut.done():
                    # scoring returns within reward_timeout (RewardRunner abandons slower calls): bounded
                    with progress.bounded(spec["reward_timeout"] + 5.0):
                        wait_futures([fut])
                else:
                    progress.tick()  # scored, waiting for room in the queue: the trainer's pace, by design
                    time.sleep(0.002)

        def score_round(r: int, idx: list[int], groups: list, gen_s: float, wait_s: float, version_: int
                        ) -> ScoredRound:
            t1 = time.perf_counter()
            G = spec["num_generations"]
            completion_ids = [c.token_ids for g in groups for c in g]
            outcome, _ = score_completions(runner, spec["tokenizer"], [rows[i] for i in idx for _ in range(G)],
                                           completion_ids, conversational=spec["conversational"],
                                           extra_columns=spec["extra_columns"])
            return ScoredRound(
                round=r, version=version_, row_indices=idx,
                token_versions=[[c.versions for c in g] for g in groups] if spec.get("inflight") else None,
                completions=[[(c.token_ids, c.logprobs, c.finish_reason) for c in g] for g in groups],
                rewards_per_func=torch.tensor(outcome.rewards, dtype=torch.float32).tolist(),
                failures=dict(outcome.failures), gen_s=gen_s, score_s=time.perf_counter() - t1, wait_s=wait_s,
                tokens=sum(len(i) for i in completion_ids))

        r, carried_wait = start_round, 0.0
        while not stop.is_set():
            progress.tick()
            t_wait = time.perf_counter()
            while version.value < r - spec["max_staleness"] and not stop.is_set():
                settle(float("inf"))  # surfaces a scoring failure while waiting
                if not scoring_overdue():
                    # waiting for the trainer is the loop working as designed; but if the trainer waits for a
                    # round whose scoring is stuck, this wait is not progress: go silent, the trainer reports it
                    progress.tick()
                time.sleep(0.002)
            if stop.is_set():
                break
            if version.value != held[0]:
                with lock:
                    load_weights()
                    held[0] = version.value
                progress.tick()
            local_version = held[0]
            if spec["backend"] == "transformers":
                backend.version = local_version
            wait_s = time.perf_counter() - t_wait + carried_wait
            idx = sampler.round(r, rank)
            # The transformers backend ticks every decode step; a vLLM generate call is one opaque call, which
            # counts as bounded by worker_start_timeout (a long reasoning round can exceed heartbeat_timeout).
            generating = (progress.bounded(spec["start_timeout"]) if spec["backend"] != "transformers"
                          else contextlib.nullcontext())
            if episodes_spec is not None:
                with generating:
                    eps, gen_s = generate_episodes(idx, generation_seed(spec["seed"], r, rank))
                done: Future = Future()
                done.set_result(ScoredRound(round=r, version=local_version, row_indices=idx, completions=[],
                                            rewards_per_func=[], failures={}, gen_s=gen_s, score_s=0.0,
                                            wait_s=wait_s, tokens=sum(sum(ep.mask) for ep in eps), episodes=eps))
                submit(done)
                settle(concurrency)
                carried_wait = 0.0
            else:
                # generation here, then scoring on a scoring thread (rollout.generate_and_score's two halves)
                with generating:
                    t0 = time.perf_counter()
                    groups = backend.generate([list(spec["prompt_ids"][i]) for i in idx], spec["sampling"],
                                              n=spec["num_generations"], seed=generation_seed(spec["seed"], r, rank))
                    gen_s = time.perf_counter() - t0
                submit(score_async(score_round, r, idx, groups, gen_s, wait_s, local_version))
                t_settle = time.perf_counter()
                settle(concurrency)
                carried_wait = time.perf_counter() - t_settle  # idle: counted in the next round's wait
            if r == start_round:
                progress.bounded_until = 0.0  # start-up is over: from now on only progress counts
            r += 1
        outbox.put(None)
        out_q.cancel_join_thread()  # stopping: rounds nobody will read must not hold the exit
    except BaseException:
        err_q.put(traceback.format_exc())
        raise
