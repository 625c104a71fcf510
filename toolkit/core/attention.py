"""Padding-free attention on CPU and any device without flash-attention.

Plain sdpa does *not* keep packed examples apart: given one packed row with `position_ids` that
restart at 0 and no mask, transformers (5.2x, measured) runs ordinary causal attention over the whole
row, so the second example attends to the first (its logits differ from the example run alone). So
packed rows must never reach plain sdpa. `varlen_sdpa` runs causal sdpa once per packed example
(boundaries from `cu_seq_lens_q`), so each example attends only to itself, attention costs what it
would without packing, and no padding is computed.

It also serves the shared-prompt layout of GRPO, DPO and PPO (`toolkit_shared_prefix`: a prompt once, then
its completions, each seeing the prompt and itself; `toolkit_shared_context`: the start all the row's
prompts share, once before them). Only `varlen_sdpa` reads that argument;
flash-attention derives boundaries from `position_ids` alone (a sequence starts where position_ids is
0), so under it the shared layout would let the second completion of a group attend to the first.
`packed_layout` is the one place that decides: the shared-prompt layout only for `toolkit_varlen`;
flash-attention gets one copy of the prompt per completion, positions restarting at 0, which is exactly
the boundaries it derives (tests/unit/test_attention_layouts.py checks this with transformers' own helper).

On the CPU the segments run one sdpa call each (sized and typed for the CPU's kernels, below). On any other
device that loop is a few kernel launches per segment per layer (a GRPO micro-batch of 8 prompts x 8 completions
is 72 segments, 30 layers, forward and backward): there the segments are gathered into padded batches of similar
length with a boolean mask and attended in a few sdpa calls per layer (`_batched_segments`, `_buckets`), the same
numbers (tests run both paths on the CPU against separate sequences).

It is registered with transformers' public `AttentionInterface` under the name `toolkit_varlen`
(and the sdpa mask under the same name), so a padded batch through the same model still takes the
ordinary sdpa path.
"""

from __future__ import annotations

__all__ = [
    "PACKED_LAYOUTS",
    "VARLEN_ATTENTION",
    "packed_layout",
    "supports_varlen",
    "use_varlen_attention",
    "varlen_kwargs",
    "varlen_sdpa",
]

import functools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .sequence_parallel import ulysses_attention

VARLEN_ATTENTION = "toolkit_varlen"


class _Segments:
    """Per-segment views of q, k or v [1, heads, T, d] along T, from one `split` where the segments tile the row.

    Slicing each segment out (the obvious way) costs, in backward, a zero-filled gradient of the whole row per
    slice, added up: measured at 6% of a PPO update (aten::fill_, 13k calls) with 9 segments per row. A split's
    backward is one concatenation. Segments that do not tile the row fall back to slices.
    """

    def __init__(self, t: torch.Tensor, bounds: list[tuple[int, int]]):
        self.t, self.parts = t, None
        cuts = sorted((int(a), int(b)) for a, b in bounds if b > a)
        if cuts and cuts[0][0] == 0 and cuts[-1][1] == t.shape[2] and all(
                x[1] == y[0] for x, y in zip(cuts, cuts[1:])):
            self.parts = dict(zip(cuts, t.split([b - a for a, b in cuts], dim=2)))

    def __call__(self, start: int, end: int) -> torch.Tensor:
        if self.parts is not None and (start, end) in self.parts:
            return self.parts[(start, end)]
        return self.t[:, :, start:end]


