"""AsyncGRPOTrainer on tiny models, with a real rollout worker process: equality with synchronous GRPO at
max_staleness 0, overlap with bounded staleness, a killed worker (restart, or stop with checkpoint and traceback),
exact resume with the worker's prompt position, and config errors."""

import json
import math
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
from builders import HELPERS
from transformers import PreTrainedTokenizerFast

from toolkit import ConfigError, TrainingHealthError
from toolkit.core import worker_handle as worker_handle_module
from toolkit.core.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from toolkit.core.checkpoint import COMPLETE_MARKER
from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.testing import tiny_model, tiny_tokenizer

pytestmark = pytest.mark.slow


def prompts(n=16):
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(n)]


def low_ids(prompts, completions, completion_ids, **kw):
    """Module-level (the worker imports it): prefers low token ids and short completions."""
    return [-sum(ids) / (len(ids) * 384.0) - len(ids) / 100.0 for ids in completion_ids]


COMMON = dict(max_steps=3, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
              learning_rate=1e-2, logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, report_to="none")


def async_cfg(tmp_path, **kw):
    # warm_start off unless a test turns it on: these tests are about the worker, and with warm start a tiny model's
    # whole run would be generated in the trainer while the worker is still importing torch
    return AsyncGRPOConfig(output_dir=str(tmp_path / "out"), **{**COMMON, "worker_threads": torch.get_num_threads(),
                                                               "heartbeat_timeout": 20, "warm_start": False, **kw})


def make(tmp_path, **kw):
    callbacks = kw.pop("callbacks", None)
    return AsyncGRPOTrainer(tiny_model(), [low_ids], async_cfg(tmp_path, **kw), train_dataset=prompts(),
                            processing_class=tiny_tokenizer(), callbacks=callbacks)


def logged(t, key):
    return [h[key] for h in t.state.log_history if key in h]


@pytest.mark.slow
@pytest.mark.parametrize("rounds_per_generation", [1, 3])
def test_max_staleness_zero_reproduces_synchronous_grpo(tmp_path, rounds_per_generation):
    sync = GRPOTrainer(tiny_model(), [low_ids], GRPOConfig(output_dir=str(tmp_path / "sync"), **COMMON),
                       train_dataset=prompts(), processing_class=tiny_tokenizer())
    sync.train()
    # at staleness 0 no round beyond the next is admissible, so rounds_per_generation cannot batch any
    t = make(tmp_path, max_staleness=0, rounds_per_generation=rounds_per_generation)
    t.train()
    assert logged(t, "reward") == pytest.approx(logged(sync, "reward"), abs=1e-6)
    assert logged(t, "loss") == pytest.approx(logged(sync, "loss"), abs=2e-6)  # logged losses are rounded to 6 decimals
    for (k, v), (_, w) in zip(sync.model.state_dict().items(), t.model.state_dict().items()):
        torch.testing.assert_close(w, v, atol=1e-6, rtol=1e-5, msg=k)
    assert logged(t, "async/staleness_max") == [0.0, 0.0, 0.0]
    assert logged(t, "async/rounds_per_generate") == [1.0, 1.0, 1.0]
    assert t.worker.process is None  # the worker is stopped when training ends


@pytest.mark.slow
def test_several_rounds_in_one_generate_call_stay_within_the_staleness_bound(tmp_path):
    """rounds_per_generation 3 at max_staleness 2: the worker's first call (weights version 0, round 0) may generate
    rounds 0-2, all admissible; every round still trains within the bound, in order, on its own prompts."""
    seen = []
    # learning rate 0: the weights never change, so each completion's sampler log-probs equal the trainer's own
    # exactly when it reached the round of its own prompt (a mix-up between a call's rounds would show as a gap)
    t = make(tmp_path, max_staleness=2, rounds_per_generation=3, scoring_concurrency=6, max_steps=6,
             learning_rate=0.0)
    original = t.build_rollout

    def spy(row_indices, *a, **kw):
        seen.append(list(row_indices))
        return original(row_indices, *a, **kw)

    t.build_rollout = spy
    t.train()
    per_call = logged(t, "async/rounds_per_generate")
    assert per_call[:3] == [3.0, 3.0, 3.0]  # rounds 0-2 came from one call
    assert max(logged(t, "async/staleness_max")) <= 2 and len(per_call) == 6
    assert logged(t, "async/samples_dropped")[-1] == 0.0
    # each round trained on the prompts synchronous GRPO's sampler gives that step, with its own completions
    assert seen == [t._rounds.round(r, 0) for r in range(6)]
    assert max(logged(t, "sampler/logp_abs_diff_max")) < 1e-3


