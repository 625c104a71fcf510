"""Prompt + completion sequences as one padding-free row, and their completion log-probs.

Every trainer that scores completions (GRPO, DPO, PPO) runs the same forward: sequences packed
into one row (positions restart per sequence, attention stays inside each sequence through
`toolkit_varlen`), hidden states gathered at the positions that predict completion tokens, and the
shared chunked LM-head function on those positions only. Models whose attention cannot run packed
rows get a right-padded batch instead; the log-probs are the same (tested).
"""

from __future__ import annotations

__all__ = [
    "TokenLogps",
    "common_start",
    "completion_entropy",
    "completion_hidden",
    "completion_logps",
    "completion_logps_and_entropy",
    "completion_token_pass",
    "group_by_prompt",
    "last_hidden",
    "pack_completions",
    "pack_for_layout",
    "pack_shared_prompts",
    "sequence_sums",
    "to_padded",
]

import contextlib
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .attention import varlen_kwargs
from .models import _CpuInferenceLinear, output_head, unwrap_model
from .numerics import chunked_entropy, chunked_token_logps, chunked_token_logps_and_entropy
from .sequence_parallel import SequenceParallel, gather_owned, sequence_parallel_of, shard_row
from .vision import IMAGE_INPUT_KEYS


def pack_completions(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *, pad_token_id: int,
                     padding_free: bool = True) -> dict[str, torch.Tensor]:
    """Sequences prompt_i + completion_i -> a batch for `completion_logps`.

    Keys: input_ids, position_ids and cu_seq_lens (packed) or attention_mask (padded);
    completion_positions [N] (flat index of the hidden state predicting each completion token),
    completion_targets [N], completion_lengths [B], sequence_ends [B] (flat index of each sequence's last
    token: where a reward model reads its score).
    """
    ids: list[int] = []
    pos: list[int] = []
    cu = [0]
    positions: list[int] = []
    lengths: list[int] = []
    for p, c in zip(prompts, completions):
        offset = len(ids)
        ids += list(p) + list(c)
        pos += list(range(len(p) + len(c)))
        cu.append(len(ids))
        # the hidden state at t predicts token t+1: completion tokens are predicted from the last prompt token on
        positions += range(offset + len(p) - 1, offset + len(p) + len(c) - 1)
        lengths.append(len(c))
    batch = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([pos], dtype=torch.long),
        "cu_seq_lens": torch.tensor(cu, dtype=torch.int32),
        "completion_positions": torch.tensor(positions, dtype=torch.long),
        "completion_targets": torch.tensor([t for c in completions for t in c], dtype=torch.long),
        "completion_lengths": torch.tensor(lengths, dtype=torch.long),
        "sequence_ends": torch.tensor(cu[1:], dtype=torch.long) - 1,
    }
    return batch if padding_free else to_padded(batch, pad_token_id)


def common_start(prompts: Sequence[Sequence[int]], *, min_saved: int = 16) -> int:
    """How many leading tokens all `prompts` share, when computing them once instead of len(prompts) times saves
    at least `min_saved` tokens; else 0. Below that the separate layout is as cheap (and each prompt keeps the
    plain causal kernel). Never the whole of the shortest prompt: each keeps at least its last token, whose
    hidden state predicts the first completion token."""
    if len(prompts) < 2:
        return 0
    n = min(len(os.path.commonprefix([list(p) for p in prompts])), min(len(p) for p in prompts) - 1)
    return n if n > 0 and (len(prompts) - 1) * n >= min_saved else 0