# Below this many query x key positions, a bfloat16 / float16 segment on CPU is attended in float32 and cast back.
# torch's CPU flash-attention kernel pays a fixed cost per call in low precision, mostly in backward: forward +
# backward of a 10-token segment took 1.0 ms in bfloat16 against 0.17 ms in float32 (0.23 ms cast up and back),
# and the packed layouts make one call per segment (28 a layer in a GRPO benchmark micro-batch, each run twice
# where activation checkpointing is on), so bf16 mixed-precision training ran slower than float32. The two cross near 256 x 256 positions; above it bfloat16 is the faster
# (measured on one 2-core AVX-512/AMX Xeon, torch 2.13; another CPU may cross elsewhere).
_CPU_FLOAT32_BELOW = 256 * 256
_LOW_PRECISION = {torch.bfloat16, torch.float16}
_CPU_ATTENTION_DTYPES = _LOW_PRECISION | {torch.float32}


def _segment_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """`F.scaled_dot_product_attention` for one segment; small low-precision CPU segments in float32.

    Low precision is the inputs' dtype or, under CPU autocast (bf16=True: accelerate wraps the forward in it),
    the autocast dtype: there the rotary embedding hands query and key over in float32 and autocast would run the
    kernel in bfloat16. The result comes back in the dtype the kernel would have returned. Anything else (float64,
    mixed dtypes outside autocast, another device) goes to the kernel as it is, errors included.
    """
    if q.device.type == "cpu" and q.shape[2] * k.shape[2] < _CPU_FLOAT32_BELOW:
        dtypes = {t.dtype for t in (q, k, v)}
        if dtypes <= _CPU_ATTENTION_DTYPES:
            autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") in _LOW_PRECISION
            low = len(dtypes) == 1 and dtypes <= _LOW_PRECISION
            if autocast or low:
                out_dtype = torch.get_autocast_dtype("cpu") if autocast else q.dtype
                mask = kwargs.get("attn_mask")
                if mask is not None and mask.is_floating_point():  # an additive mask must match the query's dtype
                    kwargs["attn_mask"] = mask.float()
                with torch.autocast("cpu", enabled=False):  # else CPU autocast could take it back to bfloat16
                    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs).to(out_dtype)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _shared_prefix_attention(query, key, value, groups, dropout: float, scaling: float | None, gqa: bool,
                             context: tuple[int, int] | None = None):
    """Attention for rows laid out as [context] [prompt | completion_1 | ... | completion_G] per group.

    The prompt attends causally to itself; each completion attends to the whole prompt and causally
    to itself, never to its siblings. Mathematically the same as G separate prompt+completion
    sequences, with the prompt computed once (and its gradient the sum over the G completions).
    A `context` (start, end) before the groups is a prefix of every group's prompt: it attends causally
    to itself, and every group's prompt and completions attend to all of it first.
    """
    bounds = ([tuple(context)] if context is not None else []) + [
        b for p_start, p_end, completions in groups for b in [(p_start, p_end), *completions]]
    q, k_, v_ = (_Segments(t, bounds) for t in (query, key, value))
    outs = []
    ctx_k = ctx_v = None
    if context is not None and context[1] > context[0]:
        c0, c1 = context
        outs.append(_segment_sdpa(q(c0, c1), k_(c0, c1), v_(c0, c1),
                                  is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=gqa))
        ctx_k, ctx_v = k_(c0, c1), v_(c0, c1)

    def after(prefix_k, prefix_v, start, end):
        """query[start:end] attending to all of prefix_k/v, then causally to itself."""
        n, n_prefix = end - start, prefix_k.shape[2]
        k = torch.cat([prefix_k, k_(start, end)], dim=2)
        v = torch.cat([prefix_v, v_(start, end)], dim=2)
        mask = torch.ones(n, n_prefix + n, dtype=torch.bool, device=query.device)
        mask[:, n_prefix:] = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
        return _segment_sdpa(q(start, end), k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa)

    for p_start, p_end, completions in groups:
        kp, vp = k_(p_start, p_end), v_(p_start, p_end)
        if p_end > p_start:
            if ctx_k is None:
                outs.append(_segment_sdpa(q(p_start, p_end), kp, vp, is_causal=True,
                                          dropout_p=dropout, scale=scaling, enable_gqa=gqa))
            else:
                outs.append(after(ctx_k, ctx_v, p_start, p_end))
        if ctx_k is not None:  # the whole prompt: the shared context, then this group's own part of it
            kp, vp = torch.cat([ctx_k, kp], dim=2), torch.cat([ctx_v, vp], dim=2)
        for c_start, c_end in completions:
            if c_end > c_start:
                outs.append(after(kp, vp, c_start, c_end))
    return torch.cat(outs, dim=2)


