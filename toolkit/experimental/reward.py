"""Reward modelling: a Bradley-Terry reward model from preference pairs (experimental).

`RewardTrainer` is a `transformers.Trainer` that trains a `*ForSequenceClassification` model with one
output so that the chosen answer scores above the rejected one:

    loss = mean(-log sigmoid(r(x, y_chosen) - r(x, y_rejected) - margin))
           + center_rewards_coefficient * mean((r_chosen + r_rejected)^2)

(Bradley-Terry as in Ouyang et al. 2022; the per-pair `margin` column as in Touvron et al. 2023; the
centring term as in Eisenstein et al. 2023; TRL's RewardTrainer options of the same names, and the
same loss and metrics on the same batch: tests/experimental/test_reward_model.py.) One step, top to bottom:

1. Data, before any model loads: preference rows in every format DPO reads (plain or
   conversational, explicit or implicit prompt, TRL's pre-tokenized pairs) are validated and
   tokenized once into prompt + chosen and prompt + rejected ids; an optional numeric `margin`
   column is checked row by row.
2. Model: a name or path loads `AutoModelForSequenceClassification` with one output (a causal LM
   checkpoint such as the embedded default gets a new score head); a given model must already be a
   sequence classifier. PEFT via `peft_config` (use `task_type="SEQ_CLS"` so the head trains).
3. Forward: chosen and rejected sequences of a micro-batch in one right-padded batch; the score is
   read at the **last token of prompt + answer**. That is where PPOTrainer(reward_model=...) and
   `toolkit.core.rewards.RewardModelReward` (GRPO's reward function, spec `reward_model:<path>`)
   read it, so the trained model is consumed unchanged. (transformers' own pooling reads the last
   non-pad token, which agrees except when a sequence ends with the pad token, e.g. pad == eos.)
4. Loss and metrics as above: accuracy (share of pairs ranked right), mean margin, reward mean/min/max.
   `pair_report()` lists which held-out pairs pass and which fail.

Checkpoints are written atomically and `train(resume_from_checkpoint=True)` resumes exactly, as in the core.
"""

from __future__ import annotations

__all__ = ["RewardConfig", "RewardTrainer", "run_reward_command"]

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from datasets import Dataset
from transformers import PreTrainedModel, Trainer, TrainingArguments, set_seed

from toolkit.core.console import show_logs
from toolkit.core.data import as_rows, detect_format, normalize_rows, tokenize_for_preference, validate
from toolkit.core.errors import ConfigError, DataError, TrainingHealthError
from toolkit.core.lifecycle import TrainerLifecycle, warn_if_smaller_than_a_batch
from toolkit.core.models import (
    DEFAULT_MODEL,
    apply_cpu_training_defaults,
    load_classifier,
    load_tokenizer,
    prepare_model,
    sequence_classifier_parts,
)

from ._trl_names import accepting_trl_names

logger = logging.getLogger(__name__)

_CITATION = """@inproceedings{ouyang2022training,
  title     = {{Training language models to follow instructions with human feedback}},
  author    = {Long Ouyang and Jeff Wu and Xu Jiang and Diogo Almeida and Carroll L. Wainwright and Pamela Mishkin and Chong Zhang and Sandhini Agarwal and Katarina Slama and Alex Ray and others},
  booktitle = {Advances in Neural Information Processing Systems 35},
  year      = {2022}
}"""


