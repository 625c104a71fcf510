"""TRL's names for the experimental configs: each field of TRL's CPOConfig, KTOConfig, ORPOConfig, OnlineDPOConfig,
GKDConfig and RewardConfig (the installed TRL) is a field of ours or is taken or refused with a ConfigError naming
the alternative (toolkit/experimental/_trl_names.py), as tests/unit/test_trl_names.py checks for the core."""

import dataclasses
import importlib
import os
import warnings

import pytest

from toolkit.core.errors import ConfigError

os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")
from toolkit.core.trl_names import TRL_FIELDS  # noqa: E402
from toolkit.experimental import cpo, gkd, kto, online_dpo, orpo, reward  # noqa: E402

trl = pytest.importorskip("trl")

OURS = {"CPOConfig": cpo.CPOConfig, "KTOConfig": kto.KTOConfig, "ORPOConfig": orpo.ORPOConfig,
        "OnlineDPOConfig": online_dpo.OnlineDPOConfig, "GKDConfig": gkd.GKDConfig, "RewardConfig": reward.RewardConfig}


def theirs(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = {"CPOConfig": "cpo", "ORPOConfig": "orpo", "OnlineDPOConfig": "online_dpo", "GKDConfig": "gkd"}
        if name in module:
            return getattr(importlib.import_module(f"trl.experimental.{module[name]}"), name)
        return getattr(trl, name)


def default(f):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


@pytest.mark.parametrize("name", list(OURS))
def test_every_trl_field_is_ours_or_has_a_fate_and_trls_defaults_run(name, tmp_path):
    ours, table = OURS[name], TRL_FIELDS[name]
    fields = {f.name for f in dataclasses.fields(ours)}
    missing = [f.name for f in dataclasses.fields(theirs(name)) if f.name not in fields and f.name not in table]
    assert not missing, f"TRL's {name} fields with no fate in toolkit/experimental/_trl_names.py: {missing}"
    for f in dataclasses.fields(theirs(name)):
        if f.name in fields or (value := default(f)) is dataclasses.MISSING:
            continue
        ours(output_dir=str(tmp_path), **{f.name: value})  # code that spells out TRL's defaults runs


@pytest.mark.parametrize("name", list(OURS))
def test_every_refusal_names_the_field_and_an_alternative(name, tmp_path):
    for field_name, entry in TRL_FIELDS[name].items():
        if entry.fate == "same":
            continue
        with pytest.raises(ConfigError, match=rf"TRL's '{field_name}' = 'not a value'.*instead: \S"):
            OURS[name](output_dir=str(tmp_path), **{field_name: "not a value"})


def test_translations_and_a_name_of_neither(tmp_path):
    cfg = online_dpo.OnlineDPOConfig(output_dir=str(tmp_path), max_new_tokens=24, use_vllm=True, vllm_mode="server",
                                     vllm_server_host="10.0.0.2", vllm_server_port=8001)
    assert cfg.max_completion_length == 24 and cfg.generation_backend == "vllm-server"
    assert cfg.generation_backend_kwargs["url"] == "http://10.0.0.2:8001"
    assert gkd.GKDConfig(output_dir=str(tmp_path), max_new_tokens=32).max_completion_length == 32
    with pytest.raises(ConfigError, match="reward_funcs=\\['reward_model:<path>'\\]"):
        online_dpo.OnlineDPOConfig(output_dir=str(tmp_path), reward_model_path="some/rm")
    with pytest.raises(ConfigError, match="CPOConfig: no field 'simpo_gama'. Did you mean simpo_gamma"):
        cpo.CPOConfig(output_dir=str(tmp_path), simpo_gama=0.5)