def _batched_segments(t: torch.Tensor) -> bool:
    """Whether packed segments run as a few padded sdpa calls (off the CPU) or one call per segment (on it).

    On a GPU the per-segment loop is kernel launches and Python for little arithmetic (72 segments a layer in the
    GPU benchmark's micro-batch, each a few launches); that this is what made ours slow there is a hypothesis: in
    the one GPU run (bench/results/gpu) the recomputed forward of activation checkpointing added 0.9 s a step, in
    a pair of runs whose noise is as large. On the CPU the loop is the faster (bench/attention_paths.py): the
    padded calls pay for every completion's copy of its prompt's keys, and for padding.
    """
    return t.device.type != "cpu"


# A segment: (start, end, prefix) where the queries start..end attend to every key of the `prefix` ranges (each
# (start, end)), then causally to their own keys.
_Spec = tuple[int, int, tuple[tuple[int, int], ...]]


# Segments are attended in buckets of similar length, one sdpa call each: a bucket's padded area (segments x
# longest queries x longest keys) stays within _PAD_FACTOR times the area its segments really cover (+ _PAD_SLACK
# positions, so tiny segments still share a call) and its mask, grouped-query heads folded in, within _MASK_ELEMENTS
# (a GPU's memory-efficient kernel takes it as an additive bias of that many elements). Long segments (more than
# _ALONE_KEYS keys) and buckets of one segment go alone, as the loop sends them: causal with no mask where nothing
# comes before them, so the kernel that needs no mask (flash on a GPU) still takes a long packed SFT example, whose
# mask would be L^2 per layer. A GRPO micro-batch of short prompts and completions is a few buckets.
_PAD_FACTOR = 2
_PAD_SLACK = 4096
_MASK_ELEMENTS = 2**24
_ALONE_KEYS = 1024


def _buckets(own: list[int], n_keys: list[int], rep: int = 1) -> list[list[int]]:
    """Segment indices grouped for padded calls, shortest keys first (see _PAD_FACTOR); `rep` query heads per key
    head multiply a bucket's mask."""
    buckets: list[list[int]] = []
    current: list[int] = []
    area = longest_q = 0
    for s in sorted(range(len(own)), key=lambda s: (n_keys[s], own[s])):
        q, k = max(longest_q, own[s]), n_keys[s]  # sorted: this segment has the most keys so far
        padded = (len(current) + 1) * q * k
        if current and (padded > _PAD_FACTOR * (area + own[s] * k) + _PAD_SLACK or padded * rep > _MASK_ELEMENTS):
            buckets.append(current)
            current, area, q = [], 0, own[s]
        current.append(s)
        area += own[s] * k
        longest_q = q
    return buckets + [current]


@functools.lru_cache(maxsize=4)  # one layout per micro-batch; every layer of its forward (and recompute) reuses it
def _segment_plan(specs: tuple[_Spec, ...], total: int, device: torch.device, rep: int = 1):
    """How to attend `specs` with `rep` query heads per key head: (calls, output index [total]) where each call is
    ("padded", query index [S * Lq], key index [S * Lk], mask [S, 1, rep * Lq, Lk], {dtype: additive bias}) or
    ("alone", spec), and the output index points into the calls' outputs laid end to end; None when the segments
    do not tile 0..total (the loop path handles that). Built once per micro-batch layout (cached), outside
    inference mode so a plan made in a no-grad pass serves a training one."""
    specs = tuple(sp for sp in specs if sp[1] > sp[0])
    spans = sorted((a, b) for a, b, _ in specs)
    if not spans or spans[0][0] != 0 or spans[-1][1] != total or any(x[1] != y[0] for x, y in zip(spans, spans[1:])):
        return None
    with torch.inference_mode(False):
        return _build_plan(specs, total, device, rep)


