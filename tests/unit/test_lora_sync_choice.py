"""Which LoRA runs the vLLM backends sync as the adapter alone (adapter_sync_refusal) and the engine's rank. The
sync itself runs against the real engine in tests/integration/test_vllm.py."""

import pytest
from peft import LoraConfig, get_peft_model

from toolkit.core.errors import ConfigError
from toolkit.core.vllm_backend import adapter_sync_refusal, engine_lora_rank, lora_sync_mode, peft_lora_rank
from toolkit.testing import tiny_model


def _peft(**kw):
    return get_peft_model(tiny_model(), LoraConfig(**{"r": 8, "target_modules": ["q_proj", "v_proj"], **kw}))


def test_a_plain_lora_adapter_is_synced_alone():
    model = _peft()
    assert peft_lora_rank(model) == 8 and adapter_sync_refusal(model, 16) is None
    assert peft_lora_rank(tiny_model()) is None
    assert peft_lora_rank(_peft(rank_pattern={"q_proj": 24})) == 24


@pytest.mark.parametrize("kw, words", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"r": 32}, "above the engine's max_lora_rank 16"),
])
def test_what_an_engine_lora_cannot_carry_is_named(kw, words):
    assert words in adapter_sync_refusal(_peft(**kw), 16)


def test_a_trained_base_weight_keeps_the_merged_sync():
    model = _peft()
    model.get_base_model().model.norm.weight.requires_grad_(True)
    assert "outside the adapters" in adapter_sync_refusal(model, 16)
    assert "no PEFT adapters" in adapter_sync_refusal(tiny_model(), 16)


def test_engine_ranks_are_the_ones_vllm_serves():
    assert [engine_lora_rank(r) for r in (1, 4, 8, 12, 16, 100, 512)] == [1, 8, 8, 16, 16, 128, 512]
    with pytest.raises(ConfigError, match="lora_sync = 'merged'"):
        engine_lora_rank(1024)


def test_auto_means_the_adapter_on_a_gpu_engine_and_merged_blocks_on_the_cpu_engine():
    """Measured (bench/grpo_vllm.py at dac86a8): on vLLM's CPU engine LoRA layers made generation ~4x slower than
    the adapter-only sync saved, so "auto" keeps merged syncs there."""
    assert lora_sync_mode("auto", on_gpu=True) == "adapter"
    assert lora_sync_mode("auto", on_gpu=False) == "merged"
    assert lora_sync_mode("adapter", on_gpu=False) == "adapter" and lora_sync_mode("merged", on_gpu=True) == "merged"
    with pytest.raises(ConfigError, match="lora_sync"):
        lora_sync_mode("lora")