@pytest.mark.slow
def test_bounded_staleness_overlaps_and_logs(tmp_path):
    t = make(tmp_path, max_staleness=1, max_steps=4)
    t.train()
    staleness = logged(t, "async/staleness_max")
    assert max(staleness) <= 1 and len(staleness) == 4
    for key in ("async/queue_depth", "async/trainer_idle_fraction", "async/generator_idle_fraction",
                "async/samples_dropped", "async/generation_tokens_per_s", "importance_ratio/mean",
                "sampler/logp_abs_diff_mean", "async/staleness_hist/0", "async/staleness_hist/1"):
        assert logged(t, key), key
    # samples generated with older weights show a sampler/trainer gap; on-policy ones do not
    gaps = logged(t, "sampler/logp_abs_diff_mean")
    assert all(math_ok(g) for g in gaps)


def math_ok(x):
    return x == x and x >= 0


def _kill_worker_when_started(trainer, sig=signal.SIGKILL):
    def run():
        deadline = time.time() + 60
        while time.time() < deadline:
            proc = trainer.worker.process
            if proc is not None and proc.pid is not None and trainer.state.global_step >= 1:
                os.kill(proc.pid, sig)
                return
            time.sleep(0.05)

    threading.Thread(target=run, daemon=True).start()


@pytest.mark.slow
def test_a_killed_worker_stops_the_run_with_a_checkpoint_and_no_hang(tmp_path):
    t = make(tmp_path, max_staleness=0, max_steps=6)
    _kill_worker_when_started(t)
    started = time.time()
    with pytest.raises(TrainingHealthError, match="rollout worker failed") as e:
        t.train()
    assert time.time() - started < 60
    assert "exited with code -9 without a traceback (killed by SIGKILL" in str(e.value)
    ckpt = tmp_path / "out" / f"checkpoint-{t.state.global_step}"
    assert (ckpt / COMPLETE_MARKER).exists()
    assert json.loads((ckpt / "async_grpo_state.json").read_text())["next_round"] == t.state.global_step


@pytest.mark.slow
def test_a_killed_worker_is_restarted_when_allowed(tmp_path):
    t = make(tmp_path, max_staleness=0, max_steps=4, worker_restarts=1)
    _kill_worker_when_started(t)
    t.train()
    assert t.state.global_step == 4
    assert logged(t, "async/worker_restarts")[-1] == 1.0


@pytest.mark.slow
def test_a_hung_worker_is_reported_within_the_heartbeat_timeout(tmp_path):
    t = make(tmp_path, max_staleness=0, max_steps=6, heartbeat_timeout=3)
    _kill_worker_when_started(t, signal.SIGSTOP)
    started = time.time()
    with pytest.raises(TrainingHealthError, match="no heartbeat"):
        t.train()
    assert time.time() - started < 60


