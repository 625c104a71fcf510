"""KTO: Kahneman-Tversky Optimisation from unpaired feedback (experimental).

Each example is a prompt, one completion and a label: desirable (True) or undesirable (False); there is
no second answer to compare with. KTO (Ethayarajh et al. 2024, eq. 7) scores a completion by its implied
reward r = log pi(y|x) - log pi_ref(y|x) against a reference point z, an estimate of KL(pi || pi_ref):

    desirable:    1 - sigmoid(beta * (r - z))      x desirable_weight
    undesirable:  1 - sigmoid(beta * (z - r))      x undesirable_weight

and the loss is the mean over the micro-batch. z is estimated as TRL does: every prompt of the micro-batch
is paired with the completion of the example before it (rotation by one), z = mean(log pi - log pi_ref) of
those mismatched pairs, detached, averaged over ranks and clamped at 0. ``loss_type="apo_zero_unpaired"``
(APO-zero, D'Oosterlinck et al. 2024) drops z: 1 - sigmoid(beta r) for desirable, sigmoid(beta r) for
undesirable completions.

`KTOTrainer` is `DPOTrainer` with another loss: each example travels as a (completion, mismatched
completion) pair around one prompt copy, so the matched and the KL sequences share DPO's packing, chunked
log-probs, reference handling (a frozen copy, or the PEFT base with adapters off), checkpoints and exact
resume. Paired preference data (chosen/rejected) is unpaired first (chosen -> desirable, rejected ->
undesirable), as TRL does. Loss, gradients and metrics equal TRL's KTOTrainer on the same batch
(tests/experimental/test_kto.py).
"""

from __future__ import annotations

__all__ = ["KTOConfig", "KTOTrainer", "kto_losses", "run_kto_command"]

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from toolkit.core.data import as_rows, detect_format, normalize_rows, tokenize_for_preference, validate
from toolkit.core.dpo import DPOConfig, DPOTrainer
from toolkit.core.errors import ConfigError, DataError, TrainingHealthError
from ._trl_names import accepting_trl_names

logger = logging.getLogger(__name__)

_CITATION = """@article{ethayarajh2024kto,
  title   = {{KTO: Model Alignment as Prospect Theoretic Optimization}},
  author  = {Kawin Ethayarajh and Winnie Xu and Niklas Muennighoff and Dan Jurafsky and Douwe Kiela},
  journal = {arXiv preprint arXiv:2402.01306},
  year    = {2024}
}"""

_LOSS_TYPES = ("kto", "apo_zero_unpaired")


def kto_losses(logratios: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor, *, beta: float,
               desirable_weight: float = 1.0, undesirable_weight: float = 1.0, loss_type: str = "kto"
               ) -> torch.Tensor:
    """Per-example KTO losses, desirable examples first, then undesirable (TRL's order; the mean is the loss).

    logratios: [B] log pi(y|x) - log pi_ref(y|x); labels: [B] bool (True = desirable); kl: the reference
    point z (a scalar, no gradient; unused by apo_zero_unpaired).
    """
    chosen, rejected = logratios[labels], logratios[~labels]
    if loss_type == "kto":
        chosen_losses = 1 - torch.sigmoid(beta * (chosen - kl))
        rejected_losses = 1 - torch.sigmoid(beta * (kl - rejected))
    elif loss_type == "apo_zero_unpaired":
        chosen_losses = 1 - torch.sigmoid(beta * chosen)
        rejected_losses = torch.sigmoid(beta * rejected)
    else:
        raise ValueError(f"loss_type must be one of {_LOSS_TYPES}, got {loss_type!r}")
    return torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses))


