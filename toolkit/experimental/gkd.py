"""GKD / on-policy distillation: the student samples, the teacher scores every token (experimental).

Generalized Knowledge Distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models"). Each
optimizer step, with probability `lmbda` the student samples completions of the round's prompts through
GRPO's generation backends (on-policy); otherwise the dataset's own completions are used (supervised KD,
which needs a 'completion' column). On every completion token both models give their whole next-token
distribution and the loss is the generalised Jensen-Shannon divergence between them (eq. 1 of the paper):

    M = beta * teacher + (1 - beta) * student
    JSD_beta = beta * KL(teacher || M) + (1 - beta) * KL(student || M)
    beta = 0: KL(teacher || student) (forward KL, supervised KD)   beta = 1: KL(student || teacher) (reverse KL)

summed over the vocabulary and averaged over the step's completion tokens (all micro-batches and ranks). `lmbda=1, beta=1` is on-policy
distillation with the full-vocabulary reverse KL (Thinking Machines' "on-policy distillation" estimates the
same quantity from the sampled token alone). The loss, per token and reduced, and its gradients equal TRL's
`GKDTrainer.generalized_jsd_loss` and `GKDTrainer.compute_loss` on the same ids (tests/experimental/test_gkd.py).

Departures from TRL, on purpose: the logits are only formed at completion positions and in chunks of
`logps_chunk_size` tokens, recomputed in backward (TRL materialises [batch, sequence, vocab] for both models);
the on-policy coin is flipped once per optimizer step (TRL: per micro-batch) and seeded by (seed, step), so a
resumed run takes the same coins; the loss divides by the step's completion tokens (TRL's num_items_in_batch
is counted from the dataset's labels before on-policy samples replace them); the teacher runs on the same
packed rows as the student (one forward each per micro-batch). Not here: TRL's `seq_kd` (teacher-generated
completions) and a teacher served by vLLM (which returns top-k log-probs, not the whole distribution).

`GKDTrainer` is `GRPOTrainer` with another loss: prompts, generation backends, rewards (optional, logged to show
the task improving), checkpoints, exact resume and several processes are GRPO's.
"""

from __future__ import annotations

__all__ = ["GKDConfig", "GKDTrainer", "generalized_jsd", "run_gkd_command"]

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from toolkit.core.attention import packed_layout, supports_varlen, use_varlen_attention
from toolkit.core.data import DatasetFormat, tokenize_for_sft
from toolkit.core.errors import ConfigError, DataError
from toolkit.core.generation import Completion
from toolkit.core.grpo import GroupRolloutConfig, GRPOTrainer, Rollout
from toolkit.core.models import (
    DEFAULT_MODEL,
    load_model,
    load_tokenizer,
    output_head,
    place_frozen,
    resolve_model_path,
    unwrap_model,
)
from toolkit.core.numerics import upcast_region
from toolkit.core.packing import completion_hidden
from toolkit.core.rollout import generation_seed
from toolkit.core.vision import is_vision_processor
from ._trl_names import accepting_trl_names

logger = logging.getLogger(__name__)

_CITATION = """@inproceedings{agarwal2024onpolicy,
  title     = {{On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes}},
  author    = {Rishabh Agarwal and Nino Vieillard and Yongchao Zhou and Piotr Stanczyk and Sabela Ramos Garea and
               Matthieu Geist and Olivier Bachem},
  booktitle = {The Twelfth International Conference on Learning Representations},
  year      = {2024}
}"""