class StuckAfterFirstRoundTokenizer(PreTrainedTokenizerFast):
    """In the rollout worker, decoding blocks forever from round 2 on: the worker's main loop is stuck while the
    process, its heartbeat thread and everything else stay alive (the case a side-thread heartbeat misses)."""

    calls = 0

    def batch_decode(self, *args, **kwargs):
        if multiprocessing.current_process().name == "toolkit-rollout-worker":
            type(self).calls += 1
            if type(self).calls >= 2:
                threading.Event().wait()
        return super().batch_decode(*args, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("scoring_concurrency", [1, 2])
def test_a_stuck_main_loop_is_reported_although_the_worker_process_lives(tmp_path, scoring_concurrency):
    """Scoring (here: decoding, stuck) runs on a scoring thread; a main loop that waits for it, at the staleness
    gate or for room, stops counting as progress once the scoring is overdue."""
    StuckAfterFirstRoundTokenizer.calls = 0
    tok = tiny_tokenizer()
    tok.__class__ = StuckAfterFirstRoundTokenizer
    t = AsyncGRPOTrainer(tiny_model(), [low_ids],
                         async_cfg(tmp_path, max_staleness=0, max_steps=6, heartbeat_timeout=3, reward_timeout=2,
                                   scoring_concurrency=scoring_concurrency),
                         train_dataset=prompts(), processing_class=tok)
    started = time.time()
    with pytest.raises(TrainingHealthError, match="no heartbeat") as e:
        t.train()
    assert t.state.global_step == 1  # round 1 was trained on; round 2's scoring never returned
    assert time.time() - started < 90
    assert "the worker is hung" in str(e.value)


@pytest.mark.slow
def test_exact_resume_includes_the_worker_position(tmp_path):
    from builders import StopAt

    full = make(tmp_path / "a", max_staleness=0, max_steps=4)
    full.train()
    first = make(tmp_path / "b", max_staleness=0, max_steps=4, save_strategy="steps", save_steps=2,
                 callbacks=[StopAt(2)])
    first.train()
    state = json.loads((tmp_path / "b" / "out" / "checkpoint-2" / "async_grpo_state.json").read_text())
    assert state["next_round"] == 2
    resumed = make(tmp_path / "b", max_staleness=0, max_steps=4, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    for (k, v), (_, w) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        torch.testing.assert_close(w, v, atol=1e-6, rtol=1e-5, msg=k)


def test_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="sync_every: with max_staleness=0"):
        async_cfg(tmp_path, max_staleness=0, sync_every=2)
    with pytest.raises(ConfigError, match="num_iterations"):
        async_cfg(tmp_path, num_iterations=2)
    with pytest.raises(ConfigError, match="generation_backend"):
        async_cfg(tmp_path, generation_backend="foo")
    for name in ("queue_size", "sync_every", "worker_threads", "scoring_concurrency", "rounds_per_generation"):
        with pytest.raises(ConfigError, match=f"{name}: must be an integer >= 1, got 0"):
            async_cfg(tmp_path, **{name: 0})
    with pytest.raises(ConfigError, match="must be importable"):
        AsyncGRPOTrainer(tiny_model(), [lambda prompts, completions, completion_ids, **kw: [0.0]],
                         async_cfg(tmp_path), train_dataset=prompts(), processing_class=tiny_tokenizer())


def _take_lock_and_die(lock):
    lock.acquire()
    os._exit(0)  # dies holding the lock, as a worker SIGKILLed inside `with lock:` does


@pytest.mark.slow
def test_a_worker_that_died_holding_the_weights_lock_does_not_hang_the_trainer(tmp_path):
    t = make(tmp_path, max_staleness=0, max_steps=2)
    t._start_worker()
    t.stop_worker()
    holder = t.worker.ctx.Process(target=_take_lock_and_die, args=(t.worker.lock,))
    holder.start()
    holder.join(timeout=30)
    starter = threading.Thread(target=t._start_worker, daemon=True)  # must not wait on the dead holder's lock
    starter.start()
    starter.join(timeout=20)
    try:
        assert not starter.is_alive(), "the trainer waits forever on a lock its dead worker held"
        assert t.worker.lock.acquire(timeout=5)
        t.worker.lock.release()
    finally:
        if not starter.is_alive():
            t.stop_worker()


def test_async_refuses_seams_its_worker_would_not_run(tmp_path):
    class Curriculum(AsyncGRPOTrainer):
        def build_prompt_sampler(self):
            return super().build_prompt_sampler()

    with pytest.raises(ConfigError, match=r"Curriculum.build_prompt_sampler: async GRPO generates and scores in its "
                                          "worker process"):
        Curriculum(tiny_model(), "numeric_match", AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=2,
                                                                   per_device_train_batch_size=2),
                   train_dataset=[{"prompt": "1+1=", "answer": "2"}] * 4, processing_class=tiny_tokenizer())


_ORPHAN_SCRIPT = """
import sys, time, threading
sys.path[:0] = [{tests!r}, {helpers!r}]
from test_async_grpo import make
from pathlib import Path
t = make(Path({tmp!r}), max_staleness=1, max_steps=10_000)
def report():
    while t.worker.process is None or t.worker.process.pid is None:
        time.sleep(0.05)
    print(t.worker.process.pid, flush=True)
threading.Thread(target=report, daemon=True).start()
t.train()
"""


