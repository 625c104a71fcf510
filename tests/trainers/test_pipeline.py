"""`toolkit pipeline`: stages in sequence from one file, each starting from the previous stage's model."""

import json

import pytest

from toolkit.core.cli import main
from toolkit.core.errors import ConfigError
from toolkit.testing import tiny_model, tiny_tokenizer

SFT = """model = "unused"
dataset = "builtin:arithmetic"
eval_dataset = "builtin:arithmetic"
dataset_size = 32
eval_size = 8
max_steps = 2
per_device_train_batch_size = 8
learning_rate = 1e-3
save_strategy = "no"
disable_tqdm = true
"""
GRPO = """dataset = "builtin:arithmetic"
eval_dataset = "builtin:arithmetic"
dataset_size = 32
eval_size = 8
max_steps = 2
per_device_train_batch_size = 8
num_generations = 4
max_completion_length = 6
learning_rate = 1e-3
save_strategy = "no"
disable_tqdm = true
"""


def files(tmp_path, grpo_extra=""):
    tiny_model().save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "sft.toml").write_text(SFT.replace('"unused"', f'"{tmp_path / "m"}"'))
    (tmp_path / "grpo.toml").write_text(GRPO + grpo_extra)
    pipeline = tmp_path / "pipeline.toml"
    pipeline.write_text(f'''output_dir = "{tmp_path / 'out'}"
stages = [
  {{command = "sft", config = "{tmp_path / 'sft.toml'}", overrides = {{eval_every = 1}}}},
  {{command = "grpo", config = "{tmp_path / 'grpo.toml'}", overrides = {{eval_every = 1}}}},
]
''')
    return pipeline


def test_stages_run_in_sequence_from_the_previous_model(tmp_path, capsys):
    assert main(["pipeline", "--config", str(files(tmp_path))]) == 0
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert [s["command"] for s in summary["stages"]] == ["sft", "grpo"]
    sft, grpo = summary["stages"]
    assert sft["output_dir"].endswith("0-sft") and grpo["output_dir"].endswith("1-grpo")
    # the RL stage started from the SFT stage's model: its "before" is the SFT stage's "after"
    assert grpo["heldout_accuracy_before"] == pytest.approx(sft["heldout_accuracy_after"])
    assert [s for s, _ in grpo["accuracy_history"]] == [0, 1, 2]
    # SFT's eval_every curve reaches the pipeline summary (and its report's column) too
    assert [s for s, _ in sft["accuracy_history"]] == [0, 1, 2]
    assert summary["final_model"].endswith("1-grpo/final") and (out / "1-grpo" / "final" / "model.safetensors").exists()
    assert (out / "report.png").stat().st_size > 1000
    assert "=== pipeline summary ===" in capsys.readouterr().out


def test_a_bad_later_stage_stops_the_pipeline_before_the_first_trains(tmp_path):
    pipeline = files(tmp_path, grpo_extra="learning_rat = 1e-5\n")
    with pytest.raises(ConfigError, match="learning_rat"):
        main(["pipeline", "--config", str(pipeline), "--debug"])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text,message", [
    ('output_dir = "o"\nstages = []', "stages must be a non-empty list"),
    ('output_dir = "o"\nstages = [{command = "kto", config = "x.toml"}]', "command 'kto' is not one of"),
    ('output_dir = "o"\nstages = [{command = "sft", config = "missing.toml"}]', "run file 'missing.toml' does not exist"),
    ('output_dir = "o"\nstage = []', "unknown keys ['stage']"),
])
def test_bad_pipeline_files_are_named(tmp_path, text, message):
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(ConfigError) as e:
        main(["pipeline", "--config", str(tmp_path / "p.toml"), "--debug"])
    assert message in str(e.value)


def test_overrides_reach_the_stage_with_their_types():
    from toolkit.core.config import parse_overrides
    from toolkit.core.pipeline import _argv

    overrides = {"learning_rate": 5e-6, "run_name": "123", "packing": False, "lora_target_modules": ["q_proj"],
                 "chat_template_kwargs": {"enable_thinking": False}, "hub_model_id": "me/2026-11-30"}
    argv = _argv({"config": "x.toml", "overrides": overrides}, tmp := __import__("pathlib").Path("o"), None)
    parsed = parse_overrides(argv[2:-2])  # the same parser the stage's command uses
    assert parsed == overrides and argv[-2:] == ["--output_dir", str(tmp)]


