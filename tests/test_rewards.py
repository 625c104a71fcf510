"""Built-in verifiable rewards and the reward runner's contract."""

from fractions import Fraction

import pytest

from toolkit.core.errors import ConfigError
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