@accepting_trl_names  # TRL's KTOConfig names: taken or refused (toolkit/experimental/_trl_names.py)
@dataclass
class KTOConfig(DPOConfig):
    """Settings of `KTOTrainer`: DPOConfig's fields plus KTO's (TRL's names and defaults: beta 0.1, weights 1).

    The batch size must be at least 2 with loss_type='kto': the KL reference point pairs each prompt with
    another example's completion of the same micro-batch.
    """

    output_dir: str | None = field(default="outputs/kto", metadata={"help": "Where checkpoints and the model go."})
    loss_type: Any = field(default="kto", metadata={"help": "kto | apo_zero_unpaired."})
    desirable_weight: float = field(default=1.0, metadata={"help": "Weight of the desirable examples' losses."})
    undesirable_weight: float = field(default=1.0, metadata={"help": "Weight of the undesirable examples' losses."})

    def __post_init__(self):
        if not isinstance(self.loss_type, str) or self.loss_type not in _LOSS_TYPES:
            raise ConfigError(f"loss_type: KTO takes one of {list(_LOSS_TYPES)}, got {self.loss_type!r}.")
        for name in ("desirable_weight", "undesirable_weight"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}.")
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
            if self.loss_type == "kto" and getattr(self, name) < 2:
                raise ConfigError(f"{name}: KTO's KL reference point pairs each prompt with another example's "
                                  "completion in the micro-batch, so it needs at least 2 (with 1 the 'KL' would be "
                                  "the example's own reward); use 2 or more.")
        _refuse_dpo_only_fields(self, "KTO")
        if self.reference_free:
            raise ConfigError("reference_free: KTO's rewards and KL reference point are log-ratios to a reference "
                              "model; with none they are the policy's own log-probs and the loss is not KTO. Leave "
                              "it False (with PEFT the reference is the base model with adapters off, no copy).")
        if self.precompute_ref_log_probs:
            raise ConfigError("precompute_ref_log_probs: KTO's KL pairs are formed per micro-batch, after shuffling, "
                              "so their reference log-probs cannot be computed ahead; leave it False (or use PEFT, "
                              "whose reference is the base model with adapters off, no second copy).")
        if self.beta <= 0:
            raise ConfigError(f"beta: must be > 0, got {self.beta}.")
        self.kto_loss_type = self.loss_type
        self.loss_type = "sigmoid"  # DPOConfig validates a registered preference loss; KTO's own loss is below
        super().__post_init__()
        self.loss_type = self.kto_loss_type  # what the model card and saved arguments show


