"""The compact console: one line per logged step with the numbers that say whether learning happens, the
full dicts in metrics.jsonl, and transformers' dict lines gone."""

import json
import logging
import math

from toolkit.core.console import compact_line
from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.core.sft import SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer


def test_the_line_reads_left_to_right():
    line = compact_line({"loss": 0.01234, "reward": 0.5631, "reward_std": 0.21, "entropy": 0.4123, "kl": 0.0031,
                         "learning_rate": 1e-5, "frac_reward_zero_std": 0.2, "completions/mean_length": 12.0},
                        step=12, max_steps=80, seconds_per_step=4.2, warnings=0)
    assert line == ("step 12/80 | loss 0.0123 | reward 0.563 ±0.21 | entropy 0.412 | kl 0.0031 | lr 1.0e-05 | "
                    "4.20 s/step | ok")
    assert compact_line({"loss": math.nan}, step=1, max_steps=0, seconds_per_step=None, warnings=0).endswith(
        "NON-FINITE LOSS")
    assert compact_line({"eval_loss": 1.5}, step=3, max_steps=9, seconds_per_step=None, warnings=2) == \
        "step 3/9 | eval_loss 1.5000 | 2 warnings above"
    # a GRPO step without signal says that the weights did not move; a 4-step log window says what share
    assert compact_line({"loss": 0.0, "update_skipped": 1.0}, step=5, max_steps=9,
                        seconds_per_step=None, warnings=0) == "step 5/9 | loss 0.0000 | no signal, update skipped | ok"
    assert "25% of updates skipped" in compact_line({"loss": 0.1, "update_skipped": 0.25}, step=8, max_steps=9,
                                                    seconds_per_step=None, warnings=0)
    assert "skipped" not in compact_line({"loss": 0.1, "update_skipped": 0.0}, step=8, max_steps=9,
                                         seconds_per_step=None, warnings=0)


def test_training_prints_compact_lines_and_writes_every_dict(tmp_path, capsys):
    rows = [{"prompt": f"What is {i} + 1? ", "completion": str(i + 1)} for i in range(8)]
    t = SFTTrainer(tiny_model(), SFTConfig(output_dir=str(tmp_path), max_steps=3, logging_steps=1, save_strategy="no",
                                           report_to="none", disable_tqdm=True),
                   train_dataset=rows, processing_class=tiny_tokenizer())
    t.train()
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if ln.startswith("step ")]
    assert [ln.split(" | ")[0] for ln in lines[:3]] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "{'loss'" not in out  # transformers' dict lines are gone
    records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = [h for h in t.state.log_history if "loss" in h]
    assert [r["loss"] for r in records if "loss" in r] == [h["loss"] for h in logged]
    assert all("grad_norm" in r for r in records if "loss" in r)


def test_grpo_lines_carry_reward_and_count_warnings(tmp_path, capsys):
    reward = lambda completions, **kw: [1.0] * len(completions)  # noqa: E731  (no signal: GRPO warns)
    t = GRPOTrainer(tiny_model(), [reward], GRPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                                      num_generations=2, max_completion_length=4, report_to="none",
                                                      save_strategy="no", disable_tqdm=True, no_signal_warn_steps=1),
                    train_dataset=[{"prompt": f"Count to {i}:"} for i in range(4)], processing_class=tiny_tokenizer())
    logging.getLogger("toolkit").setLevel(logging.INFO)
    t.train()
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ") and "runtime_s" not in ln]
    assert len(lines) == 3 and all("reward 1.000" in ln for ln in lines)
    assert any("warning" in ln.split(" | ")[-1] for ln in lines), lines


def test_counted_warnings_still_reach_stderr_where_nothing_else_is_configured(capsys):
    """The counter on the "toolkit" logger must not take the place of Python's last-resort handler (a notebook
    with no logging set up), also when an interrupted train() left it attached; where a handler is configured
    (the CLI, pytest) it prints nothing twice."""
    from toolkit.core.console import _WarningCounter

    toolkit_logger, root = logging.getLogger("toolkit"), logging.getLogger()
    counter, saved = _WarningCounter(), root.handlers[:]
    toolkit_logger.addHandler(counter)
    try:
        root.handlers.clear()
        logging.getLogger("toolkit.core.generation").warning("bf16=True with float32 weights: nobody configured")
        assert counter.count == 1
        assert "nobody configured" in capsys.readouterr().err
        seen = []
        handler = logging.Handler(level=logging.WARNING)
        handler.emit = lambda record: seen.append(record.getMessage())
        root.addHandler(handler)
        logging.getLogger("toolkit.core.generation").warning("configured")
        assert counter.count == 2 and seen == ["configured"]
        assert "configured" not in capsys.readouterr().err
    finally:
        toolkit_logger.removeHandler(counter)
        root.handlers[:] = saved


def test_a_short_run_shows_its_first_and_last_loss_whatever_logging_steps_says(tmp_path, capsys):
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(8)]
    cfg = SFTConfig(output_dir=str(tmp_path), max_steps=5, logging_steps=10, per_device_train_batch_size=2,
                    report_to="none", save_strategy="no")
    trainer = SFTTrainer(tiny_model(), cfg, train_dataset=rows, processing_class=tiny_tokenizer())
    trainer.train()
    logged = [h["step"] for h in trainer.state.log_history if "loss" in h]
    assert logged == [1, 5]
    out = capsys.readouterr().out
    assert "step 1/5 | loss " in out and "step 5/5 | loss " in out
    cfg = SFTConfig(output_dir=str(tmp_path), max_steps=6, logging_steps=3, per_device_train_batch_size=2,
                    report_to="none", save_strategy="no")
    trainer = SFTTrainer(tiny_model(), cfg, train_dataset=rows, processing_class=tiny_tokenizer())
    trainer.train()
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 3, 6]  # the last step once


SCRIPT = """
from toolkit.core.sft import SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer
cfg = SFTConfig(output_dir={out!r}, max_steps=1, report_to="none", save_strategy="no")
SFTTrainer(tiny_model(), cfg, train_dataset=[{{"prompt": "1+1=", "completion": "2"}}] * 4,
           processing_class=tiny_tokenizer())
import logging
logging.basicConfig(level=logging.INFO)   # configured later: toolkit's lines must not print twice
logging.getLogger("toolkit.core.sft").info("after basicConfig")
"""


def test_the_start_up_summary_shows_where_nothing_configured_logging(tmp_path):
    """A notebook or a plain script configures no logging: Python would drop toolkit's INFO lines."""
    import subprocess
    import sys

    def run(**env):
        import os

        proc = subprocess.run([sys.executable, "-c", SCRIPT.format(out=str(tmp_path))], capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout + proc.stderr

    out = run()
    assert "[toolkit] SFT loss settings:" in out
    assert out.count("after basicConfig") == 1
    quiet = run(TOOLKIT_VERBOSITY="warning")
    assert "SFT loss settings" not in quiet
    assert "SFT loss settings" not in run(RANK="1")  # under torchrun only rank 0 tells the story
