"""Tensor memory: the dispatch-level tally, the allocator's peak on CPU, and the memory model's bookkeeping.

The memory model against real trainers' measured peaks is tests/trainers/test_memory_model.py (real model).
"""

from __future__ import annotations

import pytest
import torch

from toolkit.core.memory import PeakAllocatorMemory, TensorMemoryTally, estimate_step_memory
from toolkit.testing import tiny_model

MB = 2**20


def test_tally_counts_a_storage_once_and_frees_it_with_its_last_view():
    with TensorMemoryTally(count_existing=False) as tally:
        a = torch.empty(4 * MB, dtype=torch.uint8)
        view = a[MB:]
        assert tally.current_bytes == 4 * MB  # the view shares a's storage
        del a
        assert tally.current_bytes == 4 * MB  # still viewed
        b = torch.empty(2 * MB, dtype=torch.uint8)
        del view
        assert tally.current_bytes == 2 * MB
        del b
    assert tally.peak_bytes == 6 * MB and tally.current_bytes == 0


def test_tally_counts_the_tensors_alive_at_entry():
    weights = torch.empty(3 * MB, dtype=torch.uint8)
    with TensorMemoryTally() as tally:
        tmp = torch.empty(MB, dtype=torch.uint8)
        del tmp
    assert tally.start_bytes >= 3 * MB
    assert tally.peak_bytes - tally.start_bytes == MB
    del weights


def test_allocator_peak_sees_a_temporary_freed_before_the_region_ends():
    keep = torch.empty(8 * MB, dtype=torch.uint8)
    with PeakAllocatorMemory() as meter:
        tmp = torch.empty(16 * MB, dtype=torch.uint8)
        del tmp
        small = torch.empty(MB, dtype=torch.uint8)
    assert meter.start_bytes >= 8 * MB
    # the 16 MB temporary is the peak even though it died inside the region (RSS could not tell this)
    assert 16 * MB <= meter.peak_bytes - meter.start_bytes < 17 * MB + MB // 2
    del keep, small


