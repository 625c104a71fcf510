"""Sequence parallelism (Ulysses): one packed row split along its tokens over a group of ranks.

A rank of a sequence-parallel group holds 1/P of the row's tokens (padded to a multiple of P). Every
position-wise part of the model (embedding, norms, MLP, rotary positions, the LM head) runs on those tokens
alone. Attention needs the whole row: before it, one all-to-all trades tokens for heads, so each rank holds every
token for H/P of the heads; our own attention (`toolkit_varlen`: packed examples, the shared-prompt layout) then
runs unchanged on the whole row with the row's own boundaries; a second all-to-all trades the heads back.

Why Ulysses and not ring attention (measured choice, docs/distributed.md):
- the attention kernels stay ours and unchanged: the packed layouts' segment boundaries (and GRPO's shared
  prompt, which a completion on one rank may need from another) are read over the whole row, where ring attention
  would have to rewrite every segment mask blockwise, with online-softmax merging of the partial results;
- traffic: two all-to-alls of q/k/v and the output per layer, each moving (P-1)/P of 1/P of the activations,
  against ring attention's P-1 passes of the keys and values;
- its limit: P must divide the attention heads (key/value heads not divisible by P are repeated first).

The log-probs: each rank scores the completion positions it holds with the chunked LM head, and the [N] values
are gathered whole on every rank of the group (`gather_owned`), so the losses (token counts, sequence sums,
advantages) run on the whole batch exactly as without sequence parallelism. Every rank of a group computes the
same loss from the same values; the gather's backward therefore hands each rank the gradient of its own
positions only, and the group's gradients add up to the whole row's (`sequence_parallel_loss` scales for the
data-parallel average, which counts each group P times).
"""

from __future__ import annotations

__all__ = [
    "RepeatBatches",
    "RepeatedBatchSampler",
    "SequenceParallel",
    "enable",
    "gather_owned",
    "sequence_parallel_group",
    "sequence_parallel_loss",
    "sequence_parallel_of",
    "shard_row",
    "ulysses_attention",
]

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: `size` consecutive global ranks share each batch."""

    group: Any                 # the torch.distributed process group of the P ranks (None when size == 1)
    size: int
    rank: int                  # this rank's index inside the group: it holds tokens [rank*L, (rank+1)*L)
    dp_rank: int               # which data-parallel replica (the batch) this group works on
    dp_size: int


@dataclass
class _Shard:
    """What the attention of one sequence-parallel forward needs beyond its local q/k/v (passed as a kwarg)."""

    sp: SequenceParallel
    length: int                      # real tokens of the whole row (the rest up to a multiple of P is padding)
    position_ids: torch.Tensor       # [1, padded length]: the whole row's positions
    extra: dict = field(default_factory=dict)


def sequence_parallel_group(size: int) -> SequenceParallel:
    """Split the world into groups of `size` consecutive ranks (collective: every rank must call it).

    Consecutive ranks: accelerate hands batch i to rank i mod world, and `RepeatBatches` repeats each batch P times,
    so the P ranks of a group receive the same batch."""
    if size < 1:
        raise ValueError(f"sequence_parallel_size must be >= 1, got {size}")
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    if size == 1:
        return SequenceParallel(None, 1, 0, rank, world)
    if world % size:
        raise ValueError(f"sequence_parallel_size={size} must divide the number of processes ({world}); launch "
                         f"{size * max(world // size, 1)} processes or choose a divisor of {world}.")
    mine = None
    for start in range(0, world, size):  # new_group is collective over the world: every rank creates every group
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return SequenceParallel(mine, size, rank % size, rank // size, world // size)


def sequence_parallel_of(model: torch.nn.Module) -> SequenceParallel | None:
    """The group a model was given (`enable`), or None: its forwards then run whole rows."""
    sp = getattr(model, "_toolkit_sequence_parallel", None)
    return sp if sp is not None and sp.size > 1 else None


def enable(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """Mark `model` (the unwrapped module) so packed forwards split their rows over `sp`'s group."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "toolkit_varlen":
        raise ValueError(
            f"sequence parallelism runs on toolkit's packed attention (toolkit_varlen), but the model uses "
            f"'{impl}'. Load it with attn_implementation='sdpa' (toolkit switches it to toolkit_varlen, which runs "
            "torch's sdpa kernels per packed segment, flash kernels included on GPU).")
    heads = model.config.num_attention_heads
    if heads % sp.size:
        raise ValueError(f"sequence_parallel_size={sp.size} must divide the model's {heads} attention heads "
                         "(Ulysses gives each rank a share of the heads).")
    model._toolkit_sequence_parallel = sp