def _build_plan(specs: tuple[_Spec, ...], total: int, device: torch.device, rep: int):
    own = [b - a for a, b, _ in specs]
    n_keys = [b - a + sum(pe - ps for ps, pe in prefix) for a, b, prefix in specs]
    small = [s for s in range(len(specs)) if n_keys[s] <= _ALONE_KEYS]
    buckets = [[small[i] for i in b] for b in _buckets([own[s] for s in small], [n_keys[s] for s in small], rep)] \
        if small else []
    groups = [b for b in buckets if len(b) > 1] + [[s] for b in buckets if len(b) == 1 for s in b] + [
        [s] for s in range(len(specs)) if n_keys[s] > _ALONE_KEYS]
    calls, out_idx, offset = [], torch.empty(total, dtype=torch.long), 0
    for bucket in groups:
        if len(bucket) == 1:
            a, b, _ = specs[bucket[0]]
            calls.append(("alone", specs[bucket[0]]))
            out_idx[a:b] = torch.arange(offset, offset + b - a)
            offset += b - a
            continue
        keys = [[i for ps, pe in specs[s][2] for i in range(ps, pe)] + list(range(*specs[s][:2])) for s in bucket]
        # keys padded to a multiple of 16 (masked): the memory-efficient kernel would otherwise copy the bias to pad it
        Lq, Lk = max(own[s] for s in bucket), -(-max(map(len, keys)) // 16) * 16
        k_idx = torch.tensor([k + [0] * (Lk - len(k)) for k in keys], dtype=torch.long)
        starts, n_own, n_pre = (torch.tensor(x, dtype=torch.long) for x in (
            [specs[s][0] for s in bucket], [own[s] for s in bucket], [len(k) - own[s] for k, s in zip(keys, bucket)]))
        i = torch.arange(Lq)
        q_idx = starts[:, None] + torch.minimum(i[None, :], n_own[:, None] - 1)  # padded rows repeat the last query
        i, j = i[None, :, None], torch.arange(Lk)[None, None, :]
        pre, n = n_pre[:, None, None], n_own[:, None, None]
        real = i < n
        mask = real & ((j < pre) | ((j >= pre) & (j - pre <= i)))
        # A padded query row sees one key: an all-masked row is NaN, and NaN times a zero gradient is still NaN.
        mask |= ~real & (j == 0)
        for r, s in enumerate(bucket):
            a, b, _ = specs[s]
            out_idx[a:b] = torch.arange(offset + r * Lq, offset + r * Lq + (b - a))
        offset += len(bucket) * Lq
        # the query rows of the `rep` heads that share a key head come as `rep` blocks of Lq (see _attend_segments)
        mask = mask[:, None].repeat(1, 1, rep, 1)
        calls.append(("padded", q_idx.reshape(-1).to(device), k_idx.reshape(-1).to(device), mask.to(device), {}))
    return calls, out_idx.to(device)


def _attend_alone(query, key, value, spec: _Spec, dropout: float, scaling: float | None, gqa: bool) -> torch.Tensor:
    """One segment as the loop attends it: causal with no mask when nothing precedes it, else its prefix in full
    and itself causally. [1, H, n, dv]."""
    a, b, prefix = spec
    if not prefix:
        return F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                              dropout_p=dropout, scale=scaling, enable_gqa=gqa)
    k = torch.cat([key[:, :, ps:pe] for ps, pe in prefix] + [key[:, :, a:b]], dim=2)
    v = torch.cat([value[:, :, ps:pe] for ps, pe in prefix] + [value[:, :, a:b]], dim=2)
    n, n_prefix = b - a, k.shape[2] - (b - a)
    mask = torch.ones(n, n_prefix + n, dtype=torch.bool, device=query.device)
    mask[:, n_prefix:] = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
    return F.scaled_dot_product_attention(query[:, :, a:b], k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                          enable_gqa=gqa)