@accepting_trl_names  # TRL's RewardConfig names: taken or refused (toolkit/experimental/_trl_names.py)
@dataclass
class RewardConfig(TrainingArguments):
    """Settings of `RewardTrainer`: every `transformers.TrainingArguments` field plus the ones below."""

    output_dir: str | None = field(default="outputs/reward", metadata={"help": "Where checkpoints and the model go."})
    learning_rate: float = field(
        default=1e-5, metadata={"help": "Peak AdamW learning rate (full fine-tuning; TRL's 1e-4 suits LoRA)."})
    logging_steps: float = field(default=10, metadata={"help": "Log metrics every this many optimizer steps."})
    report_to: Any = field(default="none", metadata={"help": "Integrations to report to ('none', 'tensorboard', ...)."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Kept False: the collator needs the token-id columns Trainer would drop."})
    max_length: int | None = field(
        default=1024, metadata={"help": "Longest prompt + answer in tokens; answers are cut at the end (reported)."})
    center_rewards_coefficient: float | None = field(
        default=None, metadata={"help": "Weight of mean((r_chosen + r_rejected)^2), which keeps scores centred on 0 "
                                        "(Eisenstein et al. 2023 use 0.01). None: off."})
    disable_dropout: bool = field(default=True, metadata={"help": "Set every dropout probability to 0."})
    chat_template_kwargs: dict | None = field(
        default=None, metadata={"help": "Extra keyword arguments for tokenizer.apply_chat_template."})
    model_dtype: str = field(
        default="float32", metadata={"help": "dtype to load the model in when it is given by name: float32 | bfloat16."})

    def __post_init__(self):
        apply_cpu_training_defaults(self)
        super().__post_init__()
        if self.max_length is not None and self.max_length < 2:
            raise ConfigError(f"max_length: must be at least 2 (or None), got {self.max_length}.")
        if self.center_rewards_coefficient is not None and not self.center_rewards_coefficient >= 0:
            raise ConfigError(f"center_rewards_coefficient: must be >= 0 (or None), got "
                              f"{self.center_rewards_coefficient}.")
        if self.model_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"model_dtype: '{self.model_dtype}' is not one of float32, bfloat16, float16.")


def _margins(rows: list[dict[str, Any]], split: str) -> list[float] | None:
    """The optional `margin` column as floats, every row checked (a missing or non-numeric one is named)."""
    if not any("margin" in r for r in rows):
        return None
    bad = [i for i, r in enumerate(rows) if not isinstance(r.get("margin"), (int, float))
           or isinstance(r.get("margin"), bool) or not math.isfinite(r["margin"])]
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise DataError(f"{split} dataset: column 'margin' must hold a finite number in every row (rows {shown}, e.g. "
                        f"{rows[bad[0]].get('margin')!r}); drop the column or fill those rows.")
    return [float(r["margin"]) for r in rows]


def _template_suffix(tokenizer: Any, template_kwargs: dict | None) -> list[int]:
    """The ids a chat template writes after an assistant turn's EOS (ChatML: the newline), [] when none."""
    eos = tokenizer.eos_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                         tokenize=False, **(template_kwargs or {}))
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if eos is None or eos not in ids:
        return []
    return ids[len(ids) - ids[::-1].index(eos):]