def pack_shared_prompts(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                        groups: Sequence[Sequence[int]], *, common_prefix: bool = False) -> dict[str, Any]:
    """Like `pack_completions`, but rows of a group (same prompt) share one copy of the prompt.

    Layout per group: [prompt | completion of row g0 | completion of row g1 | ...]; completion
    positions continue the prompt's positions. The completion tokens come out in row order, as
    with `pack_completions`, so callers need not care which layout ran. Needs `toolkit_varlen`
    attention (it reads `toolkit_shared_prefix`). Saves (G-1) x prompt tokens of forward and
    backward per group: GRPO's G samples share a prompt, so do DPO's chosen and rejected.

    With `common_prefix`, the tokens every group's prompt starts with (a chat template's system prompt
    and instruction: 27 of 45 prompt tokens in the PPO benchmark) are laid out once before the groups,
    as `shared_context` (start, end); each group's span then holds only the rest of its prompt, and its
    prompt and completions attend to the context as well. Saves (groups-1) x context tokens more; PPO,
    whose every completion has its own prompt, has nothing else to share. Same numbers as separate
    sequences (tests/unit/test_packing.py).
    """
    order = [r for g in groups for r in g]
    if sorted(order) != list(range(len(prompts))):
        raise ValueError("pack_shared_prompts: groups must cover every row exactly once")
    group_prompts = []
    for group in groups:
        p = list(prompts[group[0]])
        if not p:
            raise ValueError(f"pack_shared_prompts: the prompt of row {group[0]} is empty; its first completion token "
                             "has nothing to be predicted from. Give every row at least one prompt token.")
        if any(list(prompts[r]) != p for r in group):
            raise ValueError("pack_shared_prompts: rows of a group must have identical prompts")
        group_prompts.append(p)
    shared = common_start(group_prompts) if common_prefix else 0
    ids: list[int] = list(group_prompts[0][:shared])
    pos: list[int] = list(range(shared))
    layout = []
    position_of: dict[int, list[int]] = {}
    ends: dict[int, int] = {}
    for group, p in zip(groups, group_prompts):
        p_start = len(ids)
        ids += p[shared:]
        pos += range(shared, len(p))
        p_end = len(ids)
        last_prompt = len(ids) - 1  # the flat index of the prompt's last token (common_start leaves it here)
        spans = []
        for r in group:
            c = list(completions[r])
            c_start = len(ids)
            ids += c
            pos += range(len(p), len(p) + len(c))
            spans.append((c_start, len(ids)))
            # first completion token is predicted by the prompt's last position, the rest by the completion's own
            position_of[r] = ([last_prompt] + list(range(c_start, c_start + len(c) - 1))) if c else []
            ends[r] = len(ids) - 1 if c else last_prompt
        layout.append((p_start, p_end, spans))
    batch = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "position_ids": torch.tensor([pos], dtype=torch.long),
        "shared_prefix": layout,
        "completion_positions": torch.tensor([i for r in range(len(prompts)) for i in position_of[r]],
                                             dtype=torch.long),
        "completion_targets": torch.tensor([t for c in completions for t in c], dtype=torch.long),
        "completion_lengths": torch.tensor([len(c) for c in completions], dtype=torch.long),
        "sequence_ends": torch.tensor([ends[r] for r in range(len(prompts))], dtype=torch.long),
    }
    if shared:
        batch["shared_context"] = (0, shared)
    return batch


def pack_for_layout(layout: str, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                    pad_token_id: int) -> dict[str, Any]:
    """The batch for `attention.packed_layout`'s answer: "shared_prompt" puts each distinct prompt once, followed by
    its completions, after the start all prompts share (`pack_shared_prompts(common_prefix=True)`); "separate"
    packs prompt + completion per row (flash-attention); "padded" pads. Same log-probs in all three."""
    if layout == "shared_prompt":
        return pack_shared_prompts(prompts, completions, group_by_prompt(prompts), common_prefix=True)
    return pack_completions(prompts, completions, pad_token_id=pad_token_id, padding_free=layout == "separate")


def group_by_prompt(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Row indices grouped by identical prompt ids, in order of first appearance."""
    seen: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prompts):
        seen.setdefault(tuple(p), []).append(i)
    return list(seen.values())


def to_padded(batch: dict[str, torch.Tensor], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The same sequences right-padded to [B, T] with an attention mask; completion positions remapped."""
    cu = batch["cu_seq_lens"].tolist()
    flat = batch["input_ids"][0]
    seqs = [flat[a:b] for a, b in zip(cu[:-1], cu[1:])]
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    remap = torch.empty(len(flat), dtype=torch.long)
    for i, (s, a) in enumerate(zip(seqs, cu[:-1])):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
        remap[a:a + len(s)] = torch.arange(len(s)) + i * T
    out = {k: v for k, v in batch.items() if k not in ("cu_seq_lens", "position_ids")}
    out.update(input_ids=ids, attention_mask=mask, completion_positions=remap[batch["completion_positions"]],
               sequence_ends=remap[batch["sequence_ends"]])
    return out


_CAPTURE = threading.local()  # .slot: the list the decoder hook appends to during a completion_hidden call
_HOOKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # decoder -> its hook handle


def _capture_last_hidden(module: torch.nn.Module, args: Any, output: Any) -> None:
    slot = getattr(_CAPTURE, "slot", None)
    if slot is not None:
        slot.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])


