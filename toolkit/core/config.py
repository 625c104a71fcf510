"""Run files and command-line overrides, one convention for every trainer.

A run file is flat TOML: run-level keys (`model`, `dataset`, LoRA settings, ...) and the trainer's
config fields side by side. On the command line, `--field value` overrides a key; values are read as
TOML literals (`--learning_rate 1e-5`, `--packing true`, `--lora_target_modules '["q_proj"]'`) and
fall back to plain strings (`--output_dir runs/a`). Unknown keys fail with the closest valid name.
"""

from __future__ import annotations

__all__ = [
    "RunArgs",
    "build_configs",
    "describe_fields",
    "field_names",
    "flatten_sections",
    "load_run_file",
    "merge_overrides",
    "parse_overrides",
    "parse_value",
    "read_toml",
    "read_yaml",
]

import dataclasses
import difflib
import re
import sys
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .errors import ConfigError
from .defaults import DEFAULT_MODEL


@dataclass
class RunArgs:
    """What a run needs besides the trainer config: which model and data, and adapters."""

    model: str = field(default=DEFAULT_MODEL, metadata={
        "help": "Model: 'smollm2-135m-instruct' (embedded, offline), a local folder, or a Hub id."})
    dataset: str = field(default="", metadata={
        "help": "Training data: a .jsonl/.json file, a generated task ('builtin:arithmetic', 'builtin:multiplication', "
                "'builtin:sorting'), or a Hub dataset id."})
    eval_dataset: str = field(default="", metadata={"help": "Evaluation data, same forms as `dataset` (optional)."})
    dataset_size: int = field(default=256, metadata={"help": "Rows to generate for builtin datasets."})
    eval_size: int = field(default=64, metadata={"help": "Held-out rows to generate for builtin datasets."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains the full model."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: Any = field(default="all-linear", metadata={
        "help": "Modules to adapt: 'all-linear' or a list of names."})
    load_in_4bit: bool = field(default=False, metadata={"help": "QLoRA: load the base model in 4-bit NF4 "
                                                                "(bitsandbytes; needs lora_r > 0)."})
    report_accuracy: bool = field(default=True, metadata={
        "help": "With eval_dataset: held-out greedy accuracy before, every eval_every steps, and after training "
                "(builtin:arithmetic by its number; other data by the run's reward functions: any prompt data for GRPO, "
                "data with an 'answer' column or a builtin task for SFT/DPO)."})
    task_max_value: int = field(default=20, metadata={"help": "builtin tasks: largest number in a problem "
                                                                   "(multiplication: of the first factor)."})
    task_max_terms: int = field(default=2, metadata={"help": "builtin tasks: most numbers in an arithmetic "
                                                                  "problem; how many numbers to sort (2-8)."})
    reward_funcs: list = field(default_factory=lambda: ["numeric_match"], metadata={
        "help": "Reward functions by name ('numeric_match', 'number_list_match', 'reasoning_gym', "
                "'format:<regex>'): RL "
                "trains on them; every trainer's held-out accuracy uses them."})
    eval_every: int = field(default=0, metadata={
        "help": "With eval_dataset: held-out greedy accuracy every this many optimizer steps (0 = before/after only); "
                "RL, SFT, DPO and the experimental trainers on fixed data."})
    attn_implementation: str = field(default="", metadata={
        "help": "Attention kernel the model loads with: '' (transformers' choice: sdpa), 'sdpa', 'eager', "
                "'flash_attention_2', 'flash_attention_3' (CUDA, with the flash-attn package), 'flex_attention', or "
                "a kernels-hub name 'org/repo'. Packed rows stay apart with each (docs/distributed.md)."})
    task_kwargs: dict | None = field(default=None, metadata={
        "help": "reasoning_gym:<task> datasets: the task's own settings (its config class's fields, e.g. "
                "{min_terms = 2, max_terms = 3} for chain_sum)."})
    task_seed: int = field(default=0, metadata={
        "help": "reasoning_gym:<task> datasets: the generator's seed (held-out rows use another, and no held-out "
                "question is trained on)."})

    def __post_init__(self):
        if self.load_in_4bit and self.lora_r <= 0:
            raise ConfigError("load_in_4bit: 4-bit weights cannot be trained directly; set lora_r > 0 (QLoRA).")
        if self.lora_r < 0:
            raise ConfigError(f"lora_r: must be >= 0, got {self.lora_r}.")
        for name, low in (("dataset_size", 1), ("eval_size", 0), ("task_max_value", 1), ("eval_every", 0),
                          ("lora_alpha", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"{name}: must be >= {low}, got {getattr(self, name)}.")
        if not 2 <= self.task_max_terms <= 8:
            raise ConfigError(f"task_max_terms: 2 to 8 (numbers per arithmetic problem, numbers to sort), got "
                              f"{self.task_max_terms}.")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout: must be in [0, 1), got {self.lora_dropout}.")
        if not str(self.model).strip():
            raise ConfigError(f"model: empty; use '{DEFAULT_MODEL}' (the embedded model), a local folder or a Hub id.")
        impl = str(self.attn_implementation).strip()
        if impl and impl not in _ATTENTION_KERNELS and not re.fullmatch(r"[^\s/]+/\S+", impl):
            raise ConfigError(f"attn_implementation: unknown kernel '{impl}'. Use one of "
                              f"{', '.join(repr(k) for k in _ATTENTION_KERNELS)}, a kernels-hub name 'org/repo', or "
                              "leave it empty for transformers' choice.")

    def peft_config(self) -> Any:
        """The LoRA adapter config these settings describe (peft's LoraConfig), or None for full fine-tuning."""
        if self.lora_r <= 0:
            return None
        from peft import LoraConfig

        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout,
                          target_modules=self.lora_target_modules, task_type="CAUSAL_LM")

    def model_init_kwargs(self, trainer_config: Any = None) -> dict[str, Any]:
        """Keyword arguments for loading the model: 4-bit NF4 quantization for QLoRA (`load_in_4bit`), else none.

        On a GPU (unless `trainer_config.use_cpu`) the model loads on this process's own GPU (LOCAL_RANK) and
        computes in bfloat16 where the GPU has it; on the CPU in float32. `attn_implementation`, when set, is
        passed on; a flash-attention kernel is refused here, before the model loads, where it cannot run."""
        import os

        import torch

        kwargs: dict[str, Any] = {}
        impl = str(self.attn_implementation).strip()
        if impl:
            _check_flash_attention(impl, trainer_config, on_gpu=torch.cuda.is_available()
                                   and not getattr(trainer_config, "use_cpu", False))
            kwargs["attn_implementation"] = impl
        if not self.load_in_4bit:
            return kwargs
        from transformers import BitsAndBytesConfig

        if torch.cuda.is_available() and not getattr(trainer_config, "use_cpu", False):
            # Trainer never moves a quantized model, so where it loads is where it trains
            device_map: Any = {"": int(os.environ.get("LOCAL_RANK", "0"))}
            compute = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        else:
            device_map, compute = "cpu", torch.float32
        return {**kwargs, "quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                                    bnb_4bit_compute_dtype=compute),
                "device_map": device_map}


