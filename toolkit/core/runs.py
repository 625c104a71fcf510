"""Run files from Python: the configs, datasets and trainer a `toolkit <command> --config <file>` run builds.

    import toolkit

    spec = toolkit.load_run("examples/grpo_arithmetic.toml", "grpo", overrides={"max_steps": 5})
    spec.config.learning_rate          # a GRPOConfig, exactly as the command builds it
    spec.train_dataset, spec.eval_dataset
    trainer = spec.make_trainer()      # the model, reward functions and LoRA settings of the file
    trainer.train()

The command line and this function share one path (the command calls `make_trainer`'s builder and
`load_dataset_spec`), so a notebook and a shell run of the same file train the same thing.
"""

from __future__ import annotations

__all__ = ["RunSpec", "load_dataset_spec", "load_run"]

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import RunArgs, build_configs, flatten_sections, load_run_file, merge_overrides, parse_overrides
from .errors import ConfigError

#: command -> (module, config class, trainer class, dataset kind)
COMMANDS: dict[str, tuple[str, str, str, str]] = {
    "sft": ("sft", "SFTConfig", "SFTTrainer", "prompt_completion"),
    "dpo": ("dpo", "DPOConfig", "DPOTrainer", "preference"),
    "grpo": ("grpo", "GRPOConfig", "GRPOTrainer", "prompt_only"),
    "async-grpo": ("async_grpo", "AsyncGRPOConfig", "AsyncGRPOTrainer", "prompt_only"),
    "ppo": ("ppo", "PPOConfig", "PPOTrainer", "prompt_only"),
}


def _classes(command: str) -> tuple[type, type, str]:
    import importlib

    if command not in COMMANDS:
        raise ConfigError(f"command: '{command}' is not one of {', '.join(COMMANDS)} (the experimental trainers' "
                          "commands are built from their own modules).")
    module, config_name, trainer_name, kind = COMMANDS[command]
    mod = importlib.import_module(f".{module}", __package__)
    return getattr(mod, config_name), getattr(mod, trainer_name), kind


def load_dataset_spec(spec: str, run: RunArgs, *, split: str, kind: str = "prompt_completion") -> Any:
    """`builtin:arithmetic`, `reasoning_gym:<task>` (with `task_kwargs`, `task_seed`), a .json/.jsonl file, or a Hub
    dataset id (where a network exists)."""
    if not spec:
        return None
    if spec.startswith("builtin:"):
        from .tasks import task_splits

        name = spec.split(":", 1)[1]
        if name == "sorting" and "numeric_match" in run.reward_funcs:
            raise ConfigError("reward_funcs: builtin:sorting's answer is a list of numbers and numeric_match reads only "
                              "the last one (it would reward ending with the largest number); use reward_funcs = "
                              "[\"number_list_match\"].")
        train, held_out = task_splits(name, run.dataset_size, run.eval_size, max_value=run.task_max_value,
                                      max_terms=run.task_max_terms, kind=kind)
        return train if split == "train" else held_out
    if spec.startswith("reasoning_gym:"):
        from .gym_tasks import gym_splits

        if kind not in ("prompt_only", "prompt_completion"):
            raise ConfigError(f"dataset: '{spec}' gives prompt-only (RL) or prompt-completion (SFT) rows; a "
                              f"{kind} trainer needs other data.")
        train, held_out = gym_splits(spec.split(":", 1)[1], run.dataset_size, run.eval_size, seed=run.task_seed,
                                     settings=run.task_kwargs, kind=kind)
        return train if split == "train" else held_out
    if Path(spec).suffix in (".json", ".jsonl"):
        return spec  # the data layer reads files itself and names the line of a broken one
    if Path(spec).exists():
        raise ConfigError(f"dataset: '{spec}' is a local {'folder' if Path(spec).is_dir() else 'file'} that is not "
                          ".json/.jsonl; convert it (e.g. pandas.read_csv(...).to_json(path, orient='records', "
                          "lines=True)). Anything else is read as a Hub dataset id.")
    from datasets import load_dataset

    return load_dataset(spec, split=split)


