"""reasoning-gym's tasks as data and rewards (toolkit.core.gym_tasks): rows, disjoint splits, the task's own
verifier as the reward (in this process and rebuilt from the row alone), errors by name, and a run through the
command line whose held-out accuracy is the task's own scoring."""

import json
import sys

import pytest

from toolkit.core.errors import ConfigError
from toolkit.core.gym_tasks import gym_answer, gym_rows, gym_splits, reasoning_gym_reward

pytest.importorskip("reasoning_gym")
CHAIN = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def score(rows, texts):
    return reasoning_gym_reward([r["prompt"] for r in rows], texts, [[]] * len(rows),
                                reasoning_gym=[r["reasoning_gym"] for r in rows])


def test_rows_carry_the_question_the_answer_and_the_entry():
    rows = gym_rows("chain_sum", 5, seed=3, settings=CHAIN, kind="prompt_completion")
    assert len(rows) == 5 and len({r["prompt"][0]["content"] for r in rows}) == 5
    row = rows[0]
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].endswith("no explanation.")
    assert row["completion"] == [{"role": "assistant", "content": row["answer"]}]
    assert json.loads(row["reasoning_gym"])["task"] == "chain_sum"
    assert "completion" not in gym_rows("chain_sum", 2, settings=CHAIN)[0]


def test_splits_are_disjoint_and_fixed_by_the_seed():
    train, held = gym_splits("chain_sum", 40, 16, settings=CHAIN)
    questions = lambda rows: {r["prompt"][0]["content"] for r in rows}  # noqa: E731
    assert len(train) == 40 and len(held) == 16 and not questions(train) & questions(held)
    again, _ = gym_splits("chain_sum", 40, 16, settings=CHAIN)
    assert again == train
    # another task_seed gives other problems, not the same ones shifted (reasoning-gym seeds item i with seed + i):
    # among ~20000 two-digit sums, two draws of 40 share about none by chance
    wide = {**CHAIN, "max_digits": 2}
    first, second = (gym_splits("chain_sum", 40, 16, settings=wide, seed=s)[0] for s in (0, 1))
    assert len(questions(first) & questions(second)) <= 2


def test_the_reward_is_the_tasks_own_verifier_rebuilt_from_the_row():
    rows = gym_rows("chain_sum", 4, settings=CHAIN)
    assert score(rows, [r["answer"] for r in rows]) == [1.0] * 4
    assert score(rows, ["no idea"] * 4) == [0.0] * 4
    # conversational completions, the answer on the last line or inside <answer> tags
    assert score(rows[:2], [[{"role": "assistant", "content": f"Let me add.\n{rows[0]['answer']}"}],
                            [{"role": "assistant", "content": f"<answer>{rows[1]['answer']}</answer>"}]]) == [1.0, 1.0]
    # another task whose verifier reads the entry's metadata
    words = gym_rows("word_sequence_reversal", 2, settings={"min_words": 3, "max_words": 3})
    assert score(words, [r["answer"] for r in words]) == [1.0, 1.0]
    assert reasoning_gym_reward([[]], ["x"], [[]], reasoning_gym=[""]) == [None]  # no entry: not judged
    # a verifier that raises on one malformed answer scores it 0.0 (the batch's other rows keep their scores)
    from toolkit.core import gym_tasks

    data = gym_tasks._dataset("chain_sum", gym_tasks._settings_json(CHAIN), 0, 16)
    real = type(data).score_answer

    def choking(self, answer, entry):
        if answer == "boom":
            raise ValueError("cannot parse")
        return real(self, answer, entry)

    type(data).score_answer = choking
    try:
        assert score(rows[:2], ["boom", rows[1]["answer"]]) == [0.0, 1.0]
    finally:
        type(data).score_answer = real
    assert gym_answer("  \nfirst\n  last  \n") == "last" and gym_answer("") == ""


def test_errors_name_the_task_the_settings_and_the_install(monkeypatch):
    with pytest.raises(ConfigError, match="no task 'chain_sums'; close: chain_sum"):
        gym_rows("chain_sums", 2)
    with pytest.raises(ConfigError, match="refused the settings"):
        gym_rows("chain_sum", 2, settings={"min_terms": 5, "max_terms": 2})
    with pytest.raises(ConfigError, match="gave .* distinct questions of the 500 asked"):
        gym_rows("chain_sum", 500, settings={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    with pytest.raises(ConfigError, match="preference pairs"):
        gym_rows("chain_sum", 2, kind="preference")
    import toolkit

    with pytest.raises(ConfigError, match="task_kwargs / task_seed: they set up reasoning_gym"):
        toolkit.load_run({"dataset": "builtin:arithmetic", "task_kwargs": {"min_terms": 2}}, "sft")
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    from toolkit.core import gym_tasks

    gym_tasks._dataset.cache_clear()
    with pytest.raises(ConfigError, match=r"pip install 'toolkit\[tasks\]'"):
        gym_rows("basic_arithmetic", 2)
    gym_tasks._dataset.cache_clear()


def test_a_grpo_run_scores_held_out_accuracy_with_the_tasks_verifier(tmp_path):
    from toolkit.core.cli import main
    from toolkit.testing import tiny_model, tiny_tokenizer

    tiny_model().save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    run = tmp_path / "run.toml"
    run.write_text(f'''model = "{tmp_path / 'm'}"
dataset = "reasoning_gym:chain_sum"
eval_dataset = "reasoning_gym:chain_sum"
dataset_size = 8
eval_size = 4
reward_funcs = ["reasoning_gym"]
max_steps = 2
per_device_train_batch_size = 4
num_generations = 2
max_completion_length = 4
save_strategy = "no"
report_to = "none"
disable_tqdm = true
output_dir = "{tmp_path / 'out'}"

[task_kwargs]
min_terms = 2
max_terms = 2
min_digits = 1
max_digits = 1
''')
    assert main(["grpo", "--config", str(run)]) == 0
    summary = json.loads((tmp_path / "out" / "report" / "summary.json").read_text())
    assert summary["reward_funcs"] == ["reasoning_gym"]
    assert 0.0 <= summary["heldout_accuracy_before"] <= 1.0 and "heldout_accuracy_after" in summary