class RewardTrainer(TrainerLifecycle, Trainer):
    """Bradley-Terry reward modelling on preference pairs; see the module docstring and docs/reward.md."""

    _tag_names = ["toolkit", "reward-modeling"]  # noqa: RUF012 (transformers reads a list)
    method_card = ("Reward modelling (Bradley-Terry)", _CITATION)
    trainer_kind = "reward"

    def __init__(
        self,
        model: str | PreTrainedModel = DEFAULT_MODEL,
        args: RewardConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        peft_config: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        model_init_kwargs: dict | None = None,
    ):
        show_logs()  # the start-up summary below is seen in a notebook too (console.show_logs)
        args = args if args is not None else RewardConfig()
        if not isinstance(args, RewardConfig):
            raise ConfigError(f"args: RewardTrainer needs a RewardConfig, got {type(args).__name__}.")
        if train_dataset is None:
            raise ConfigError("train_dataset: RewardTrainer needs preference data (chosen/rejected).")

        # 1. Data before any model.
        tokenizer = processing_class if processing_class is not None else load_tokenizer(model)
        if getattr(tokenizer, "image_processor", None) is not None:  # (vision.is_vision_processor)
            raise ConfigError("processing_class: RewardTrainer does not take vision-language models yet; SFT, DPO and "
                              "GRPO do (docs/vision.md).")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        train_tok = self.prepare_examples(train_dataset, tokenizer, args, "train")
        eval_tok = self.prepare_examples(eval_dataset, tokenizer, args, "eval") if eval_dataset is not None else None

        # 2. Model: a sequence classifier with one output.
        init_kwargs = dict(model_init_kwargs or {})
        dtype = init_kwargs.pop("dtype", args.model_dtype)
        if isinstance(model, str):
            set_seed(args.seed)  # the new score head is drawn at random: the run's seed makes it reproducible
            model = load_classifier(model, dtype)
        else:
            try:
                sequence_classifier_parts(model)
            except ConfigError:
                raise ConfigError(
                    f"model: RewardTrainer trains a sequence classifier; got {type(model).__name__}. Pass the model's "
                    "name or path (a score head is added), or load it with AutoModelForSequenceClassification."
                    "from_pretrained(..., num_labels=1).") from None
        model.config.pad_token_id = tokenizer.pad_token_id  # what transformers' own pooling and pipelines read
        if args.disable_dropout:
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        task = getattr(peft_config, "task_type", None)
        if str(getattr(task, "value", task)) == "CAUSAL_LM":
            # PEFT would fail inside (a causal-LM wrapper around a classifier); and the head would stay frozen
            raise ConfigError("peft_config: task_type='CAUSAL_LM' would leave the score head frozen at its random "
                              "start while only the adapters train; use task_type='SEQ_CLS' (PEFT then trains the "
                              "head, modules_to_save).")
        model = prepare_model(model, peft_config)
        _, head = sequence_classifier_parts(model)
        if not any(p.requires_grad for p in head.parameters()):
            raise ConfigError("peft_config: the score head is frozen, so it would stay at its random start while only "
                              "the adapters train; use task_type='SEQ_CLS' (PEFT then trains the head, "
                              "modules_to_save) or add 'score' to modules_to_save.")
        logger.info("Reward modelling: Bradley-Terry loss%s%s; score at the last token of prompt + answer; "
                    "max_length=%s.", " with per-pair margins" if "margin" in train_tok[0] else "",
                    f", centring {args.center_rewards_coefficient}" if args.center_rewards_coefficient else "",
                    args.max_length)

        super().__init__(model=model, args=args, data_collator=_PairCollator(tokenizer.pad_token_id),
                         train_dataset=Dataset.from_list(train_tok),
                         eval_dataset=Dataset.from_list(eval_tok) if eval_tok is not None else None,
                         processing_class=tokenizer, callbacks=callbacks, optimizers=optimizers)
        self.loss_is_scaled_for_ga = False  # a mean over the micro-batch's pairs; Trainer divides by accumulation
        warn_if_smaller_than_a_batch(self, len(train_tok))

    # ----------------------------------------------------------------------------------- data

    def prepare_examples(self, data: Any, tokenizer: Any, args: RewardConfig, split: str) -> list[dict[str, Any]]:
        rows = normalize_rows(as_rows(data))
        fmt = detect_format(rows)
        if fmt.kind not in ("preference", "tokenized_preference"):
            raise DataError(f"RewardTrainer {split} data: needs preference pairs ('chosen' and 'rejected', optional "
                            f"'prompt'; or TRL's pre-tokenized pairs); this dataset is {fmt.describe()}.")
        validate(rows, fmt, tokenizer=tokenizer)
        margins = _margins(rows, split)
        # pre-tokenized pairs may come without a prompt (each answer a whole sequence, TRL's reward layout)
        examples, report, identical = tokenize_for_preference(rows, fmt, tokenizer, max_length=args.max_length,
                                                              template_kwargs=args.chat_template_kwargs,
                                                              allow_empty_prompt=True)
        logger.info("Reward %s data: %s: %s", split, fmt.describe(), report.summary(args.max_length))
        if report.truncated_rows:
            logger.warning("Reward: %d of %d %s rows were truncated to max_length=%s (longest %d tokens); a cut answer "
                           "is scored on its beginning only.", report.truncated_rows, report.rows, split,
                           args.max_length, report.longest)
        if identical and len(identical) == len(rows):
            raise DataError(f"Reward {split} data: in every one of its {len(rows)} rows chosen == rejected, so there is "
                            "nothing to rank (a column mapped twice?). Check the 'chosen' and 'rejected' columns.")
        if identical:
            logger.warning("Reward: %d of %d %s rows have chosen == rejected (rows %s%s); their loss is log 2 whatever "
                           "the model does. Drop them.", len(identical), len(rows), split,
                           ", ".join(map(str, identical[:5])), " ..." if len(identical) > 5 else "")
        # A chat template writes tokens after the end-of-turn token (ChatML: "<|im_end|>" then "\n"). A sampled
        # completion stops at that token (EOS, the RL trainers' default stop), and PPO and RewardModelReward read
        # the score at a completion's last token; so an answer that ends with EOS + the template's own suffix loses
        # the suffix, and the score is trained at the token where it will be read. Only that exact suffix is cut:
        # an answer truncated by max_length, or given pre-tokenized, is left as it is.
        suffix = _template_suffix(tokenizer, args.chat_template_kwargs) if fmt.conversational else []
        eos = tokenizer.eos_token_id
        for i, e in enumerate(examples):
            for side in ("chosen_ids", "rejected_ids"):
                ids = list(e[side])
                n = len(suffix)
                if n and len(ids) > n and ids[-n:] == suffix and ids[-n - 1] == eos:
                    e[side] = ids[:-n]
            if margins is not None:
                e["margin"] = margins[i]
        return examples

    # --------------------------------------------------------------------------------- seams

    def compute_rewards(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen [B], rejected [B]) scores at the last token of each prompt + answer, from one forward.

        Override to score differently (another pooling, an ensemble); the loss reads only these two."""
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False,
                    output_hidden_states=True)
        hidden = out.hidden_states[-1]  # [2B, T, H], after the final norm
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), inputs["last_index"]]
        _, head = sequence_classifier_parts(model)
        scores = head(last.to(head.weight.dtype)).squeeze(-1).float()
        return scores.chunk(2)

    def compute_reward_loss(self, chosen: torch.Tensor, rejected: torch.Tensor,
                            margin: torch.Tensor | None) -> torch.Tensor:
        """Bradley-Terry: mean -log sigmoid(r_c - r_r - margin), plus the optional centring term."""
        diff = chosen - rejected - (margin if margin is not None else 0.0)
        loss = -F.logsigmoid(diff).mean()
        if self.args.center_rewards_coefficient is not None:
            loss = loss + self.args.center_rewards_coefficient * ((chosen + rejected) ** 2).mean()
        return loss

    # ----------------------------------------------------------------------------- Trainer hooks

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chosen, rejected = self.compute_rewards(model, inputs)
        loss = self.compute_reward_loss(chosen, rejected, inputs.get("margin"))
        if not torch.isfinite(loss):
            raise TrainingHealthError(f"reward loss is {loss.item()} at step {self.state.global_step}; lower the "
                                      "learning rate or check the data for extreme lengths.")
        mode = "train" if model.training else "eval"
        with torch.no_grad():
            # per pair, from every rank: the logged accuracy and margin are means over all pairs seen, whatever the
            # batch sizes (min/max: the mean over batches of each batch's extreme, as TRL logs them)
            # (one process: nothing to gather, and gather_for_metrics would trim by the dataloader's remainder state)
            gather = self.accelerator.gather_for_metrics if self.accelerator.num_processes > 1 else (lambda t: t)
            diff = gather((chosen - rejected).detach())
            both = gather(torch.cat([chosen, rejected]).detach())
            self.record_metric("accuracy", (diff > 0).float(), mode=mode)
            self.record_metric("margin", diff, mode=mode)
            self.record_metric("mean_reward", both, mode=mode)
            self.record_metric("min_reward", both.min(), mode=mode)
            self.record_metric("max_reward", both.max(), mode=mode)
        return (loss, {"chosen": chosen.detach(), "rejected": rejected.detach()}) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    @torch.no_grad()
    def pair_report(self, dataset: Any = None) -> dict[str, Any]:
        """Pass/fail on held-out pairs (default: eval_dataset): a pair passes when chosen scores above rejected.

        Returns {"pairs", "accuracy", "mean_margin", "failed_rows"} (row indices of the dataset given)."""
        examples = (self.prepare_examples(dataset, self.processing_class, self.args, "report") if dataset is not None
                    else [self.eval_dataset[i] for i in range(len(self.eval_dataset))] if self.eval_dataset is not None
                    else None)
        if examples is None:
            raise ConfigError("pair_report: no dataset given and the trainer has no eval_dataset.")
        model, was = self.model, self.model.training
        model.eval()
        margins: list[float] = []
        size = self.args.per_device_eval_batch_size
        for start in range(0, len(examples), size):
            batch = self._prepare_inputs(self.data_collator(examples[start:start + size]))
            chosen, rejected = self.compute_rewards(model, batch)
            margins += (chosen - rejected).tolist()
        model.train(was)
        failed = [i for i, m in enumerate(margins) if not m > 0]
        return {"pairs": len(margins), "accuracy": 1 - len(failed) / max(len(margins), 1),
                "mean_margin": sum(margins) / max(len(margins), 1), "failed_rows": failed}


class _PairCollator:
    """Chosen sequences then rejected ones, right-padded, with the index of each sequence's last token."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        seqs = ([list(e["prompt_ids"]) + list(e["chosen_ids"]) for e in examples]
                + [list(e["prompt_ids"]) + list(e["rejected_ids"]) for e in examples])
        longest = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), longest), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
            mask[i, :len(s)] = 1
        batch = {"input_ids": ids, "attention_mask": mask, "last_index": mask.sum(1) - 1}
        if "margin" in examples[0]:
            batch["margin"] = torch.tensor([e["margin"] for e in examples], dtype=torch.float32)
        return batch


def run_reward_command(argv: list[str]) -> int:
    """`toolkit reward --config <file> [--field value ...]`: train, report held-out pair accuracy before/after,
    save to output_dir/final with its card, print a summary (the CLI path SFT and DPO take)."""
    from toolkit.core.cli import run_offline

    def make(run, cfg, train, held_out):
        peft = run.peft_config()
        if peft is not None:
            peft.task_type = "SEQ_CLS"  # PEFT then trains the score head too (modules_to_save)
        return RewardTrainer(run.model, cfg, train_dataset=train, eval_dataset=held_out,
                             peft_config=peft, model_init_kwargs=run.model_init_kwargs(cfg))

    return run_offline(argv, RewardConfig, make, kind="preference", title="Reward model",
                       eval_keys=("eval_accuracy", "eval_margin"), generates=False)
