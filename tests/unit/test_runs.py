"""`toolkit.load_run`: a run file's configs, datasets and trainer from Python, as the command builds them."""

import json

import pytest
import torch
from safetensors.torch import load_file

import toolkit
from toolkit.core.errors import ConfigError
from toolkit.core.grpo import GRPOTrainer
from toolkit.core.sft import SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer


@pytest.fixture
def model_dir(tmp_path):
    folder = tmp_path / "m"
    tiny_model().save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return str(folder)


def run_file(tmp_path, model_dir, text):
    path = tmp_path / "run.toml"
    path.write_text(f'model = "{model_dir}"\n' + text)
    return path


def test_every_example_loads_into_its_commands_config_and_datasets():
    for name, command in [("sft_smollm2.toml", "sft"), ("dpo_arithmetic.toml", "dpo"),
                          ("grpo_arithmetic.toml", "grpo"), ("ppo_arithmetic.toml", "ppo")]:
        spec = toolkit.load_run(f"examples/{name}", command)
        assert type(spec.config).__name__ == {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig",
                                              "ppo": "PPOConfig"}[command]
        assert len(spec.train_dataset) > 0, name


def test_sections_dotted_overrides_and_command_line_tokens(tmp_path, model_dir):
    values = {"model": model_dir, "dataset": "builtin:arithmetic", "dataset_size": 16, "eval_size": 4,
              "eval_dataset": "builtin:arithmetic",
              "reward_funcs": ["numeric_match"], "lora": {"r": 4, "target_modules": ["q_proj"]},
              "loss_type": "decoupled_ppo",
              "loss_kwargs": {"behaviour_cap": 2.0, "proximal": "exact"}}
    spec = toolkit.load_run(values, "grpo", overrides={"lora.r": 8, "loss_kwargs.behaviour_cap": 3.0,
                                                      "learning_rate": 3e-6})
    assert spec.args.lora_r == 8 and spec.args.lora_target_modules == ["q_proj"]
    assert spec.config.loss_kwargs == {"behaviour_cap": 3.0, "proximal": "exact"} and spec.config.learning_rate == 3e-6
    assert len(spec.train_dataset) == 16 and len(spec.eval_dataset) == 4
    same = toolkit.load_run(values, "grpo", overrides=["--lora.r", "8", "--loss_kwargs.behaviour_cap", "3.0",
                                                      "--learning_rate", "3e-6"])
    assert same.config == spec.config and same.args == spec.args
    sections = toolkit.load_run(values, "grpo", overrides={"lora": {"r": 8}, "loss_kwargs": {"behaviour_cap": 3.0,
                                                                                             "proximal": "exact"},
                                                          "learning_rate": 3e-6})
    assert sections.config == spec.config and sections.args == spec.args
    trainer = spec.make_trainer()
    assert isinstance(trainer, GRPOTrainer) and trainer.reward_runner.names == ["numeric_match"]
    assert trainer.eval_dataset is not None  # GRPO's evaluate() gets the held-out rows
    assert sum(p.numel() for n, p in trainer.model.named_parameters() if "lora_" in n) > 0


def test_a_python_run_trains_the_same_weights_as_the_command(tmp_path, model_dir):
    path = run_file(tmp_path, model_dir, 'dataset = "builtin:arithmetic"\ndataset_size = 16\neval_dataset = ""\n'
                                         'max_steps = 2\nper_device_train_batch_size = 4\nlearning_rate = 1e-3\n'
                                         'save_strategy = "no"\nreport_to = "none"\ndisable_tqdm = true\n'
                                         'report_accuracy = false\n')
    from toolkit.core.cli import main

    assert main(["sft", "--config", str(path), "--output_dir", str(tmp_path / "cli")]) == 0
    spec = toolkit.load_run(path, "sft", overrides={"output_dir": str(tmp_path / "py")})
    assert isinstance(spec.config, SFTConfig)
    trainer = spec.make_trainer()
    assert isinstance(trainer, SFTTrainer)
    trainer.train()
    saved = load_file(tmp_path / "cli" / "final" / "model.safetensors")
    trained = {n: p.detach() for n, p in trainer.model.named_parameters()}
    assert any(not torch.equal(saved[n], tiny_model().state_dict()[n]) for n in saved)  # the run trained
    for name, tensor in saved.items():
        assert torch.equal(tensor, trained[name]), name


def test_bad_calls_are_refused_by_name(tmp_path, model_dir):
    with pytest.raises(ConfigError, match="'rlhf' is not one of sft, dpo, grpo"):
        toolkit.load_run({"model": model_dir, "dataset": "builtin:arithmetic"}, "rlhf")
    with pytest.raises(ConfigError, match="not one string"):
        toolkit.load_run({"model": model_dir, "dataset": "builtin:arithmetic"}, "sft", overrides="--max_steps 3")
    with pytest.raises(ConfigError, match="unknown key 'learnig_rate'. Did you mean 'learning_rate'"):
        toolkit.load_run({"model": model_dir, "dataset": "builtin:arithmetic", "learnig_rate": 1.0}, "sft")
    with pytest.raises(ConfigError, match="no training data"):
        toolkit.load_run({"model": model_dir}, "sft")
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps({"model": model_dir, "dataset": "builtin:arithmetic", "max_steps": "ten"}))
    with pytest.raises(ConfigError, match="max_steps: expected int"):
        toolkit.load_run(path, "sft")
