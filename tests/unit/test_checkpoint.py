"""The checkpoint protocol (toolkit/core/checkpoint.py): staging, marker, swap into place, rotation after the new
checkpoint is complete, and which folders resume accepts. The kills themselves are in tests/integration/test_crash_resume.py."""

import json
import logging

import pytest
import torch

from toolkit import ConfigError
from toolkit.core.checkpoint import (
    COMPLETE_MARKER,
    STAGING_DIR,
    begin_checkpoint,
    commit_checkpoint,
    latest_complete_checkpoint,
    resolve_resume,
)


def _write(root, step, *, limit=None, payload="new"):
    staging = begin_checkpoint(root, step)
    (staging / "weights.txt").write_text(payload)
    return commit_checkpoint(staging, root, step, save_total_limit=limit)


def test_commit_puts_a_complete_folder_in_place_and_rotates_only_afterwards(tmp_path):
    for step in (1, 2, 3):
        final = _write(tmp_path, step, limit=2)
        assert json.loads((final / COMPLETE_MARKER).read_text()) == {"global_step": step}
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert not any((tmp_path / STAGING_DIR).iterdir())


def test_rewriting_a_step_replaces_the_whole_folder_never_mixes_old_and_new(tmp_path):
    old = _write(tmp_path, 2, payload="old")
    (old / "only_in_old.txt").write_text("stale")
    new = _write(tmp_path, 2, payload="new")
    assert (new / "weights.txt").read_text() == "new"
    assert not (new / "only_in_old.txt").exists()  # a half-old, half-new folder cannot exist
    assert not list(tmp_path.glob(".trash-*"))


def test_leftovers_of_interrupted_writes_are_never_resumed_and_are_cleaned_up(tmp_path):
    _write(tmp_path, 1)
    (tmp_path / "checkpoint-2").mkdir()          # an unmarked folder: another tool's, or toolkit 0.1 killed mid-save
    begin_checkpoint(tmp_path, 5)                 # a staging folder a kill left behind, of another step
    assert latest_complete_checkpoint(tmp_path).endswith("checkpoint-1")
    assert resolve_resume(True, str(tmp_path)).endswith("checkpoint-1")
    _write(tmp_path, 3, limit=1)
    # checkpoint-1 rotated away; the unmarked folder is not toolkit's to delete; stale staging is gone
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert not any((tmp_path / STAGING_DIR).iterdir())


def test_a_kill_between_the_two_renames_of_a_re_save_loses_nothing(tmp_path):
    import os

    final = _write(tmp_path, 2, payload="old")
    os.replace(final, tmp_path / ".replaced-checkpoint-2")   # where a kill after the first rename leaves it
    assert latest_complete_checkpoint(tmp_path) == str(final)  # put back on the next look
    assert (final / "weights.txt").read_text() == "old"
    os.replace(final, tmp_path / ".replaced-checkpoint-2")
    _write(tmp_path, 3, limit=1)   # rotation must not delete it as a leftover either: it restores, then rotates
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]


def test_rotation_keeps_the_most_recently_completed(tmp_path):
    import time

    _write(tmp_path, 5)
    time.sleep(0.02)
    _write(tmp_path, 3, limit=1)  # a run resumed from an earlier step: its new checkpoint is the one kept
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]


def test_a_plain_transformers_checkpoint_is_accepted_with_a_warning(tmp_path, caplog):
    plain = tmp_path / "checkpoint-7"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(b"x")
    (plain / "trainer_state.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="toolkit.core.checkpoint"):
        assert resolve_resume(str(plain), str(tmp_path)) == str(plain)
        assert resolve_resume(True, str(tmp_path)) == str(plain)
    assert sum("transformers/TRL checkpoint" in r.getMessage() for r in caplog.records) == 2
    broken = tmp_path / "checkpoint-8"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"x")  # weights but no trainer_state.json: stopped mid-save
    with pytest.raises(ConfigError, match=r"is incomplete \(no toolkit_checkpoint_complete.json, no "
                                          r"trainer_state.json\).*Use the previous checkpoint"):
        resolve_resume(str(broken), str(tmp_path))


def test_resuming_from_the_last_checkpoint_trains_nothing_more(tmp_path):
    """transformers checks max_steps only after a step: resumed mid-epoch at max_steps it trained one step more."""
    from toolkit import GRPOConfig, GRPOTrainer
    from toolkit.testing import tiny_model, tiny_tokenizer

    def make():
        cfg = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                         max_completion_length=4, save_strategy="steps", save_steps=1, logging_steps=1,
                         report_to="none", disable_tqdm=True, lr_scheduler_type="constant", learning_rate=1e-2)
        reward = lambda prompts, completions, completion_ids, **kw: [float(sum(c) % 3) for c in completion_ids]  # noqa: E731
        return GRPOTrainer(tiny_model(), reward, cfg, train_dataset=[{"prompt": f"P{i}"} for i in range(16)],
                           processing_class=tiny_tokenizer())

    first = make()
    first.train()
    again = make()
    out = again.train(resume_from_checkpoint=True)
    assert out.global_step == 2 and again.state.global_step == 2
    assert not (tmp_path / "checkpoint-3").exists()
    for (k, v), (_, w) in zip(first.model.state_dict().items(), again.model.state_dict().items()):
        assert torch.equal(v, w), k  # the checkpoint's weights are loaded
