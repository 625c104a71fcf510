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
(tests/experimental/test_online_dpo.py). Departures, each on purpose:

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
from toolkit.core.grpo import GroupRolloutConfig, GRPOTrainer, Rollout
from toolkit.core.models import DEFAULT_MODEL
from toolkit.core.numerics import tokens_to_rows
from toolkit.core.objectives import PreferenceLossInputs, resolve_preference_loss_settings
from toolkit.core.packing import completion_logps
from toolkit.core.plugins import registry
from ._trl_names import accepting_trl_names

logger = logging.getLogger(__name__)

_CITATION = """@article{guo2024direct,
  title   = {{Direct Language Model Alignment from Online AI Feedback}},
  author  = {Shangmin Guo and Biao Zhang and Tianlin Liu and Tianqi Liu and Misha Khalman and Felipe Llinares
             and Alexandre Ram\\'{e} and Thomas Mesnard and Yao Zhao and Bilal Piot and Johan Ferret and
             Mathieu Blondel},
  journal = {arXiv preprint arXiv:2402.04792},
  year    = {2024}
}"""


@accepting_trl_names  # TRL's OnlineDPOConfig names: taken or refused (toolkit/experimental/_trl_names.py)
@dataclass
class OnlineDPOConfig(GroupRolloutConfig):
    """Settings of `OnlineDPOTrainer`: the GRPO family's sampling, reward and batching fields (`GroupRolloutConfig`)
    plus DPO's loss fields below.

    `beta` is DPO's (the strength of the implicit KL to the reference). Defaults follow TRL's OnlineDPOConfig
    (beta 0.1, sigmoid, learning rate 5e-7, temperature 0.9, 2 completions).
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
    loss_kwargs: dict | None = field(default=None, metadata={
        "help": "The preference loss's own settings (a plugin loss's), checked against its settings dataclass."})
    label_smoothing: float = field(default=0.0, metadata={"help": "cDPO label smoothing (sigmoid, robust)."})
    disable_dropout: bool = field(default=True, metadata={
        "help": "Turn the policy's dropout off before training (TRL's default for this trainer): the sampler and the "
                "trainer then score completions with the same network."})
    zero_variance_filter: bool = field(default=True, metadata={
        "help": "Leave pairs whose completions scored the same out of the loss (no preference). False: keep "
                "them with the first completion as chosen (TRL's behaviour)."})

    def __post_init__(self):
        super().__post_init__()
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
    """Online DPO on prompt data with reward functions (see the module docstring); GRPOTrainer's arguments.

    Built on GRPO's rollouts through its public objective seams: the reference is always read, each group's
    (best, worst) pair is chosen in `select_rows` and carried as `Rollout.pairs`, and `compute_loss` is DPO's.
    """

    supports_environments = False  # multi-turn episodes: GRPOTrainer only, for now (docs/agents.md)

    _tag_names = ["toolkit", "online-dpo"]
    trainer_kind = "online-dpo"
    method_card = ("Online DPO", _CITATION)

    def __init__(self, model: Any = DEFAULT_MODEL, reward_funcs: Any = (), args: OnlineDPOConfig | None = None,
                 **kwargs: Any):
        args = args if args is not None else OnlineDPOConfig()
        if not isinstance(args, OnlineDPOConfig):
            raise ConfigError(f"args: OnlineDPOTrainer needs an OnlineDPOConfig, got {type(args).__name__}.")
        super().__init__(model, reward_funcs, args, **kwargs)

    # ------------------------------------------------------------------------------ GRPO's objective seams

    def uses_reference_model(self, args: Any) -> bool:
        return True  # DPO's implicit reward is always relative to the reference

    def setup_objective(self, args: Any) -> None:
        self.preference_loss = registry().get("preference_loss", args.loss_type, field="loss_type")
        resolve_preference_loss_settings(self.preference_loss, args, name=args.loss_type)

    def describe_objective(self, args: Any) -> str:
        return (f"Online DPO: loss_type={args.loss_type} beta={args.beta}, {args.num_generations} completions per "
                f"prompt (pair = best vs worst), ties {'left out' if args.zero_variance_filter else 'kept'}")

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

    def select_rows(self, rollout: Rollout, zero_std: torch.Tensor) -> torch.Tensor:
        """Each group's (chosen, rejected) pair, as `rollout.pairs`; only the pairs' rows are in the loss."""
        chosen, rejected, valid = select_pairs(rollout.rewards, self.args.num_generations,
                                               keep_ties=not self.args.zero_variance_filter)
        rollout.pairs = torch.stack([chosen[valid], rejected[valid]], dim=-1)
        included = torch.zeros_like(rollout.included)
        included[rollout.pairs.flatten()] = True
        return included

    @torch.no_grad()
    def build_rollout(self, row_indices, groups, rewards_per_func, t_gen, t_score, **kwargs) -> Rollout:
        """GRPO's rollout, with the pairs' metrics."""
        rollout = super().build_rollout(row_indices, groups, rewards_per_func, t_gen, t_score, **kwargs)
        pairs = rollout.pairs
        margin = rollout.rewards[pairs[:, 0]] - rollout.rewards[pairs[:, 1]]
        rollout.metrics.update({
            "frac_pairs_in_loss": len(pairs) / len(row_indices),
            "objective/scores": rollout.metrics["reward"],
            "objective/scores_margin": float(margin.mean()) if margin.numel() else 0.0,
        })
        return rollout

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        flat = self.forward_tokens(model, inputs).logps
        mask = inputs["completion_mask"]
        seq = tokens_to_rows(flat, mask).sum(-1)
        ref = (inputs["ref_logps"] * mask).sum(-1)
        pairs = inputs["pairs"].to(seq.device)
        if int(inputs["loss_mask"].any(-1).sum()) != 2 * len(pairs):
            raise TrainingHealthError(f"online DPO step {self.state.global_step}: {len(pairs)} pairs but "
                                      f"{int(inputs['loss_mask'].any(-1).sum())} rows in the loss of a micro-batch; "
                                      "every row in the loss must belong to one pair (a select_rows or "
                                      "build_rollout override broke the pairing).")
        chosen, rejected = pairs[:, 0], pairs[:, 1]
        logratios = seq - ref
        lengths = mask.sum(-1).to(seq.dtype)
        settings = resolve_preference_loss_settings(self.preference_loss, self.args, name=self.args.loss_type)
        losses = self.preference_loss(PreferenceLossInputs(logratios[chosen], logratios[rejected], lengths[chosen],
                                                           lengths[rejected]), settings)
        # The step's pair count over every micro-batch and rank (GRPO's step_prompts counts the groups with rows in
        # the loss: one pair each), so accumulated micro-batches add up to the step's mean; 0 x seq keeps a graph
        # when this micro-batch has no pair.
        loss = losses.sum() / inputs["step_prompts"] + 0.0 * seq.sum()
        self.health.check_finite(self.state.global_step, loss=loss, logps=flat)
        self._record_pair_metrics(seq.detach(), ref, chosen, rejected)
        return (loss, {"logps": flat.detach()}) if return_outputs else loss

    def _record_pair_metrics(self, seq, ref, chosen, rejected) -> None:
        """TRL's online-DPO metric names; the rewards are beta x log-ratio (DPO's implicit rewards)."""
        beta = self.args.beta
        self.record_metric("beta", beta)
        if len(chosen):  # (a micro-batch without a pair holds one masked stand-in row: not a sample)
            logratios = seq - ref
            c, r = beta * logratios[chosen], beta * logratios[rejected]
            self.record_metric("objective/kl", torch.cat([logratios[chosen], logratios[rejected]]).mean())
            self.record_metric("rewards/chosen", c.mean())
            self.record_metric("rewards/rejected", r.mean())
            self.record_metric("rewards/margins", (c - r).mean())
            self.record_metric("rewards/accuracies", (c > r).float().mean())
            self.record_metric("logps/chosen", seq[chosen].mean())
            self.record_metric("logps/rejected", seq[rejected].mean())


def run_online_dpo_command(argv: list[str]) -> int:
    """`toolkit online-dpo --config <file>`: GRPO's command path (held-out accuracy before/after, report)."""
    from toolkit.core.cli import run_online

    def make(run, cfg, train, callbacks):
        return OnlineDPOTrainer(run.model, list(run.reward_funcs), cfg, train_dataset=train,
                                peft_config=run.peft_config(), model_init_kwargs=run.model_init_kwargs(cfg),
                                callbacks=callbacks)

    return run_online(argv, OnlineDPOConfig, make, title="Online DPO", reward_key="reward",
                       step_name="optimizer step")
