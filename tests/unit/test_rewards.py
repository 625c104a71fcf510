"""Built-in verifiable rewards and the reward runner's contract."""

import math
from fractions import Fraction

import pytest

from toolkit.core.errors import ConfigError, TrainingHealthError
from toolkit.core.rewards import RewardRunner, format_reward, length_penalty, numeric_match, parse_number


@pytest.mark.parametrize("text, value", [
    ("42", Fraction(42)), ("The answer is -7.", Fraction(-7)), ("12 + 17 = 29", Fraction(29)),
    ("about 2.50 dollars", Fraction(5, 2)), ("3/4", Fraction(3, 4)), ("1,234 apples", Fraction(1234)),
    (r"so \boxed{2/4} and then 99", Fraction(1, 2)), (r"\boxed{10} or \boxed{11}", Fraction(11)),
    ("no number here", None), ("1/0", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_numeric_match_compares_exactly_and_skips_unreadable_answers():
    completions = ["The answer is 0.5", "1/2", r"\boxed{3}", "4", [{"role": "assistant", "content": "5"}]]
    answers = ["1/2", "0.50", "3", "four", "5"]
    assert numeric_match(None, completions, None, answer=answers) == [1.0, 1.0, 1.0, None, 1.0]


def test_format_reward_and_length_penalty():
    fmt = format_reward(r"-?\d+")
    assert fmt(None, ["12", " 12 ", "12 apples"], None) == [1.0, 1.0, 0.0]
    pen = length_penalty(10, target=4)
    assert pen(None, ["a"] * 3, [[1] * 4, [1] * 7, [1] * 12]) == [0.0, -0.5, -1.0]
    with pytest.raises(ConfigError, match="length_penalty: target"):
        length_penalty(10, target=10)


def test_runner_rejects_wrong_shapes_and_values_without_stopping():
    def short(prompts, completions, completion_ids, **kw):
        return [1.0]

    def words(prompts, completions, completion_ids, **kw):
        return ["good"] * len(completions)

    runner = RewardRunner([short, words], timeout=5)
    out = runner(["p", "p"], ["a", "b"], [[1], [2]], {})
    assert all(v != v for row in out.rewards for v in row)  # all NaN
    assert out.failures == {"short": 1, "words": 1}


def test_runner_needs_a_reward():
    with pytest.raises(ConfigError, match="at least one reward"):
        RewardRunner([])


# ------------------------------------------------------------------------------------ isolation


def test_a_hung_sync_reward_is_abandoned_at_its_timeout_and_does_not_starve_the_next_batch():
    import time

    def hangs(prompts, completions, completion_ids, **kw):
        time.sleep(30)

    def healthy(prompts, completions, completion_ids, **kw):
        return [1.0] * len(completions)

    runner = RewardRunner([healthy, hangs], timeout=0.5, max_consecutive_failures=5)
    for _ in range(2):  # the second batch does not queue behind the first batch's hung call
        started = time.perf_counter()
        out = runner(["p"], ["a"], [[1]], {})
        assert time.perf_counter() - started < 2.0
        assert out.rewards[0] == [1.0] and math.isnan(out.rewards[1][0])
    assert runner.failures == {"healthy": 0, "hangs": 2} and out.abandoned == 2


def test_an_async_reward_that_blocks_its_loop_is_cut_at_its_timeout():
    import time

    async def blocks(prompts, completions, completion_ids, **kw):
        time.sleep(30)  # a blocking call inside async def: it never yields to the loop

    runner = RewardRunner([blocks], timeout=0.5)
    started = time.perf_counter()
    out = runner(["p"], ["a"], [[1]], {})
    assert time.perf_counter() - started < 2.0 and math.isnan(out.rewards[0][0])


def test_nan_is_a_failure_none_is_not_and_consecutive_failures_stop_with_the_columns():
    def nan_once(prompts, completions, completion_ids, **kw):
        return [float("nan"), None]

    runner = RewardRunner([nan_once], timeout=5, max_consecutive_failures=2)
    runner(["p", "q"], ["a", "b"], [[1], [2]], {"answer": ["1", "2"]})
    assert runner.failures == {"nan_once": 1}
    with pytest.raises(TrainingHealthError, match=r"'nan_once' failed on 2 batches in a row \(last: it returned nan "
                                                  r"for row 0.*columns \['answer'\]"):
        runner(["p", "q"], ["a", "b"], [[1], [2]], {"answer": ["1", "2"]})

    def none_only(prompts, completions, completion_ids, **kw):
        return [None, None]

    runner = RewardRunner([none_only], timeout=5, max_consecutive_failures=1)
    out = runner(["p", "q"], ["a", "b"], [[1], [2]], {})
    assert runner.failures == {"none_only": 0} and all(math.isnan(v) for v in out.rewards[0])


@pytest.mark.slow
def test_a_process_with_a_hung_reward_still_exits(tmp_path):
    import subprocess
    import sys
    import textwrap
    import time

    script = tmp_path / "hang.py"
    script.write_text(textwrap.dedent("""
        import time
        from toolkit.core.rewards import RewardRunner

        def hangs(prompts, completions, completion_ids, **kw):
            time.sleep(600)

        RewardRunner([hangs], timeout=0.2)(["p"], ["a"], [[1]], {})
        print("scored")
    """))
    started = time.time()
    # The bound is half the hung call's 600 s, not a speed claim: importing torch and transformers in a fresh
    # process has taken 70 s on a loaded 2-core machine (a 60 s bound failed CI once), never near 300.
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "scored" in out.stdout
    assert time.time() - started < 300  # the hung call does not hold the exit


def test_numpy_and_tensor_returns_are_lists_and_a_function_that_keeps_hanging_stops_the_run():
    import time

    import numpy as np
    import torch

    def as_numpy(prompts, completions, completion_ids, **kw):
        return np.ones(len(completions))

    def as_tensor(prompts, completions, completion_ids, **kw):
        return torch.zeros(len(completions))

    out = RewardRunner([as_numpy, as_tensor], timeout=5)(["p", "q"], ["a", "b"], [[1], [2]], {})
    assert out.rewards == [[1.0, 1.0], [0.0, 0.0]]

    def hangs(prompts, completions, completion_ids, **kw):
        time.sleep(30)

    runner = RewardRunner([hangs], timeout=0.05, max_consecutive_failures=100)
    with pytest.raises(TrainingHealthError, match=r"'hangs' has 4 calls still running past reward_timeout"):
        for _ in range(5):
            runner(["p"], ["a"], [[1]], {})


def test_number_list_match_reads_the_numbers_in_order():
    from toolkit.core.rewards import number_list_match

    completions = ["3, 7, 12", "3,7,12.", "The sorted list: 3 7 12", "3, 12, 7", "3, 7", "3, 7, 12, 12",
                   [{"role": "assistant", "content": "-1, 0"}], "anything"]
    answers = ["3, 7, 12"] * 6 + ["-1, 0", "no numbers"]
    assert number_list_match(None, completions, None, answer=answers) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, None]