def test_allocator_peak_matches_the_tally_on_a_training_step():
    """Two independent counts of the same step: the allocator's running total and the dispatch-level tally."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    x = torch.randn(512, 256)

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with PeakAllocatorMemory() as meter:
        step()
    with TensorMemoryTally() as tally:
        step()
    measured, tallied = meter.peak_bytes - meter.start_bytes, tally.peak_bytes - tally.start_bytes
    assert measured > 2 * MB
    assert abs(measured - tallied) / measured < 0.05, (measured, tallied)


@pytest.fixture(scope="module")
def config():
    return tiny_model(vocab_size=384, hidden_size=64, num_layers=2).config


def test_estimate_books_weights_gradients_and_adam_state_exactly(config):
    est = estimate_step_memory(config, "sft", batch_size=2, seq_len=64, bf16=False)
    model = tiny_model(vocab_size=384, hidden_size=64, num_layers=2)
    n = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # the rotary frequencies
    assert est.weights == 4 * n + buffers
    assert est.gradients == 4 * n
    tensors = len(list(model.parameters()))
    # exp_avg and exp_avg_sq per parameter, and each parameter's step counter (a scalar tensor)
    assert 2 * 4 * n <= est.optimizer <= 2 * 4 * n + 8 * tensors
    assert est.peak >= est.weights + est.gradients + est.optimizer
    assert est.kv_cache == 0


def test_estimate_follows_the_settings_that_change_memory(config):
    base = estimate_step_memory(config, "sft", batch_size=4, seq_len=256)
    longer = estimate_step_memory(config, "sft", batch_size=4, seq_len=512)
    ckpt = estimate_step_memory(config, "sft", batch_size=4, seq_len=512, activation_checkpointing=True)
    lora = estimate_step_memory(config, "sft", batch_size=4, seq_len=256, lora_r=4)
    assert longer.activations > 1.5 * base.activations
    assert ckpt.activations < longer.activations
    assert lora.gradients < base.gradients / 5 and lora.optimizer < base.optimizer / 5
    dpo = estimate_step_memory(config, "dpo", batch_size=2, prompt_len=32, completion_len=64)
    dpo_lora = estimate_step_memory(config, "dpo", batch_size=2, prompt_len=32, completion_len=64, lora_r=4)
    assert dpo.details["frozen_copies"] == 1 and dpo.weights == 2 * base.weights  # the reference copy
    assert dpo_lora.details["frozen_copies"] == 0  # the base with adapters off is the reference


def test_estimate_counts_generation_kv_cache_for_grpo(config):
    est = estimate_step_memory(config, "grpo", batch_size=8, num_generations=4, prompt_len=16, completion_len=48)
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert est.kv_cache == 2 * layers * kv_heads * head_dim * 8 * (16 + 48) * 2  # bf16 compute
    assert est.details["tokens_per_micro_batch"] == 2 * 16 + 8 * 48  # each prompt once (shared-prompt layout)


def test_estimate_refuses_bad_settings_by_name(config):
    with pytest.raises(ValueError, match="trainer: 'kto'"):
        estimate_step_memory(config, "kto")
    with pytest.raises(ValueError, match="seq_len: must be >= 1"):
        estimate_step_memory(config, "sft", seq_len=0)
    with pytest.raises(ValueError, match="one must divide the other"):
        estimate_step_memory(config, "grpo", batch_size=6, num_generations=4)


# ---------------------------------------------------------------------------------------- GPU defaults (on CPU)
# No GPU here: the choices are pure functions of a described card (GpuInfo), tested with cards described by hand.

def _card(capability=(9, 0), bf16=True, free_gib=70.0):
    from toolkit.core.models import GpuInfo

    return GpuInfo(name="H100", capability=capability, bf16=bf16, total_bytes=80 * 2**30,
                   free_bytes=int(free_gib * 2**30))


def _args(**kw):
    from types import SimpleNamespace

    return SimpleNamespace(**{"bf16": None, "fp16": False, "tf32": None, "use_cpu": False, **kw})


def test_gpu_defaults_choose_bf16_and_tf32_where_the_card_has_them():
    from toolkit.core.models import apply_gpu_defaults

    args = _args()
    chosen = apply_gpu_defaults(args, _card())
    assert args.bf16 is True and args.tf32 is True
    assert chosen == ["bf16 mixed precision (autocast over float32 weights)", "TF32 matmuls"]
    old = _args()
    chosen = apply_gpu_defaults(old, _card(capability=(7, 0), bf16=False))  # a V100: neither
    assert old.bf16 is False and old.tf32 is None and "has no bf16" in chosen[0]


def test_gpu_defaults_leave_a_users_settings_and_the_cpu_alone():
    from toolkit.core.models import apply_gpu_defaults

    mine = _args(bf16=False, tf32=False)
    assert apply_gpu_defaults(mine, _card()) == [] and mine.bf16 is False and mine.tf32 is False
    cpu = _args()
    assert apply_gpu_defaults(cpu, None) == [] and cpu.bf16 is False and cpu.tf32 is None
    forced = _args(use_cpu=True)
    assert apply_gpu_defaults(forced, _card()) == [] and forced.bf16 is False


def test_cpu_configs_keep_their_defaults():
    from toolkit import GRPOConfig, SFTConfig

    for cfg in (SFTConfig(output_dir="/tmp/x", report_to="none"), GRPOConfig(output_dir="/tmp/x", report_to="none")):
        assert cfg.bf16 is False and not cfg.tf32


def test_checkpointing_follows_the_memory_model_against_the_card():
    from toolkit.core.models import choose_checkpointing_by_memory

    model = tiny_model(vocab_size=384, hidden_size=64, num_layers=2)
    shape = dict(batch_size=4, seq_len=512)
    roomy = _args(bf16=True, activation_checkpointing=False, gradient_checkpointing=False,
                  _checkpointing_by_memory=True)
    line = choose_checkpointing_by_memory(roomy, model, "sft", _card(free_gib=70), **shape)
    assert roomy.activation_checkpointing is False and "off" in line and "fits" in line
    tight = _args(bf16=True, activation_checkpointing=False, gradient_checkpointing=False,
                  _checkpointing_by_memory=True, activation_offloading=None)
    line = choose_checkpointing_by_memory(tight, model, "sft", _card(free_gib=0.001), **shape)
    assert tight.activation_checkpointing is True and tight.gradient_checkpointing is True and "exceeds" in line
    assert tight.activation_offloading is True and "activation offloading on" in line  # still over: next rung
    snug = _args(bf16=True, activation_checkpointing=False, gradient_checkpointing=False,
                 _checkpointing_by_memory=True, activation_offloading=None)
    without = estimate_step_memory(model.config, "sft", **shape).peak * 1.1 / 2**30
    line = choose_checkpointing_by_memory(snug, model, "sft", _card(free_gib=without * 0.9), **shape)
    assert snug.activation_checkpointing is True and snug.activation_offloading is None  # checkpointing suffices
    users = _args(bf16=True, activation_checkpointing=False, _checkpointing_by_memory=False)  # set by the user
    assert choose_checkpointing_by_memory(users, model, "sft", _card(free_gib=0.001), **shape) is None
    assert users.activation_checkpointing is False
    assert choose_checkpointing_by_memory(tight, model, "sft", None, **shape) is None  # no GPU: nothing chosen


def test_held_out_evaluation_decodes_in_the_training_precision():
    from types import SimpleNamespace

    from toolkit.core.report import evaluation_precision

    model = tiny_model()
    with evaluation_precision(SimpleNamespace(bf16=True, fp16=False), model):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    with evaluation_precision(SimpleNamespace(bf16=False, fp16=False), model):
        assert not torch.is_autocast_enabled("cpu")


def test_the_rollout_worker_gets_a_gpu_of_its_own_when_there_is_one():
    from toolkit.core.rollout_worker import choose_worker_device

    assert choose_worker_device(None, cuda=False, gpus=0) == "cpu"
    assert choose_worker_device(None, cuda=True, gpus=1) == "cuda:0"  # beside the trainer
    assert choose_worker_device(None, cuda=True, gpus=2) == "cuda:1"  # its own
    # 2 training processes on 4 GPUs: rank 0's worker on GPU 2, rank 1's on GPU 3; on 2 GPUs, each beside its rank
    assert [choose_worker_device(None, cuda=True, gpus=4, trainer_index=r, local_processes=2) for r in (0, 1)] == [
        "cuda:2", "cuda:3"]
    assert [choose_worker_device(None, cuda=True, gpus=2, trainer_index=r, local_processes=2) for r in (0, 1)] == [
        "cuda:0", "cuda:1"]
    assert choose_worker_device("cpu", cuda=True, gpus=8) == "cpu"  # the user's choice
    # one visible GPU per rank (a scheduler's --gpus-per-task=1): rank 1's only card is its cuda:0
    assert choose_worker_device(None, cuda=True, gpus=1, trainer_index=1, local_processes=2,
                                trainer_device="cuda:0") == "cuda:0"


def test_a_card_that_only_emulates_bf16_gets_float32(monkeypatch):
    """torch.cuda.is_bf16_supported() says yes on a T4 (emulated, slow); the default asks for Ampere or later."""
    from toolkit.core import models

    monkeypatch.setattr(models, "_has_gpu", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    card = models.gpu_info(memory=False)  # properties only: no CUDA context for free memory at config time
    assert card.bf16 is False and card.free_bytes == 0
    args = _args()
    assert "has no bf16" in models.apply_gpu_defaults(args, card)[0] and args.bf16 is False


def test_several_processes_keep_the_fixed_checkpointing_default():
    """Each rank would decide from its own card (and FSDP refuses Trainer's checkpointing beside its own)."""
    from toolkit.core.models import choose_checkpointing_by_memory

    model = tiny_model(vocab_size=384, hidden_size=64, num_layers=2)
    for extra in ({"world_size": 2}, {"fsdp": "full_shard"}):
        args = _args(bf16=True, activation_checkpointing=False, gradient_checkpointing=False,
                     _checkpointing_by_memory=True, **extra)
        line = choose_checkpointing_by_memory(args, model, "sft", _card(free_gib=0.001), batch_size=4, seq_len=512)
        assert args.activation_checkpointing is False and "fixed default" in line


def test_a_worker_device_the_worker_cannot_use_is_refused_before_start(tmp_path):
    from toolkit import AsyncGRPOConfig
    from toolkit.core.errors import ConfigError

    for bad in ("gpu", "meta", "cuda:x"):
        with pytest.raises(ConfigError, match=f"worker_device: '{bad}'.*'cpu', 'cuda' or 'cuda:N'"):
            AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", worker_device=bad)
    assert AsyncGRPOConfig(output_dir=str(tmp_path), report_to="none", worker_device="cuda:1").worker_device == "cuda:1"