def generalized_jsd(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-position generalised JSD [N] between two [N, V] logit tensors, summed over the vocabulary.

    beta = 0 is KL(teacher || student), beta = 1 is KL(student || teacher); in between, the divergence of each
    from their beta-mixture, weighted beta and 1 - beta. Computed in log space (the mixture by logsumexp).
    """
    s = F.log_softmax(student_logits / temperature, dim=-1)
    t = F.log_softmax(teacher_logits / temperature, dim=-1)
    if beta == 0:
        return (t.exp() * (t - s)).sum(-1)
    if beta == 1:
        return (s.exp() * (s - t)).sum(-1)
    b = torch.tensor(beta, dtype=s.dtype, device=s.device)
    m = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
    return b * (t.exp() * (t - m)).sum(-1) + (1 - b) * (s.exp() * (s - m)).sum(-1)


def _chunk_jsd(hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, beta, temperature, upcast):
    dtype = torch.float32 if upcast else hidden.dtype
    with upcast_region(upcast, hidden.device.type):
        student = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
        with torch.no_grad():
            teacher = F.linear(teacher_hidden.to(dtype), teacher_weight.to(dtype),
                               None if teacher_bias is None else teacher_bias.to(dtype))
    return generalized_jsd(student, teacher, beta, temperature).sum()


@accepting_trl_names  # TRL's GKDConfig names: taken or refused (toolkit/experimental/_trl_names.py)
@dataclass
class GKDConfig(GroupRolloutConfig):
    """Settings of `GKDTrainer`: the GRPO family's sampling, reward and batching fields (`GroupRolloutConfig`) plus
    GKD's below (TRL's names and defaults).

    `beta` is GKD's interpolation of the divergence.
    """

    output_dir: str | None = field(default="outputs/gkd", metadata={"help": "Checkpoints, final model."})
    learning_rate: float = field(default=1e-5, metadata={"help": "Peak AdamW learning rate."})
    num_generations: int = field(default=1, metadata={"help": "Completions the student samples per prompt."})
    temperature: float = field(default=0.9, metadata={"help": "The student's sampling temperature (the loss "
                                                              "compares the models at temperature 1)."})
    lmbda: float = field(default=0.5, metadata={
        "help": "Probability that a step trains on the student's own samples (on-policy); otherwise on the "
                "dataset's 'completion' column. 1.0: fully on-policy (no completions needed)."})
    beta: float = field(default=0.5, metadata={
        "help": "Generalised JSD interpolation: 0 = KL(teacher||student), 1 = KL(student||teacher) (reverse KL)."})
    teacher_model_name_or_path: str | None = field(default=None, metadata={
        "help": "The teacher: a local path or embedded model name (the tokenizer must be the student's)."})
    disable_dropout: bool = field(default=True, metadata={
        "help": "Turn the policy's dropout off before training (TRL's default for this trainer): the sampler and the "
                "trainer then score completions with the same network."})

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.lmbda <= 1.0:
            raise ConfigError(f"lmbda: the probability of an on-policy step must be in [0, 1], got {self.lmbda}.")
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError(f"beta: GKD's interpolation must be in [0, 1] (0 forward KL, 1 reverse KL), got "
                              f"{self.beta}.")
        if self.lmbda < 1 and self.num_generations > 1:
            # the loss is a token mean, so G copies give the value of one, at G times the compute
            logger.warning("GKD: lmbda=%s with num_generations=%d: off-policy steps train on each dataset completion "
                           "%d times over (the same loss as once, %dx the compute).", self.lmbda,
                           self.num_generations, self.num_generations, self.num_generations)


class GKDTrainer(GRPOTrainer):
    """GKD on prompt (and, for lmbda < 1, prompt-completion) data; see the module docstring.

    `teacher_model` is a model or a path (default: `args.teacher_model_name_or_path`); it is frozen and in eval
    mode. `reward_funcs` are optional and only logged (the loss does not read them).
    """
    supports_vision = False  # (vision-language models: not yet; docs/vision.md)

    supports_environments = False  # multi-turn episodes: GRPOTrainer only, for now (docs/agents.md)
    needs_rewards = False  # rewards are only logged

    _tag_names = ["toolkit", "gkd"]
    trainer_kind = "gkd"
    method_card = ("Generalized Knowledge Distillation (GKD)", _CITATION)

    def __init__(self, model: Any = DEFAULT_MODEL, teacher_model: Any = None, args: GKDConfig | None = None,
                 reward_funcs: Any = (), train_dataset: Any = None, processing_class: Any = None, **kwargs: Any):
        args = args if args is not None else GKDConfig()
        if not isinstance(args, GKDConfig):
            raise ConfigError(f"args: GKDTrainer needs a GKDConfig, got {type(args).__name__}.")
        teacher_model = teacher_model if teacher_model is not None else args.teacher_model_name_or_path
        if teacher_model is None:
            raise ConfigError("teacher_model: GKD needs a teacher; pass teacher_model= or set "
                              "teacher_model_name_or_path (a local path or an embedded model name).")
        if "ref_model" in kwargs:
            raise ConfigError("ref_model: GKD has no reference model; the teacher is teacher_model.")
        tokenizer = processing_class if processing_class is not None else load_tokenizer(model)
        if is_vision_processor(tokenizer):  # before the teacher's tokenizer is compared (a processor has no vocab)
            raise ConfigError(f"processing_class: {type(self).__name__} does not take vision-language models yet; "
                              "GRPOTrainer (and the experimental OnlineDPOTrainer) do.")
        if isinstance(teacher_model, str):
            # before any model loads: a teacher with another vocabulary would give a divergence between unrelated
            # distributions, silently
            teacher_tok = load_tokenizer(teacher_model)
            if teacher_tok.get_vocab() != tokenizer.get_vocab():
                raise ConfigError(f"teacher_model: the teacher's tokenizer ({teacher_model}) differs from the "
                                  "student's; GKD compares next-token distributions over one vocabulary. Use a "
                                  "teacher of the same tokenizer family.")
            # the heads, from the models' configs: a teacher whose head is too small is refused before the student
            # (or the teacher) loads, not after
            _compared_vocab(_head_rows(model), _head_rows(teacher_model), len(tokenizer))
        super().__init__(model, reward_funcs, args, train_dataset=train_dataset, processing_class=tokenizer, **kwargs)
        if isinstance(teacher_model, str):
            teacher_model = load_model(teacher_model, dtype=args.model_dtype)
        # Trainer places only the student; the teacher goes to the same device
        self.teacher_model = place_frozen(teacher_model.eval().requires_grad_(False), self.args.device)
        # the loaded heads (also for models given as objects); None: equal heads, compared whole
        self._vocab = _compared_vocab(output_head(self.model)[0].shape[0],
                                      output_head(self.teacher_model)[0].shape[0], len(tokenizer))
        if self.padding_free and supports_varlen(self.teacher_model):
            use_varlen_attention(self.teacher_model)
        # the teacher reads the student's packed rows, so the layout is one both attention implementations run
        self.packed_layout = packed_layout(unwrap_model(self.model), self.teacher_model) if self.padding_free \
            else "padded"

    # ------------------------------------------------------------------------------ GRPO's seams

    def uses_reference_model(self, args: Any) -> bool:
        return False  # the teacher is not a reference: it is read in the loss, on every vocabulary entry

    def setup_objective(self, args: Any) -> None:
        if args.skip_solved_threshold is not None and not self.reward_runner.funcs:
            raise ConfigError("skip_solved_threshold: a prompt counts as solved by its reward, and this GKD run has no "
                              "reward functions; add reward_funcs or leave skip_solved_threshold unset.")

    def describe_objective(self, args: Any) -> str:
        return (f"GKD: beta={args.beta} (0 forward KL, 1 reverse KL), lmbda={args.lmbda} (share of on-policy steps); "
                f"logged rewards {self.reward_runner.names or 'none'}")

    def prepare_prompts(self, train_dataset: Any, tokenizer: Any, args: Any) -> None:
        """GRPO's prompt rows, and for lmbda < 1 the dataset's completions as token ids (before any model loads)."""
        super().prepare_prompts(train_dataset, tokenizer, args)
        self._dataset_completions = self._tokenize_completions(args, tokenizer) if args.lmbda < 1 else None

    def _tokenize_completions(self, args: Any, tokenizer: Any) -> list[list[int]]:
        """The dataset's completions as token ids (the SFT tokenizer's completion part), for off-policy steps."""
        if "completion" not in self.dataset_format.extra_columns:
            raise DataError(f"GKD with lmbda={args.lmbda} trains {100 * (1 - args.lmbda):.0f}% of its steps on the "
                            "dataset's completions, and this dataset has no 'completion' column (columns: "
                            f"{['prompt', *self.dataset_format.extra_columns]}). Add one, or set lmbda=1.0 (every step "
                            "on-policy).")
        fmt = DatasetFormat("prompt_completion", self.dataset_format.conversational, ("prompt", "completion"), ())
        rows = [{"prompt": r["prompt"], "completion": r["completion"]} for r in self.rows]
        examples, _ = tokenize_for_sft(rows, fmt, tokenizer, max_length=None, completion_only_loss=True,
                                       assistant_only_loss=False, template_kwargs=args.chat_template_kwargs)
        out = []
        for i, e in enumerate(examples):
            ids = [t for t, m in zip(e["input_ids"], e["completion_mask"]) if m][: args.max_completion_length]
            if not ids:
                raise DataError(f"GKD: row {i}'s completion is empty after tokenization; give it text or drop the row.")
            out.append(ids)
        return out

    def on_policy_step(self, step: int) -> bool:
        """Whether optimizer step `step` samples from the student: a coin of probability lmbda, seeded by (seed,
        step) so that a resumed run takes the same coins."""
        if self.args.lmbda >= 1.0:
            return True
        return random.Random(generation_seed(self.args.seed, step, 0)).random() < self.args.lmbda

    @torch.no_grad()
    def generate_rollout(self, row_indices) -> Rollout:
        if self.on_policy_step(self.state.global_step):
            rollout = super().generate_rollout(row_indices)
            rollout.metrics["on_policy"] = 1.0
            return rollout
        # off-policy: the dataset's completions; their reward is not the student's, so it is logged apart (the
        # report's reward curve and the falling-reward warning read the student's samples only), and nothing
        # was generated
        G = self.args.num_generations
        groups = [[Completion(list(self._dataset_completions[i]), [0.0] * len(self._dataset_completions[i]), "stop")
                   for _ in range(G)] for i in row_indices]
        rows = [self.rows[i] for i in row_indices for _ in range(G)]
        rewards = self.compute_rewards(rows, [c.token_ids for g in groups for c in g])
        rollout = self.build_rollout(row_indices, groups, rewards, 0.0, 0.0)
        rollout.metrics["on_policy"] = 0.0
        rollout.metrics["reward_dataset"] = rollout.metrics.pop("reward")
        for key in [k for k in rollout.metrics if k.startswith("rewards/")]:
            rollout.metrics[key.replace("rewards/", "rewards_dataset/", 1)] = rollout.metrics.pop(key)
        for key in ("reward_std", "generation_tokens_per_s", "time/generation_s"):
            rollout.metrics.pop(key, None)
        return rollout

    def compute_rewards(self, rows, completion_ids) -> torch.Tensor:
        if not self.reward_runner.funcs:  # rewards are optional here: none, no scores (NaN = not judged)
            return torch.full((0, len(completion_ids)), float("nan"))
        return super().compute_rewards(rows, completion_ids)

    def compute_advantages(self, rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the loss reads no advantages; a group of one sample has no spread to compare with
        return torch.zeros_like(rewards), torch.zeros_like(rewards, dtype=torch.bool)

    def select_rows(self, rollout: Rollout, zero_std: torch.Tensor) -> torch.Tensor:
        """Every completion: distillation has no reward to filter on."""
        return torch.ones_like(rollout.included)

    @torch.no_grad()
    def build_rollout(self, row_indices, groups, rewards_per_func, t_gen, t_score, **kwargs) -> Rollout:
        rollout = super().build_rollout(row_indices, groups, rewards_per_func, t_gen, t_score, **kwargs)
        rollout.metrics.pop("frac_reward_zero_std", None)  # ties in reward do not stop distillation from learning
        return rollout

    # ------------------------------------------------------------------------------ the loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        hidden = completion_hidden(model, inputs)
        was = self.teacher_model.training
        with torch.no_grad():  # a teacher dispatched over devices answers on its own: bring it to the student's
            teacher_hidden = completion_hidden(self.teacher_model, inputs).to(hidden.device)
        self.teacher_model.train(was)
        weight, bias = output_head(model)
        t_weight, t_bias = output_head(self.teacher_model)
        t_weight = t_weight.to(hidden.device)
        t_bias = None if t_bias is None else t_bias.to(hidden.device)
        if self._vocab is not None:  # heads padded to different sizes: compare over the tokenizer's entries
            weight, t_weight = weight[: self._vocab], t_weight[: self._vocab]
            bias = None if bias is None else bias[: self._vocab]
            t_bias = None if t_bias is None else t_bias[: self._vocab]
        keep = inputs["loss_mask"][inputs["completion_mask"]]  # flat: the tokens in the loss
        hidden, teacher_hidden = hidden[keep], teacher_hidden[keep]
        total = hidden.new_zeros((), dtype=torch.float32)
        chunk = self.args.logps_chunk_size
        for start in range(0, hidden.shape[0], chunk):
            # recomputed in backward: only one chunk's [chunk, vocab] logits of each model exist at a time
            total = total + checkpoint(_chunk_jsd, hidden[start:start + chunk], weight, bias,
                                       teacher_hidden[start:start + chunk], t_weight, t_bias, self.args.beta, 1.0,
                                       self.args.fp32_lm_head, use_reentrant=False)
        # the step's token count over every micro-batch and rank, so accumulated micro-batches add up to the mean
        # over the step's tokens (TRL's num_items_in_batch normalisation)
        loss = total / inputs["step_tokens"] + 0.0 * hidden.sum()  # 0 x hidden: a graph even with no token
        self.health.check_finite(self.state.global_step, loss=loss)
        self.record_metric("jsd_per_token", total.detach() / keep.sum().clamp(min=1))
        return (loss, {}) if return_outputs else loss


def _head_rows(model: Any) -> int | None:
    """The LM head's rows of a model given by name or path, from its config (no weights loaded), or of a model
    object; None when they cannot be told."""
    if not isinstance(model, str):
        return output_head(model)[0].shape[0]
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(model))
    except Exception:  # noqa: BLE001 (no config to read here: the check after loading still runs)
        return None
    config = getattr(config, "text_config", None) or config
    return getattr(config, "vocab_size", None)


def _compared_vocab(student: int | None, teacher: int | None, tokenizer: int) -> int | None:
    """How many vocabulary entries the divergence compares: None (the whole heads) when they are equal, else the
    tokenizer's entries. Families pad their heads to different sizes (a 0.5B and a 7B model of one family), so
    unequal heads are cut to len(tokenizer); a teacher head that cannot cover the tokenizer and the student's head
    (the student could sample ids the teacher has no row for) is refused."""
    if student is None or teacher is None or student == teacher:
        return None
    if tokenizer > teacher or student > teacher or tokenizer > student:
        raise ConfigError(f"teacher_model: its LM head has {teacher} rows, the student's {student}, the tokenizer "
                          f"{tokenizer} entries; GKD needs the teacher's head to cover the tokenizer and the "
                          "student's head, and the student's to cover the tokenizer. Use a teacher of the same family "
                          "with a head at least as large.")
    return tokenizer


def run_gkd_command(argv: list[str]) -> int:
    """`toolkit gkd --config <file>`: GRPO's command path (held-out accuracy before/after, report); the teacher is
    `teacher_model_name_or_path`."""
    from toolkit.core.cli import run_online

    def make(run, cfg, train, callbacks):
        return GKDTrainer(run.model, args=cfg, reward_funcs=list(run.reward_funcs), train_dataset=train,
                          peft_config=run.peft_config(), model_init_kwargs=run.model_init_kwargs(cfg),
                          callbacks=callbacks)

    # prompt + completion rows: off-policy steps (lmbda < 1) read the completions; on-policy ones ignore them
    return run_online(argv, GKDConfig, make, title="GKD", reward_key="reward", step_name="optimizer step",
                       kind="prompt_completion")