def shard_row(kwargs: dict[str, Any], sp: SequenceParallel) -> tuple[dict[str, Any], int, int]:
    """A packed forward's kwargs (input_ids and position_ids [1, T], the attention's boundary kwargs) for this
    rank: its 1/P of the tokens, the row padded to a multiple of P. Returns (kwargs, first, end) of its positions."""
    ids, pos = kwargs["input_ids"], kwargs.get("position_ids")
    if ids.dim() != 2 or ids.shape[0] != 1 or pos is None:
        raise ValueError("sequence parallelism splits one packed row ([1, T] input_ids with position_ids); "
                         "a padded batch cannot be split (use padding_free / the packed layouts).")
    total = ids.shape[1]
    local = math.ceil(total / sp.size)
    pad = local * sp.size - total
    if pad:
        ids = torch.nn.functional.pad(ids, (0, pad), value=0)
        pos = torch.nn.functional.pad(pos, (0, pad), value=0)
    start, end = sp.rank * local, (sp.rank + 1) * local
    out = dict(kwargs)
    out.update(input_ids=ids[:, start:end], position_ids=pos[:, start:end], toolkit_sp=_Shard(sp, total, pos))
    return out, start, end


class RepeatBatches(torch.utils.data.Sampler):
    """Indices of `sampler` in batches of `batch_size`, each batch repeated `repeats` times in a row.

    accelerate hands batch i of a data loader to rank i mod world; with every batch repeated P times, the P
    consecutive ranks of a sequence-parallel group get the same batch, and the groups get the batches one process
    with every group's batches would see in that order. A last, short batch is completed with the epoch's first
    indices (so a repeated batch never straddles two ranks' turns), or dropped with `drop_last`."""

    def __init__(self, sampler, batch_size: int, repeats: int, *, drop_last: bool = False):
        self.sampler, self.batch_size, self.repeats, self.drop_last = sampler, batch_size, repeats, drop_last

    def __iter__(self):
        first: list[int] | None = None
        batch: list[int] = []
        for index in self.sampler:  # lazily: a sampler may decide later indices from training (GRPO's solved prompts)
            batch.append(index)
            if len(batch) == self.batch_size:
                first = first or batch
                yield from batch * self.repeats
                batch = []
        if batch and not self.drop_last:
            fill = ((first or batch) * self.batch_size)[: self.batch_size - len(batch)]
            yield from (batch + fill) * self.repeats

    def __len__(self) -> int:
        n = len(self.sampler)
        batches = n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        return batches * self.batch_size * self.repeats

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)


