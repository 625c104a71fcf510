"""Rollouts shared by the online trainers: prompt order, generation seeds, sample-then-score.

GRPO and async GRPO's worker process draw prompts (`RoundSampler`), seed the sampler
(`generation_seed`) and sample-then-score (`generate_and_score`) with this one code, so async GRPO at
max_staleness 0 equals synchronous GRPO. PPO uses the same seed formulas (`generation_seed`,
`order_seed`) and scoring (`rewards.score_completions`); it samples one completion per prompt itself.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import ConfigError, ToolkitDeprecationWarning
from .generation import Completion, GenerationBackend, SamplingParams

__all__ = ["RoundSampler", "ScoredGroups", "gather_scored", "generate_and_score", "generation_seed", "order_seed"]


def order_seed(seed: int, epoch: int) -> int:
    """Seed of the prompt permutation of `epoch` (GRPO rounds, PPO passes)."""
    return seed * 1_000_003 + epoch


def generation_seed(seed: int, step: int, offset: int = 0) -> int:
    """Seed of the sampler at optimizer step / round / update `step`; `offset` is the rank (or PPO's epoch).

    Seeding generation per step (not once per run) is what makes a resumed run draw the same samples.
    """
    return (seed * 1_000_003 + step * 7919 + offset) % (2**63)


class RoundSampler:
    """Yields each round's prompt indices `repeat` times (once per micro-step of the round).

    Rounds draw `prompts_per_round` prompt indices per process from a permutation seeded by
    (seed, epoch), skipping prompts marked solved. Deterministic, so a resumed run sees the same
    order; with several processes, consecutive batches go to consecutive ranks. Subclass and
    override `order` for a curriculum (the wrapper seam; GRPOTrainer.build_prompt_sampler).
    """

    def __init__(self, n_rows: int, prompts_per_round: int, repeat: int, *, seed: int, num_processes: int = 1,
                 solved: set[int] | None = None):
        self.n_rows, self.per_round, self.repeat = n_rows, prompts_per_round, repeat
        self.seed, self.num_processes = seed, num_processes
        self.solved = solved if solved is not None else set()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> list[int]:
        """The prompt indices of the current epoch, in order (solved prompts left out)."""
        legacy = getattr(type(self), "_order", None)
        if legacy is not None:  # a toolkit 0.1 curriculum overrode the private `_order`
            warnings.warn(f"{type(self).__name__}._order() is the toolkit 0.1 name of the prompt-order seam, "
                          "deprecated in 0.2 and removed in 0.3: override order() instead.",
                          ToolkitDeprecationWarning, stacklevel=2)
            return legacy(self)
        g = torch.Generator().manual_seed(order_seed(self.seed, self.epoch))
        return [i for i in torch.randperm(self.n_rows, generator=g).tolist() if i not in self.solved]

    def round(self, r: int, rank: int = 0) -> list[int]:
        """Row indices of process `rank`'s share of round r counted over epochs (no solved prompts): the async
        worker's view, the same rows iterating the sampler gives that rank at round r."""
        per_step = self.per_round * self.num_processes
        per_epoch = self.n_rows // per_step
        self.set_epoch(r // per_epoch)
        start = (r % per_epoch) * per_step + rank * self.per_round
        return self.order()[start:start + self.per_round]

    def __iter__(self):
        order = self.order()
        per_step = self.per_round * self.num_processes
        for start in range(0, len(order) - per_step + 1, per_step):
            chunk = order[start:start + per_step]
            parts = [chunk[p * self.per_round:(p + 1) * self.per_round] for p in range(self.num_processes)]
            for _ in range(self.repeat):
                yield from parts

    def __len__(self) -> int:
        # Counts every prompt (solved ones included) so Trainer's step arithmetic stays fixed.
        return (self.n_rows // (self.per_round * self.num_processes)) * self.repeat * self.num_processes


@dataclass
class ScoredGroups:
    """`n` completions per prompt, generated and scored. Rows are prompt-major (row i*n+j: completion j of prompt i)."""

    groups: list[list[Completion]]
    rewards_per_func: torch.Tensor   # [F, R], NaN = not judged
    generation_s: float
    scoring_s: float

    @property
    def completion_ids(self) -> list[list[int]]:
        return [c.token_ids for g in self.groups for c in g]


def gather_scored(scored: ScoredGroups, sp: Any) -> ScoredGroups:
    """The groups each rank of a sequence-parallel group generated and scored for its part of a shared round, in
    rank order on every rank of the group (`sequence_parallel.SequenceParallel`)."""
    import torch.distributed as dist

    parts: list[Any] = [None] * sp.size
    dist.all_gather_object(parts, (scored.groups, scored.rewards_per_func.cpu(), scored.generation_s,
                                   scored.scoring_s), group=sp.group)
    return ScoredGroups(groups=[g for part in parts for g in part[0]],
                        rewards_per_func=torch.cat([part[1] for part in parts], dim=1).to(scored.rewards_per_func.device),
                        generation_s=max(part[2] for part in parts), scoring_s=max(part[3] for part in parts))


def generate_and_score(
    backend: GenerationBackend,
    prompt_ids: Sequence[Sequence[int]],
    rows: Sequence[dict[str, Any]],
    *,
    sampling: SamplingParams,
    n: int,
    seed: int,
    score: Callable[[list[dict[str, Any]], list[list[int]]], torch.Tensor],
    images: Sequence[Sequence[Any]] | None = None,
) -> ScoredGroups:
    """Sample `n` completions per prompt as token ids, then score them with `score(rows, completion_ids)`.

    `rows[i]` is prompt i's dataset row; `score` receives it repeated per completion and returns [F, R].
    `images[i]`: the images prompt i shows (vision-language models; the backend must take `images=`).
    """
    t0 = time.perf_counter()
    if images is not None:
        import inspect

        params = inspect.signature(backend.generate).parameters
        if "images" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            raise ConfigError(f"generation_backend: {type(backend).__name__}.generate takes no images=, so prompts "
                              "with images cannot be sampled with it; use the transformers backend.")
        groups = backend.generate([list(p) for p in prompt_ids], sampling, n=n, seed=seed, images=images)
    else:
        groups = backend.generate([list(p) for p in prompt_ids], sampling, n=n, seed=seed)
    t1 = time.perf_counter()
    completion_ids = [c.token_ids for g in groups for c in g]
    rewards = score([row for row in rows for _ in range(n)], completion_ids)
    return ScoredGroups(groups=groups, rewards_per_func=rewards, generation_s=t1 - t0,
                        scoring_s=time.perf_counter() - t1)
