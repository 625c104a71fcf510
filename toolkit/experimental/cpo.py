"""CPO and SimPO: reference-free preference optimisation (experimental).

`CPOTrainer` is `DPOTrainer` without a reference model (no second copy, no reference forward), with
TRL's CPOTrainer options:

    loss = mean(preference loss of z) + cpo_alpha * NLL(chosen answers)

where z compares the policy's own log-probs of the two answers:

- ``loss_type="sigmoid"`` (CPO, Xu et al. 2024): -log sigmoid(beta * (log p(y_c) - log p(y_r))), with
  cDPO label smoothing; ``"hinge"``: relu(1 - beta * z); ``"ipo"``: (z_avg - 1 / (2 beta))^2 on
  per-token averages.
- ``loss_type="simpo"`` (SimPO, Meng et al. 2024): the log-probs averaged per answer token and a target
  margin gamma: -log sigmoid(beta * (avg log p(y_c) - avg log p(y_r)) - simpo_gamma). SimPO proper is
  ``cpo_alpha=0`` (no NLL term); ``cpo_alpha > 0`` gives CPO-SimPO.
- The NLL term is the token mean of -log p over every chosen-answer token of the micro-batch (the
  prompt is not in it), as in TRL.

Loss and gradients equal TRL's CPOTrainer on the same batch (tests/experimental/test_cpo.py). The losses are
registered as preference losses ("simpo", "cpo_nll") when this module is imported, so DPOTrainer's
machinery (data validation, packing, chunked log-probs, resume) runs them unchanged.
"""

from __future__ import annotations

__all__ = ["CPOConfig", "CPOTrainer", "SimPOSettings", "run_cpo_command"]

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from toolkit.core.dpo import DPOConfig, DPOTrainer
from toolkit.core.errors import ConfigError
from toolkit.core.hookspecs import hookimpl
from toolkit.core.objectives import PreferenceLoss, PreferenceLossInputs
from toolkit.core.objectives.settings import NoSettings, SettingsError
from toolkit.core.plugins import registry
from ._trl_names import accepting_trl_names

_CITATION = """@inproceedings{xu2024contrastive,
  title     = {{Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in Machine Translation}},
  author    = {Haoran Xu and Amr Sharaf and Yunmo Chen and Weiting Tan and Lingfeng Shen and Benjamin Van Durme and Kenton Murray and Young Jin Kim},
  booktitle = {Forty-first International Conference on Machine Learning},
  year      = {2024}
}
@inproceedings{meng2024simpo,
  title     = {{SimPO: Simple Preference Optimization with a Reference-Free Reward}},
  author    = {Yu Meng and Mengzhou Xia and Danqi Chen},
  booktitle = {Advances in Neural Information Processing Systems 37},
  year      = {2024}
}"""

_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


@dataclass(frozen=True)
class SimPOSettings:
    """beta: reward scale; simpo_gamma: target reward margin (the loss shifts by gamma); label_smoothing as cDPO."""

    beta: float = 2.0
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5

    def __post_init__(self):
        if self.beta <= 0:
            raise SettingsError("beta", f"must be > 0, got {self.beta}.")
        if not 0 <= self.label_smoothing <= 0.5:
            raise SettingsError("label_smoothing", f"must be in [0, 0.5], got {self.label_smoothing}.")


def simpo_loss(inputs: PreferenceLossInputs, settings: SimPOSettings) -> torch.Tensor:
    """Per pair: -log sigmoid(beta * (avg_c - avg_r) - gamma), smoothed; with no reference the log-ratios are the
    policy's summed log-probs, averaged here over each answer's tokens."""
    z = (inputs.chosen_logratios / inputs.chosen_lengths.clamp(min=1)
         - inputs.rejected_logratios / inputs.rejected_lengths.clamp(min=1)) - settings.simpo_gamma / settings.beta
    ls = settings.label_smoothing
    return -F.logsigmoid(settings.beta * z) * (1 - ls) - F.logsigmoid(-settings.beta * z) * ls


def chosen_nll(inputs: PreferenceLossInputs, settings: Any) -> torch.Tensor:
    """Per pair, so that the trainer's mean over pairs is the token mean of -log p over all chosen-answer tokens
    of the micro-batch: -sum_i log p(y_c,i) / sum_i |y_c,i|, each pair carrying B / total of it."""
    total = inputs.chosen_lengths.sum().clamp(min=1)
    return -inputs.chosen_logratios * len(inputs.chosen_logratios) / total


PREFERENCE_LOSSES = {
    "simpo": PreferenceLoss(simpo_loss, SimPOSettings, "SimPO (Meng et al. 2024): length-normalised, margin gamma, "
                                                       "reference-free (toolkit.experimental.cpo)"),
    "cpo_nll": PreferenceLoss(chosen_nll, NoSettings, "NLL of the chosen answers, token mean over the micro-batch "
                                                      "(CPO's behaviour-cloning term; toolkit.experimental.cpo)"),
}


class _Plugin:
    @staticmethod
    @hookimpl
    def toolkit_register_preference_losses():
        return PREFERENCE_LOSSES


_PLUGIN_NAME = "toolkit.experimental.cpo"
if not registry().pm.has_plugin(_PLUGIN_NAME):
    registry().register(_Plugin(), name=_PLUGIN_NAME)