# transformers' own names (a kernels-hub 'org/repo' is accepted besides)
_ATTENTION_KERNELS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
_FLASH_PACKAGES = {"flash_attention_2": ("flash_attn", "pip install flash-attn --no-build-isolation"),
                   "flash_attention_3": ("flash_attn_interface", "build flash-attention's hopper/ package")}


def _check_flash_attention(impl: str, trainer_config: Any, *, on_gpu: bool) -> None:
    """A flash-attention kernel runs on CUDA only, in 16 bits, and needs its package: say so before the model loads
    (transformers would fail at load with an import message, or at the first forward)."""
    if impl not in _FLASH_PACKAGES:
        return
    import importlib.util

    if not on_gpu:
        raise ConfigError(f"attn_implementation: '{impl}' runs on CUDA GPUs only, and this run trains on the CPU "
                          "(no GPU, or use_cpu=true). Use 'sdpa' here.")
    package, install = _FLASH_PACKAGES[impl]
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"attn_implementation: '{impl}' needs the '{package}' package, which is not installed "
                          f"({install}); or use 'sdpa'.")
    dtype = getattr(trainer_config, "model_dtype", None)
    mixed = getattr(trainer_config, "bf16", False) or getattr(trainer_config, "fp16", False)
    if dtype == "float32" and not mixed:
        # flash-attention takes bfloat16/float16 only; under autocast the projections hand it 16-bit tensors
        raise ConfigError(f"attn_implementation: '{impl}' computes in bfloat16 or float16, and this run's model is "
                          "float32 without mixed precision. Set model_dtype = 'bfloat16' (or bf16 = true), or use "
                          "'sdpa'.")


