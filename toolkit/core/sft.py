"""Supervised fine-tuning.

`SFTTrainer` is a `transformers.Trainer`: notebooks, callbacks, `push_to_hub`, accelerate and
PEFT work as users expect. What it adds, top to bottom:

1. Data: detect the format (docs/datasets.md), validate every row *before* the model loads,
   tokenize once, keep ids end to end; report truncation and the effective loss settings.
2. Model: the embedded SmolLM2 by short name, a path, a Hub id or a built model; LoRA/QLoRA via
   a `peft_config`.
3. Loss: token-level cross-entropy from the shared chunked log-prob function, so the
   [batch, seq, vocab] logits tensor never exists; normalised by the number of loss tokens of the
   whole accumulated step (so 8x1 equals 4x2).
4. Packing: `padding_free` concatenates a micro-batch into one row; `packing` first fills rows of
   up to `max_length` tokens (best-fit decreasing). Either way each example attends only to itself.
5. Checkpoints: marked complete atomically; `resume_from_checkpoint=True` picks the newest complete one.

Public seams for wrappers (override in a subclass; no patching): `compute_token_logps` (how
per-token log-probs are computed), `compute_sft_loss` (the loss from those log-probs).
"""

from __future__ import annotations

__all__ = [
    "SFTConfig",
    "SFTTrainer",
]

import itertools
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedModel, Trainer, TrainingArguments

from .attention import supports_varlen, use_varlen_attention, varlen_kwargs
from .data import (
    SFTCollator,
    as_rows,
    detect_format,
    is_stream,
    normalize_rows,
    pack_bins,
    tokenize_for_sft,
    validate,
)
from .errors import ConfigError, DataError, TrainingHealthError
from .trl_names import accepting_trl_names
from .console import show_logs
from .lifecycle import TrainerLifecycle, warn_if_smaller_than_a_batch
from .models import (
    BF16_HELP,
    OFFLOADING_HELP,
    SEQUENCE_PARALLEL_HELP,
    DEFAULT_MODEL,
    apply_cpu_training_defaults,
    log_gpu_defaults,
    load_model,
    load_tokenizer,
    output_head,
    prepare_model,
    unwrap_model,
)
from .numerics import DEFAULT_CHUNK_SIZE, chunked_token_logps
from .packing import completion_logps
from .sequence_parallel import sequence_parallel_loss
from .vision import (
    IMAGE_INPUT_KEYS,
    ListDataset,
    VisionCollator,
    freeze_vision_tower,
    is_vision_processor,
    text_tokenizer,
    tokenize_vision_for_sft,
    validate_vision,
)

logger = logging.getLogger(__name__)