def _decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The causal LM's decoder (its body, whose output is the last hidden state), or None where the model has no
    separate one. Its output is taken by a forward hook rather than `output_hidden_states=True`, which keeps every
    layer's output to the end of the forward: in a pass without gradients (reference, old log-probs) those would
    otherwise be freed layer by layer (L x [tokens, H] held for nothing)."""
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or decoder is model:
        return None
    return decoder


def _forward_kwargs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The kwargs of a completion forward over `batch` (packed, shared-prompt or padded)."""
    base = unwrap_model(model)
    head = base.get_output_embeddings()
    kwargs: dict[str, Any] = {"input_ids": batch["input_ids"], "use_cache": False}
    if head is not None:
        kwargs["logits_to_keep"] = 1
        if _decoder(base) is None:
            kwargs["output_hidden_states"] = True
    if "shared_prefix" in batch:
        kwargs["position_ids"] = batch["position_ids"]
        kwargs["toolkit_shared_prefix"] = batch["shared_prefix"]
        if "shared_context" in batch:
            kwargs["toolkit_shared_context"] = batch["shared_context"]
    elif "cu_seq_lens" in batch:
        kwargs["position_ids"] = batch["position_ids"]
        kwargs.update(varlen_kwargs(batch["cu_seq_lens"]))
    else:
        kwargs["attention_mask"] = batch["attention_mask"]
    if batch.get("pixels"):  # pixels not yet encoded would be dropped here and the image tokens read as text
        raise ValueError("completion_hidden: the batch holds images not yet encoded; pass it through "
                         "vision.attach_image_features(model, batch, processor) first.")
    kwargs.update({k: batch[k] for k in IMAGE_INPUT_KEYS if k in batch})  # rows with images (vision.py)
    return kwargs


def last_hidden(model: torch.nn.Module, kwargs: dict[str, Any]) -> torch.Tensor:
    """[B, T, H] final hidden states of a forward with `kwargs` (the LM head is not run over them)."""
    base = unwrap_model(model)
    head = base.get_output_embeddings()
    decoder = _decoder(base) if head is not None else None
    # without autograd (reference and behaviour scoring) on CPU, `logits_to_keep=1` hands a frozen model's head
    # a non-contiguous [B, 1, H] slice that torch multiplies with the weight expanded B times (models.py). Only
    # the fold (max_rows=0): scoring keeps the training forward's products, so old log-probs equal the first
    # iteration's bit for bit
    on_cpu = kwargs["input_ids"].device.type == "cpu"
    fold = _CpuInferenceLinear(max_rows=0) if on_cpu and not torch.is_grad_enabled() else contextlib.nullcontext()
    if decoder is not None and decoder not in _HOOKED:
        # one hook per decoder for its lifetime (a hook added and removed per call would make a compiled model
        # recompile); it records only while a call below has its slot open
        _HOOKED[decoder] = decoder.register_forward_hook(_capture_last_hidden)
    captured: list[torch.Tensor] = []
    _CAPTURE.slot = captured
    try:
        with fold:
            out = model(**kwargs)
    finally:
        _CAPTURE.slot = None
    if head is None:
        return out.last_hidden_state
    if captured:
        return captured[-1]
    if getattr(out, "hidden_states", None) is not None:
        return out.hidden_states[-1]
    # a patched forward that bypassed the decoder module's __call__ (no hook ran): ask for the states
    with fold:
        return model(**kwargs, output_hidden_states=True).hidden_states[-1]


def completion_hidden(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                      positions: torch.Tensor | None = None) -> torch.Tensor:
    """[N, H] final hidden states at the completion-predicting positions (or at `positions`).

    A causal LM runs with `logits_to_keep=1` (no full logits); a base model (a critic's or reward
    model's backbone, no LM head) returns its last hidden state directly. Not under sequence parallelism (each
    rank holds a share of the row's hidden states): `completion_token_pass` and `completion_logps` split the row.
    """
    if sequence_parallel_of(unwrap_model(model)) is not None:
        raise ValueError("completion_hidden: this model's rows are split over a sequence-parallel group; score "
                         "completions with completion_token_pass / completion_logps, which gather the log-probs.")
    hidden = last_hidden(model, _forward_kwargs(model, batch))
    return hidden.reshape(-1, hidden.shape[-1])[batch["completion_positions"] if positions is None else positions]


def _sequence_parallel_pass(model: torch.nn.Module, batch: dict[str, torch.Tensor], sp: SequenceParallel, *,
                            temperature: float, chunk_size: int, upcast: bool, entropy: bool) -> TokenLogps:
    """`completion_token_pass` with the row split over `sp`'s group: each rank runs the LM head on the completion
    positions it holds; the [N] log-probs (with `entropy`, the detached entropies from the same product) are
    gathered whole on every rank. No [N, H] hidden states: gathering them would cost each rank the whole row's."""
    kwargs, start, end = shard_row(_forward_kwargs(model, batch), sp)
    hidden = last_hidden(model, kwargs)[0]                                 # [L, H] this rank's tokens
    positions, targets = batch["completion_positions"], batch["completion_targets"]
    mine = ((positions >= start) & (positions < end)).nonzero().squeeze(1)
    local_hidden = hidden[positions[mine] - start]
    weight, bias = output_head(model)
    n = positions.numel()
    ent = None
    if entropy:  # with or without autograd (a step without signal logs its entropy too): one LM-head product
        logps, ent = chunked_token_logps_and_entropy(local_hidden, weight, targets[mine], bias=bias,
                                                     temperature=temperature, chunk_size=chunk_size, upcast=upcast)
    else:
        logps = chunked_token_logps(local_hidden, weight, targets[mine], bias=bias, temperature=temperature,
                                    chunk_size=chunk_size, upcast=upcast)
    return TokenLogps(gather_owned(logps, mine, n, sp),
                      entropy=gather_owned(ent.detach(), mine, n, sp) if ent is not None else None)


