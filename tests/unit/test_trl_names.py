"""TRL's config names: each field of TRL's SFTConfig, DPOConfig and GRPOConfig (the installed TRL) is a field of
ours or is taken or refused with a ConfigError naming the alternative (toolkit.core.trl_names)."""

import dataclasses

import pytest
import torch

from toolkit import DPOConfig, GRPOConfig, SFTConfig
from toolkit._dev import trl_names_doc
from toolkit.core.errors import ConfigError
from toolkit.core.trl_names import TRL_FIELDS

trl = pytest.importorskip("trl")

PAIRS = [(trl.SFTConfig, SFTConfig), (trl.DPOConfig, DPOConfig), (trl.GRPOConfig, GRPOConfig)]


def _default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@pytest.mark.parametrize("theirs, ours", PAIRS, ids=lambda c: c.__name__)
def test_every_trl_field_is_ours_or_has_a_fate(theirs, ours, tmp_path):
    fields = {f.name for f in dataclasses.fields(ours)}
    table = TRL_FIELDS[ours.__name__]
    missing = [f.name for f in dataclasses.fields(theirs) if f.name not in fields and f.name not in table]
    assert not missing, f"TRL's {theirs.__name__} fields with no fate in toolkit/core/trl_names.py: {missing}"
    for f in dataclasses.fields(theirs):
        if f.name in fields or (value := _default(f)) is dataclasses.MISSING:
            continue
        # TRL's default is taken: code that spells out TRL's defaults runs
        ours(output_dir=str(tmp_path), **{f.name: value})
        entry = table[f.name]
        if entry.fate != "same":
            assert any(v == value and type(v) is type(value) for v in entry.accepts), (f.name, value, entry.accepts)
    # the fields both have (beyond TrainingArguments'): TRL's default is a value ours takes
    from transformers import TrainingArguments

    shared = {f.name for f in dataclasses.fields(TrainingArguments)}
    for f in dataclasses.fields(theirs):
        if f.name in fields and f.name not in shared and (value := _default(f)) is not dataclasses.MISSING:
            ours(output_dir=str(tmp_path), **{f.name: value})


@pytest.mark.parametrize("ours", [SFTConfig, DPOConfig, GRPOConfig], ids=lambda c: c.__name__)
def test_every_refusal_names_the_field_and_an_alternative(ours, tmp_path):
    for name, entry in TRL_FIELDS[ours.__name__].items():
        if entry.fate == "same":
            continue
        with pytest.raises(ConfigError, match=rf"TRL's '{name}' = 'not a value'.*instead: \S"):
            ours(output_dir=str(tmp_path), **{name: "not a value"})


def test_trl_vllm_settings_become_our_backend_settings(tmp_path):
    cfg = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_mode="server", vllm_server_host="10.0.0.2",
                     vllm_server_port=8001, vllm_server_timeout=120, vllm_importance_sampling_mode="sequence_mask",
                     vllm_enable_sleep_mode=True,
                     vllm_importance_sampling_cap=3.0, cast_lm_head_to_fp32=True, use_bias_correction_kl=False)
    assert cfg.generation_backend == "vllm-server"
    assert cfg.generation_backend_kwargs == {"url": "http://10.0.0.2:8001", "startup_timeout": 120.0}
    assert (cfg.importance_sampling_level, cfg.importance_sampling_mode, cfg.importance_sampling_cap) == (
        "sequence", "mask", 3.0)
    assert cfg.fp32_lm_head is True and cfg.kl_bias_correction is False
    colocated = GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_max_model_length=512,
                           generation_backend_kwargs={"lora_sync": "merged"})
    # the user's own generation_backend_kwargs keep their keys beside the translated ones; a key set two ways is
    # refused rather than one of them dropped
    assert colocated.generation_backend == "vllm"
    assert colocated.generation_backend_kwargs == {"max_model_len": 512, "lora_sync": "merged"}
    with pytest.raises(ConfigError, match=r"\['max_model_len'\].*disagree"):
        GRPOConfig(output_dir=str(tmp_path), use_vllm=True, vllm_max_model_length=512,
                   generation_backend_kwargs={"max_model_len": 1024})
    assert GRPOConfig(output_dir=str(tmp_path), use_vllm=False).generation_backend == "transformers"
    assert GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_correction=False).importance_sampling_cap is None


