"""Direct Preference Optimization and its loss family.

`DPOTrainer` is a `transformers.Trainer`. One step, top to bottom:

1. Data (once, before any model loads): preference rows in any format the data layer detects
   (plain or conversational, explicit or implicit prompt) are validated and tokenized into
   prompt ids + chosen ids + rejected ids. Identical chosen/rejected rows are reported.
2. One forward for the whole micro-batch: every prompt+chosen and prompt+rejected sequence packed
   into one padding-free row (examples never attend to each other); per-token log-probs from the
   shared chunked LM-head function at the completion positions only, summed per sequence. The
   [2B, seq, vocab] logits tensor never exists.
3. Reference log-probs: a frozen copy, the PEFT base with adapters disabled (no second copy),
   precomputed once before training (`precompute_ref_log_probs`, then no reference is held), or
   none (`reference_free`).
4. Loss: `loss_type` (one name or a list, with `loss_weights`) through `preference_loss`, or any
   preference loss a plugin registered (toolkit.core.hookspecs).

Follows Rafailov et al. (2023); loss variants cite their papers in `numerics.preference_loss`.
Loss and reward metrics equal TRL's DPOTrainer on the same batch (tests/trainers/test_dpo.py).
Seams: `compute_sequence_logps`, `compute_reference_logps`, `compute_preference_loss`.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from datasets import Dataset
from transformers import PreTrainedModel, Trainer, TrainingArguments

from .attention import packed_layout, supports_varlen, use_varlen_attention
from .data import as_rows, detect_format, normalize_rows, tokenize_for_preference, validate
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
    disable_dropout,
    log_gpu_defaults,
    is_peft_model,
    load_model,
    load_tokenizer,
    place_frozen,
    prepare_model,
    unwrap_model,
)
from .numerics import DEFAULT_CHUNK_SIZE
from .objectives import PreferenceLossInputs, resolve_preference_loss_settings
from .objectives.preference import check_loss_kwargs_used
from .packing import completion_logps, pack_for_layout, sequence_sums
from .sequence_parallel import sequence_parallel_loss
from .plugins import registry
from .vision import (
    ListDataset,
    encode_images,
    freeze_vision_tower,
    image_inputs_for_rows,
    image_tokens_per_example,
    is_vision_processor,
    pixel_inputs,
    text_tokenizer,
    tokenize_vision_for_preference,
    validate_vision,
)

logger = logging.getLogger(__name__)


__all__ = ["DPOConfig", "DPOTrainer"]


@accepting_trl_names
@dataclass
class DPOConfig(TrainingArguments):
    """Settings of `DPOTrainer`: every `TrainingArguments` field plus the ones below (TRL's names)."""

    output_dir: str | None = field(default="outputs/dpo", metadata={"help": "Checkpoints and the final model."})
    learning_rate: float = field(default=1e-6, metadata={"help": "Peak AdamW learning rate."})
    logging_steps: float = field(default=10, metadata={"help": "Log every this many optimizer steps."})
    report_to: Any = field(default="none", metadata={"help": "Integrations to report to."})
    remove_unused_columns: bool = field(default=False, metadata={"help": "Kept False (tokenized columns are ours)."})
    optim: str = field(default="adamw_torch_fused", metadata={"help": "Optimizer (TrainingArguments names)."})

    beta: float = field(default=0.1, metadata={"help": "Strength of the implicit KL to the reference (tau for ipo)."})
    loss_type: Any = field(default="sigmoid", metadata={
        "help": "sigmoid | robust | hinge | ipo | sft (the chosen answer's NLL, to combine: [\"sigmoid\", \"sft\"]) | "
                "a registered loss, or a list of them (see loss_weights)."})
    loss_weights: list[float] | None = field(default=None, metadata={"help": "One weight per loss type."})
    loss_kwargs: dict | None = field(default=None, metadata={
        "help": "The preference losses' own settings (a plugin loss's), checked against their settings dataclasses; "
                "beta and label_smoothing are set by their config fields."})
    label_smoothing: float = field(default=0.0, metadata={"help": "Assumed label-noise rate (cDPO/robust)."})
    max_length: int | None = field(default=1024, metadata={
        "help": "Longest prompt + answer; answers are cut at the end, and the count reported."})
    precompute_ref_log_probs: bool = field(default=False, metadata={
        "help": "Compute reference log-probs once before training and hold no reference model while training."})
    reference_free: bool = field(default=False, metadata={"help": "Use no reference (its log-probs are 0)."})
    model_init_kwargs: dict | None = field(
        default=None, metadata={"help": "Keyword arguments for from_pretrained when the model is given by name (TRL's "
                                        "field); the trainer's model_init_kwargs argument adds to them."})
    disable_dropout: bool = field(default=True, metadata={
        "help": "No dropout in the policy and the reference (TRL's name and default): the two log-probs of an "
                "unchanged model then agree."})
    chat_template_kwargs: dict | None = field(default=None, metadata={"help": "Extra apply_chat_template kwargs."})
    logps_chunk_size: int = field(default=DEFAULT_CHUNK_SIZE, metadata={"help": "Chunk size of the LM head."})
    fp32_lm_head: bool = field(default=True, metadata={"help": "Compute the LM head in fp32."})
    activation_offloading: bool | None = field(default=None, metadata={"help": OFFLOADING_HELP})
    sequence_parallel_size: int = field(default=1, metadata={"help": SEQUENCE_PARALLEL_HELP})
    bf16: bool | None = field(default=None, metadata={"help": BF16_HELP})
    model_dtype: str = field(default="float32", metadata={"help": "dtype for a model given by name."})
    flat_warn_steps: int = field(default=20, metadata={
        "help": "Warn when reward accuracy and margin have not moved for this many logged steps."})
    freeze_vision_tower: bool = field(default=True, metadata={
        "help": "Vision-language models: keep the vision encoder's weights fixed (LoRA targets stay in the "
                "language model too)."})
    train_projector: bool = field(default=True, metadata={
        "help": "Vision-language models: train the projector into the language model even with the tower frozen."})

    def __post_init__(self):
        apply_cpu_training_defaults(self)
        super().__post_init__()
        types = [self.loss_type] if isinstance(self.loss_type, str) else list(self.loss_type)
        if self.beta <= 0:
            raise ConfigError(f"beta: must be > 0, got {self.beta}.")
        if self.sequence_parallel_size < 1:
            raise ConfigError(f"sequence_parallel_size: must be >= 1, got {self.sequence_parallel_size}.")
        # Each loss checks its own settings (e.g. label_smoothing's range) before any model loads.
        losses = {t: registry().get("preference_loss", t, field="loss_type") for t in types}
        for t, loss in losses.items():
            resolve_preference_loss_settings(loss, self, name=t)
        check_loss_kwargs_used(losses, self)
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            raise ConfigError(f"loss_weights: {len(self.loss_weights)} weights for {len(types)} loss types {types}.")
        if self.reference_free and self.precompute_ref_log_probs:
            raise ConfigError("precompute_ref_log_probs: there is nothing to precompute with reference_free=True.")
        self.loss_types = types
        self.loss_weight_values = list(self.loss_weights) if self.loss_weights is not None else [1.0] * len(types)


class DPOTrainer(TrainerLifecycle, Trainer):
    """DPO and variants on preference data; see the module docstring and docs/dpo.md."""

    _tag_names = ["toolkit", "dpo"]
    trainer_kind = "dpo"
    supports_vision = True  # pairs with images (docs/vision.md); a subclass that cannot take them sets False

    def __init__(
        self,
        model: str | PreTrainedModel = DEFAULT_MODEL,
        ref_model: str | PreTrainedModel | None = None,
        args: DPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        model_init_kwargs: dict | None = None,
        data_collator: Any = None,
    ):
        show_logs()  # the start-up summary below is seen in a notebook too (console.show_logs)
        args = args if args is not None else DPOConfig()
        if not isinstance(args, DPOConfig):
            raise ConfigError(f"args: DPOTrainer needs a DPOConfig, got {type(args).__name__}.")
        if data_collator is not None:
            # accepted as a keyword (TRL's DPOTrainer has it) so the refusal can say what to do instead
            raise ConfigError("data_collator: DPOTrainer forms its own batches (each pair packed around one shared "
                              "prompt copy), so a collator cannot be swapped in. To choose the tokens, pass "
                              "pre-tokenized pairs (prompt_input_ids, chosen_input_ids, rejected_input_ids); to "
                              "change how log-probs are computed, override compute_sequence_logps in a subclass.")
        if train_dataset is None:
            raise ConfigError("train_dataset: DPOTrainer needs preference data (chosen/rejected).")

        # 1. Data before any model.
        tokenizer = processing_class if processing_class is not None else load_tokenizer(model)
        self.vision = is_vision_processor(tokenizer)  # an AutoProcessor: prompts may hold images
        if self.vision and not type(self).supports_vision:
            raise ConfigError(f"processing_class: {type(self).__name__} does not take vision-language models yet; "
                              "DPOTrainer does.")
        if text_tokenizer(tokenizer).pad_token_id is None:
            text_tokenizer(tokenizer).pad_token = text_tokenizer(tokenizer).eos_token
        train_tok = self.prepare_examples(train_dataset, tokenizer, args, "train")
        eval_tok = self.prepare_examples(eval_dataset, tokenizer, args, "eval") if eval_dataset is not None else None

        # 2. Models.
        init_kwargs = {**(args.model_init_kwargs or {}), **(model_init_kwargs or {})}
        dtype = init_kwargs.pop("dtype", init_kwargs.pop("torch_dtype", args.model_dtype))
        model = load_model(model, dtype=dtype, **init_kwargs)
        if args.disable_dropout:  # before the reference is copied from it: neither drops anything
            disable_dropout(model)
        self.ref_model = None
        if self.vision:
            peft_config = freeze_vision_tower(model, peft_config, freeze=args.freeze_vision_tower,
                                              train_projector=args.train_projector)
        model = prepare_model(model, peft_config)  # a wrapper's PeftModel is used as given
        if is_peft_model(model) and ref_model is None:
            pass  # the reference is the base with the adapters disabled: no second copy
        elif not args.reference_free:
            self.ref_model = load_model(ref_model, dtype=dtype) if ref_model is not None else copy.deepcopy(model)
            self.ref_model.eval().requires_grad_(False)
        # vision rows are padded: a packed row would need each example's image positions (M-RoPE for Qwen2-VL)
        self.padding_free = supports_varlen(unwrap_model(model)) and not self.vision
        for m in (unwrap_model(model), self.ref_model):
            if m is not None and self.padding_free:
                use_varlen_attention(m)
        # chosen and rejected share one prompt copy only where the kernel can express it (attention.packed_layout)
        self.packed_layout = packed_layout(unwrap_model(model), self.ref_model) if self.padding_free else "padded"
        self.setup_sequence_parallel(args, [model, self.ref_model], refuse=(
            "splits packed rows; vision-language pairs are padded." if self.vision else
            "splits packed rows, and this model's attention cannot run them (use attn_implementation='sdpa')."
            if not self.padding_free else None),
            split_seams=(DPOTrainer, ("compute_loss", "compute_sequence_logps")))
        # prompt + completion <= max_length per sequence; a pair holds the prompt once and two completions, so the
        # most tokens a pair can hold is with a short prompt: an eighth of max_length for the estimate's prompt
        longest = args.max_length or 1024
        log_gpu_defaults(args, model, "dpo", batch_size=args.per_device_train_batch_size,
                         prompt_len=max(longest // 8, 1), completion_len=longest - max(longest // 8, 1),
                         reference_model=self.ref_model is not None)
        logger.info("%s reference=%s; max_length=%s.", self.describe_loss(args),
                    "none" if args.reference_free else "precomputed" if args.precompute_ref_log_probs else
                    "PEFT base (adapters off)" if self.ref_model is None else "frozen copy", args.max_length)

        as_dataset = ListDataset if self.vision else Dataset.from_list  # (images stay Python objects)
        super().__init__(model=model, args=args,
                         data_collator=_PreferenceCollator(tokenizer if self.vision else None),
                         train_dataset=as_dataset(train_tok),
                         eval_dataset=as_dataset(eval_tok) if eval_tok is not None else None,
                         processing_class=tokenizer, callbacks=callbacks, optimizers=optimizers)
        if self.ref_model is not None:
            # Trainer places only the policy; the frozen reference was loaded or copied on the CPU
            place_frozen(self.ref_model, self.args.device)
        warn_if_smaller_than_a_batch(self, len(train_tok))
        self.preference_losses = []  # (name, PreferenceLoss, its settings at start-up, weight)
        self._loss_takes_chosen_logps = "chosen_logps" in inspect.signature(self.compute_preference_loss).parameters
        for name, weight in zip(args.loss_types, args.loss_weight_values):
            loss = registry().get("preference_loss", name, field="loss_type")
            self.preference_losses.append((name, loss, resolve_preference_loss_settings(loss, args, name=name), weight))
        self.loss_is_scaled_for_ga = False  # mean over examples per micro-batch; Trainer divides by accumulation
        self._flat: list[tuple[float, float]] = []
        if args.precompute_ref_log_probs:
            self._precompute_reference()

    def describe_loss(self, args: DPOConfig) -> str:
        """The start-up log's account of the loss (a subclass with another loss says what it computes)."""
        return (f"DPO loss settings: loss_type={args.loss_types} weights={args.loss_weight_values} beta={args.beta} "
                f"label_smoothing={args.label_smoothing}")

    # ----------------------------------------------------------------------------------- data

    def prepare_examples(self, data: Any, tokenizer: Any, args: DPOConfig, split: str) -> list[dict[str, Any]]:
        """Rows of `data` ("train" or "eval" `split`) -> tokenized examples, checked before any model loads (the
        seam a trainer with other rows overrides: KTO's unpaired feedback)."""
        rows = normalize_rows(as_rows(data))
        fmt = detect_format(rows)
        vision = is_vision_processor(tokenizer)
        validate(rows, fmt, tokenizer=tokenizer, vision=vision)
        images = validate_vision(rows, fmt, tokenizer, trainer="DPO")  # (refuses image rows for a text model)
        if vision:
            examples, report, identical = tokenize_vision_for_preference(
                rows, images, fmt, tokenizer, max_length=args.max_length, template_kwargs=args.chat_template_kwargs)
        else:
            examples, report, identical = tokenize_for_preference(rows, fmt, tokenizer, max_length=args.max_length,
                                                                  template_kwargs=args.chat_template_kwargs)
        logger.info("DPO %s data: %s: %s", split, fmt.describe(), report.summary(args.max_length))
        if report.truncated_rows:
            logger.warning("DPO: %d of %d %s rows were truncated to max_length=%s (longest %d tokens).",
                           report.truncated_rows, report.rows, split, args.max_length, report.longest)
        if identical and len(identical) == len(rows):
            raise DataError(f"DPO {split} data: in every one of its {len(rows)} rows chosen == rejected, so there is "
                            "no preference to learn (a column mapped twice?). Check the 'chosen' and 'rejected' "
                            "columns.")
        if identical:
            logger.warning("DPO: %d of %d %s rows have chosen == rejected (rows %s%s); they carry no preference and "
                           "only add noise. Drop them.", len(identical), len(rows), split,
                           ", ".join(map(str, identical[:5])), " ..." if len(identical) > 5 else "")
        self.identical_rows = identical
        for e in examples:
            e["ref_chosen_logps"] = e["ref_rejected_logps"] = float("nan")
        return examples

    @torch.no_grad()
    def _precompute_reference(self) -> None:
        """One pass over the datasets storing reference log-probs, then release the reference model."""
        for name in ("train_dataset", "eval_dataset"):
            ds = getattr(self, name)
            if ds is None:
                continue
            chosen, rejected = [], []
            for start in range(0, len(ds), self.args.per_device_train_batch_size):
                batch = self.data_collator([ds[i] for i in range(start, min(start + self.args.per_device_train_batch_size,
                                                                                 len(ds)))])
                c, r = self.compute_reference_logps(batch)
                chosen += c.tolist()
                rejected += r.tolist()
            if isinstance(ds, ListDataset):
                for e, c, r in zip(ds.examples, chosen, rejected):
                    e["ref_chosen_logps"], e["ref_rejected_logps"] = c, r
                continue
            ds = ds.remove_columns(["ref_chosen_logps", "ref_rejected_logps"])
            ds = ds.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)
            setattr(self, name, ds)
        self.ref_model = None  # nothing of the reference stays in memory while training

    # --------------------------------------------------------------------------------- seams

    def _batch(self, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
        prompts = inputs["prompt_ids"] + inputs["prompt_ids"]
        completions = inputs["chosen_ids"] + inputs["rejected_ids"]  # [chosen..., rejected...]
        # with toolkit_varlen, chosen and rejected share one copy of their prompt, and all pairs one copy of the
        # start their prompts share (a chat template's system prompt)
        return pack_for_layout(self.packed_layout, prompts, completions,
                               pad_token_id=text_tokenizer(self.processing_class).pad_token_id)

    def compute_sequence_logps(self, model: torch.nn.Module, inputs: dict[str, Any]
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen [B], rejected [B], completion lengths [2B]): summed log-probs from one packed forward.

        With images, each pair's images go through the vision tower once; chosen and rejected rows reuse the
        features (TRL's DPO encodes them twice)."""
        batch = self._batch(inputs)
        batch = {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        if inputs.get("pixels"):
            pixels = {k: v.to(self.args.device) for k, v in inputs["pixels"].items()}
            n = len(inputs["prompt_ids"])
            counts = inputs["images_per_example"]
            tokens = image_tokens_per_example(model, batch["input_ids"], list(range(n)) * 2, n)
            batch.update(image_inputs_for_rows(encode_images(model, pixels, counts, tokens), pixels, counts,
                                               list(range(n)) * 2, batch["input_ids"], self.processing_class))
        flat = completion_logps(model, batch, chunk_size=self.args.logps_chunk_size, upcast=self.args.fp32_lm_head)
        sums = sequence_sums(flat, batch["completion_lengths"])
        chosen, rejected = sums.chunk(2)
        return chosen, rejected, batch["completion_lengths"]

    @torch.no_grad()
    def compute_reference_logps(self, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.args.reference_free:
            n = len(inputs["prompt_ids"])
            return torch.zeros(n), torch.zeros(n)
        if "ref_chosen_logps" in inputs and not torch.isnan(inputs["ref_chosen_logps"]).any():
            return inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
        if self.ref_model is None:  # PEFT: the base model with adapters disabled
            model = self.accelerator.unwrap_model(self.model)
            ctx = model.disable_adapter()
        else:
            model, ctx = self.ref_model, contextlib.nullcontext()
        was = model.training
        model.eval()
        with ctx:
            chosen, rejected, _ = self.compute_sequence_logps(model, inputs)
        model.train(was)
        return chosen, rejected

    def compute_preference_loss(self, chosen_logratios: torch.Tensor, rejected_logratios: torch.Tensor,
                                lengths: torch.Tensor, chosen_logps: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted sum over `loss_type`s of the mean per-example loss. `chosen_logps`: the policy's summed
        log-probs of the chosen answers (the "sft" term's input)."""
        chosen_len, rejected_len = lengths.chunk(2)
        inputs = PreferenceLossInputs(chosen_logratios, rejected_logratios, chosen_len.float(), rejected_len.float(),
                                      chosen_logps=chosen_logps)
        loss = chosen_logratios.new_zeros(())
        for name, preference_loss, _, weight in self.preference_losses:
            # Settings are read from args at every step, so a callback that schedules beta takes effect.
            settings = resolve_preference_loss_settings(preference_loss, self.args, name=name)
            loss = loss + weight * preference_loss(inputs, settings).mean()
        return loss

    # ----------------------------------------------------------------------------- Trainer hooks

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chosen, rejected, lengths = self.compute_sequence_logps(model, inputs)
        ref_chosen, ref_rejected = self.compute_reference_logps(inputs)
        ref_chosen, ref_rejected = ref_chosen.to(chosen.device), ref_rejected.to(chosen.device)
        chosen_logratios, rejected_logratios = chosen - ref_chosen, rejected - ref_rejected
        # Passed only to a compute_preference_loss that takes it: a wrapper's override written for toolkit 0.1's
        # three arguments keeps working (the "sft" term then says it did not get the log-probs).
        extra = {"chosen_logps": chosen} if self._loss_takes_chosen_logps else {}
        loss = self.compute_preference_loss(chosen_logratios, rejected_logratios, lengths, **extra)
        loss = sequence_parallel_loss(loss, self.sequence_parallel)  # each rank of a group holds a share of the row
        if not torch.isfinite(loss):
            raise TrainingHealthError(f"DPO loss is {loss.item()} at step {self.state.global_step}; check for extreme "
                                      "sequence lengths or lower the learning rate.")
        mode = "train" if model.training else "eval"
        with torch.no_grad():
            chosen_rewards = self.args.beta * chosen_logratios.detach()
            rejected_rewards = self.args.beta * rejected_logratios.detach()
            for name, value in (("rewards/chosen", chosen_rewards.mean()), ("rewards/rejected", rejected_rewards.mean()),
                                ("rewards/accuracies", (chosen_rewards > rejected_rewards).float().mean()),
                                ("rewards/margins", (chosen_rewards - rejected_rewards).mean()),
                                ("logps/chosen", chosen.detach().mean()), ("logps/rejected", rejected.detach().mean())):
                self.record_metric(name, value, mode=mode)
        return (loss, {"chosen": chosen.detach()}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def on_log_metrics(self, logs: dict[str, float], mode: str) -> None:
        if mode == "train" and "rewards/accuracies" in logs:
            self._watch_flat(logs)

    def _watch_flat(self, logs: dict[str, float]) -> None:
        self._flat.append((logs["rewards/accuracies"], logs["rewards/margins"]))
        k = self.args.flat_warn_steps
        if len(self._flat) >= k and len(self._flat) % k == 0:
            window = self._flat[-k:]
            if max(abs(m) for _, m in window) < 1e-3 and max(a for a, _ in window) - min(a for a, _ in window) < 1e-6:
                logger.warning(
                    "DPO step %d: reward margins stayed at ~0 and accuracies flat for %d logged steps: the policy is "
                    "not moving away from the reference. Raise the learning rate or beta, and check that chosen and "
                    "rejected really differ.", self.state.global_step, k)


class _PreferenceCollator:
    """Keeps token-id lists as lists (packing happens in the trainer); reference log-probs as tensors; with a
    vision processor, each pair's images as pixel tensors once (chosen and rejected share them)."""

    def __init__(self, processor: Any = None):
        self.processor = processor

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        vision = {}
        if self.processor is not None:
            images = [list(e["images"]) for e in examples]
            vision = {"pixels": pixel_inputs(self.processor, images), "images_per_example": [len(x) for x in images]}
        return {**vision,
            "prompt_ids": [list(e["prompt_ids"]) for e in examples],
            "chosen_ids": [list(e["chosen_ids"]) for e in examples],
            "rejected_ids": [list(e["rejected_ids"]) for e in examples],
            "ref_chosen_logps": torch.tensor([e["ref_chosen_logps"] for e in examples], dtype=torch.float32),
            "ref_rejected_logps": torch.tensor([e["ref_rejected_logps"] for e in examples], dtype=torch.float32),
        }
