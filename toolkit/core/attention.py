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
the boundaries it derives (tests/test_attention_layouts.py checks this with transformers' own helper).

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

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

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


def varlen_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                cu_seq_lens_q: torch.Tensor | None = None, toolkit_shared_prefix: list | None = None,
                toolkit_shared_context: tuple[int, int] | None = None, **kwargs):
    """query [1, heads, T, d], key/value [1, kv_heads, T, d]; `cu_seq_lens_q` [n+1] boundaries of the packed examples.

    With `toolkit_shared_prefix` (list of (prompt_start, prompt_end, [(completion_start, completion_end)])),
    completions that share a prompt are laid out once after it (see `_shared_prefix_attention`);
    `toolkit_shared_context` (start, end) is a prefix all groups' prompts share, laid out once before them.
    """
    if toolkit_shared_prefix is not None and query.shape[0] == 1:
        out = _shared_prefix_attention(query, key, value, toolkit_shared_prefix, dropout, scaling,
                                       query.shape[1] != key.shape[1], context=toolkit_shared_context)
        return out.transpose(1, 2).contiguous(), None
    if cu_seq_lens_q is None or query.shape[0] != 1 or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    gqa = query.shape[1] != key.shape[1]
    cu = cu_seq_lens_q.tolist()
    bounds = list(zip(cu[:-1], cu[1:]))
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
