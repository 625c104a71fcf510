"""Online DPO: preference pairs sampled from the policy itself, judged by reward functions (experimental).

Each step, for every prompt of the round, the generation backend (the same ones GRPO uses: transformers,
colocated vLLM, a `toolkit vllm-serve` server) samples `num_generations` completions as token ids; the run's
reward functions (any GRPO reward: a verifier, `reward_model:<path>` for a trained reward model, an async
judge) score them; the best-scored completion becomes "chosen" and the worst "rejected"; and a DPO-family
preference loss (`loss_type`: sigmoid, ipo, hinge, robust, or a registered one) is taken on exactly the
sampled ids against the reference model (a frozen copy, or the PEFT base with adapters off):

    loss = mean over the step's pairs of  -log sigmoid(beta * ((log pi(c) - log pi_ref(c)) - (log pi(r) - log pi_ref(r))))

With `num_generations=2` this is Guo et al. (2024) "Direct Language Model Alignment from Online AI Feedback"
and TRL's OnlineDPOTrainer: loss, gradients and metrics equal TRL's on the same sampled pairs
(tests/test_online_dpo.py). Departures, each on purpose:

- Pairs whose completions scored the same carry no preference and leave the loss (`zero_variance_filter`,
  on by default; TRL keeps them with the first completion as "chosen", which trains on a coin flip). Set
  `zero_variance_filter=False` for TRL's behaviour. `frac_pairs_in_loss` says how many pairs were used.
- `num_generations` may exceed 2: the pair is then (best, worst) of the group, a stronger contrast.
- `per_device_train_batch_size` counts completions, as in GRPO (TRL's counts prompts).
- "ipo" divides the log-ratios by the answer lengths, as toolkit's and TRL's DPOTrainer do; TRL's online DPO
  uses the summed log-ratios for IPO. The sigmoid loss (the default) is the same in both.

`OnlineDPOTrainer` is `GRPOTrainer` with another loss: prompts, rollouts, rewards, generation backends,
checkpoints and exact resume, several processes and the health checks are GRPO's.
"""

from __future__ import annotations

__all__ = ["OnlineDPOConfig", "OnlineDPOTrainer", "run_online_dpo_command", "select_pairs"]

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from toolkit.core.errors import ConfigError, TrainingHealthError
from toolkit.core.grpo import GRPOConfig, GRPOTrainer, Rollout
from toolkit.core.models import DEFAULT_MODEL
from toolkit.core.objectives import PreferenceLossInputs, resolve_preference_loss_settings
from toolkit.core.packing import completion_logps
from toolkit.core.plugins import registry

logger = logging.getLogger(__name__)

_CITATION = """@article{guo2024direct,
  title   = {{Direct Language Model Alignment from Online AI Feedback}},
  author  = {Shangmin Guo and Biao Zhang and Tianlin Liu and Tianqi Liu and Misha Khalman and Felipe Llinares
             and Alexandre Ram\\'{e} and Thomas Mesnard and Yao Zhao and Bilal Piot and Johan Ferret and
             Mathieu Blondel},
  journal = {arXiv preprint arXiv:2402.04792},
  year    = {2024}
}"""


@dataclass
class OnlineDPOConfig(GRPOConfig):
    """Settings of `OnlineDPOTrainer`: GRPO's sampling, reward and batching fields, DPO's loss fields.

    `beta` is DPO's (the strength of the implicit KL to the reference), not GRPO's KL coefficient. Defaults
    follow TRL's OnlineDPOConfig (beta 0.1, sigmoid, learning rate 5e-7, temperature 0.9, 2 completions).
    """

    output_dir: str | None = field(default="outputs/online-dpo", metadata={"help": "Checkpoints, final model."})
    learning_rate: float = field(default=5e-7, metadata={"help": "Peak AdamW learning rate."})
    num_generations: int = field(default=2, metadata={
        "help": "Completions sampled per prompt; the pair is the best- and the worst-scored of them."})
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature (the loss reads the "
                                                              "model's own log-probs, temperature 1)."})
    beta: float = field(default=0.1, metadata={"help": "DPO's beta: strength of the implicit KL to the reference."})
    loss_type: str = field(default="sigmoid", metadata={
        "help": "A preference loss: sigmoid (DPO) | ipo | hinge | robust | a registered one."})
    label_smoothing: float = field(default=0.0, metadata={"help": "cDPO label smoothing (sigmoid, robust)."})
    zero_variance_filter: bool = field(default=True, metadata={
        "help": "Leave pairs whose completions scored the same out of the loss (no preference). False: keep "
                "them with the first completion as chosen (TRL's behaviour)."})

    def _check_objective(self) -> None:
        if not isinstance(self.loss_type, str):
            raise ConfigError(f"loss_type: online DPO takes one preference loss by name, got {self.loss_type!r}.")
        if not self.beta > 0:
            raise ConfigError(f"beta: DPO's beta must be > 0, got {self.beta}.")
        if self.num_generations < 2:
            raise ConfigError(f"num_generations: must be >= 2 (a pair needs two completions), got "
                              f"{self.num_generations}.")
        if self.loss_type == "sft":
            raise ConfigError("loss_type: 'sft' is only the chosen answer's likelihood term, which DPOTrainer combines "
                              "with a preference loss; online DPO takes one preference loss (e.g. 'sigmoid').")
        loss = registry().get("preference_loss", self.loss_type, field="loss_type")
        resolve_preference_loss_settings(loss, self, name=self.loss_type)
        # GRPO's own objective fields are not read here: refused by name rather than silently ignored.
        for name, default in (("num_iterations", 1), ("off_policy_mask_threshold", None),
                              ("skip_solved_threshold", None), ("advantage_estimator", "grpo"),
                              ("advantage_estimator_kwargs", None), ("mask_truncated_completions", False)):
            if getattr(self, name) != default:
                raise ConfigError(f"{name}: online DPO does not read GRPO's {name} (got {getattr(self, name)!r}); "
                                  "leave it unset.")


