"""Nothing lost: a failed push leaves the trained model on disk and says where; a save into a file is refused
before anything is written; run files with a byte-order mark read as they look."""

import os

import pytest
import torch
from builders import plain_pc
from safetensors.torch import load_file

from toolkit import ConfigError, SFTConfig, SFTTrainer
from toolkit.core.config import load_run_file
from toolkit.core.errors import HubPushError
from toolkit.testing import tiny_model, tiny_tokenizer


def sft(tmp_path, **kw):
    return SFTTrainer(tiny_model(), SFTConfig(output_dir=str(tmp_path / "run"), max_steps=2, learning_rate=1e-2,
                                              report_to="none", disable_tqdm=True, save_strategy="no", **kw),
                      train_dataset=plain_pc(8), processing_class=tiny_tokenizer())


def test_a_push_without_network_leaves_the_trained_model_on_disk_and_says_where(tmp_path, monkeypatch):
    """push_to_hub() with no network raised before anything was saved (transformers creates the Hub repo first), so a
    notebook ending with it kept the trained weights only in memory."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = sft(tmp_path, hub_model_id="someone/tiny-sft")
    t.train()
    with pytest.raises(HubPushError) as e:
        t.push_to_hub()
    out = tmp_path / "run"
    message = str(e.value)
    assert "push_to_hub: the push failed" in message and str(out.resolve()) in message
    assert "hf upload <repo-id>" in message
    saved = load_file(str(out / "model.safetensors"))
    trained = {k: v for k, v in t.model.state_dict().items()}
    assert saved and all(torch.equal(saved[k], trained[k]) for k in saved)  # the trained weights, not the start
    assert (out / "README.md").exists() and (out / "tokenizer_config.json").exists()
    assert not (out / ".toolkit-saving").exists()  # no staging folder left behind


def test_saving_into_a_path_that_is_a_file_is_a_config_error(tmp_path):
    t = sft(tmp_path)
    taken = tmp_path / "model.bin"
    taken.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"save_model: '.*model.bin' is a file; a model is saved as a folder"):
        t.save_model(str(taken))
    assert taken.read_text() == "not a folder"


def test_a_save_killed_midway_leaves_complete_files(tmp_path, monkeypatch):
    """The files are written into a staging folder and moved in one rename each: a save that fails while writing
    leaves the earlier model's files whole."""
    t = sft(tmp_path)
    t.save_model(str(tmp_path / "final"))
    before = (tmp_path / "final" / "model.safetensors").read_bytes()
    import transformers

    def dies(self, output_dir=None, _internal_call=False):
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "model.safetensors"), "wb") as f:
            f.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.Trainer, "save_model", dies)
    with pytest.raises(KeyboardInterrupt):
        t.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == before


def test_a_run_file_with_a_byte_order_mark_reads_as_it_looks(tmp_path):
    path = tmp_path / "run.toml"
    path.write_bytes("\ufeffmodel = \"m\"\nlearning_rate = 1e-5\n".encode("utf-8"))
    assert load_run_file(path) == {"model": "m", "learning_rate": 1e-5}
    path.write_bytes(b"\xff\xfe m = 1")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_run_file(path)


def test_the_gathered_state_dict_keeps_tied_weights_tied_and_holds_nothing_when_not_kept():
    """full_state_dict (FSDP2 saves; run sharded by tests/integration/test_multiprocess.py): a weight under two
    names stays one tensor, so save_pretrained writes it once; a rank that does not write keeps nothing."""
    from toolkit.core.lifecycle import full_state_dict

    model = tiny_model()
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2 is
    kept = full_state_dict(model)
    assert kept.keys() == model.state_dict().keys()
    assert kept["lm_head.weight"] is kept["model.embed_tokens.weight"]
    assert all(v.device.type == "cpu" and not v.requires_grad for v in kept.values())
    torch.testing.assert_close(kept["model.norm.weight"], model.model.norm.weight.detach())
    assert full_state_dict(model, keep=False) == {}