def _attend_segments(query, key, value, specs: tuple[_Spec, ...], dropout: float, scaling: float | None):
    """query [1, H, T, d], key/value [1, kvH, T, d] -> [1, H, T, dv], the segments in a few padded sdpa calls
    (`_segment_plan`); None when the segments do not tile the row."""
    heads, kv_heads = query.shape[1], key.shape[1]
    rep = heads // kv_heads
    plan = _segment_plan(specs, query.shape[2], query.device, rep)
    if plan is None:
        return None
    calls, out_idx = plan
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else query.dtype
    outs = []
    for call in calls:
        if call[0] == "alone":
            outs.append(_attend_alone(query, key, value, call[1], dropout, scaling, heads != kv_heads)[0])
            continue
        _, q_idx, k_idx, mask, biases = call
        S, Lq, Lk = mask.shape[0], mask.shape[2] // rep, mask.shape[3]
        # Grouped-query attention without expanding keys and values: the `rep` query heads that share a kv head
        # become `rep` blocks of queries against it (query head h uses kv head h // rep, as transformers' repeat_kv).
        q = query[0].index_select(1, q_idx).view(kv_heads, rep, S, Lq, -1).permute(2, 0, 1, 3, 4)
        q = q.reshape(S, kv_heads, rep * Lq, -1)
        k = key[0].index_select(1, k_idx).view(kv_heads, S, Lk, -1).transpose(0, 1)
        v = value[0].index_select(1, k_idx).view(kv_heads, S, Lk, -1).transpose(0, 1)
        if dtype not in biases:  # one additive bias per micro-batch, shared by every layer (and their backward)
            biases[dtype] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=biases[dtype], dropout_p=dropout, scale=scaling)
        out = out.view(S, kv_heads, rep, Lq, -1).permute(1, 2, 0, 3, 4)  # [kvH, rep, S, Lq, dv]
        outs.append(out.reshape(heads, S * Lq, -1))
    return torch.cat(outs, dim=1).index_select(1, out_idx).unsqueeze(0)


def _shared_prefix_specs(groups, context: tuple[int, int] | None) -> tuple[_Spec, ...]:
    """`_shared_prefix_attention`'s segments as specs: the context causal; a prompt after the context; a
    completion after the context and its whole prompt."""
    ctx = ((int(context[0]), int(context[1])),) if context is not None and context[1] > context[0] else ()
    specs = [(ctx[0][0], ctx[0][1], ())] if ctx else []
    for p_start, p_end, completions in groups:
        prompt = ((int(p_start), int(p_end)),) if p_end > p_start else ()
        specs += [(int(p_start), int(p_end), ctx)] if prompt else []
        specs += [(int(c_start), int(c_end), ctx + prompt) for c_start, c_end in completions]
    return tuple(specs)