def test_a_stage_without_held_out_accuracy_still_gets_a_summary(tmp_path, capsys):
    """An SFT stage on a .jsonl file has no accuracy: the table shows '-' (it crashed on None before)."""
    tiny_model().save_pretrained(tmp_path / "m")
    tiny_tokenizer().save_pretrained(tmp_path / "m")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"prompt": f"{i}+1=", "completion": str(i + 1)})
                                                for i in range(8)))
    (tmp_path / "sft.toml").write_text(f'model = "{tmp_path / "m"}"\ndataset = "{tmp_path / "d.jsonl"}"\n'
                                       'max_steps = 1\nsave_strategy = "no"\ndisable_tqdm = true\n')
    (tmp_path / "p.toml").write_text(f'output_dir = "{tmp_path / "out"}"\nstages = [{{command = "sft", config = "sft.toml"}}]\n')
    assert main(["pipeline", "--config", str(tmp_path / "p.toml")]) == 0  # sft.toml found next to the pipeline file
    out = capsys.readouterr().out
    assert "0-sft" in out and "-          -" in out.split("=== pipeline summary ===")[1]


def test_what_would_fail_late_is_refused_up_front(tmp_path):
    pipeline = files(tmp_path, grpo_extra='reward_funcs = ["numeric_mtach"]\n')
    with pytest.raises(ConfigError, match="numeric_mtach"):
        main(["pipeline", "--config", str(pipeline), "--debug"])
    (tmp_path / "grpo.toml").write_text(GRPO.replace('dataset = "builtin:arithmetic"\n', 'dataset = "nothere.jsonl"\n', 1))
    with pytest.raises(ConfigError, match="nothere.jsonl"):
        main(["pipeline", "--config", str(pipeline), "--debug"])
    (tmp_path / "p2.toml").write_text('output_dir = "o"\nstages = [{command = "sft", config = "sft.toml", '
                                      'overrides = {output_dir = "x"}}]\n')
    with pytest.raises(ConfigError, match=r"overrides may not set \['output_dir'\]"):
        main(["pipeline", "--config", str(tmp_path / "p2.toml"), "--debug"])
    assert not (tmp_path / "out").exists()


def test_every_stage_is_checked_before_the_first_trains_and_named_from_one(tmp_path):
    """The pipeline's docstring promised it; a typo in stage 2's environment_kwargs, a stage-2 dataset of the wrong
    shape or without the column its reward needs surfaced only after stage 1 had trained. Each now fails first,
    naming the stage as the log numbers it (from 1)."""
    from toolkit.core.errors import DataError

    pipeline = files(tmp_path, grpo_extra='environment = "calculator"\nenvironment_kwargs = {max_tool_trns = 2}\n'
                                          'reward_funcs = []\n')
    with pytest.raises(ConfigError, match=r"pipeline stage 2 of 2 \(grpo, .*grpo.toml\): environment_kwargs: got an "
                                          r"unexpected keyword argument 'max_tool_trns'"):
        main(["pipeline", "--config", str(pipeline), "--debug"])
    no_answer = tmp_path / "prompts.jsonl"
    no_answer.write_text("\n".join(json.dumps({"prompt": f"{i}+1="}) for i in range(16)))
    (tmp_path / "grpo.toml").write_text(GRPO.replace('dataset = "builtin:arithmetic"\n', f'dataset = "{no_answer}"\n', 1))
    with pytest.raises(DataError, match=r"pipeline stage 2 of 2 .*reward function 'numeric_match' needs the "
                                        r"column\(s\) \['answer'\], which the dataset does not have"):
        main(["pipeline", "--config", str(pipeline), "--debug"])
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) for _ in range(4)))
    (tmp_path / "sft.toml").write_text(SFT.replace('"unused"', f'"{tmp_path / "m"}"').replace(
        'dataset = "builtin:arithmetic"\n', f'dataset = "{pairs}"\n', 1))
    with pytest.raises(ConfigError, match=r"pipeline stage 1 of 2 \(sft, .*\): dataset: a sft stage needs "
                                          r"language_modeling or prompt_completion or tokenized data"):
        main(["pipeline", "--config", str(pipeline), "--debug"])
    (tmp_path / "p.toml").write_text('output_dir = "o"\nstages = [{command = "sft", config = "sft.toml"}, '
                                     '{command = "grpo", config = "missing.toml"}]\n')
    with pytest.raises(ConfigError, match=r"stage 2: run file 'missing.toml' does not exist"):
        main(["pipeline", "--config", str(tmp_path / "p.toml"), "--debug"])
    assert not (tmp_path / "out").exists()


def test_a_reward_needing_a_missing_column_is_refused_before_any_model_loads(tmp_path):
    from toolkit import GRPOConfig, GRPOTrainer
    from toolkit.core.errors import DataError

    with pytest.raises(DataError, match=r"train_dataset: reward function 'numeric_match' needs the column\(s\) "
                                        r"\['answer'\].*its columns: \['prompt'\]"):
        GRPOTrainer("/nonexistent/model", ["numeric_match"], GRPOConfig(output_dir=str(tmp_path), num_generations=2,
                                                                       per_device_train_batch_size=2),
                    train_dataset=[{"prompt": "1+1="}] * 4, processing_class=tiny_tokenizer())