def completion_logps(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, temperature: float = 1.0,
                     chunk_size: int = 512, upcast: bool = True,
                     hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Flat [N] log-probs of the completion tokens under `model` (pass `hidden` to reuse a forward)."""
    sp = sequence_parallel_of(unwrap_model(model)) if hidden is None else None
    if sp is not None:
        return _sequence_parallel_pass(model, batch, sp, temperature=temperature, chunk_size=chunk_size,
                                       upcast=upcast, entropy=False).logps
    if hidden is None:
        hidden = completion_hidden(model, batch)
    weight, bias = output_head(model)  # whole even under FSDP2 (models.output_head)
    return chunked_token_logps(hidden, weight, batch["completion_targets"], bias=bias,
                               temperature=temperature, chunk_size=chunk_size, upcast=upcast)


def completion_logps_and_entropy(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, temperature: float = 1.0,
                                 chunk_size: int = 512, upcast: bool = True, hidden: torch.Tensor | None = None,
                                 keep_for_backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat [N] log-probs (with grad) and detached entropies of the completion tokens from one LM-head product
    per chunk: a training forward that also logs entropy. `keep_for_backward` as in
    `numerics.chunked_token_logps_and_entropy` (only when no other forward runs before this one's backward)."""
    if hidden is None:
        hidden = completion_hidden(model, batch)
    weight, bias = output_head(model)
    return chunked_token_logps_and_entropy(hidden, weight, batch["completion_targets"], bias=bias,
                                           temperature=temperature, chunk_size=chunk_size, upcast=upcast,
                                           keep_for_backward=keep_for_backward)


def completion_entropy(model: torch.nn.Module, hidden: torch.Tensor, *, temperature: float = 1.0,
                       chunk_size: int = 512, upcast: bool = True) -> torch.Tensor:
    """Detached [N] entropies of the completion tokens from hidden states already computed (a trainer's metrics
    when its log-probs came from an override that did not compute them)."""
    weight, bias = output_head(model)
    with torch.no_grad():
        return chunked_entropy(hidden.detach(), weight.detach(), bias=bias.detach() if bias is not None else None,
                               temperature=temperature, chunk_size=chunk_size, upcast=upcast)


@dataclass
class TokenLogps:
    """What one forward over a packed batch gives a policy loss: the completion tokens' log-probs, and what the
    metrics read from the same forward (so no trainer keeps them aside between calls)."""

    logps: torch.Tensor                   # [N] the completion tokens, row-major; carries the gradient
    entropy: torch.Tensor | None = None   # [N] detached, from the same LM-head product; None: not computed
    hidden: torch.Tensor | None = None    # [N, H] detached final hidden states (entropy can be computed from them)


def completion_token_pass(model: torch.nn.Module, batch: dict[str, torch.Tensor], *, temperature: float = 1.0,
                          chunk_size: int = 512, upcast: bool = True, hidden: torch.Tensor | None = None,
                          keep_for_backward: bool = False) -> TokenLogps:
    """The completion tokens' log-probs under `model`, with their entropy when autograd is on (a training forward:
    one LM-head product per chunk for both) and without it otherwise (scoring reference or old log-probs)."""
    sp = sequence_parallel_of(unwrap_model(model)) if hidden is None else None
    if sp is not None:
        return _sequence_parallel_pass(model, batch, sp, temperature=temperature, chunk_size=chunk_size,
                                       upcast=upcast, entropy=True)
    if hidden is None:
        hidden = completion_hidden(model, batch)
    if not torch.is_grad_enabled():
        return TokenLogps(completion_logps(model, batch, temperature=temperature, chunk_size=chunk_size,
                                           upcast=upcast, hidden=hidden), hidden=hidden.detach())
    logps, entropy = completion_logps_and_entropy(model, batch, temperature=temperature, chunk_size=chunk_size,
                                                  upcast=upcast, hidden=hidden, keep_for_backward=keep_for_backward)
    return TokenLogps(logps, entropy=entropy, hidden=hidden.detach())


def sequence_sums(flat: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Sum a flat per-token tensor within each sequence: [N] + lengths [B] -> [B]."""
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=flat.device), lengths.to(flat.device))
    return torch.zeros(len(lengths), dtype=flat.dtype, device=flat.device).index_add(0, seq, flat)