@accepting_trl_names
@dataclass
class SFTConfig(TrainingArguments):
    """Settings of `SFTTrainer`: every `transformers.TrainingArguments` field plus the ones below.

    Defaults differ from TrainingArguments where SFT practice differs: learning_rate 2e-5,
    logging every 10 steps, no reporting integrations, columns never dropped by Trainer.
    """

    output_dir: str | None = field(default="outputs/sft", metadata={"help": "Where checkpoints and the final model go."})
    learning_rate: float = field(default=2e-5, metadata={"help": "Peak AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Log metrics every this many optimizer steps."})
    report_to: Any = field(default="none", metadata={"help": "Integrations to report to ('none', 'tensorboard', ...)."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: our collator needs the tokenized columns Trainer would drop."})

    max_length: int | None = field(
        default=1024, metadata={"help": "Longest tokenized example; longer ones are truncated and the count reported. "
                                        "None keeps everything."})
    packing: bool = field(
        default=False, metadata={"help": "Fill rows of up to max_length tokens with several examples (best-fit "
                                         "decreasing); examples never attend to each other."})
    padding_free: bool | None = field(
        default=None, metadata={"help": "Concatenate each micro-batch into one row instead of padding it (same "
                                        "examples per step, same loss, no pad tokens computed). None: on whenever "
                                        "the attention implementation keeps examples apart (sdpa, eager, flash)."})
    optim: str = field(
        default="adamw_torch_fused", metadata={"help": "Optimizer (TrainingArguments names). The fused AdamW has no "
                                                       "per-step temporaries the size of the model."})
    completion_only_loss: bool | None = field(
        default=None, metadata={"help": "For prompt-completion data: train only on completion tokens. "
                                        "None means True for prompt-completion data."})
    assistant_only_loss: bool = field(
        default=False, metadata={"help": "For conversational 'messages' data: train only on assistant turns."})
    model_init_kwargs: dict | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when the model is given by name (TRL's "
                                        "field); the trainer's model_init_kwargs argument adds to them."})
    chat_template_kwargs: dict | None = field(
        default=None, metadata={"help": "Extra keyword arguments for tokenizer.apply_chat_template."})
    logps_chunk_size: int = field(
        default=DEFAULT_CHUNK_SIZE, metadata={"help": "Token positions whose vocabulary logits exist at once in the "
                                                      "loss (memory vs. speed)."})
    fp32_lm_head: bool = field(
        default=True, metadata={"help": "Compute the LM head and log-softmax in fp32 even for bf16 models."})
    activation_offloading: bool | None = field(default=None, metadata={"help": OFFLOADING_HELP})
    sequence_parallel_size: int = field(default=1, metadata={"help": SEQUENCE_PARALLEL_HELP})
    bf16: bool | None = field(default=None, metadata={"help": BF16_HELP})
    model_dtype: str = field(
        default="float32", metadata={"help": "dtype to load the model in when it is given by name: float32 | bfloat16."})
    freeze_vision_tower: bool = field(
        default=True, metadata={"help": "Vision-language models: keep the vision encoder's weights fixed (LoRA "
                                        "targets then stay in the language model too)."})
    train_projector: bool = field(
        default=True, metadata={"help": "Vision-language models: train the projector from image features to the "
                                        "language model even when the vision tower is frozen."})

    def __post_init__(self):
        apply_cpu_training_defaults(self)
        super().__post_init__()
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"max_length: must be at least 2 (or None), got {self.max_length}.")
        if self.packing and self.max_length is None:
            raise ConfigError("packing: needs max_length to know how many tokens fit in a row; set max_length.")
        if self.logps_chunk_size < 1:
            raise ConfigError(f"logps_chunk_size: must be >= 1, got {self.logps_chunk_size}.")
        if self.sequence_parallel_size < 1:
            raise ConfigError(f"sequence_parallel_size: must be >= 1, got {self.sequence_parallel_size}.")
        if self.model_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"model_dtype: '{self.model_dtype}' is not one of float32, bfloat16, float16.")


def _formatted(rows: list[dict[str, Any]], formatting_func: Any, name: str, first_row: int = 0) -> list[dict[str, Any]]:
    """TRL's `formatting_func(row) -> str`: each row becomes `{"text": ...}` (a one-string list is accepted)."""
    if formatting_func is None:
        return rows
    out = []
    for i, row in enumerate(rows, start=first_row):
        try:
            text = formatting_func(row)
        except Exception as e:
            raise DataError(f"formatting_func: failed on {name} row {i} ({type(e).__name__}: {e}); the row has "
                            f"columns {sorted(row)}.") from e
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        if not isinstance(text, str):
            raise DataError(f"formatting_func: returned {type(text).__name__} for {name} row {i}; it must return the "
                            "row's training text as one string.")
        out.append({"text": text})
    return out


def _standard_keys(example: dict[str, Any]) -> dict[str, Any]:
    ids, mask = example["input_ids"], example["completion_mask"]
    rest = {k: v for k, v in example.items() if k not in ("input_ids", "completion_mask", "seq_lens")}
    return {**rest, "input_ids": ids, "attention_mask": [1] * len(ids),
            "labels": [t if m else -100 for t, m in zip(ids, mask)]}


