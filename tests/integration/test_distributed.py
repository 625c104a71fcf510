"""Process-level behaviour that needs no process group: refusals and launch mismatches (rank-0 output under a
real torchrun is in test_multiprocess.py)."""

import logging

import pytest

from toolkit.core.distributed import requested_processes, warn_if_fewer_processes_than_asked
from toolkit.core.errors import ConfigError
from toolkit.testing import tiny_model, tiny_tokenizer


@pytest.mark.parametrize("argv,expected", [
    (["/usr/bin/python", "/venv/bin/accelerate", "launch", "--cpu", "--num_processes", "2", "train.py"], 2),
    (["accelerate", "launch", "--num_processes=4", "-m", "toolkit.core.cli", "sft"], 4),
    (["accelerate", "launch", "--num-processes", "3", "x.py"], 3),
    (["/usr/bin/python3", "-m", "accelerate.commands.launch", "--num_processes", "2", "x.py"], 2),
    (["accelerate", "launch", "x.py"], None),
    (["torchrun", "--nproc_per_node", "2", "x.py"], None),
    (["bash", "run.sh", "launch", "--num_processes", "2"], None),
])
def test_the_process_count_an_accelerate_command_asks_for(argv, expected):
    assert requested_processes(argv) == expected


def test_a_launch_that_started_fewer_processes_than_asked_is_said_out_loud(monkeypatch, caplog):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with caplog.at_level(logging.WARNING):
        assert warn_if_fewer_processes_than_asked(["accelerate", "launch", "--cpu", "--num_processes", "2", "t.py"])
    assert "asked for 2 processes but started one" in caplog.text and "torchrun" in caplog.text
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not warn_if_fewer_processes_than_asked(["accelerate", "launch", "--num_processes", "2", "t.py"])
    monkeypatch.delenv("WORLD_SIZE")
    assert not warn_if_fewer_processes_than_asked(["python", "train.py"])


def test_multi_process_launches_are_checked_before_loading_anything(tmp_path, monkeypatch):
    """PPO and async GRPO run with several processes now (tests/integration/test_multiprocess.py); what they cannot do under a
    multi-process launch is refused by name before any model loads: sharding (PPO, async), a vLLM server shared
    by async ranks, too few prompts for N x rollout_batch_size, and GRPO's per-rank solved set."""
    from toolkit.core.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from toolkit.core.distributed import refuse_multiprocess
    from toolkit.core.ppo import PPOConfig, PPOTrainer

    common = dict(output_dir=str(tmp_path / "out"), report_to="none", per_device_train_batch_size=4,
                  max_completion_length=4)
    ppo_cfg = PPOConfig(**common)
    server_cfg = AsyncGRPOConfig(num_generations=2, generation_backend="vllm-server", **common)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    rows = [{"prompt": f"a{i}", "answer": str(i)} for i in range(6)]
    with pytest.raises(ConfigError, match=r"train_dataset: 6 prompts, fewer than one update needs "
                                          r"\(rollout_batch_size=4 x 2 processes\)"):
        PPOTrainer("does-not-matter/never-loaded", ["numeric_match"], ppo_cfg, train_dataset=rows,
                   processing_class=tiny_tokenizer())
    with pytest.raises(ConfigError, match="generation_backend: 'vllm-server' with several trainer processes"):
        AsyncGRPOTrainer("does-not-matter/never-loaded", ["numeric_match"], server_cfg, train_dataset=rows,
                         processing_class=tiny_tokenizer())
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --config_file fsdp2.yaml` sets
    with pytest.raises(ConfigError, match="ACCELERATE_USE_FSDP: PPOTrainer does not shard its models"):
        PPOTrainer("does-not-matter/never-loaded", ["numeric_match"], ppo_cfg, train_dataset=rows)
    with pytest.raises(ConfigError, match="ACCELERATE_USE_FSDP: AsyncGRPOTrainer does not shard its models"):
        AsyncGRPOTrainer("does-not-matter/never-loaded", ["numeric_match"], AsyncGRPOConfig(num_generations=2, **common),
                         train_dataset=rows, processing_class=tiny_tokenizer())
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    from toolkit.core.grpo import GRPOConfig

    with pytest.raises(ConfigError, match="skip_solved_threshold: not supported with several processes"):
        GRPOConfig(num_generations=2, skip_solved_threshold=0.9, **common)
    # the public helper for a trainer of one's own that runs in one process only
    with pytest.raises(ConfigError, match="MyTrainer runs in one process only .* WORLD_SIZE=2"):
        refuse_multiprocess("MyTrainer", "its state is per process")
    assert not (tmp_path / "out").exists()


def test_fsdp_asked_for_on_cpu_is_reported_not_silently_dropped(monkeypatch, caplog):
    """Under torchrun on CPU, accelerate runs a run configured for FSDP as DDP without a word (transformers
    itself refuses fsdp in a single process); the trainers say so. Checked on the trainer's two attributes the
    decision reads (the sharded run itself is tests/integration/test_multiprocess.py)."""
    import logging
    import types

    from toolkit.core.distributed import warn_if_sharding_ignored

    monkeypatch.setenv("WORLD_SIZE", "2")
    unsharded = types.SimpleNamespace(args=types.SimpleNamespace(fsdp=True), is_fsdp_enabled=False)
    with caplog.at_level(logging.WARNING, logger="toolkit.core.distributed"):
        assert warn_if_sharding_ignored(unsharded)
    assert "FSDP was configured" in caplog.text and "runs DDP over 2 processes" in caplog.text
    sharded = types.SimpleNamespace(args=types.SimpleNamespace(fsdp=True), is_fsdp_enabled=True)
    assert not warn_if_sharding_ignored(sharded)
    assert not warn_if_sharding_ignored(types.SimpleNamespace(args=types.SimpleNamespace(fsdp=False)))


@pytest.mark.parametrize("name,kind", [("ddp", "MULTI_GPU"), ("fsdp2", "FSDP"), ("zero2", "DEEPSPEED")])
def test_the_shipped_accelerate_configs_load(name, kind):
    """examples/accelerate/*.yaml are read by accelerate's own loader (a typo in a key would fail here)."""
    from pathlib import Path

    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(__file__).parents[2] / "examples" / "accelerate" / f"{name}.yaml"
    config = load_config_from_file(str(path))
    assert str(config.distributed_type).endswith(kind) and config.num_processes == 2
    if name == "fsdp2":
        assert config.fsdp_config["fsdp_version"] == 2 and config.fsdp_config["fsdp_reshard_after_forward"]
    if name == "zero2":
        assert config.deepspeed_config["zero_stage"] == 2


def test_output_head_is_the_parameter_itself_without_sharding_and_refuses_zero3():
    from toolkit.core.models import output_head

    model = tiny_model()
    weight, bias = output_head(model)
    assert weight is model.get_output_embeddings().weight and bias is None  # no copy, no gather
    # DeepSpeed ZeRO-3 marks its partitioned parameters with ds_id (deepspeed is not installed here)
    model.get_output_embeddings().weight.ds_id = 7
    with pytest.raises(ConfigError, match="DeepSpeed ZeRO-3: the LM head weight is partitioned"):
        output_head(model)


def test_output_head_refuses_lora_on_the_lm_head():
    from peft import LoraConfig, get_peft_model

    from toolkit.core.models import output_head

    model = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ConfigError, match="adapters on the LM head"):
        output_head(model)
    # modules_to_save trains a whole copy of the head, which the wrapper's .weight is: allowed
    saved = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    weight, _ = output_head(saved)
    assert weight.requires_grad