class RepeatedBatchSampler(torch.utils.data.Sampler):
    """Evaluation's counterpart of `RepeatBatches`: batches of consecutive indices of `sampler`, each yielded
    `repeats` times in a row, no index twice (a held-out loss must not count rows twice).

    Batches of `batch_size`, the last one short, when their count is a multiple of `replicas` (one per
    data-parallel replica: accelerate would otherwise pad the replicas' turns with repeats of the first batches);
    else the rows are split into the next multiple of `replicas` batches of near-equal size (at most `batch_size`)."""

    def __init__(self, sampler, batch_size: int, repeats: int, replicas: int = 1):
        # `size`, not `batch_size`: accelerate's BatchSamplerShard reads a `batch_size` as "every batch is full" and
        # would hold a short last batch back from some ranks; without it, batches are taken as they come
        self.sampler, self.size, self.repeats, self.replicas = sampler, batch_size, repeats, replicas
        n = len(sampler)
        count = math.ceil(n / batch_size)
        if count % replicas:
            count = math.ceil(count / replicas) * replicas
            if count > n:
                raise ValueError(f"{n} held-out rows cannot give each of {replicas} data-parallel replicas a batch "
                                 f"of its own; use at least {replicas} rows or fewer replicas.")
            self.sizes = [n // count + (1 if k < n % count else 0) for k in range(count)]
        else:
            self.sizes = [min(batch_size, n - k * batch_size) for k in range(count)]

    def __iter__(self):
        order = list(self.sampler)
        start = 0
        for size in self.sizes:
            for _ in range(self.repeats):
                yield order[start:start + size]
            start += size

    def __len__(self) -> int:
        return len(self.sizes) * self.repeats


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0 (chunk p goes to rank p); its own inverse, so backward is the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad, memory_format=torch.contiguous_format)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _tokens_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[1, h, L, d] (all heads, my tokens) -> [1, h/P, P*L, d] (my heads, every token, in rank order)."""
    _, h, length, d = x.shape
    chunks = x[0].reshape(sp.size, h // sp.size, length, d)            # chunk p: the heads rank p will hold
    got = _AllToAll.apply(chunks, sp.group)                            # got[p]: rank p's tokens of my heads
    return got.permute(1, 0, 2, 3).reshape(1, h // sp.size, sp.size * length, d)


def _heads_to_tokens(out: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[1, P*L, h/P, d] (attention's output layout: my heads, every token) -> [1, L, h, d] (all heads, my tokens)."""
    _, total, h_local, d = out.shape
    length = total // sp.size
    chunks = out[0].reshape(sp.size, length, h_local, d)               # chunk p: rank p's tokens
    got = _AllToAll.apply(chunks, sp.group)                            # got[p]: rank p's heads of my tokens
    return got.permute(1, 0, 2, 3).reshape(1, length, sp.size * h_local, d)


def ulysses_attention(inner, module, query, key, value, attention_mask, shard: _Shard, **kwargs):
    """Run `inner` (an attention function in transformers' interface) over the whole row, each rank on H/P heads.

    query [1, H, L, d] and key/value [1, K, L, d] hold this rank's L tokens. Key/value heads that P does not divide
    are repeated to H first (each query head keeps its own key/value head)."""
    sp = shard.sp
    if key.shape[1] % sp.size:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    q, k, v = (_tokens_to_heads(t, sp)[:, :, :shard.length] for t in (query, key, value))
    kwargs["position_ids"] = shard.position_ids[:, :shard.length]
    out, _ = inner(module, q, k, v, attention_mask, **kwargs)            # [1, T, H/P, d]
    pad = query.shape[2] * sp.size - out.shape[1]  # the row's padding: attended by nothing, zeros on the way back
    if pad:
        out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, pad))
    return _heads_to_tokens(out, sp), None


class _GatherOwned(torch.autograd.Function):
    """Values each rank computed for its own indices of an [N] tensor -> the whole [N] on every rank of the group.

    Backward hands each rank the gradient at its own indices: every rank of the group computes the same loss from
    the whole tensor, so summing every rank's share would count it P times."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, index: torch.Tensor, n: int, group) -> torch.Tensor:
        ctx.save_for_backward(index)
        whole = local.new_zeros((n, *local.shape[1:]))
        whole[index] = local
        dist.all_reduce(whole, group=group)  # the owners' values are disjoint; the others add zeros (exact)
        return whole

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad[index], None, None, None


def gather_owned(local: torch.Tensor, index: torch.Tensor, n: int, sp: SequenceParallel) -> torch.Tensor:
    """The group's values at indices 0..n-1 (each index computed by exactly one rank: `local` at `index`)."""
    if not local.requires_grad:
        whole = local.new_zeros((n, *local.shape[1:]))
        whole[index] = local
        dist.all_reduce(whole, group=sp.group)
        return whole
    return _GatherOwned.apply(local, index, n, sp.group)


def sequence_parallel_loss(loss: torch.Tensor, sp: SequenceParallel | None) -> torch.Tensor:
    """The loss to backpropagate on a rank of a sequence-parallel group: its value unchanged (what is logged), its
    gradient x P. Data-parallel averaging divides by every rank of the world, P per group, while each rank of a
    group holds only its positions' share of the group's gradient (the shares add up to it once)."""
    if sp is None or sp.size == 1 or not loss.requires_grad:
        return loss
    return loss + (sp.size - 1) * (loss - loss.detach())