def load_datasets(run: RunArgs, kind: str) -> tuple[Any, Any]:
    """(train, held-out) of a run, as its command loads them."""
    if not run.dataset:
        raise ConfigError("dataset: no training data given; set `dataset = ...` in the run file or pass --dataset.")
    gym = any(str(spec).startswith("reasoning_gym:") for spec in (run.dataset, run.eval_dataset))
    if not gym and (run.task_kwargs or run.task_seed):
        raise ConfigError("task_kwargs / task_seed: they set up reasoning_gym:<task> datasets, and this run has none "
                          f"(dataset = {run.dataset!r}); remove them or use a reasoning_gym:<task> dataset.")
    train = load_dataset_spec(run.dataset, run, split="train", kind=kind)
    held_out = load_dataset_spec(run.eval_dataset, run, split="test", kind=kind) if run.eval_dataset else None
    return train, held_out


def build_trainer(command: str, run: RunArgs, config: Any, train_dataset: Any, eval_dataset: Any = None,
                  **kwargs: Any) -> Any:
    """The trainer of `command` as the command line builds it: the run's model (loaded with its
    model_init_kwargs), LoRA settings and, for RL, reward functions; `kwargs` add or replace constructor arguments
    (callbacks, processing_class, an already loaded `model`, ...)."""
    _, trainer_cls, _ = _classes(command)
    model = kwargs.pop("model", run.model)
    base: dict[str, Any] = {"args": config, "train_dataset": train_dataset, "peft_config": run.peft_config(),
                            "model_init_kwargs": run.model_init_kwargs(config)}
    if eval_dataset is not None and "eval_dataset" in inspect.signature(trainer_cls.__init__).parameters:
        base["eval_dataset"] = eval_dataset  # (PPO takes none: its held-out accuracy is the command's callback)
    if command in ("grpo", "async-grpo", "ppo"):
        base["reward_funcs"] = list(run.reward_funcs)
    return trainer_cls(model, **{**base, **kwargs})


@dataclasses.dataclass
class RunSpec:
    """A run file read as its command reads it: `args` (model, data, LoRA, rewards: the keys that are not the
    trainer's config), `config` (the trainer's config class), the datasets, and `make_trainer()`.

    What the command does beyond building these is the caller's from Python: `trainer.train(
    resume_from_checkpoint=spec.config.resume_from_checkpoint)`; the command also measures held-out greedy
    accuracy before and after (`report_accuracy`, `eval_every`), saves to output_dir/final with the card, and
    pushes once with `push_to_hub`."""

    command: str
    args: RunArgs
    config: Any
    train_dataset: Any
    eval_dataset: Any

    def make_trainer(self, **kwargs: Any) -> Any:
        """The trainer the command would train (kwargs add or replace constructor arguments, e.g. `callbacks`).
        GRPO and async GRPO also get the held-out data as `eval_dataset` (their `evaluate()`; PPO takes none); the
        command measures held-out accuracy with its own callback instead."""
        return build_trainer(self.command, self.args, self.config, self.train_dataset, self.eval_dataset, **kwargs)


def load_run(source: str | Path | Mapping[str, Any], command: str,
             overrides: Mapping[str, Any] | Sequence[str] | None = None) -> RunSpec:
    """The configs and datasets `toolkit <command> --config <source> <overrides>` would build.

    `source`: a run file (TOML, or YAML for .yaml/.yml) or a dict of the same keys (sections allowed: `{"lora":
    {"r": 16}}`). `command`: sft, dpo, grpo, async-grpo or ppo. `overrides`: a dict (dotted keys as on the command
    line: `{"loss_kwargs.epsilon_max": 5, "lora.r": 8}`) or the command line's own `["--max_steps", "5"]`. Every
    key is checked (names, types, TRL names) before anything loads, as the command does."""
    config_cls, _, kind = _classes(command)
    if isinstance(source, Mapping):
        values = flatten_sections(dict(source), where="load_run(dict)")
    else:
        values = load_run_file(source)
    if overrides is not None:
        if isinstance(overrides, Mapping):  # sections allowed here too: {"lora": {"r": 8}} is lora_r
            extra = flatten_sections(dict(overrides), where="load_run(overrides)")
        elif isinstance(overrides, (str, bytes)):
            raise ConfigError("load_run: overrides is a dict or a list of command-line tokens "
                              "(['--max_steps', '5']), not one string.")
        else:
            extra = parse_overrides(list(overrides))
        values = merge_overrides(values, extra)
    run, config = build_configs(values, config_cls)
    train, held_out = load_datasets(run, kind)
    return RunSpec(command=command, args=run, config=config, train_dataset=train, eval_dataset=held_out)