def varlen_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                cu_seq_lens_q: torch.Tensor | None = None, toolkit_shared_prefix: list | None = None,
                toolkit_shared_context: tuple[int, int] | None = None, **kwargs):
    """query [1, heads, T, d], key/value [1, kv_heads, T, d]; `cu_seq_lens_q` [n+1] boundaries of the packed examples.

    With `toolkit_shared_prefix` (list of (prompt_start, prompt_end, [(completion_start, completion_end)])),
    completions that share a prompt are laid out once after it (see `_shared_prefix_attention`);
    `toolkit_shared_context` (start, end) is a prefix all groups' prompts share, laid out once before them.
    With `toolkit_sp` (a sequence-parallel forward), q/k/v hold this rank's share of the row's tokens: the
    attention runs over the whole row on a share of the heads (`sequence_parallel.ulysses_attention`).
    """
    shard = kwargs.pop("toolkit_sp", None)
    if shard is not None:
        return ulysses_attention(varlen_sdpa, module, query, key, value, attention_mask, shard, dropout=dropout,
                                 scaling=scaling, cu_seq_lens_q=cu_seq_lens_q, toolkit_shared_prefix=toolkit_shared_prefix,
                                 toolkit_shared_context=toolkit_shared_context, **kwargs)
    if toolkit_shared_prefix is not None and query.shape[0] == 1:
        out = None
        if _batched_segments(query):
            out = _attend_segments(query, key, value, _shared_prefix_specs(toolkit_shared_prefix,
                                                                           toolkit_shared_context), dropout, scaling)
        if out is None:
            out = _shared_prefix_attention(query, key, value, toolkit_shared_prefix, dropout, scaling,
                                           query.shape[1] != key.shape[1], context=toolkit_shared_context)
        return out.transpose(1, 2).contiguous(), None
    if cu_seq_lens_q is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    cu = cu_seq_lens_q.tolist()
    bounds = list(zip(cu[:-1], cu[1:]))
    if _batched_segments(query):
        out = _attend_segments(query, key, value, tuple((a, b, ()) for a, b in bounds), dropout, scaling)
        if out is not None:
            return out.transpose(1, 2).contiguous(), None
    q, k, v = (_Segments(t, bounds) for t in (query, key, value))
    outs = []
    for start, end in bounds:
        if end <= start:
            continue
        outs.append(_segment_sdpa(q(start, end), k(start, end), v(start, end),
                                  is_causal=True, dropout_p=dropout, scale=scaling, enable_gqa=gqa))
    out = torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(VARLEN_ATTENTION, varlen_sdpa)
AttentionMaskInterface.register(VARLEN_ATTENTION, sdpa_mask)


def varlen_kwargs(cu_seq_lens: torch.Tensor) -> dict[str, torch.Tensor | int]:
    """The kwargs transformers passes down to attention for packed rows (same names as flash-attention varlen)."""
    cu = cu_seq_lens.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


_SWITCHABLE = ("sdpa", "eager", None)
_NATIVE_VARLEN = ("flash_attention_2", "flash_attention_3", VARLEN_ATTENTION)


def supports_varlen(model) -> bool:
    """Whether packed rows can run through `model` with each example attending only to itself."""
    return getattr(model.config, "_attn_implementation", None) in _SWITCHABLE + _NATIVE_VARLEN


PACKED_LAYOUTS = ("shared_prompt", "separate", "padded")


def packed_layout(*models) -> str:
    """How GRPO and DPO may lay out a micro-batch for these models' attention (all must agree):

    - "shared_prompt": one copy of each prompt followed by its completions (`pack_shared_prompts`); only
      `toolkit_varlen` reads the `toolkit_shared_prefix` boundaries this needs.
    - "separate": packed rows of prompt + completion, positions restarting at 0 per sequence
      (`pack_completions(padding_free=True)`); what flash-attention's varlen kernels derive from position_ids.
    - "padded": a padded batch with an attention mask (any other implementation).

    Call it after `use_varlen_attention` (which switches sdpa/eager to `toolkit_varlen`).
    """
    impls = {getattr(m.config, "_attn_implementation", None) for m in models if m is not None}
    if impls == {VARLEN_ATTENTION}:
        return "shared_prompt"
    if impls and impls <= set(_NATIVE_VARLEN):
        return "separate"
    return "padded"


def use_varlen_attention(model) -> None:
    """Switch a model from sdpa/eager to `toolkit_varlen`; flash-attention handles varlen natively and stays."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl in _SWITCHABLE:
        model.set_attn_implementation(VARLEN_ATTENTION)
    elif impl not in _NATIVE_VARLEN:
        raise ValueError(f"attention implementation '{impl}' cannot run packed rows")