def _check_collator(collator: Any, examples: list[dict[str, Any]]) -> None:
    try:
        batch = collator(examples)
    except Exception as e:
        raise ConfigError(f"data_collator: failed on the first examples ({type(e).__name__}: {e}); it receives dicts "
                          f"with keys {sorted(examples[0])}.") from e
    missing = [k for k in ("input_ids", "labels", "attention_mask") if k not in batch]
    if missing:
        raise ConfigError(f"data_collator: its batch lacks {missing} (it has {sorted(batch)}); SFT needs input_ids, "
                          "labels (-100 = not in the loss) and attention_mask.")


# Rows of a stream read before the model loads: enough to detect the format and catch a wrong column early.
_STREAM_HEAD_ROWS = 64


def _stream_head(data: Any, name: str) -> tuple[list[dict[str, Any]], Any]:
    """The first rows of a stream, and the stream to train on (for a one-shot iterator: those rows, then the rest)."""
    if iter(data) is data and name == "eval_dataset":
        raise ConfigError("eval_dataset: a one-shot iterator (e.g. a generator) would be used up by the first "
                          "evaluation, and every later one would see no rows; pass a datasets.IterableDataset (read "
                          "again each time) or a list.")
    if iter(data) is data:
        # A generator or iterator can be read once: keep what was peeked and go on from there (one pass only).
        head = list(itertools.islice(data, _STREAM_HEAD_ROWS))
        source: Any = itertools.chain(head, data)
        logger.warning("SFT: %s is a one-shot iterator (e.g. a generator); it is read once, so training stops when "
                       "it runs out even before max_steps. Pass a datasets.IterableDataset to read it again.", name)
    else:
        head = list(itertools.islice(iter(data), _STREAM_HEAD_ROWS))
        source = data
    if not head:
        raise DataError(f"{name}: the stream yielded no rows.")
    for i, row in enumerate(head):
        if not isinstance(row, Mapping):
            raise DataError(f"{name}: streamed row {i} is a {type(row).__name__}, not a dict of columns.")
    return [dict(r) for r in head], source


class _SFTStream(torch.utils.data.IterableDataset):
    """A streamed dataset validated and tokenized one row at a time as Trainer reads it, never held whole.

    The format was detected, and the first rows checked, before the model loaded; every row is checked
    against that format as it arrives, and a bad one stops the run naming its index in the stream.
    """

    def __init__(self, source: Any, fmt: Any, tokenizer: Any, formatting_func: Any, tok_kwargs: dict[str, Any],
                 name: str, standard_keys: bool):
        self.source, self.fmt, self.tokenizer = source, fmt, tokenizer
        self.formatting_func, self.tok_kwargs, self.name = formatting_func, tok_kwargs, name
        self.standard_keys = standard_keys
        self._warned_truncation = False

    def set_epoch(self, epoch: int) -> None:
        """Trainer calls this at each pass; a shuffled datasets.IterableDataset then reshuffles per pass."""
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def __iter__(self):
        for i, row in enumerate(self.source):
            if not isinstance(row, Mapping):
                raise DataError(f"{self.name}: streamed row {i} is a {type(row).__name__}, not a dict of columns.")
            rows = normalize_rows(_formatted([dict(row)], self.formatting_func, self.name, first_row=i), first_row=i)
            validate(rows, self.fmt, tokenizer=self.tokenizer, first_row=i)
            (example,), report = tokenize_for_sft(rows, self.fmt, self.tokenizer, first_row=i, **self.tok_kwargs)
            if report.truncated_rows and not self._warned_truncation:
                self._warned_truncation = True
                logger.warning("SFT: streamed %s row %d (%d tokens) was truncated to max_length=%s; later truncations "
                               "are not reported one by one.", self.name, i, report.longest,
                               self.tok_kwargs["max_length"])
            yield _standard_keys(example) if self.standard_keys else example


