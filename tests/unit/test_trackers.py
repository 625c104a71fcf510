"""`report_to` trackers, for real: a short run writes metrics that are read back from the tracker's own files.

Both trackers are local-first: tensorboard writes event files under `logging_dir`; trackio writes a SQLite
database under TRACKIO_DIR (set to a temporary folder; no Space, no network)."""

import json
import os
import subprocess
import sys

import pytest

from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.core.sft import SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer

ROWS = [{"prompt": f"What is {i} + 1? ", "completion": str(i + 1)} for i in range(8)]


def test_tensorboard_gets_every_logged_loss_and_grpo_rewards(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="the 'trackers' extra (scripts/setup.sh installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # transformers 5 takes the event folder from TENSORBOARD_LOGGING_DIR (else output_dir/runs/<time>)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb-sft"))
    sft = SFTTrainer(tiny_model(), SFTConfig(output_dir=str(tmp_path / "sft"), max_steps=3, logging_steps=1,
                                             report_to="tensorboard",
                                             save_strategy="no", disable_tqdm=True),
                     train_dataset=ROWS, processing_class=tiny_tokenizer())
    sft.train()
    events = EventAccumulator(str(tmp_path / "tb-sft"))
    events.Reload()
    logged = [h["loss"] for h in sft.state.log_history if "loss" in h]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(logged, rel=1e-6)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb-grpo"))
    grpo = GRPOTrainer(tiny_model(), [lambda completions, **kw: [float(len(c)) for c in completions]],
                       GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=2, per_device_train_batch_size=4,
                                  num_generations=2, max_completion_length=4, report_to="tensorboard",
                                  save_strategy="no", disable_tqdm=True),
                       train_dataset=[{"prompt": f"Count to {i}:"} for i in range(4)], processing_class=tiny_tokenizer())
    grpo.train()
    events = EventAccumulator(str(tmp_path / "tb-grpo"))
    events.Reload()
    rewards = [h["reward"] for h in grpo.state.log_history if "reward" in h]
    assert [e.value for e in events.Scalars("train/reward")] == pytest.approx(rewards, rel=1e-6)


_TRACKIO_RUN = r"""
import json, sys
from toolkit.core.sft import SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer
rows = [{"prompt": f"What is {i} + 1? ", "completion": str(i + 1)} for i in range(8)]
cfg = SFTConfig(output_dir=sys.argv[1], max_steps=3, logging_steps=1, report_to="trackio", project="toolkit-test",
                run_name="sft-run", save_strategy="no", disable_tqdm=True)
t = SFTTrainer(tiny_model(), cfg, train_dataset=rows, processing_class=tiny_tokenizer())
t.train()
print(json.dumps([h["loss"] for h in t.state.log_history if "loss" in h]))
"""


@pytest.mark.slow
def test_trackio_gets_every_logged_loss(tmp_path):
    pytest.importorskip("trackio", reason="the 'trackers' extra (scripts/setup.sh installs it)")
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", _TRACKIO_RUN, str(tmp_path / "out")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logged = json.loads(proc.stdout.strip().splitlines()[-1])
    read = subprocess.run([sys.executable, "-c", (
        "import json; from trackio.sqlite_storage import SQLiteStorage; "
        "print(json.dumps(SQLiteStorage.get_logs('toolkit-test', 'sft-run')))")],
        capture_output=True, text=True, env=env, timeout=120)
    assert read.returncode == 0, read.stderr[-4000:]
    logs = json.loads(read.stdout.strip().splitlines()[-1])
    losses = [row["train/loss"] for row in logs if "train/loss" in row]
    assert losses == pytest.approx(logged, rel=1e-6)