def select_pairs(rewards: torch.Tensor, group_size: int, *, keep_ties: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen [P], rejected [P], valid [P] bool) row indices of each group's pair, from rewards [P x G].

    chosen is the best-scored completion, rejected the worst (the first such, in sampling order); rows
    without a reward (NaN) are never picked. A group with fewer than two scored rows has no pair; a group
    whose best and worst tie has none either unless `keep_ties` (then the first two scored rows, the first
    as chosen: TRL's rule for two completions).
    """
    r = rewards.view(-1, group_size)
    scored = ~torch.isnan(r)
    best = torch.where(scored, r, torch.full_like(r, -float("inf"))).argmax(-1)
    worst = torch.where(scored, r, torch.full_like(r, float("inf"))).argmin(-1)
    rows = torch.arange(r.shape[0])
    tied = r[rows, best] == r[rows, worst]
    # on a tie keep_ties takes the first two scored rows: cumsum marks the first (1) and second (2)
    order = scored.long().cumsum(-1)
    first = (order == 1).long().argmax(-1)
    second = (order == 2).long().argmax(-1)
    chosen = torch.where(tied, first, best)
    rejected = torch.where(tied, second, worst)
    valid = (scored.sum(-1) >= 2) & (~tied | keep_ties)
    offset = rows * group_size
    return chosen + offset, rejected + offset, valid


class OnlineDPOTrainer(GRPOTrainer):
    """Online DPO on prompt data with reward functions (see the module docstring); GRPOTrainer's arguments."""

    _supports_environments = False  # multi-turn episodes: GRPOTrainer only, for now (docs/agents.md)

    _tag_names = ["toolkit", "online-dpo"]
    _method_card = ("Online DPO", _CITATION)

    def __init__(self, model: Any = DEFAULT_MODEL, reward_funcs: Any = (), args: OnlineDPOConfig | None = None, **kwargs: Any):
        args = args if args is not None else OnlineDPOConfig()
        if not isinstance(args, OnlineDPOConfig):
            raise ConfigError(f"args: OnlineDPOTrainer needs an OnlineDPOConfig, got {type(args).__name__}.")
        super().__init__(model, reward_funcs, args, **kwargs)

    def _uses_reference(self, args: Any) -> bool:
        return True  # DPO's implicit reward is always relative to the reference

    def _setup_objective(self, args: Any) -> None:
        self.preference_loss = registry().get("preference_loss", args.loss_type, field="loss_type")
        resolve_preference_loss_settings(self.preference_loss, args, name=args.loss_type)

    def _log_objective(self, args: Any, weights: list[float]) -> None:
        logger.info("Online DPO: loss_type=%s beta=%s, %d completions per prompt (pair = best vs worst), %d prompts "
                    "per step, ties %s; rewards %s with weights %s.", args.loss_type, args.beta, args.num_generations,
                    self.prompts_per_round, "left out" if args.zero_variance_filter else "kept (first = chosen)",
                    self.reward_runner.names, weights)

    def compute_token_logps(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Flat [N] log-probs of the sampled tokens at temperature 1: DPO's implicit reward is on the model's own
        distribution, whatever temperature sampled the pair (as in TRL)."""
        return completion_logps(model, batch, temperature=1.0, chunk_size=self.args.logps_chunk_size,
                                upcast=self.args.fp32_lm_head)

    def compute_advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """No advantages (the loss reads the pair); zero_std marks the groups with no pair to learn from, for GRPO's
        frac_reward_zero_std metric and its no-signal warning."""
        G = self.args.num_generations
        _, _, valid = select_pairs(rewards, G, keep_ties=not self.args.zero_variance_filter)
        return torch.zeros_like(rewards), (~valid).repeat_interleave(G)

    @torch.no_grad()
    def build_rollout(self, row_indices, groups, rewards_per_func, t_gen, t_score) -> Rollout:
        """GRPO's rollout; then each group's (chosen, rejected) pair, marked by advantage +1 / -1 on the two rows
        that stay in the loss (the micro-batches carry advantages, so the pairing needs no new field)."""
        rollout = super().build_rollout(row_indices, groups, rewards_per_func, t_gen, t_score)
        G = self.args.num_generations
        chosen, rejected, valid = select_pairs(rollout.rewards, G, keep_ties=not self.args.zero_variance_filter)
        included = torch.zeros_like(rollout.included)
        advantages = torch.zeros_like(rollout.advantages)
        included[chosen[valid]] = True
        included[rejected[valid]] = True
        advantages[chosen[valid]] = 1.0
        advantages[rejected[valid]] = -1.0
        rollout.included, rollout.advantages = included, advantages
        margin = rollout.rewards[chosen[valid]] - rollout.rewards[rejected[valid]]
        rollout.metrics.update({
            "frac_rows_in_loss": float(included.float().mean()),
            "frac_pairs_in_loss": float(valid.float().mean()),
            "objective/scores": rollout.metrics["reward"],
            "objective/scores_margin": float(margin.mean()) if margin.numel() else 0.0,
        })
        return rollout

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        flat = self.compute_token_logps(model, inputs)
        mask = inputs["completion_mask"]
        seq = self._to_rows(flat, mask).sum(-1)
        ref = (inputs["ref_logps"] * mask).sum(-1)
        in_loss = inputs["loss_mask"].any(-1)
        # Rows are prompt-major and each group holds at most one pair, so the i-th chosen and the i-th rejected
        # row belong to the same prompt.
        chosen, rejected = in_loss & (inputs["advantages"] > 0), in_loss & (inputs["advantages"] < 0)
        if int(chosen.sum()) != int(rejected.sum()) or int(in_loss.sum()) != 2 * int(chosen.sum()):
            raise TrainingHealthError(f"online DPO step {self.state.global_step}: {int(chosen.sum())} chosen and "
                                      f"{int(rejected.sum())} rejected rows in a micro-batch; every pair must be "
                                      "whole (a compute_loss or build_rollout override broke the pairing).")
        logratios = seq - ref
        lengths = mask.sum(-1).to(seq.dtype)
        settings = resolve_preference_loss_settings(self.preference_loss, self.args, name=self.args.loss_type)
        losses = self.preference_loss(PreferenceLossInputs(logratios[chosen], logratios[rejected], lengths[chosen],
                                                           lengths[rejected]), settings)
        # The step's pair count over every micro-batch and rank (GRPO's step_prompts counts the groups with rows in
        # the loss: one pair each), so accumulated micro-batches add up to the step's mean; 0 x seq keeps a graph
        # when this micro-batch has no pair.
        loss = losses.sum() / inputs["step_prompts"] + 0.0 * seq.sum()
        self._health.check_finite(self.state.global_step, loss=loss, logps=flat)
        self._record_pair_metrics(seq.detach(), ref, chosen, rejected, mask)
        return (loss, {"logps": flat.detach()}) if return_outputs else loss

    def _record_pair_metrics(self, seq, ref, chosen, rejected, mask) -> None:
        """TRL's online-DPO metric names; the rewards are beta x log-ratio (DPO's implicit rewards)."""
        s, beta = self._step_metrics, self.args.beta
        s["beta"].append(beta)
        if chosen.any():  # (a micro-batch without a pair holds one masked stand-in row: not a sample)
            s["objective/kl"].append(float((seq - ref)[chosen | rejected].mean()))
            c, r = beta * (seq - ref)[chosen], beta * (seq - ref)[rejected]
            s["rewards/chosen"].append(float(c.mean()))
            s["rewards/rejected"].append(float(r.mean()))
            s["rewards/margins"].append(float((c - r).mean()))
            s["rewards/accuracies"].append(float((c > r).float().mean()))
            s["logps/chosen"].append(float(seq[chosen].mean()))
            s["logps/rejected"].append(float(seq[rejected].mean()))


def run_online_dpo_command(argv: list[str]) -> int:
    """`toolkit online-dpo --config <file>`: GRPO's command path (held-out accuracy before/after, report)."""
    from toolkit.core.cli import _model_init_kwargs, _peft_config, _run_online

    def make(run, cfg, train, callbacks):
        return OnlineDPOTrainer(run.model, list(run.reward_funcs), cfg, train_dataset=train,
                                peft_config=_peft_config(run), model_init_kwargs=_model_init_kwargs(run),
                                callbacks=callbacks)

    return _run_online(argv, OnlineDPOConfig, make, title="Online DPO", reward_key="reward",
                       step_name="optimizer step")