class KTOTrainer(DPOTrainer):
    """KTO on unpaired (prompt, completion, label) data; see the module docstring."""
    supports_vision = False  # (vision-language models: not yet; docs/vision.md)

    _tag_names = ["toolkit", "kto"]  # noqa: RUF012 (transformers reads a list)
    trainer_kind = "kto"
    method_card = ("Kahneman-Tversky Optimization (KTO)", _CITATION)

    def __init__(self, model: Any = None, ref_model: Any = None, args: KTOConfig | None = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None,
                 peft_config: Any = None, callbacks: list | None = None, optimizers: tuple = (None, None),
                 model_init_kwargs: dict | None = None):
        args = args if args is not None else KTOConfig()
        if not isinstance(args, KTOConfig):
            raise ConfigError(f"args: KTOTrainer needs a KTOConfig, got {type(args).__name__}.")
        kwargs = {} if model is None else {"model": model}
        super().__init__(**kwargs, ref_model=ref_model, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                         callbacks=callbacks, optimizers=optimizers, model_init_kwargs=model_init_kwargs)
        self.data_collator = _KTOCollator(max_length=args.max_length)

    def describe_loss(self, args: Any) -> str:
        a = args
        return (f"KTO loss settings: loss_type={a.kto_loss_type} beta={a.beta} desirable_weight={a.desirable_weight} "
                f"undesirable_weight={a.undesirable_weight}")

    # ------------------------------------------------------------------------------------ data

    def prepare_examples(self, data: Any, tokenizer: Any, args: Any, split: str) -> list[dict[str, Any]]:
        rows = normalize_rows(as_rows(data))
        fmt = detect_format(rows)
        if fmt.kind == "preference":
            if "prompt" not in fmt.columns:
                raise DataError(f"KTO {split} data: preference pairs without a 'prompt' column; KTO pairs prompts "
                                "with other examples' completions, so it needs the prompt apart. Add a 'prompt' "
                                "column.")
            validate(rows, fmt, tokenizer=tokenizer)
            # unpaired as TRL does: every chosen answer (desirable), then every rejected one (undesirable). Kept
            # in blocks, so that rows next to each other (the KL pairs of an in-order eval batch) have different
            # prompts, not a prompt's own other answer
            rows = [{"prompt": r["prompt"], "completion": r[side], "label": side == "chosen"}
                    for side in ("chosen", "rejected") for r in rows]
            fmt = detect_format(rows)
        if fmt.kind != "unpaired_preference":
            raise DataError(f"KTO {split} data: KTO needs unpaired feedback ('prompt', 'completion', 'label' with "
                            f"label True = desirable) or preference pairs ('prompt', 'chosen', 'rejected'); this "
                            f"dataset is {fmt.describe()}.")
        validate(rows, fmt, tokenizer=tokenizer)
        # Tokenized as DPO tokenizes a pair (template, EOS, truncation keeping the prompt); both sides are the row's
        # completion, the second one is replaced per micro-batch by another example's completion (the KL pair).
        as_pairs = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": r["completion"]} for r in rows]
        examples, report, _ = tokenize_for_preference(as_pairs, detect_format(as_pairs), tokenizer,
                                                      max_length=args.max_length,
                                                      template_kwargs=args.chat_template_kwargs)
        desirable = sum(r["label"] for r in rows)
        logger.info("KTO %s data: %s, %d desirable and %d undesirable: %s", split, fmt.describe(), desirable,
                    len(rows) - desirable, report.summary(args.max_length))
        if report.truncated_rows:
            logger.warning("KTO: %d of %d %s rows were truncated to max_length=%s (longest %d tokens).",
                           report.truncated_rows, report.rows, split, args.max_length, report.longest)
        if split == "train" and desirable in (0, len(rows)):
            # KTO's loss weighs each example against a reference point learnt from the mismatched pairs; with one
            # label only, it never sees the other side of the value function: it trains, but not as KTO means
            logger.warning("KTO train data: every one of its %d rows has label=%s (%s); KTO learns from desirable "
                           "and undesirable examples together. Add rows with label=%s, or train with SFT (all "
                           "desirable) instead.", len(rows), bool(desirable), "desirable" if desirable else
                           "undesirable", not desirable)
        if split == "train" and 0 < desirable < len(rows):
            # the KTO paper's advice: weight so that desirable_weight x n_D / (undesirable_weight x n_U) is in [1, 4/3]
            ratio = args.desirable_weight * desirable / (args.undesirable_weight * (len(rows) - desirable))
            if not 1.0 <= ratio <= 4 / 3:
                logger.warning("KTO: desirable_weight x desirable / (undesirable_weight x undesirable) = %.2f, outside "
                               "the [1, 4/3] the KTO paper recommends; e.g. undesirable_weight=%.3g puts it at 1.",
                               ratio, args.desirable_weight * desirable / (len(rows) - desirable))
        self.identical_rows = []
        out = []
        for e, r in zip(examples, rows):
            out.append({"prompt_ids": e["prompt_ids"], "completion_ids": e["chosen_ids"], "label": bool(r["label"]),
                        "ref_chosen_logps": float("nan"), "ref_rejected_logps": float("nan")})
        return out

    # ------------------------------------------------------------------------------------ loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """KTO's loss from one packed forward of the matched and the mismatched (KL) completions."""
        target, mismatched, lengths = self.compute_sequence_logps(model, inputs)
        ref_target, ref_mismatched = (x.to(target.device) for x in self.compute_reference_logps(inputs))
        labels = inputs["label"].to(target.device)
        logratios = target - ref_target
        if self.args.kto_loss_type == "kto":
            kl = (mismatched.detach() - ref_mismatched).mean()
            if self.accelerator.num_processes > 1:  # the reference point of the whole step, as TRL gathers it
                kl = self.accelerator.gather(kl.reshape(1)).mean()
            kl = kl.clamp(min=0)
        else:
            kl = torch.zeros((), device=target.device)
        losses = kto_losses(logratios, labels, kl, beta=self.args.beta, desirable_weight=self.args.desirable_weight,
                            undesirable_weight=self.args.undesirable_weight, loss_type=self.args.kto_loss_type)
        loss = losses.mean()
        if not torch.isfinite(loss):
            raise TrainingHealthError(f"KTO loss is {loss.item()} at step {self.state.global_step}; lower the learning "
                                      "rate or check the data for extreme lengths.")
        mode = "train" if model.training else "eval"
        with torch.no_grad():
            self.record_metric("kl", kl, mode=mode)
            rewards = self.args.beta * logratios.detach()
            if labels.any():
                self.record_metric("rewards/chosen", rewards[labels].mean(), mode=mode)
                self.record_metric("logps/chosen", target.detach()[labels].mean(), mode=mode)
            if (~labels).any():
                self.record_metric("rewards/rejected", rewards[~labels].mean(), mode=mode)
                self.record_metric("logps/rejected", target.detach()[~labels].mean(), mode=mode)
            if labels.any() and (~labels).any():
                self.record_metric("rewards/margins", rewards[labels].mean() - rewards[~labels].mean(), mode=mode)
        return (loss, {"logps": target.detach()}) if return_outputs else loss


