"""ORPO: odds-ratio preference optimisation, supervised fine-tuning and preference in one loss (experimental).

ORPO (Hong et al. 2024) needs no reference model and no SFT stage before it:

    loss = NLL(prompt + chosen answer) - beta * mean(log sigmoid(log_odds))
    log_odds = log(p_c / (1 - p_c)) - log(p_r / (1 - p_r))

where p_c, p_r are the per-token average probabilities of the chosen and rejected answers (exp of the mean
log-prob over the answer's tokens), and the NLL is the token mean of -log p over the **whole** chosen
sequence, prompt tokens included, over the micro-batch (as the paper and TRL compute it: ORPO is also the
SFT stage). log(1 - p) is computed as log1mexp(log p), stable for p near 0 and near 1.

`ORPOTrainer` is `DPOTrainer` (data formats, validation, chunked log-probs, atomic checkpoints, exact
resume) with no reference model and one change to the packed forward: the prompt's first token is the
shared prefix and everything after it is scored, so the prompt tokens' log-probs exist for the NLL while the
odds use the answer's tokens only. Loss, gradients and metrics equal TRL's ORPOTrainer on the same batch
(tests/experimental/test_orpo.py).
"""

from __future__ import annotations

__all__ = ["ORPOConfig", "ORPOTrainer", "log1mexp", "odds_ratio_terms", "run_orpo_command"]

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from toolkit.core.dpo import DPOConfig, DPOTrainer
from toolkit.core.errors import ConfigError, TrainingHealthError
from toolkit.core.packing import completion_logps, pack_completions
from ._trl_names import accepting_trl_names

_CITATION = """@inproceedings{hong2024orpo,
  title     = {{ORPO: Monolithic Preference Optimization without Reference Model}},
  author    = {Jiwoo Hong and Noah Lee and James Thorne},
  booktitle = {Proceedings of the 2024 Conference on Empirical Methods in Natural Language Processing},
  year      = {2024}
}"""


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation: log(-expm1(x)) near 0, log1p(-exp(x)) below -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def odds_ratio_terms(chosen_avg_logps: torch.Tensor, rejected_avg_logps: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log sigmoid(log_odds) [B], log_odds [B]) from the answers' per-token average log-probs."""
    c, r = chosen_avg_logps.float(), rejected_avg_logps.float()
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r))
    return F.logsigmoid(log_odds), log_odds


@accepting_trl_names  # TRL's ORPOConfig names: taken or refused (toolkit/experimental/_trl_names.py)
@dataclass
class ORPOConfig(DPOConfig):
    """Settings of `ORPOTrainer`: DPOConfig's fields (no reference model); `beta` weighs the odds-ratio term
    (TRL's default 0.1)."""

    output_dir: str | None = field(default="outputs/orpo", metadata={"help": "Where checkpoints and the model go."})
    beta: float = field(default=0.1, metadata={"help": "Weight of the odds-ratio term (lambda in the paper)."})
    loss_type: Any = field(default="orpo", metadata={"help": "orpo (the one loss: NLL + odds ratio)."})

    def __post_init__(self):
        from toolkit.experimental.kto import _refuse_dpo_only_fields

        if self.beta <= 0:
            raise ConfigError(f"beta: must be > 0, got {self.beta}.")
        if self.loss_type != "orpo":
            raise ConfigError(f"loss_type: ORPO has one loss (NLL + odds ratio); leave loss_type unset, got "
                              f"{self.loss_type!r}.")
        if self.precompute_ref_log_probs:
            raise ConfigError("precompute_ref_log_probs: ORPO has no reference model; leave it False.")
        _refuse_dpo_only_fields(self, "ORPO")
        self.loss_type = "sigmoid"  # DPOConfig checks a registered preference loss; ORPO's own loss is below
        self.reference_free = True
        super().__post_init__()
        self.loss_type = "orpo"  # what the model card and saved arguments show