def test_model_init_kwargs_and_trust_remote_code_and_shuffling(tmp_path):
    cfg = SFTConfig(output_dir=str(tmp_path), trust_remote_code=True, model_init_kwargs={"dtype": "bfloat16"})
    assert cfg.model_init_kwargs == {"dtype": "bfloat16", "trust_remote_code": True}
    with pytest.raises(ConfigError, match=r"disagree"):  # a dict key set two ways
        SFTConfig(output_dir=str(tmp_path), trust_remote_code=True, model_init_kwargs={"trust_remote_code": False})
    # TRL's shuffle_dataset shuffles the dataset once while preparing it; batches are random either way
    assert SFTConfig(output_dir=str(tmp_path), shuffle_dataset=False).train_sampling_strategy == "random"


def test_trl_s_precedence_between_its_sampler_correction_settings(tmp_path):
    """correction=False wins over the clip settings, the deprecated cap over clip_max, whatever the order."""
    for kwargs in ({"vllm_importance_sampling_clip_max": 5.0, "vllm_importance_sampling_correction": False},
                   {"vllm_importance_sampling_correction": False, "vllm_importance_sampling_clip_max": 5.0,
                    "vllm_importance_sampling_clip_min": 0.5}):
        cfg = GRPOConfig(output_dir=str(tmp_path), **kwargs)
        assert (cfg.importance_sampling_cap, cfg.importance_sampling_min) == (None, None)
    both = GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_clip_max=5.0, vllm_importance_sampling_cap=4.0)
    assert both.importance_sampling_cap == 4.0
    assert GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_cap=None).importance_sampling_cap == 2.0
    # our own backend name turns TRL's vllm settings on as use_vllm does
    ours = GRPOConfig(output_dir=str(tmp_path), generation_backend="vllm", vllm_gpu_memory_utilization=0.5)
    assert ours.generation_backend_kwargs == {"gpu_memory_utilization": 0.5}
    from toolkit import AsyncGRPOConfig

    with pytest.raises(ConfigError, match="never sleeps"):
        AsyncGRPOConfig(output_dir=str(tmp_path), vllm_enable_sleep_mode=True)


def test_disable_dropout_takes_every_dropout_out():
    from toolkit.core.models import disable_dropout
    from toolkit.testing import tiny_model

    model = tiny_model()
    model.config.attention_dropout = 0.3
    model.model.layers[0].self_attn.attention_dropout = 0.3
    model.model.dropout_layer = torch.nn.Dropout(0.5)
    disable_dropout(model)
    assert model.model.dropout_layer.p == 0.0 and model.model.layers[0].self_attn.attention_dropout == 0.0
    assert DPOConfig(output_dir="/tmp/x").disable_dropout is True and GRPOConfig(output_dir="/tmp/x").disable_dropout is False


def test_a_name_of_neither_gets_the_closest_of_ours(tmp_path):
    with pytest.raises(ConfigError, match=r"no field 'lerning_rate'.*Did you mean learning_rate"):
        GRPOConfig(output_dir=str(tmp_path), lerning_rate=1e-5)
    with pytest.raises(ConfigError, match=r"TRL's 'repetition_penalty' = 1.2 is not supported; instead: "):
        GRPOConfig(output_dir=str(tmp_path), repetition_penalty=1.2)


def test_the_trainers_load_the_model_with_the_configs_model_init_kwargs(tmp_path):
    from toolkit import SFTTrainer, embedded_model_path

    rows = [{"prompt": "1 + 1 =", "completion": " 2"}] * 4
    trainer = SFTTrainer(str(embedded_model_path()), SFTConfig(output_dir=str(tmp_path), max_steps=1,
                                                              model_init_kwargs={"rms_norm_eps": 1e-3}),
                         train_dataset=rows)
    assert trainer.model.config.rms_norm_eps == 1e-3  # a config value from_pretrained took from the kwargs


def test_the_committed_table_is_the_generated_one():
    assert trl_names_doc.DOC.read_text() == trl_names_doc.render(), (
        "docs/trl-names.md is out of date: python -m toolkit._dev.trl_names_doc --write")