ALIASES = {"lr": "learning_rate", "bs": "per_device_train_batch_size", "batch_size": "per_device_train_batch_size",
           "epochs": "num_train_epochs", "steps": "max_steps", "grad_accum": "gradient_accumulation_steps"}


def field_names(*classes: type) -> dict[str, type]:
    names: dict[str, type] = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            if f.init and not f.name.startswith("_"):
                names[f.name] = cls
    return names


def parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def merge_overrides(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`values` (a run file's) with command-line `overrides` on top: a dotted key (`loss_kwargs.epsilon_max`, from
    `--loss_kwargs.epsilon_max 5`) sets one entry of a `*_kwargs` table, keeping the file's others; on a section
    name (`--lora.r 16`) it is the flat key (`lora_r`)."""
    out = dict(values)
    for key, value in overrides.items():
        head, dot, sub = key.partition(".")
        if not dot:
            out[key] = value
        elif _is_table(head):
            table = out.get(head)
            if table is not None and not isinstance(table, dict):
                raise ConfigError(f"command line: '--{key}' sets an entry of '{head}', which is {table!r}, not a table.")
            out[head] = {**(table or {}), sub: value}
        elif "." in sub:
            raise ConfigError(f"command line: '--{key}': one dot only (a *_kwargs table's key, or a section's).")
        else:
            out[f"{head}_{sub}"] = value
    return out


def parse_overrides(argv: Sequence[str]) -> dict[str, Any]:
    """`--key value` / `--key=value` pairs; `--flag` alone means true."""
    out: dict[str, Any] = {}
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--"):
            raise ConfigError(f"command line: expected --field value, got '{tok}'.")
        key = tok[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            out[key.replace("-", "_")] = parse_value(raw)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[key.replace("-", "_")] = parse_value(argv[i + 1])
            i += 2
        else:
            out[key.replace("-", "_")] = True
            i += 1
    return out


def read_toml(path: str | Path, *, what: str = "file") -> dict[str, Any]:
    """A TOML file as a dict; a missing file or bad TOML is a ConfigError naming it (run files, pipelines)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--config: {what} '{path}' does not exist.")
    try:
        # UTF-8 with or without a byte-order mark (Windows editors add one; TOML itself forbids it)
        return tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config: '{path}' is not UTF-8 text ({e}); save it as UTF-8.") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config: '{path}' is not valid TOML: {e}") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML run file as a dict (the same keys as TOML); a missing file or bad YAML is a ConfigError naming it."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        """YAML 1.1 reads `1e-5` (no dot) as a string; run files mean a number, as TOML does."""

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--config: file '{path}' does not exist.")
    try:
        data = yaml.load(path.read_text(encoding="utf-8-sig"), Loader=Loader)  # noqa: S506 - a SafeLoader
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config: '{path}' is not UTF-8 text ({e}); save it as UTF-8.") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config: '{path}' is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: '{path}' holds a {type(data).__name__} at the top; a run file is a mapping of "
                          "keys to values.")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"--config: '{path}' has keys that are not names: {bad} (YAML reads on/off/yes/no and "
                          "numbers as such; quote them).")
    return data


def _is_table(key: str) -> bool:
    """Keys whose value is one dict (kept whole): `*_kwargs`, TrainingArguments' `*_config` and `deepspeed`."""
    return key.endswith(("_kwargs", "_config")) or key == "deepspeed"


