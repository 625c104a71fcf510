"""HTTPJudge against a real HTTP server on loopback (toolkit.testing.JudgeServer): scores, failures counted
the usual way, the `judge:<url>` spec, and async GRPO overlapping a slow judge with generation."""

import time

import pytest

from toolkit import ConfigError, TrainingHealthError
from toolkit.core.plugins import resolve_reward
from toolkit.core.rewards import HTTPJudge, RewardRunner
from toolkit.testing import JudgeServer

PROMPTS = ["What is 2 + 2?", "What is 3 + 4?", "What is 1 + 1?"]
COMPLETIONS = ["4", "The answer is 8", "2"]


def test_the_judge_scores_a_batch_over_http():
    with JudgeServer() as server:
        runner = RewardRunner([HTTPJudge(server.url)], timeout=10)
        out = runner(PROMPTS, COMPLETIONS, [[1], [2], [3]], {"answer": ["4", "7", "2"]})
        assert out.rewards == [[1.0, 0.0, 1.0]] and server.requests == 1


def test_a_failing_or_slow_judge_fails_the_batch_and_then_the_run_naming_it():
    with JudgeServer(fail_every=1) as server:
        runner = RewardRunner([HTTPJudge(server.url, name="my_judge")], timeout=10, max_consecutive_failures=2)
        out = runner(PROMPTS, COMPLETIONS, [[1]] * 3, {"answer": ["4", "7", "2"]})
        assert runner.failures["my_judge"] == 1 and "503" in runner.last_error["my_judge"]
        assert all(x != x for x in out.rewards[0])  # NaN: excluded, not zero
        with pytest.raises(TrainingHealthError, match="my_judge"):
            runner(PROMPTS, COMPLETIONS, [[1]] * 3, {"answer": ["4", "7", "2"]})
    with JudgeServer(latency=(2.0, 2.0)) as server:
        runner = RewardRunner([HTTPJudge(server.url)], timeout=0.5)
        started = time.perf_counter()
        runner(PROMPTS, COMPLETIONS, [[1]] * 3, {"answer": ["4", "7", "2"]})
        assert time.perf_counter() - started < 1.5 and runner.failures["judge"] == 1
    # nothing listening: a connection error, counted the same way
    runner = RewardRunner([HTTPJudge("http://127.0.0.1:9/score")], timeout=5)
    runner(PROMPTS, COMPLETIONS, [[1]] * 3, {"answer": ["4", "7", "2"]})
    assert runner.failures["judge"] == 1


def test_the_judge_spec_and_bad_urls():
    judge = resolve_reward("judge:http://127.0.0.1:8000/score")
    assert isinstance(judge, HTTPJudge) and judge.url.endswith(":8000/score")
    with pytest.raises(ConfigError, match="not an http"):
        HTTPJudge("127.0.0.1:8000")
    with pytest.raises(ConfigError, match="timeout"):
        HTTPJudge("http://127.0.0.1:8000/score", timeout=0)


@pytest.mark.slow
def test_async_grpo_scores_with_the_judge_while_it_generates_the_next_round(tmp_path):
    """The worker generates round r+1 while round r waits for the judge, so the judge sees two rounds' requests
    at once (never more than scoring_concurrency); the trainer gets every round with the judge's rewards."""
    from test_async_grpo import async_cfg, logged

    from toolkit.core.async_grpo import AsyncGRPOTrainer
    from toolkit.testing import tiny_model, tiny_tokenizer

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(16)]
    with JudgeServer(latency=(0.8, 0.8)) as server:
        t = AsyncGRPOTrainer(tiny_model(), [HTTPJudge(server.url)],
                             async_cfg(tmp_path, max_steps=4, max_staleness=2, scoring_concurrency=2),
                             train_dataset=rows, processing_class=tiny_tokenizer())
        t.train()
        assert server.requests >= 4
        assert server.max_in_flight == 2  # round r+1 was generated and sent while round r was being judged
    assert len(logged(t, "loss")) == 4 and max(logged(t, "async/staleness_max")) <= 2
    assert all(s >= 0.75 for s in logged(t, "time/scoring_s")), logged(t, "time/scoring_s")