class _KTOCollator:
    """Token-id lists per example, and each prompt's mismatched completion for the KL reference point: the
    completion of the example before it in the micro-batch (rotation by one, TRL's pairing), cut so that prompt
    and mismatched completion fit in max_length (at least one completion token is kept)."""

    def __init__(self, max_length: int | None = None):
        self.max_length = max_length

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        prompts = [list(e["prompt_ids"]) for e in examples]
        completions = [list(e["completion_ids"]) for e in examples]
        mismatched = completions[-1:] + completions[:-1]
        if self.max_length is not None:
            mismatched = [c[:max(self.max_length - len(p), 1)] for p, c in zip(prompts, mismatched)]
        return {
            "prompt_ids": prompts,
            "chosen_ids": completions,   # the matched completions (DPO's "chosen" slot)
            "rejected_ids": mismatched,  # the mismatched ones (DPO's "rejected" slot)
            "label": torch.tensor([bool(e["label"]) for e in examples], dtype=torch.bool),
            "ref_chosen_logps": torch.full((len(examples),), float("nan")),
            "ref_rejected_logps": torch.full((len(examples),), float("nan")),
        }


def _refuse_dpo_only_fields(config: Any, method: str) -> None:
    """DPOConfig fields a trainer with its own loss does not read: refused by name rather than ignored."""
    for name, default in (("label_smoothing", 0.0), ("loss_kwargs", None), ("loss_weights", None)):
        if getattr(config, name) not in (default, {}, []):
            raise ConfigError(f"{name}: {method} has its own loss and does not read DPO's {name} (got "
                              f"{getattr(config, name)!r}); leave it unset.")


def run_kto_command(argv: list[str]) -> int:
    """`toolkit kto --config <file>`: the DPO command's path; builtin preference pairs are unpaired."""
    from toolkit.core.cli import run_offline

    def make(run, cfg, train, held_out):
        return KTOTrainer(run.model, args=cfg, train_dataset=train, eval_dataset=held_out,
                          peft_config=run.peft_config(), model_init_kwargs=run.model_init_kwargs(cfg))

    return run_offline(argv, KTOConfig, make, kind="preference", title="KTO",
                       eval_keys=("eval_rewards/margins", "eval_kl"))