class SFTTrainer(TrainerLifecycle, Trainer):
    """Supervised fine-tuning on language-modeling or prompt-completion data (plain or conversational).

    Supports completion-only and assistant-only loss, padding-free batches and packing (each example
    attends only to itself), PEFT LoRA and QLoRA, evaluation, atomic checkpoints and exact resume.
    A streamed dataset (`datasets.IterableDataset`, a generator) is tokenized row by row as training
    reads it, never held whole; its first 64 rows are checked before the model loads, and the run
    needs `max_steps` (a stream has no length) and cannot use `packing` (it fills rows from the
    whole dataset).
    Departs from TRL's SFTTrainer in three ways: the logits tensor is never materialised (chunked
    LM head), the loss mask never comes from `input_ids == pad_token_id` (so EOS is learned when
    pad == eos), and bad rows stop the run before the model loads.
    """

    _tag_names = ["toolkit", "sft"]
    trainer_kind = "sft"

    def __init__(
        self,
        model: str | PreTrainedModel = DEFAULT_MODEL,
        args: SFTConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        model_init_kwargs: dict | None = None,
        data_collator: Any = None,
        formatting_func: Any = None,
        **kwargs: Any,
    ):
        show_logs()  # the start-up summary below is seen in a notebook too (console.show_logs)
        args = args if args is not None else SFTConfig()
        if not isinstance(args, SFTConfig):
            raise ConfigError(f"args: SFTTrainer needs an SFTConfig, got {type(args).__name__}.")
        if train_dataset is None:
            raise ConfigError("train_dataset: SFTTrainer needs a training dataset (Dataset, list of dicts or .jsonl path).")
        if data_collator is not None and (args.packing or args.padding_free):
            raise ConfigError("data_collator: a collator of your own pads the batch itself, so packing/padding_free "
                              "cannot apply; set packing=False and padding_free=False, or drop data_collator.")

        streamed = {name: is_stream(d) for name, d in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset))}
        if streamed["train_dataset"] and args.max_steps <= 0:
            raise ConfigError("max_steps: a streamed train_dataset has no length, so the number of optimizer steps "
                              "cannot be derived from epochs; set max_steps=N.")
        if any(streamed.values()) and args.packing:
            raise ConfigError("packing: fills rows best-fit from the whole dataset, which a stream does not have; set "
                              "packing=False (padding_free, on by default, already keeps pad tokens out).")

        # 1. Data first: every row is checked before a model is loaded (minutes saved per mistake). Of a stream,
        #    the first rows are checked now and each later one as training reads it.
        tokenizer = processing_class if processing_class is not None else load_tokenizer(model)
        self.vision = is_vision_processor(tokenizer)  # an AutoProcessor: rows may hold images
        if self.vision and any(streamed.values()):
            raise ConfigError("train_dataset/eval_dataset: streamed vision-language datasets are not supported yet; "
                              "pass a datasets.Dataset or a list (images are decoded once, before training).")
        if text_tokenizer(tokenizer).pad_token_id is None:
            text_tokenizer(tokenizer).pad_token = text_tokenizer(tokenizer).eos_token
        train_rows, eval_rows, sources = self._read_rows(train_dataset, eval_dataset, streamed, formatting_func,
                                                         tokenizer)
        if args.sequence_parallel_size > 1 and sources:
            raise ConfigError(f"sequence_parallel_size={args.sequence_parallel_size}: {', '.join(sorted(sources))} is "
                              "streamed; every rank would read its own rows, and a sequence-parallel group must share "
                              "them. Pass a datasets.Dataset or a list, or set sequence_parallel_size=1.")
        completion_only = self._completion_only(args)
        # a pre-tokenized dataset's other columns go to a collator of your own, never into our batches
        tok_kwargs = dict(max_length=args.max_length, completion_only_loss=completion_only,
                          assistant_only_loss=args.assistant_only_loss, template_kwargs=args.chat_template_kwargs,
                          keep_extra_columns=data_collator is not None)
        train_tok, eval_tok, report = self._tokenize(train_rows, eval_rows, tokenizer, tok_kwargs, args,
                                                     streamed["train_dataset"])

        # 2. Model.
        model = self._load_model(model, args, peft_config, model_init_kwargs, data_collator)
        packed = self.padding_free
        refuse = ("splits packed rows; vision-language rows are padded." if self.vision else
                  "splits packed rows, and this model's batches are padded (padding_free=False or an attention "
                  "implementation that cannot keep packed examples apart)." if not packed else None)
        self.setup_sequence_parallel(args, [model], refuse=refuse,
                                     split_seams=(SFTTrainer, ("compute_loss", "compute_token_logps")))

        # 3. Datasets of token ids (packing groups whole examples into rows of at most max_length).
        if args.packing:
            train_tok = _pack(train_tok, args.max_length)
            eval_tok = _pack(eval_tok, args.max_length) if eval_tok is not None else None
        pad_id = text_tokenizer(tokenizer).pad_token_id
        collator = VisionCollator(tokenizer, pad_id) if self.vision else SFTCollator(pad_id, padding_free=packed)
        if data_collator is not None:
            # A collator of your own gets the standard keys (input_ids, attention_mask, labels with -100 outside
            # the loss, plus a pre-tokenized dataset's other columns) and must return at least input_ids, labels
            # and attention_mask; checked on two examples now rather than at step 0.
            train_tok = [_standard_keys(e) for e in train_tok]
            eval_tok = [_standard_keys(e) for e in eval_tok] if eval_tok is not None else None
            _check_collator(data_collator, train_tok[:2])
            collator = data_collator
        # Examples with images stay Python objects (a datasets.Dataset would re-encode every image).
        as_dataset = ListDataset if self.vision else Dataset.from_list
        datasets_ = {"train_dataset": as_dataset(train_tok),
                     "eval_dataset": as_dataset(eval_tok) if eval_tok is not None else None}
        for name, source in sources.items():
            fmt = self.dataset_format if name == "train_dataset" else self._eval_format
            datasets_[name] = _SFTStream(source, fmt, tokenizer, formatting_func, tok_kwargs, name,
                                         standard_keys=data_collator is not None)
        if sources:
            # accelerate's default for a stream is to read it on rank 0 and split each batch, which cannot split the
            # padding-free rows of different lengths; instead every rank reads the stream and keeps its share of
            # each global batch (IterableDatasetShard), the same examples per step as one process with world x B.
            args.accelerator_config.dispatch_batches = False
        log_gpu_defaults(args, model, "sft", batch_size=args.per_device_train_batch_size, seq_len=args.max_length or 1024)
        logger.info(
            "SFT loss settings: %s; completion_only_loss=%s assistant_only_loss=%s packing=%s padding_free=%s "
            "max_length=%s gradient_checkpointing=%s; loss = token-mean over the whole accumulated step "
            "(%d loss tokens in the data).",
            self.dataset_format.describe(), completion_only, args.assistant_only_loss, args.packing,
            packed, args.max_length, args.gradient_checkpointing, report.loss_tokens,
        )
        super().__init__(model=model, args=args, data_collator=collator, **datasets_, processing_class=tokenizer,
                         callbacks=callbacks, optimizers=optimizers, **kwargs)
        if "train_dataset" not in sources:  # (a stream's length is unknown)
            warn_if_smaller_than_a_batch(self, len(datasets_["train_dataset"]))
        # Our compute_loss divides by the token count of the whole accumulated step (num_items_in_batch),
        # so Trainer must count the tokens and must not divide by the accumulation steps again.
        self.model_accepts_loss_kwargs = True
        self.loss_is_scaled_for_ga = True
        self._window_tokens = 0
        self._window_loss_tokens = 0
        self._window_start = time.perf_counter()
        self._total_tokens = 0

    def _tokenize(self, train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]] | None, tokenizer: Any,
                  tok_kwargs: dict[str, Any], args: SFTConfig, streamed: bool) -> tuple[list, list | None, Any]:
        """(train examples, eval examples, the train report), with what was truncated reported."""
        if self.vision:
            train_tok, report = self._tokenize_vision(train_rows, self._train_images, tok_kwargs)
        else:
            train_tok, report = tokenize_for_sft(train_rows, self.dataset_format, tokenizer, **tok_kwargs)
        self.tokenization_report = report
        logger.info("SFT train data%s: %s: %s", " (the first rows of the stream)" if streamed else "",
                    self.dataset_format.describe(), report.summary(args.max_length))
        if report.truncated_rows:
            logger.warning("SFT: %d of %d training rows were truncated to max_length=%s (longest: %d tokens).",
                           report.truncated_rows, report.rows, args.max_length, report.longest)
        eval_tok = None
        if eval_rows is not None:
            if self.vision:
                eval_tok, eval_report = self._tokenize_vision(eval_rows, self._eval_images, tok_kwargs)
            else:
                eval_tok, eval_report = tokenize_for_sft(eval_rows, self.dataset_format, tokenizer, **tok_kwargs)
            logger.info("SFT eval data: %s", eval_report.summary(args.max_length))
        return train_tok, eval_tok, report

    def _tokenize_vision(self, rows: list[dict[str, Any]], images: list[list[Any]],
                         tok_kwargs: dict[str, Any]) -> tuple[list[dict[str, Any]], Any]:
        kwargs = {k: v for k, v in tok_kwargs.items() if k != "keep_extra_columns"}
        return tokenize_vision_for_sft(rows, images, self.dataset_format, self.processing_class_in, **kwargs)

    def _completion_only(self, args: SFTConfig) -> bool:
        """completion_only_loss resolved for the detected format (None: on for prompt-completion data)."""
        completion_only = args.completion_only_loss
        if completion_only is None:
            completion_only = self.dataset_format.kind == "prompt_completion"
        elif completion_only and self.dataset_format.kind == "tokenized":
            raise ConfigError("completion_only_loss=True: pre-tokenized rows carry their loss mask in "
                              "'completion_mask' or 'labels'; leave completion_only_loss unset.")
        elif completion_only and self.dataset_format.kind != "prompt_completion":
            raise ConfigError(f"completion_only_loss=True needs prompt-completion data; this dataset is "
                              f"{self.dataset_format.describe()}. Use assistant_only_loss for 'messages' rows.")
        return completion_only

    def _load_model(self, model: Any, args: SFTConfig, peft_config: Any, model_init_kwargs: dict | None,
                    data_collator: Any) -> Any:
        """The model (loaded, PEFT applied) and whether batches are packed (sets `padding_free`)."""
        init_kwargs = {**(args.model_init_kwargs or {}), **(model_init_kwargs or {})}
        model = load_model(model, dtype=init_kwargs.pop("dtype", init_kwargs.pop("torch_dtype", args.model_dtype)),
                           **init_kwargs)
        if self.vision:
            peft_config = freeze_vision_tower(model, peft_config, freeze=args.freeze_vision_tower,
                                              train_projector=args.train_projector)
        model = prepare_model(model, peft_config)  # a wrapper's PeftModel is used as given
        varlen_ok = supports_varlen(unwrap_model(model))
        if self.vision:
            if args.packing or args.padding_free:
                raise ConfigError("packing/padding_free: not available for vision-language models yet (a packed row "
                                  "would need each example's image positions, 3-D M-RoPE ones for Qwen2-VL); set "
                                  "packing=False, padding_free=False.")
            logger.info("SFT: vision-language batches are right-padded (padding-free rows with images are not "
                        "implemented yet).")
            self.padding_free = False
            return model
        if (args.packing or args.padding_free) and not varlen_ok:
            raise ConfigError(
                f"packing/padding_free: attention implementation '{unwrap_model(model).config._attn_implementation}' "
                "cannot keep packed examples apart. Load the model with attn_implementation='sdpa' (or "
                "flash_attention_2 on GPU), or set packing=False, padding_free=False."
            )
        self.padding_free = args.packing or (args.padding_free if args.padding_free is not None else
                                             varlen_ok and data_collator is None)
        if self.padding_free:
            use_varlen_attention(unwrap_model(model))
        return model

    def _read_rows(self, train_dataset: Any, eval_dataset: Any, streamed: dict[str, bool], formatting_func: Any,
                   tokenizer: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
        """(train rows, eval rows, the streams to train on) with the format detected and every row validated (of
        a stream, its first rows); sets `dataset_format`."""
        sources: dict[str, Any] = {}
        if streamed["train_dataset"]:
            head, sources["train_dataset"] = _stream_head(train_dataset, "train_dataset")
            train_rows = normalize_rows(_formatted(head, formatting_func, "train_dataset"))
        else:
            train_rows = normalize_rows(_formatted(as_rows(train_dataset), formatting_func, "train_dataset"))
        self.processing_class_in = tokenizer
        self.dataset_format = detect_format(train_rows, tokenized=True)
        validate(train_rows, self.dataset_format, tokenizer=tokenizer, vision=self.vision)
        # images decoded once, here, and refused row by row before any model loads (also: images with a text model)
        self._train_images = validate_vision(train_rows, self.dataset_format, tokenizer) if self.vision or \
            "images" in self.dataset_format.extra_columns or "image" in self.dataset_format.extra_columns else None
        eval_rows, self._eval_format = None, None
        if eval_dataset is not None:
            if streamed["eval_dataset"]:
                head, sources["eval_dataset"] = _stream_head(eval_dataset, "eval_dataset")
            else:
                head = as_rows(eval_dataset)
            eval_rows = normalize_rows(_formatted(head, formatting_func, "eval_dataset"))
            self._eval_format = detect_format(eval_rows, tokenized=True)
            fmt, train_fmt = self._eval_format, self.dataset_format
            if (fmt.kind, fmt.conversational) != (train_fmt.kind, train_fmt.conversational):
                raise ConfigError(f"eval_dataset: it is {self._eval_format.describe()} but train_dataset is "
                                  f"{self.dataset_format.describe()}; use the same format for both.")
            validate(eval_rows, self._eval_format, tokenizer=tokenizer, vision=self.vision)
            self._eval_images = (validate_vision(eval_rows, self._eval_format, tokenizer, where="eval_dataset")
                                 if self.vision else None)
        return train_rows, eval_rows, sources

    # ---------------------------------------------------------------------------------- seams

    def compute_token_logps(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs of the label tokens. Returns (logps [N], targets [N]) for the N positions with a label.

        Override to change how log-probs are computed (a fused kernel, a different head); the
        default runs the model with `logits_to_keep=1` (so transformers builds no full logits)
        and feeds the final hidden states to the shared chunked LM-head function.
        """
        if self.sequence_parallel is not None:  # the row split over the group; the log-probs gathered whole
            shifted = inputs["labels"][0, 1:]
            positions = (shifted != -100).nonzero().squeeze(1)
            batch = {"input_ids": inputs["input_ids"], "position_ids": inputs["position_ids"],
                     "cu_seq_lens": inputs["cu_seq_lens"], "completion_positions": positions,
                     "completion_targets": shifted[positions]}
            return completion_logps(model, batch, chunk_size=self.args.logps_chunk_size,
                                    upcast=self.args.fp32_lm_head), shifted[positions]
        forward_kwargs: dict[str, Any] = {"input_ids": inputs["input_ids"], "use_cache": False,
                                          "output_hidden_states": True, "logits_to_keep": 1}
        if "cu_seq_lens" in inputs:
            forward_kwargs["position_ids"] = inputs["position_ids"]
            forward_kwargs.update(varlen_kwargs(inputs["cu_seq_lens"]))
        else:
            forward_kwargs["attention_mask"] = inputs["attention_mask"]
        forward_kwargs.update({k: inputs[k] for k in IMAGE_INPUT_KEYS if k in inputs})  # a vision batch's pixels
        outputs = model(**forward_kwargs)
        hidden = outputs.hidden_states[-1]  # [B, T, H], after the final norm
        labels = inputs["labels"]
        shifted = labels[:, 1:]
        selected = shifted != -100  # [B, T-1]
        weight, bias = output_head(model)  # whole even under FSDP2 (models.output_head)
        logps = chunked_token_logps(
            hidden[:, :-1][selected], weight, shifted[selected], bias=bias,
            chunk_size=self.args.logps_chunk_size, upcast=self.args.fp32_lm_head,
        )
        return logps, shifted[selected]

    def compute_sft_loss(self, logps: torch.Tensor, num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
        """Negative log-likelihood summed over this micro-batch, divided by the loss tokens of the whole step."""
        denom = num_items_in_batch if num_items_in_batch is not None else max(logps.numel(), 1)
        return -logps.sum() / denom

    # ------------------------------------------------------------------------- Trainer hooks

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        logps, _ = self.compute_token_logps(model, inputs)
        sp = self.sequence_parallel
        if sp is not None and num_items_in_batch is not None and self.args.average_tokens_across_devices:
            num_items_in_batch = num_items_in_batch / sp.size  # the ranks of a group counted their one batch P times
        loss = self.compute_sft_loss(logps, num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None and self.args.world_size > 1:
            # gradients are averaged over ranks; the denominator is global (one per replica of the batch)
            loss = loss * (sp.dp_size if sp is not None else self.args.world_size)
        loss = sequence_parallel_loss(loss, sp)
        if not torch.isfinite(loss):
            raise TrainingHealthError(
                f"SFT loss is {loss.item()} at step {self.state.global_step}: the model's log-probs of the label "
                "tokens are not finite. Lower the learning rate, check the data for extreme lengths, or use fp32."
            )
        if model.training:
            self._window_tokens += int(inputs["input_ids"].numel() if "attention_mask" not in inputs
                                       else inputs["attention_mask"].sum())
            self._window_loss_tokens += logps.numel()
        return (loss, {"logps": logps.detach()}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            logps, _ = self.compute_token_logps(model, inputs)
            loss = -logps.sum() / max(logps.numel(), 1)
        return loss.detach(), None, None

    def on_log_metrics(self, logs: dict[str, float], mode: str) -> None:
        if mode != "train" or not self.model.training:
            return
        now = time.perf_counter()
        self._total_tokens += self._window_loss_tokens
        # Real (non-padding) tokens through the model per second, and loss tokens seen so far.
        logs["train_tokens_per_second"] = round(self._window_tokens / max(now - self._window_start, 1e-9), 1)
        logs["num_loss_tokens"] = self._total_tokens
        if logs["loss"] < 30:
            logs["perplexity"] = round(math.exp(logs["loss"]), 3)
        self._window_tokens, self._window_loss_tokens, self._window_start = 0, 0, now

    def restore_checkpoint_state(self, folder: Path | None) -> None:
        self._window_start = time.perf_counter()


def _pack(examples: list[dict[str, list[int]]], capacity: int) -> list[dict[str, Any]]:
    bins = pack_bins([len(e["input_ids"]) for e in examples], capacity)
    rows = []
    for b in bins:
        ids, mask, lens = [], [], []
        for i in sorted(b):
            ids += examples[i]["input_ids"]
            mask += examples[i]["completion_mask"]
            lens.append(len(examples[i]["input_ids"]))
        rows.append({"input_ids": ids, "completion_mask": mask, "seq_lens": lens})
    return rows