@pytest.mark.slow
def test_the_worker_exits_when_its_trainer_is_killed(tmp_path):
    """SIGKILL skips the trainer's cleanup; the worker notices its parent is gone instead of running orphaned."""
    import subprocess
    import sys

    script = _ORPHAN_SCRIPT.format(tests=os.path.dirname(__file__), helpers=str(HELPERS), tmp=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    worker = int(proc.stdout.readline())
    time.sleep(1)  # the worker is still importing: it must notice even a parent that died before it looked
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.time() + 15
    while time.time() < deadline:
        try:
            with open(f"/proc/{worker}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):  # exited; a zombie waits for whoever adopted it to reap it
            return
        time.sleep(0.2)
    os.kill(worker, signal.SIGKILL)
    pytest.fail("the rollout worker outlived its killed trainer by 15 s")


_UNGUARDED_SCRIPT = """
import sys
sys.path[:0] = [{tests!r}, {helpers!r}]
from test_async_grpo import make
from pathlib import Path
make(Path({tmp!r}), max_staleness=1, max_steps=2).train()
"""


@pytest.mark.slow
def test_a_script_without_a_main_guard_is_told_why_its_worker_died(tmp_path):
    """The worker is spawned: it imports the main module again, which here trains at import time; Python refuses
    the second start on the worker's stderr, and the trainer's error must say what to change, not 'killed?'."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED_SCRIPT.format(tests=os.path.dirname(__file__), helpers=str(HELPERS), tmp=str(tmp_path)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert out.returncode != 0
    assert "bootstrapping phase" in out.stderr  # Python's own refusal, from the worker
    assert "rollout worker failed" in out.stderr
    assert "before it was ready" in out.stderr and 'if __name__ == "__main__":' in out.stderr


@pytest.mark.slow
def test_the_main_guard_hint_is_given_only_for_a_first_start_that_failed():
    """The hint's conditions, on the trainer's failure check alone (the real case runs in the test above): a
    non-zero exit before the worker was ready, with no worker of the run ready before (a restarted worker got past
    the re-import once, so the main module is not the cause), and no traceback in the queue."""
    import queue as queue_module
    from types import SimpleNamespace

    def failure(exitcode, ever_ready, traceback=None):
        from toolkit.core.worker_handle import WorkerHandle

        h = WorkerHandle(threads=1, queue_size=1, start_timeout=60, heartbeat_timeout=60)
        h.err_q = queue_module.Queue()
        if traceback:
            h.err_q.put(traceback)
        h.process = SimpleNamespace(is_alive=lambda: False, exitcode=exitcode)
        h.handoff = SimpleNamespace(worker_ready=lambda: False)
        h.ever_ready = ever_ready
        return h.failure()

    assert "__main__" in failure(1, ever_ready=False)
    assert "__main__" not in failure(1, ever_ready=True)
    assert "__main__" not in failure(0, ever_ready=False)
    assert failure(-9, ever_ready=False).endswith("(killed by SIGKILL; the out-of-memory killer sends it)")
    assert failure(-11, ever_ready=False).endswith("(killed by SIGSEGV)")
    assert failure(1, ever_ready=False, traceback="Traceback: boom") == "Traceback: boom"


def test_progress_bounds_nest():
    from toolkit.core.rollout_worker import Progress

    p = Progress()
    with p.bounded(100):
        outer = p.bounded_until
        with p.bounded(1):
            assert p.bounded_until == outer  # the shorter inner bound does not cut the outer one
        assert p.bounded_until == outer  # and leaving it does not end the outer one
    assert p.bounded_until == 0.0 and p.count == 2


def test_the_workers_round_view_equals_the_samplers_per_rank_order():
    """A rollout worker asks RoundSampler.round(r, rank) for its share of round r; iterating the sampler (what
    synchronous GRPO's dataloader does) must give every rank the same rows, across epoch boundaries."""
    from toolkit.core.rollout import RoundSampler

    for processes in (1, 2, 3):
        it = RoundSampler(23, 3, 1, seed=5, num_processes=processes)
        flat = []
        for epoch in range(3):
            it.set_epoch(epoch)
            flat += list(it)
        rounds = [flat[k:k + processes] for k in range(0, len(flat), processes)]
        view = RoundSampler(23, 3, 1, seed=5, num_processes=processes)
        assert [[view.round(r, rank) for rank in range(processes)] for r in range(len(rounds))] == rounds


@pytest.mark.slow
@pytest.mark.parametrize("warm_start", [False, True])
def test_episodes_at_max_staleness_zero_reproduce_synchronous_grpo(tmp_path, warm_start):
    """Multi-turn episodes in the worker process (a Gymnasium environment made by name there) train exactly what
    synchronous GRPO's episodes train. With warm start the first rounds' episodes run in the trainer (a tiny model's
    three steps may all be), with the worker's prompts and seeds."""
    pytest.importorskip("gymnasium")
    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    episodes = dict(environment="gymnasium", environment_kwargs={"env": "episode_envs:Turns-v0"}, max_turns=3,
                    max_episode_tokens=200, stop_token_ids=[end] + list(range(200, 384)))
    rows = [{"prompt": "play", "seed": i} for i in range(16)]
    sync = GRPOTrainer(tiny_model(), [], GRPOConfig(output_dir=str(tmp_path / "sync"), **COMMON, **episodes),
                       train_dataset=rows, processing_class=tok)
    sync.train()
    t = AsyncGRPOTrainer(tiny_model(), [], async_cfg(tmp_path, max_staleness=0, warm_start=warm_start, **episodes),
                         train_dataset=rows, processing_class=tiny_tokenizer())
    t.train()
    assert (logged(t, "async/rounds_in_trainer")[-1] >= 1) == warm_start
    assert max(logged(sync, "episodes/turns_mean")) > 1
    assert logged(t, "episodes/turns_mean") == logged(sync, "episodes/turns_mean")
    assert logged(t, "reward") == pytest.approx(logged(sync, "reward"), abs=1e-6)
    assert logged(t, "loss") == pytest.approx(logged(sync, "loss"), abs=2e-6)  # logged losses are rounded to 6 decimals
    for (k, v), (_, w) in zip(sync.model.state_dict().items(), t.model.state_dict().items()):
        torch.testing.assert_close(w, v, atol=1e-6, rtol=1e-5, msg=k)


@pytest.mark.slow
def test_episodes_of_several_rounds_in_one_call_reach_their_own_rounds(tmp_path):
    """rounds_per_generation 2 with multi-turn episodes: one call runs two rounds' episodes; each round gets its own
    rows' episodes (the first observation names the row's seed) and trains within the staleness bound."""
    pytest.importorskip("gymnasium")
    from gymnasium.utils.seeding import np_random

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = [{"prompt": "play", "seed": i} for i in range(16)]
    t = AsyncGRPOTrainer(tiny_model(), [], async_cfg(
        tmp_path, max_staleness=1, rounds_per_generation=2, scoring_concurrency=4, max_steps=4,
        environment="gymnasium", environment_kwargs={"env": "episode_envs:Turns-v0"}, max_turns=3,
        max_episode_tokens=200, stop_token_ids=[end] + list(range(200, 384))), train_dataset=rows,
        processing_class=tok)
    firsts = []
    original = t.build_rollout

    def spy(row_indices, *a, row_prompt_ids=None, **kw):
        G = t.args.num_generations
        for j, i in enumerate(row_indices):
            start = int(np_random(rows[i]["seed"])[0].integers(100))
            firsts.append(all(f"Start {start}" in tok.decode(p) for p in row_prompt_ids[j * G:(j + 1) * G]))
        return original(row_indices, *a, row_prompt_ids=row_prompt_ids, **kw)

    t.build_rollout = spy
    t.train()
    assert logged(t, "async/rounds_per_generate")[:2] == [2.0, 2.0]
    assert max(logged(t, "async/staleness_max")) <= 1 and len(logged(t, "loss")) == 4
    assert firsts and all(firsts)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["factory object", "registered at run time"])
def test_an_environment_the_worker_could_not_build_by_name_reaches_it_as_a_factory(tmp_path, how):
    """An `environment=` factory object, or an environment registered at run time in this process only (the worker
    process's own registry has entry-point plugins and built-ins only): the worker gets the factory itself, pickled,
    and at max_staleness 0 trains what synchronous GRPO trains with the same environment. A factory that cannot be
    pickled is refused before any model loads."""
    pytest.importorskip("gymnasium")
    import functools

    from toolkit.core.environments import GymnasiumEnvironment
    from toolkit.core.hookspecs import hookimpl
    from toolkit.core.plugins import registry

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turns = functools.partial(GymnasiumEnvironment, "episode_envs:Turns-v0")  # a module-level class: it pickles
    episodes = dict(max_turns=3, max_episode_tokens=200, stop_token_ids=[end] + list(range(200, 384)))
    rows = [{"prompt": "play", "seed": i} for i in range(16)]
    sync = GRPOTrainer(tiny_model(), [], GRPOConfig(output_dir=str(tmp_path / "sync"), **COMMON, **episodes),
                       train_dataset=rows, processing_class=tok, environment=turns)
    sync.train()
    with pytest.raises(ConfigError, match="environment: async GRPO builds the environments in its worker"):
        AsyncGRPOTrainer(tiny_model(), [], async_cfg(tmp_path, max_staleness=0, **episodes), train_dataset=rows,
                         processing_class=tok, environment=lambda: turns())

    class RunTimeOnly:
        @hookimpl
        def toolkit_register_environments(self):
            return {"turns-here-only": turns}

    if how == "factory object":
        kw, cfg = {"environment": turns}, async_cfg(tmp_path, max_staleness=0, **episodes)
    else:
        registry().register(RunTimeOnly(), "run-time-only-env")
        kw, cfg = {}, async_cfg(tmp_path, max_staleness=0, environment="turns-here-only", **episodes)
    try:
        t = AsyncGRPOTrainer(tiny_model(), [], cfg, train_dataset=rows, processing_class=tiny_tokenizer(), **kw)
        t.train()
    finally:
        if how != "factory object":
            registry().unregister("run-time-only-env")
    assert logged(t, "async/rounds_in_trainer")[-1] == 0  # every round came from the worker (warm_start off)
    assert max(logged(sync, "episodes/turns_mean")) > 1
    assert logged(t, "episodes/turns_mean") == logged(sync, "episodes/turns_mean")
    assert logged(t, "reward") == pytest.approx(logged(sync, "reward"), abs=1e-6)
    for (k, v), (_, w) in zip(sync.model.state_dict().items(), t.model.state_dict().items()):
        torch.testing.assert_close(w, v, atol=1e-6, rtol=1e-5, msg=k)


def test_a_run_time_environment_the_worker_cannot_get_is_refused_before_any_model_loads(tmp_path):
    """Registered in this process only, with a factory that cannot be pickled: the worker could neither receive it
    nor find the name in its own registry (entry points and built-ins), so the trainer refuses it up front."""
    from toolkit.core.hookspecs import hookimpl
    from toolkit.core.plugins import registry

    class RunTimeLambda:
        @hookimpl
        def toolkit_register_environments(self):
            return {"lambda-only": lambda: None}

    registry().register(RunTimeLambda(), "run-time-lambda-env")
    try:
        # a model that would fail to load: the check must come first
        with pytest.raises(ConfigError, match="'lambda-only' was registered in this process only"):
            AsyncGRPOTrainer(str(tmp_path / "no-model-here"), [], async_cfg(tmp_path, environment="lambda-only"),
                             train_dataset=[{"prompt": "play"}] * 8, processing_class=tiny_tokenizer())
    finally:
        registry().unregister("run-time-lambda-env")


def test_a_factory_from_a_notebook_is_refused_even_inside_a_partial(tmp_path, monkeypatch):
    """A notebook's classes live in an interactive `__main__` (no file), which the spawned worker cannot import;
    pickle sends them by reference all the same. Found wherever it sits: the factory, or a partial's argument."""
    import functools
    import sys
    import types

    from toolkit.core.environments import GymnasiumEnvironment

    notebook = types.ModuleType("__main__")  # what Jupyter's kernel has: no __file__
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    Game = type("Game", (), {"__module__": "__main__"})
    notebook.Game = Game
    for factory in (Game, functools.partial(GymnasiumEnvironment, Game)):
        with pytest.raises(ConfigError, match="defined in an interactive session"):
            AsyncGRPOTrainer(str(tmp_path / "no-model-here"), [], async_cfg(tmp_path), train_dataset=[{"prompt": "p"}],
                             processing_class=tiny_tokenizer(), environment=factory)
    monkeypatch.setattr(notebook, "__file__", "/tmp/script.py", raising=False)  # a script: spawn runs it again
    assert worker_handle_module.not_importable_in_worker(Game) is None


@pytest.mark.slow
def test_an_episode_info_that_does_not_pickle_is_sent_as_text_not_lost(tmp_path, caplog):
    """A value in an environment's step info that cannot be pickled used to make the worker's queue drop the whole
    round in its feeder thread (and one that pickles but cannot be unpickled would raise in the trainer); each now
    arrives as a string naming its type, the run trains every round, and the trainer warns with the fix."""
    import episode_envs

    tok = tiny_tokenizer()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    seen = []

    class Recording(AsyncGRPOTrainer):
        def rollout_from_episodes(self, row_indices, episodes, t_gen):
            seen.extend(ep.infos[-1] for ep in episodes)
            return super().rollout_from_episodes(row_indices, episodes, t_gen)

    t = Recording(tiny_model(), [], async_cfg(tmp_path, max_staleness=0, max_turns=1, max_episode_tokens=50,
                                              stop_token_ids=[end] + list(range(200, 384))),
                  train_dataset=[{"prompt": "play", "seed": i} for i in range(16)], processing_class=tok,
                  environment=episode_envs.LockInInfo)
    with caplog.at_level("WARNING", logger="toolkit"):
        t.train()
    assert len(logged(t, "reward")) == 3 and len(seen) == 3 * 8
    # the worker's rounds report how long they waited for their environments
    shares = logged(t, "episodes/environment_share")
    assert len(logged(t, "episodes/environment_s")) == len(shares) == 3 and all(0 <= s <= 1 for s in shares)
    assert all(info["lock"].startswith("<not picklable: lock>") and info["error"].startswith("<not picklable: "
               "NeedsCode>") and isinstance(info["chars"], int) for info in seen)
    assert "could not be sent from the rollout worker" in caplog.text


# ------------------------------------------------------------------------------------------------- warm start


def _wait_for_the_worker_at_step(trainer, step):
    """A callback: at the end of `step`, wait until the rollout worker says it is ready, so that the trainer's next
    round is the first it may take from the worker."""
    from transformers import TrainerCallback

    class Wait(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                deadline = time.time() + 120
                while not getattr(trainer.worker.handoff, "real", trainer.worker.handoff).worker_ready():
                    assert time.time() < deadline, "the worker did not become ready within 120 s"
                    time.sleep(0.05)

    trainer.add_callback(Wait())


def _sync_run(tmp_path, steps):
    sync = GRPOTrainer(tiny_model(), [low_ids], GRPOConfig(output_dir=str(tmp_path / "sync"),
                                                           **{**COMMON, "max_steps": steps}),
                       train_dataset=prompts(), processing_class=tiny_tokenizer())
    sync.train()
    return sync


def _assert_same_run(t, sync):
    assert logged(t, "reward") == pytest.approx(logged(sync, "reward"), abs=1e-6)
    assert logged(t, "loss") == pytest.approx(logged(sync, "loss"), abs=2e-6)  # logged losses are rounded to 6 decimals
    for (k, v), (_, w) in zip(sync.model.state_dict().items(), t.model.state_dict().items()):
        torch.testing.assert_close(w, v, atol=1e-6, rtol=1e-5, msg=k)


@pytest.mark.slow
def test_warm_start_generates_in_the_trainer_until_the_worker_is_ready_and_equals_synchronous_grpo(tmp_path):
    """The trainer generates the first rounds itself while the worker process starts, then the worker takes over;
    at max_staleness 0 the run is synchronous GRPO's whichever process generated a round."""
    sync = _sync_run(tmp_path, 5)
    t = make(tmp_path, max_staleness=0, max_steps=5, warm_start=True)
    _wait_for_the_worker_at_step(t, 2)
    t.train()
    here = logged(t, "async/rounds_in_trainer")[-1]
    # round 0 always (a spawned worker cannot be ready at once); round 1 unless the worker was ready within one
    # tiny step; from round 2 on the worker (it was ready when step 2 ended)
    assert 1 <= here <= 2
    assert logged(t, "async/generator_idle_fraction"), "no round came from the worker"
    assert t._superseded <= 1  # 1 only if the worker got ready within the ~0.1 ms between a check and a claim
    _assert_same_run(t, sync)


class _LateSight(AsyncGRPOTrainer):
    """Sees its worker's readiness only from step 3 on, although the worker is ready at the end of step 1: the worker
    begins at round 1 (after the last claimed round, 0), the trainer goes on generating rounds 1 and 2 itself, so
    the handoff crosses and the worker's copies of rounds 1 and 2 must be discarded.

    The trainer's claims made after the worker was ready (rounds 1 and 2) are kept from it. With them visible, the
    worker skips a round the trainer claimed while it waited for weights, so whether it made a copy of round 2
    depended on which process came first (the test failed once in CI that way). Hidden, the worker always makes
    both copies: the widest crossing, which is the path under test here."""

    def _start_worker(self):
        super()._start_worker()
        real, trainer = self.worker.handoff, self

        class View:
            def __init__(self):
                self.real = real

            def worker_ready(self):
                return real.worker_ready() and trainer.state.global_step >= 3

            def claim(self, r):
                if not real.worker_ready():  # round 0, before the worker began; see the class's docstring
                    real.claim(r)

            def __getattr__(self, name):  # ready_at, next_round: the real ones
                return getattr(real, name)

        self.worker.handoff = View()


@pytest.mark.slow
def test_a_crossed_handoff_discards_the_workers_copies_and_still_equals_synchronous_grpo(tmp_path):
    sync = _sync_run(tmp_path, 6)
    t = _LateSight(tiny_model(), [low_ids], async_cfg(tmp_path, max_staleness=0, max_steps=6, warm_start=True),
                   train_dataset=prompts(), processing_class=tiny_tokenizer())
    _wait_for_the_worker_at_step(t, 1)
    t.train()
    assert logged(t, "async/rounds_in_trainer")[-1] == 3  # rounds 0, 1, 2
    assert t._superseded == 2  # the worker's rounds 1 and 2
    _assert_same_run(t, sync)


@pytest.mark.slow
def test_a_worker_hung_at_start_up_is_reported_while_the_trainer_trains_on(tmp_path):
    """The worker hangs importing a reward's module (a plugin import that never returns). The trainer keeps training
    on rounds it generates itself, and reports the worker as hung once worker_start_timeout has passed."""
    import hangs_in_worker

    t = AsyncGRPOTrainer(tiny_model(), [hangs_in_worker.short],
                         async_cfg(tmp_path, max_staleness=0, max_steps=400, warm_start=True,
                                   worker_start_timeout=6, heartbeat_timeout=3),
                         train_dataset=prompts(), processing_class=tiny_tokenizer())
    started = time.time()
    with pytest.raises(TrainingHealthError, match=r"not ready \d+ s after its start \(> worker_start_timeout 6 s\): "
                                                  "the worker hangs while starting"):
        t.train()
    assert time.time() - started < 90
    assert t.state.global_step < 400
    assert t.state.global_step >= 2  # trained meanwhile, on rounds of its own
    assert t.worker.process is None  # stopped (killed) before the error was raised


def test_settings_that_cannot_reach_the_worker_fail_in_the_trainer_naming_why(tmp_path):
    rows = [{**row, "handle": threading.Lock()} for row in prompts()]  # an extra column nothing can pickle
    t = AsyncGRPOTrainer(tiny_model(), [low_ids], async_cfg(tmp_path, max_staleness=0), train_dataset=rows,
                         processing_class=tiny_tokenizer())
    with pytest.raises(ConfigError, match=r"cannot be sent to its process \(TypeError: cannot pickle '_thread.lock'"):
        t.train()
    assert t.worker.process is None


@pytest.mark.slow
def test_a_worker_killed_during_the_warm_start_is_restarted_and_the_run_still_equals_synchronous_grpo(tmp_path):
    from transformers import TrainerCallback

    sync = _sync_run(tmp_path, 5)
    t = make(tmp_path, max_staleness=0, max_steps=5, warm_start=True, worker_restarts=1)
    killed = []

    class KillAtStep1(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                killed.append(t.worker.ready())
                t.worker.process.kill()
                t.worker.process.join(timeout=30)

    t.add_callback(KillAtStep1())
    _wait_for_the_worker_at_step(t, 3)  # the restarted worker takes over from round 3
    t.train()
    assert killed == [False]  # killed while starting, so the trainer noticed between rounds of its own
    assert logged(t, "async/worker_restarts")[-1] == 1.0
    assert logged(t, "async/rounds_in_trainer")[-1] == 3
    assert logged(t, "async/generator_idle_fraction"), "no round came from the restarted worker"
    _assert_same_run(t, sync)


def test_warm_start_defaults_to_on_with_transformers_and_off_with_vllm(tmp_path):
    assert make(tmp_path, warm_start=None).warm_start is True
    t = make(tmp_path, warm_start=None, generation_backend="vllm")
    assert t.warm_start is False and t.args.warm_start is None  # resolved in the trainer; the config is left alone


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["sync", "async", "async-warm"])
def test_generation_in_bfloat16_trains_the_float32_model_with_the_sampler_gap_corrected(tmp_path, trainer):
    """generation_backend_kwargs.dtype = bfloat16: GRPO's backend decodes on a cast copy refreshed every round;
    async GRPO's worker casts its own model, into which each published float32 state loads. Either way the gap
    between the sampler's and the trainer's log-probs stays at bfloat16 rounding while the weights move (lr 1e-2):
    a copy left at old weights would show the whole update as a gap."""
    kw = dict(max_steps=4, generation_backend_kwargs={"dtype": "bfloat16"})
    if trainer == "sync":
        t = GRPOTrainer(tiny_model(), [low_ids], GRPOConfig(output_dir=str(tmp_path / "sync"), **{**COMMON, **kw}),
                        train_dataset=prompts(), processing_class=tiny_tokenizer())
    else:  # async-warm: the trainer generates rounds itself while the worker starts (tiny model: most of them)
        t = make(tmp_path, max_staleness=0, warm_start=trainer == "async-warm", **kw)
    t.train()
    if trainer == "async-warm":
        assert logged(t, "async/rounds_in_trainer")[-1] >= 1
        assert t._warm_copy is None or t._warm  # dropped once the worker took over
    assert all(p.dtype == torch.float32 for p in t.model.parameters())
    gaps = logged(t, "sampler/logp_abs_diff_mean")
    # float32 sampling gives gaps of ~1e-7 here: above 1e-4 means the bfloat16 weights really sampled
    assert len(gaps) == 4 and all(1e-4 < g < 0.05 for g in gaps), gaps
    assert logged(t, "loss") and all(math.isfinite(x) for x in logged(t, "loss"))


def test_a_generation_dtype_async_grpo_cannot_use_fails_in_the_config_not_in_the_worker(tmp_path):
    from toolkit.core.ppo import PPOConfig

    with pytest.raises(ConfigError, match=r"generation_backend_kwargs.dtype: 'half' is not one of bfloat16"):
        async_cfg(tmp_path, generation_backend_kwargs={"dtype": "half"})
    with pytest.raises(ConfigError, match=r"generation_backend_kwargs.dtype: 'half' is not one of bfloat16"):
        PPOConfig(output_dir=str(tmp_path / "ppo"), generation_backend_kwargs={"dtype": "half"})
    # a setting the transformers backend does not take: named in every config, not dropped by the worker
    for make_cfg in (lambda kw: async_cfg(tmp_path, **kw), lambda kw: GRPOConfig(output_dir=str(tmp_path), **kw),
                     lambda kw: PPOConfig(output_dir=str(tmp_path / "ppo"), **kw)):
        with pytest.raises(ConfigError, match=r"the transformers backend takes only 'dtype'.*\['max_model_len'\]"):
            make_cfg(dict(generation_backend_kwargs={"dtype": "bfloat16", "max_model_len": 512}))