@accepting_trl_names  # TRL's CPOConfig names: taken or refused (toolkit/experimental/_trl_names.py)
@dataclass
class CPOConfig(DPOConfig):
    """Settings of `CPOTrainer`: DPOConfig's fields (no reference model) plus CPO's. `loss_type` is one of
    sigmoid | hinge | ipo | simpo; TRL's defaults: beta 0.1, cpo_alpha 1.0, simpo_gamma 0.5."""

    output_dir: str | None = field(default="outputs/cpo", metadata={"help": "Where checkpoints and the model go."})
    cpo_alpha: float = field(default=1.0, metadata={
        "help": "Weight of the NLL of the chosen answers (0 with loss_type='simpo' is SimPO proper)."})
    simpo_gamma: float = field(default=0.5, metadata={"help": "SimPO's target reward margin (loss_type='simpo')."})

    def __post_init__(self):
        if not isinstance(self.loss_type, str) or self.loss_type not in _LOSS_TYPES:
            raise ConfigError(f"loss_type: CPO takes one of {list(_LOSS_TYPES)}, got {self.loss_type!r}.")
        if self.cpo_alpha < 0:
            raise ConfigError(f"cpo_alpha: must be >= 0, got {self.cpo_alpha}.")
        if self.precompute_ref_log_probs:
            raise ConfigError("precompute_ref_log_probs: CPO has no reference model; leave it False.")
        self.cpo_loss_type = self.loss_type
        self.reference_free = True
        # DPO's machinery computes a weighted list of registered preference losses
        self.loss_type = [self.cpo_loss_type] + (["cpo_nll"] if self.cpo_alpha > 0 else [])
        self.loss_weights = [1.0] + ([self.cpo_alpha] if self.cpo_alpha > 0 else [])
        if self.cpo_loss_type == "simpo":
            self.loss_kwargs = {**(self.loss_kwargs or {}), "simpo_gamma": self.simpo_gamma}
        super().__post_init__()


class CPOTrainer(DPOTrainer):
    """CPO / SimPO: DPOTrainer without a reference model and with CPO's losses; see the module docstring."""
    supports_vision = False  # (vision-language models: not yet; docs/vision.md)

    _tag_names = ["toolkit", "cpo"]  # noqa: RUF012 (transformers reads a list)
    method_card = ("Contrastive Preference Optimization (CPO) / SimPO", _CITATION)
    trainer_kind = "cpo"

    def __init__(self, model: Any = None, args: CPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, peft_config: Any = None,
                 callbacks: list | None = None, optimizers: tuple = (None, None),
                 model_init_kwargs: dict | None = None):
        args = args if args is not None else CPOConfig()
        if not isinstance(args, CPOConfig):
            raise ConfigError(f"args: CPOTrainer needs a CPOConfig, got {type(args).__name__}.")
        kwargs = {} if model is None else {"model": model}
        super().__init__(**kwargs, ref_model=None, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                         processing_class=processing_class, peft_config=peft_config, callbacks=callbacks,
                         optimizers=optimizers, model_init_kwargs=model_init_kwargs)
        self.ref_model = None  # reference-free: a PEFT model's adapter-free base is not consulted either

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """DPO's loss on the policy's own log-probs; the logged rewards are beta x the log-probs TRL's CPO uses
        (per-token averages for simpo and ipo, sums otherwise)."""
        chosen, rejected, lengths = self.compute_sequence_logps(model, inputs)
        loss = self.compute_preference_loss(chosen, rejected, lengths)
        mode = "train" if model.training else "eval"
        with torch.no_grad():
            chosen_len, rejected_len = (x.float().clamp(min=1).to(chosen.device) for x in lengths.chunk(2))
            per_token = self.args.cpo_loss_type in ("simpo", "ipo")
            c = chosen.detach() / chosen_len if per_token else chosen.detach()
            r = rejected.detach() / rejected_len if per_token else rejected.detach()
            self.record_metric("rewards/chosen", (self.args.beta * c).mean(), mode=mode)
            self.record_metric("rewards/rejected", (self.args.beta * r).mean(), mode=mode)
            self.record_metric("rewards/accuracies", (c > r).float().mean(), mode=mode)
            self.record_metric("rewards/margins", (self.args.beta * (c - r)).mean(), mode=mode)
            self.record_metric("logps/chosen", c.mean(), mode=mode)
            self.record_metric("logps/rejected", r.mean(), mode=mode)
            self.record_metric("nll_loss", (-chosen.detach().sum() / chosen_len.sum()), mode=mode)
        if not torch.isfinite(loss):
            from toolkit.core.errors import TrainingHealthError

            raise TrainingHealthError(f"CPO loss is {loss.item()} at step {self.state.global_step}; lower the "
                                      "learning rate or check the data for extreme lengths.")
        return (loss, {"chosen": chosen.detach()}) if return_outputs else loss


def run_cpo_command(argv: list[str]) -> int:
    """`toolkit cpo --config <file>`: the DPO command's path (held-out accuracy and eval loss before/after)."""
    from toolkit.core.cli import run_offline

    def make(run, cfg, train, held_out):
        return CPOTrainer(run.model, args=cfg, train_dataset=train, eval_dataset=held_out,
                          peft_config=run.peft_config(), model_init_kwargs=run.model_init_kwargs(cfg))

    return run_offline(argv, CPOConfig, make, kind="preference", title="CPO",
                       eval_keys=("eval_rewards/accuracies", "eval_rewards/margins"))
