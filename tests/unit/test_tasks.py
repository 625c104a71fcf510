"""The generated tasks: right answers, disjoint splits, near misses that are wrong, and the error for a typo."""

import re

import pytest

from toolkit.core.errors import ConfigError
from toolkit.core.rewards import number_list_match, numeric_match
from toolkit.core.tasks import TASKS, arithmetic_splits, task_rows, task_splits


def _question(row):
    return row["prompt"][-1]["content"]


def test_arithmetic_rows_are_the_ones_every_measured_run_used():
    """The held-out set behind every accuracy in the README and examples: the refactor must not move it."""
    train, held_out = arithmetic_splits(512, 64, max_value=20, max_terms=2, kind="prompt_only")
    # (the values the generator gave before builtin tasks were generalised, read from that version)
    assert _question(held_out[0]) == "What is 17 + 6? Answer with just the number." and held_out[0]["answer"] == "23"
    assert len(train) == 512 and _question(train[0]) == "What is 14 - 2? Answer with just the number."
    t2, h2 = arithmetic_splits(512, 64, max_value=20, max_terms=2, kind="prompt_completion")
    assert [_question(r) for r in t2 + h2] == [_question(r) for r in train + held_out]
    # preference rows draw a near miss after each problem from the same generator (so their problems differ)
    t3, h3 = arithmetic_splits(512, 64, max_value=20, max_terms=2, kind="preference")
    assert (h3[0]["chosen"][0]["content"], h3[0]["rejected"][0]["content"]) == ("23", "24")
    assert (_question(t3[-1]), t3[-1]["rejected"][0]["content"]) == ("What is 4 + 2? Answer with just the number.", "8")


@pytest.mark.parametrize("task, max_value, max_terms", [("arithmetic", 20, 3), ("multiplication", 99, 2),
                                                        ("sorting", 99, 4)])
def test_every_task_answers_right_and_its_splits_are_disjoint(task, max_value, max_terms):
    train, held_out = task_splits(task, 300, 50, max_value=max_value, max_terms=max_terms, kind="prompt_completion")
    assert len(train) == 300 and len(held_out) == 50
    assert not {_question(r) for r in train} & {_question(r) for r in held_out}
    if task == "sorting":  # a reordering of a held-out list is the same problem: never trained on
        assert not {r["answer"] for r in train} & {r["answer"] for r in held_out}
    assert len({_question(r) for r in train}) == 300
    for row in train + held_out:
        numbers = [int(n) for n in re.findall(r"-?\d+", _question(row).split("?")[0].split(".")[0])]
        if task == "sorting":
            assert len(numbers) == max_terms and row["answer"] == ", ".join(map(str, sorted(numbers)))
        elif task == "multiplication":
            assert 2 <= numbers[1] <= 9 and int(row["answer"]) == numbers[0] * numbers[1]
        else:
            assert int(row["answer"]) == eval(_question(row)[len("What is "):_question(row).index("?")])
        assert row["completion"][0]["content"] == row["answer"]


@pytest.mark.parametrize("task, reward", [("arithmetic", numeric_match), ("multiplication", numeric_match),
                                          ("sorting", number_list_match)])
def test_the_task_reward_accepts_the_chosen_answer_and_rejects_the_near_miss(task, reward):
    rows = task_rows(task, 40, max_value=50, max_terms=3, kind="preference")
    answers = [r["answer"] for r in rows]
    assert reward(None, [r["chosen"] for r in rows], None, answer=answers) == [1.0] * 40
    assert reward(None, [r["rejected"] for r in rows], None, answer=answers) == [0.0] * 40


def test_unknown_tasks_and_impossible_sizes_are_named():
    with pytest.raises(ConfigError, match="unknown builtin 'division'.*builtin:arithmetic, builtin:multiplication"):
        task_rows("division", 3)
    with pytest.raises(ConfigError, match="cannot draw 100 distinct builtin:multiplication problems"):
        task_rows("multiplication", 100, max_value=5)
    with pytest.raises(ConfigError, match="must be >= task_max_terms"):
        task_rows("sorting", 1, max_value=3, max_terms=4)
    assert set(TASKS) == {"arithmetic", "multiplication", "sorting", "calculator", "shapes"}


def test_calculator_rows_warm_up_with_the_tool_sometimes_and_hold_out_disjoint_questions():
    train, held_out = task_splits("calculator", 200, 20, max_value=99, kind="prompt_completion")
    with_tool = [r for r in train if any(m["role"] == "tool" for m in r["messages"])]
    assert 15 <= len(with_tool) <= 50  # about 15% use the tool; the rest answer at once
    for r in with_tool:
        call, result, answer = r["messages"][2:]
        expression = call["content"].split('"expression": "')[1].split('"')[0]
        assert result["content"] == answer["content"] == r["answer"] == str(eval(expression))  # noqa: S307
    questions = {r["messages"][1]["content"] for r in train}
    assert not questions & {r["messages"][1]["content"] for r in held_out}
    rows = task_rows("calculator", 5, max_value=99, kind="prompt_only")
    assert all(set(r) == {"prompt", "answer"} for r in rows)