def flatten_sections(data: dict[str, Any], *, where: str) -> dict[str, Any]:
    """A run file's sections as flat keys: `[lora]` with `r = 16` is `lora_r = 16` (a section names the prefix of
    the keys it holds); `*_kwargs` tables stay tables (they are one dict-valued key each). `where` names the
    source in errors."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and not _is_table(key):
            for sub, inner in value.items():
                if isinstance(inner, dict) and not _is_table(sub):
                    raise ConfigError(f"{where}: section [{key}] holds another section [{key}.{sub}]; one level of "
                                      "sections only.")
                flat = f"{key}_{sub}"
                if flat in out or flat in data:
                    raise ConfigError(f"{where}: '{flat}' is given twice (as a key and in section [{key}]).")
                out[flat] = inner
        else:
            out[key] = value
    return out


def load_run_file(path: str | Path) -> dict[str, Any]:
    """A run file (TOML, or YAML for .yaml/.yml) as the flat keys the command line takes: sections flattened
    (`[lora]` r -> lora_r), `*_kwargs` tables kept."""
    data = read_yaml(path) if Path(path).suffix.lower() in (".yaml", ".yml") else read_toml(path)
    return flatten_sections(data, where=f"--config '{path}'")


def _check_type(name: str, value: Any, annotation: Any) -> None:
    """Reject values whose type cannot be what the field means (before any model loads)."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    text = text.replace("typing.", "").replace(" ", "")
    if text in ("Any", ""):
        return
    allowed = set(text.replace("Optional[", "").replace("]", "").split("|"))
    checks = {
        "bool": lambda v: isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "None": lambda v: v is None,
        "dict": lambda v: isinstance(v, dict),
        "list": lambda v: isinstance(v, list),
    }
    known = [a for a in allowed if a in checks or a.startswith(("list", "dict"))]
    if not known:
        return
    ok = any(checks.get(a.split("[")[0], lambda v: False)(value) for a in allowed)
    if not ok:
        raise ConfigError(f"{name}: expected {text}, got {value!r} ({type(value).__name__}).")


def build_configs(values: dict[str, Any], config_cls: type) -> tuple[RunArgs, Any]:
    """Split flat `values` into RunArgs and `config_cls`, checking names and types first."""
    valid = field_names(RunArgs, config_cls)
    from .trl_names import TRL_FIELDS

    trl = TRL_FIELDS.get(config_cls.__name__, {})
    for key in values:
        if key not in valid and key in trl:
            continue  # TRL's name: the config translates or refuses it (docs/trl-names.md)
        if key not in valid:
            # Abbreviations people type, which string similarity maps to the wrong field (lr -> lora_r).
            close = [ALIASES[key]] if key in ALIASES else difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown key '{key}'.{hint} `toolkit {_cli_name(config_cls)} --help` lists every key.")
    hints = {}
    for cls in (RunArgs, config_cls):
        try:
            hints.update(typing.get_type_hints(cls))
        except Exception:
            hints.update({f.name: f.type for f in dataclasses.fields(cls)})
    for key, value in values.items():
        if key == "resume_from_checkpoint" and isinstance(value, bool):
            continue  # `true` = the newest complete checkpoint (the trainers' train() accepts it)
        if key in valid:
            _check_type(key, value, hints.get(key, "Any"))
    run = RunArgs(**{k: v for k, v in values.items() if valid.get(k) is RunArgs})
    cfg = config_cls(**{k: v for k, v in values.items() if valid.get(k, config_cls) is config_cls})
    return run, cfg


def _cli_name(config_cls: type) -> str:
    return config_cls.__name__.replace("Config", "").lower()


def describe_fields(*classes: type) -> str:
    lines = []
    for cls in classes:
        lines.append(f"\n{cls.__name__}:")
        for f in dataclasses.fields(cls):
            if not f.init or f.name.startswith("_"):
                continue
            default = f.default if f.default is not dataclasses.MISSING else "(computed)"
            help_text = f.metadata.get("help", "")
            help_text = help_text.split("\n")[0][:110]
            lines.append(f"  --{f.name} (default {default!r}): {help_text}")
    return "\n".join(lines)