class ORPOTrainer(DPOTrainer):
    """ORPO: NLL of the chosen sequence plus the odds-ratio preference term, no reference; see the module docstring."""
    supports_vision = False  # (vision-language models: not yet; docs/vision.md)

    _tag_names = ["toolkit", "orpo"]  # noqa: RUF012 (transformers reads a list)
    method_card = ("Odds Ratio Preference Optimization (ORPO)", _CITATION)
    trainer_kind = "orpo"

    def __init__(self, model: Any = None, args: ORPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None),
                 model_init_kwargs: dict | None = None):
        args = args if args is not None else ORPOConfig()
        if not isinstance(args, ORPOConfig):
            raise ConfigError(f"args: ORPOTrainer needs an ORPOConfig, got {type(args).__name__}.")
        kwargs = {} if model is None else {"model": model}
        super().__init__(**kwargs, ref_model=None, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, peft_config=peft_config, callbacks=callbacks,
                         optimizers=optimizers, model_init_kwargs=model_init_kwargs)
        self.ref_model = None  # no reference: a PEFT model's adapter-free base is not consulted either

    def describe_loss(self, args: Any) -> str:
        return f"ORPO loss settings: NLL(prompt + chosen) - beta x log sigmoid(log odds ratio), beta={args.beta}"

    def compute_sequence_logps(self, model: torch.nn.Module, inputs: dict[str, Any]
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen, rejected [B]: per-token average log-probs of the answers; nll: the chosen sequences' token-mean
        NLL over prompt and answer) from one packed forward in which everything after the prompt's first token
        is scored."""
        prompts, chosen, rejected = inputs["prompt_ids"], inputs["chosen_ids"], inputs["rejected_ids"]
        heads = [p[:1] for p in prompts] * 2
        tails = [p[1:] + c for p, c in zip(prompts, chosen)] + [p[1:] + r for p, r in zip(prompts, rejected)]
        batch = pack_completions(heads, tails, pad_token_id=self.processing_class.pad_token_id,
                                 padding_free=self.packed_layout != "padded")
        batch = {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
        flat = completion_logps(model, batch, chunk_size=self.args.logps_chunk_size, upcast=self.args.fp32_lm_head)
        per_seq = flat.split(batch["completion_lengths"].tolist())
        answer_lengths = [len(c) for c in chosen] + [len(r) for r in rejected]
        averages = torch.stack([s[len(s) - n:].sum() / max(n, 1) for s, n in zip(per_seq, answer_lengths)])
        B = len(prompts)
        chosen_tokens = sum(len(s) for s in per_seq[:B])
        nll = -torch.cat(per_seq[:B]).sum() / max(chosen_tokens, 1)
        return averages[:B], averages[B:], nll

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        chosen, rejected, nll = self.compute_sequence_logps(model, inputs)
        ratio, log_odds = odds_ratio_terms(chosen, rejected)
        loss = nll - self.args.beta * ratio.mean()
        if not torch.isfinite(loss):
            raise TrainingHealthError(f"ORPO loss is {loss.item()} at step {self.state.global_step}; lower the "
                                      "learning rate or check the data for extreme lengths.")
        mode = "train" if model.training else "eval"
        with torch.no_grad():
            c, r = self.args.beta * chosen.detach(), self.args.beta * rejected.detach()
            self.record_metric("rewards/chosen", c.mean(), mode=mode)
            self.record_metric("rewards/rejected", r.mean(), mode=mode)
            self.record_metric("rewards/accuracies", (c > r).float().mean(), mode=mode)
            self.record_metric("rewards/margins", (c - r).mean(), mode=mode)
            self.record_metric("logps/chosen", chosen.detach().mean(), mode=mode)
            self.record_metric("logps/rejected", rejected.detach().mean(), mode=mode)
            self.record_metric("nll_loss", nll.detach(), mode=mode)
            self.record_metric("log_odds_ratio", ratio.detach().mean(), mode=mode)
            self.record_metric("log_odds_chosen", log_odds.detach().mean(), mode=mode)
        return (loss, {"chosen": chosen.detach()}) if return_outputs else loss


def run_orpo_command(argv: list[str]) -> int:
    """`toolkit orpo --config <file>`: the DPO command's path (held-out accuracy and eval loss before/after)."""
    from toolkit.core.cli import run_offline

    def make(run, cfg, train, held_out):
        return ORPOTrainer(run.model, args=cfg, train_dataset=train, eval_dataset=held_out,
                           peft_config=run.peft_config(), model_init_kwargs=run.model_init_kwargs(cfg))

    return run_offline(argv, ORPOConfig, make, kind="preference", title="ORPO",
                       eval_keys=("eval_rewards/accuracies", "eval_rewards/margins", "eval_nll_loss"))
