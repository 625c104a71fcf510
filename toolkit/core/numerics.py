"""The numerics every trainer must agree on, once, as small pure tensor functions.

Log-probabilities, entropy, masked aggregation and KL estimators live here and nowhere else:
trainers may copy orchestration code from each other (with a `Copied from` marker), never these.
Each function has a naive reference in `tests/unit/test_numerics.py`.

Shapes use N for a flat number of token positions, B for batch, T for sequence length,
H for hidden size and V for vocabulary size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Literal

import torch

__all__ = [
    "AGGREGATIONS",
    "Aggregation",
    "DEFAULT_CHUNK_SIZE",
    "SCALE_REWARDS",
    "aggregate",
    "chunked_entropy",
    "chunked_token_logps",
    "chunked_token_logps_and_entropy",
    "clipped_surrogate",
    "clipped_value_loss",
    "explained_variance",
    "gae",
    "group_advantages",
    "gspo_surrogate",
    "importance_weights",
    "kl_estimate",
    "loglinear_proximal_logps",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "off_policy_sequence_mask",
    "preference_loss",
    "rloo_advantages",
    "second_moment_mask",
    "tokens_to_rows",
    "truncated_importance_weights",
    "upcast_region",
]

#: Default number of token positions whose logits exist at once: 512 x 49,152 x 4 bytes = 100 MB.
DEFAULT_CHUNK_SIZE = 512


def upcast_region(upcast: bool, device_type: str) -> Any:
    """Autocast off where `upcast` promises float32 products: a wrapper's bfloat16 / float16 autocast region would
    take them back to low precision whatever their inputs' dtypes. On CUDA, TF32 off too (the GPU default turns it
    on for float32 matmuls; a TF32 product keeps 10 bits of mantissa, which is what the fp32 head is there to
    avoid)."""
    if not upcast:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    if torch.is_autocast_enabled(device_type):
        stack.enter_context(torch.autocast(device_type, enabled=False))
    if device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        stack.enter_context(_full_fp32_matmuls())
    return stack


@contextlib.contextmanager
def _full_fp32_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = True


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, upcast: bool) -> torch.Tensor:
    """[n, H] x [V, H] -> [n, V] logits, in fp32 when `upcast` (ScaleRL: fp32 LM head raises the asymptote)."""
    if upcast:
        h, weight = h.float(), weight.float()
        bias = bias.float() if bias is not None else None
    with upcast_region(upcast, h.device.type):
        logits = h @ weight.t()
        if bias is not None:
            logits = logits + bias
    return logits.float()


class _ChunkedTokenLogps(torch.autograd.Function):
    """log softmax(h W^T / temperature)[target], computed chunk by chunk in forward *and* backward.

    Autograd through a plain Python loop over chunks would keep every chunk's [n, V] logits alive
    until backward, which is the very tensor we want never to hold. So backward recomputes each
    chunk's logits (one extra LM-head matmul) and forms the gradient directly:
        d logp_t / d z = onehot(target) - softmax(z),  z = logits / temperature.
    `chunked_token_logps_and_entropy(..., keep_for_backward=True)`, when everything is one chunk
    (n <= chunk_size), keeps that chunk's log-softmax instead, for a caller whose backward follows directly.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk_size: int, upcast: bool,
                with_entropy: bool = False, keep_for_backward: bool = False):
        n = hidden.shape[0]
        logps = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device) if with_entropy else None
        # the head cast once per call, not once per chunk (a [V, H] copy each time for bf16 weights)
        head = weight.float() if upcast else weight
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            z = _chunk_logits(hidden[start:end], head, bias, upcast)
            if temperature != 1.0:
                z.div_(temperature)
            lse[start:end] = torch.logsumexp(z, dim=-1)
            logps[start:end] = z.gather(-1, targets[start:end, None]).squeeze(-1) - lse[start:end]
            # One chunk only (n <= chunk_size), asked for, and a gradient to come: keep its log-softmax for
            # backward rather than recompute the LM-head product there. Only for a caller whose backward follows
            # this forward directly (GRPO's step, PPO's with a value head): backward would rebuild this very chunk
            # at its start, with the same activations alive, so the peak is the same. With another forward in
            # between (a reference or critic model) the kept chunk would add to that forward's peak.
            keep = keep_for_backward and n <= chunk_size and any(ctx.needs_input_grad[:3])
            if entropy is not None or keep:
                logp = z.sub_(lse[start:end, None])  # log p, in z's storage
                if entropy is not None:  # from the same logits: -sum p log p
                    entropy[start:end] = -logp.exp().mul_(logp).sum(-1)
                if keep:
                    ctx.kept_logp = logp
                del logp  # else the next chunk's logits would be built while this one's are still held
            del z
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets, lse)
        ctx.has_bias = bias is not None
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.upcast = upcast
        if entropy is not None:
            ctx.mark_non_differentiable(entropy)
            return logps, entropy
        return logps

    @staticmethod
    def backward(ctx, grad_logps, *_no_grad_for_entropy):
        with upcast_region(ctx.upcast, grad_logps.device.type):  # a backward() called inside autocast
            return _ChunkedTokenLogps._backward(ctx, grad_logps)

    @staticmethod
    def _backward(ctx, grad_logps):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = grad_b = None  # the first chunk's product starts them (no [V, H] of zeros to fill first)
        w32 = weight.float() if (ctx.upcast or weight.dtype == torch.float32) else weight
        grad_logps = grad_logps.float()
        # released here, not with the graph: the body's backward comes next and its gradients pile up meanwhile
        # (a retained graph's second backward recomputes)
        kept, ctx.kept_logp = getattr(ctx, "kept_logp", None), None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            g = grad_logps[start:end]
            if kept is not None:  # the one chunk's log-softmax, kept by forward
                dz, kept = kept.exp_().mul_(-g[:, None]), None  # released above: built in its storage
            else:
                z = _chunk_logits(h, w32 if ctx.upcast else weight, bias, ctx.upcast)
                if ctx.temperature != 1.0:
                    z.div_(ctx.temperature)
                # dz = g * (onehot - softmax), built in place in z's storage.
                dz = z.sub_(lse[start:end, None]).exp_().mul_(-g[:, None])
            dz.scatter_add_(-1, targets[start:end, None], g[:, None])
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            if need_h:
                grad_h[start:end] = (dz.to(w32.dtype) @ w32).to(hidden.dtype)
            if need_w:  # accumulate in place: no [V, H] temporary per chunk
                if grad_w is None:
                    grad_w = dz.t() @ h.to(torch.float32)
                else:
                    grad_w.addmm_(dz.t(), h.to(torch.float32))
            if need_b:
                grad_b = dz.sum(0) if grad_b is None else grad_b.add_(dz.sum(0))
            del dz
        # no positions (a micro-batch with nothing to score): zeros, not None, so every rank's head gradient
        # exists (a DDP / FSDP2 reduction waits for it) and the optimizer steps it as before
        if need_w and grad_w is None:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        if need_b and grad_b is None:
            grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(weight.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def chunked_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    upcast: bool = True,
) -> torch.Tensor:
    """Per-token log-probabilities of `targets` under softmax(hidden @ weight.T / temperature).

    Args:
        hidden: [N, H] final hidden states at the positions that predict `targets` (already shifted).
        weight: [V, H] LM-head weight (tied or not). `bias`: optional [V].
        targets: [N] token ids.
        temperature: logits are divided by it, exactly as the sampler does, so sampler and trainer
            log-probs agree (field note 8: a temperature applied on one side only doubles the ratio).
        chunk_size: positions whose [chunk, V] logits exist at once, in forward and in backward.
        upcast: compute the LM head in fp32 even when the model runs in bf16.

    Returns:
        [N] fp32 log-probabilities, differentiable with respect to `hidden`, `weight` and `bias`.
        Peak extra memory is O(chunk_size x V) instead of O(N x V).
    """
    _check_chunked_args("chunked_token_logps", hidden, targets, temperature, chunk_size)
    return _ChunkedTokenLogps.apply(hidden, weight, bias, targets.long(), float(temperature), int(chunk_size), upcast)


def _check_chunked_args(name: str, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                        chunk_size: int) -> None:
    if hidden.dim() != 2 or targets.dim() != 1 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{name} expects hidden [N, H] and targets [N]; got {tuple(hidden.shape)} "
                         f"and {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def chunked_token_logps_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    upcast: bool = True,
    keep_for_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunked_token_logps` and, from the same chunks of logits, the [N] entropy (nats) of each position's
    distribution, without gradient (a metric): one LM-head product where `chunked_token_logps` and
    `chunked_entropy` take two (on the 135M model, 90 ms of a GRPO step's 3 s, and a softmax of 49k per token).

    `keep_for_backward`: when all N positions fit one chunk, keep that chunk's [N, V] log-softmax until
    backward instead of recomputing the LM-head product there. For a caller whose backward follows this call
    with no other forward in between (then the peak is the same); otherwise it adds N x V floats to that
    forward's peak."""
    _check_chunked_args("chunked_token_logps_and_entropy", hidden, targets, temperature, chunk_size)
    return _ChunkedTokenLogps.apply(hidden, weight, bias, targets.long(), float(temperature), int(chunk_size), upcast,
                                    True, bool(keep_for_backward))


@torch.no_grad()
def chunked_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    upcast: bool = True,
) -> torch.Tensor:
    """[N] entropy (nats) of softmax(hidden @ weight.T / temperature), chunked; no gradient (a metric)."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    head = weight.float() if upcast else weight  # cast once per call
    for start in range(0, hidden.shape[0], chunk_size):
        end = min(start + chunk_size, hidden.shape[0])
        z = _chunk_logits(hidden[start:end], head, bias, upcast)
        if temperature != 1.0:
            z.div_(temperature)
        logp = torch.log_softmax(z, dim=-1)
        out[start:end] = -(logp.exp() * logp).sum(-1)
    return out


def tokens_to_rows(flat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Flat per-token values [N] (row-major, the `True` positions of `mask`) -> [B, T] with zeros elsewhere."""
    return torch.zeros(mask.shape, dtype=flat.dtype, device=flat.device).masked_scatter(mask, flat)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is true (mask may be bool or 0/1 float)."""
    values = values * mask.to(values.dtype)
    return values.sum() if dim is None else values.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` where `mask` is true; an empty mask gives 0, not NaN (the caller decides if that is an error)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


#: How a [B, T] per-token loss becomes a scalar. The names are the RL literature's:
#: - "sequence": mean over each sequence's tokens, then mean over sequences (GRPO paper).
#: - "token": sum over all tokens / number of tokens in the batch (BNPO, DAPO; SFT uses this).
#: - "constant": sum over all tokens / (B x `constant`), `constant` usually max completion length (Dr. GRPO).
#: - "prompt": mean over all tokens of each prompt's group of generations, then mean over prompts (ScaleRL).
AGGREGATIONS = ("sequence", "token", "constant", "prompt")
Aggregation = Literal["sequence", "token", "constant", "prompt"]


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    *,
    constant: float | None = None,
    group_ids: torch.Tensor | None = None,
    num_items: float | torch.Tensor | None = None,
    num_sequences: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token quantity to a scalar under one of `AGGREGATIONS`.

    `num_items` / `num_sequences`, when given, replace the local token / sequence counts by global
    ones (all micro-batches of an accumulated step, all ranks), so that splitting a batch into
    micro-batches does not change the gradient (8x1 equals 4x2).
    """
    mask = mask.to(per_token.dtype)
    if mode == "token":
        denom = num_items if num_items is not None else mask.sum().clamp(min=1)
        return (per_token * mask).sum() / denom
    if mode == "sequence":
        per_seq = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        denom = num_sequences if num_sequences is not None else per_token.shape[0]
        return per_seq.sum() / denom
    if mode == "constant":
        if constant is None or constant <= 0:
            raise ValueError("aggregate(mode='constant') needs constant > 0 (usually max_completion_length)")
        denom = num_sequences if num_sequences is not None else per_token.shape[0]
        return (per_token * mask).sum() / (denom * constant)
    if mode == "prompt":
        if group_ids is None:
            raise ValueError("aggregate(mode='prompt') needs group_ids: [B] index of each row's prompt")
        groups, inverse = torch.unique(group_ids, return_inverse=True)
        sums = torch.zeros(len(groups), dtype=per_token.dtype, device=per_token.device)
        counts = torch.zeros_like(sums)
        sums.index_add_(0, inverse, (per_token * mask).sum(-1))
        counts.index_add_(0, inverse, mask.sum(-1))
        denom = num_sequences if num_sequences is not None else len(groups)
        return (sums / counts.clamp(min=1)).sum() / denom
    raise ValueError(f"unknown aggregation '{mode}'; choose one of {AGGREGATIONS}")


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, kind: Literal["k1", "k2", "k3"] = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman, "Approximating KL divergence").

    With r = ref_logps - logps: k1 = -r (unbiased, high variance, can be negative);
    k2 = r^2 / 2 (biased, low variance); k3 = exp(r) - r - 1 (unbiased, always >= 0; GRPO's choice).
    """
    log_ratio = ref_logps - logps
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.pow(2)
    if kind == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"unknown KL estimator '{kind}'; choose k1, k2 or k3")


# --------------------------------------------------------------------------------------------------
# RL numerics: advantages, policy losses, importance weights
# --------------------------------------------------------------------------------------------------

SCALE_REWARDS = ("group", "batch", "batch_centred", "none")


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: str = "group", eps: float = 1e-4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages (GRPO, DeepSeekMath eq. 3; Dr. GRPO and ScaleRL for the scaling variants).

    Args:
        rewards: [B] rewards, B = groups x `group_size`, rows of one group contiguous. NaN marks a
            row without a reward: it is left out of its group's statistics and gets advantage 0.
        scale: "group": (r - mean_g) / (std_g + eps); "batch": (r - mean_g) / (std of the raw rewards
            over the batch + eps), TRL's option of that name; "batch_centred": (r - mean_g) / (std over
            the batch of the group-centred rewards + eps), ScaleRL's batch-level advantage normalisation
            (the spread between prompts' mean rewards does not inflate the divisor); "none": r - mean_g
            (Dr. GRPO: no std division, which biases towards easy/hard prompts otherwise).

    Returns:
        (advantages [B], zero_std [B] bool): zero_std marks rows whose group has fewer than two
        rewarded rows or all-equal rewards, i.e. no learning signal (zero-variance filtering).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [groups * {group_size}], got {tuple(rewards.shape)}")
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale!r}")
    r = rewards.view(-1, group_size).float()
    valid = ~torch.isnan(r)
    count = valid.sum(-1, keepdim=True)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    mean = r0.sum(-1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(valid, r - mean, torch.zeros_like(r))
    # unbiased std within the group, as torch.std (and TRL) compute it
    var = centred.pow(2).sum(-1, keepdim=True) / (count - 1).clamp(min=1)
    std = var.sqrt()
    zero_std = (count < 2) | (std < 1e-8)
    if scale == "group":
        adv = centred / (std + eps)
    elif scale in ("batch", "batch_centred"):
        flat = r[valid] if scale == "batch" else centred[valid]  # unbiased std, as torch.std (and TRL)
        batch_std = flat.std() if flat.numel() > 1 else torch.zeros((), dtype=flat.dtype)
        adv = centred / (batch_std + eps)
    else:
        adv = centred
    adv = torch.where(valid & ~zero_std, adv, torch.zeros_like(adv))
    return adv.reshape(-1), zero_std.expand_as(r).reshape(-1)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out advantages (Ahmadian et al., 2024): r_i - mean of the other rewards of its group.

    Equals count/(count-1) x (r_i - group mean), with count the rewarded rows of the group; an
    unbiased baseline, no std division. NaN rows and the zero_std mask are treated as in
    `group_advantages`.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [groups * {group_size}], got {tuple(rewards.shape)}")
    r = rewards.view(-1, group_size).float()
    valid = ~torch.isnan(r)
    count = valid.sum(-1, keepdim=True)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    total = r0.sum(-1, keepdim=True)
    others_mean = (total - r0) / (count - 1).clamp(min=1)
    centred = torch.where(valid, r - total / count.clamp(min=1), torch.zeros_like(r))
    zero_std = (count < 2) | (centred.abs().amax(-1, keepdim=True) < 1e-8)
    adv = torch.where(valid & ~zero_std, r0 - others_mean, torch.zeros_like(r))
    return adv.reshape(-1), zero_std.expand_as(r).reshape(-1)


def gspo_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    token_level: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GSPO loss (Zheng et al. 2025): the clipped surrogate with one importance ratio per sequence,

        s_i = exp(mean over the completion's tokens of (log pi - log pi_old))

    the length-normalised sequence likelihood ratio, clipped to [1 - eps_low, 1 + eps_high] (GSPO's ranges are
    about 3e-4 / 4e-4, not PPO's 0.2). `token_level=True` is GSPO-token: s_i,t = sg[s_i] pi(y_t) / sg[pi(y_t)],
    the same value for every token of a sequence, with each token's own gradient (so per-token advantages can
    be used). logps, old_logps, mask: [B, T]; advantages [B] or [B, T]. Returns (loss [B, T], info) as
    `clipped_surrogate` does (the masks are per sequence, repeated over its tokens).
    """
    m = mask.to(logps.dtype)
    seq_log_ratio = ((logps - old_logps) * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [B]
    if token_level:
        log_ratio = seq_log_ratio.detach()[:, None] + logps - logps.detach()
    else:
        log_ratio = seq_log_ratio[:, None].expand_as(logps)
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    loss = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv)
    info = {
        "ratio": ratio.detach(),
        "clipped_low": ((ratio < 1 - epsilon_low) & (adv < 0)).detach(),
        "clipped_high": ((ratio > 1 + epsilon_high) & (adv > 0)).detach(),
    }
    return loss, info


def clipped_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token PPO clipped surrogate loss, -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).

    logps, old_logps: [B, T]; advantages: [B] (broadcast over tokens) or [B, T]. Returns (loss [B, T], info)
    where info holds per-token bool masks `clipped_low` / `clipped_high` (the clip was active and
    bound the objective) and the ratio rho, for metrics.
    """
    ratio = torch.exp(logps - old_logps)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # per sequence (GRPO) or per token (PPO)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv
    loss = -torch.min(unclipped, clipped)
    info = {
        "ratio": ratio.detach(),
        "clipped_low": ((ratio < 1 - epsilon_low) & (adv < 0)).detach(),
        "clipped_high": ((ratio > 1 + epsilon_high) & (adv > 0)).detach(),
    }
    return loss, info


def truncated_importance_weights(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, cap: float,
                                 *, level: str = "token", mask: torch.Tensor | None = None) -> torch.Tensor:
    """Truncated importance sampling (TIS) weights min(pi_trainer / pi_sampler, cap), no gradient.

    Corrects the mismatch between the engine that sampled (its log-probs) and the trainer's own
    log-probs of the same tokens (different kernels, stale weights). level="sequence" uses the
    product of token ratios over each sequence (exp of the masked sum of log-ratios).
    """
    return importance_weights(trainer_logps, sampler_logps, cap=cap, level=level, mode="truncate", mask=mask)


def importance_weights(trainer_logps: torch.Tensor, sampler_logps: torch.Tensor, *, cap: float | None,
                       floor: float | None = None, level: str = "token", mode: str = "truncate",
                       mask: torch.Tensor | None = None) -> torch.Tensor:
    """Sampler-correction weights from the ratio pi_trainer / pi_sampler, no gradient; [B, T].

    level: "token" (one ratio per token) | "sequence" (the product of a sequence's token ratios, the same
    weight on all its tokens). mode: "truncate" (TIS: the ratio clamped to [floor, cap]) | "mask" (MIS,
    masked importance sampling: the ratio itself, or 0 where it is above cap or below floor, so tokens or
    whole sequences the sampler drew too far from the trainer's policy drop out instead of counting at the
    bound). None leaves a side unbounded. The four combinations are TRL's vllm_importance_sampling_mode
    token_truncate, token_mask, sequence_truncate, sequence_mask.
    """
    log_ratio = (trainer_logps - sampler_logps).detach()
    if level == "sequence":
        m = mask.to(log_ratio.dtype) if mask is not None else torch.ones_like(log_ratio)
        log_ratio = (log_ratio * m).sum(-1, keepdim=True).expand_as(log_ratio)
    elif level != "token":
        raise ValueError(f"importance level must be 'token' or 'sequence', got {level!r}")
    ratio = torch.exp(log_ratio)
    if mode == "truncate":
        return ratio.clamp(min=floor, max=cap)
    if mode == "mask":
        outside = torch.zeros_like(ratio, dtype=torch.bool)
        if cap is not None:
            outside |= ratio > cap
        if floor is not None:
            outside |= ratio < floor
        return ratio.masked_fill(outside, 0.0)
    raise ValueError(f"importance sampling mode must be 'truncate' or 'mask', got {mode!r}")


def loglinear_proximal_logps(behaviour_logps: torch.Tensor, current_logps: torch.Tensor,
                             behaviour_versions: torch.Tensor, *, proximal_version: int,
                             current_version: int) -> torch.Tensor:
    """AReaL's cheap proximal policy for decoupled PPO, [B, T], no gradient: log-linear interpolation between
    the behaviour policy and the current one by policy version, instead of a forward pass of the proximal
    weights. Per token, alpha = (v_prox - v_behaviour) / (v_current - v_behaviour), clamped to [0, 1], and
    log pi_prox = log pi_behaviour + alpha (log pi_current - log pi_behaviour). A token sampled by the
    proximal weights themselves gets alpha = 0 (its behaviour log-prob, exactly right); one the current weights
    sampled gets alpha = 1."""
    v = behaviour_versions.to(torch.float64)
    span = (current_version - v).clamp(min=1e-9)
    alpha = ((proximal_version - v) / span).clamp(0.0, 1.0)
    # a token the current weights sampled: their own log-prob (the sampler's may differ by engine numerics)
    alpha = torch.where(v >= current_version, torch.ones_like(alpha), alpha).to(behaviour_logps.dtype)
    b = behaviour_logps.detach()
    return b + alpha * (current_logps.detach() - b)


def second_moment_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """M2PO's second-moment trust region (Zheng et al. 2025), [B, T] bool, no gradient: the tokens kept.

    M2 = mean over kept tokens of (log pi / pi_behaviour)^2. Tokens with the largest squared log-ratio are
    dropped, fewest first, until M2 <= threshold: the smallest set of outliers whose removal bounds the
    batch's second moment (which, unlike a per-token clip, leaves the many moderately off-policy tokens in).
    Ties at the boundary are broken by position, so the result is deterministic.
    """
    keep = mask.clone().bool()
    sq = (log_ratio.detach().to(torch.float64) ** 2)[keep]
    n = sq.numel()
    if n == 0 or float(sq.mean()) <= threshold:
        return keep
    order = torch.argsort(sq, stable=True)               # ascending
    prefix_mean = torch.cumsum(sq[order], 0) / torch.arange(1, n + 1, dtype=torch.float64, device=sq.device)
    # prefix means never decrease (each added value is >= the ones before it): keep the longest prefix within
    m = int((prefix_mean <= threshold).sum())
    kept_flat = torch.zeros(n, dtype=torch.bool)
    kept_flat[order[:m].cpu()] = True
    keep[keep.clone()] = kept_flat.to(keep.device)
    return keep


def off_policy_sequence_mask(logps: torch.Tensor, behaviour_logps: torch.Tensor, advantages: torch.Tensor,
                             mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (eq. 9): [B, 1], 0 for a completion with a negative advantage
    whose mean per-token KL from the behaviour policy, mean(log pi_behaviour - log pi), exceeds `threshold`;
    1 otherwise. Negative-advantage samples the policy has already drifted far from push it around most
    and teach least; positive ones are kept whatever their drift. No gradient."""
    if advantages.dim() != 1:
        raise ValueError("off_policy_sequence_mask: needs one advantage per completion ([B]), got "
                         f"{tuple(advantages.shape)}")
    m = mask.to(logps.dtype)
    kl = torch.nan_to_num((behaviour_logps - logps.detach()) * m, nan=0.0).sum(-1) / m.sum(-1).clamp(min=1.0)
    return ((advantages >= 0) | (kl <= threshold)).to(logps.dtype).unsqueeze(-1)


# --------------------------------------------------------------------------------------------------
# Preference losses (DPO family)
# --------------------------------------------------------------------------------------------------


def preference_loss(
    kind: str,
    chosen_logratios: torch.Tensor,
    rejected_logratios: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-example preference loss from policy-minus-reference log-ratios ([B] each, summed over tokens).

    - "sigmoid": DPO (Rafailov et al. 2023, eq. 7), with conservative label smoothing (cDPO) when
      label_smoothing > 0: -(1-ls) log s(b d) - ls log s(-b d), d = chosen - rejected log-ratio.
    - "robust": rDPO (Chowdhury et al. 2024, eq. 21): unbiased under label noise ls.
    - "hinge": SLiC (Zhao et al. 2023): relu(1 - b d).
    - "ipo": IPO (Azar et al. 2023, eq. 17) on *per-token average* log-ratios (as TRL, confirmed by the
      IPO authors): (d_avg - 1/(2 b))^2; needs the completion lengths.
    """
    d = chosen_logratios - rejected_logratios
    logsig = torch.nn.functional.logsigmoid
    if kind == "sigmoid":
        return -(1 - label_smoothing) * logsig(beta * d) - label_smoothing * logsig(-beta * d)
    if kind == "robust":
        if not 0 <= label_smoothing < 0.5:
            raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
        return (-(1 - label_smoothing) * logsig(beta * d) + label_smoothing * logsig(-beta * d)) / (1 - 2 * label_smoothing)
    if kind == "hinge":
        return torch.relu(1 - beta * d)
    if kind == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("ipo needs chosen_lengths and rejected_lengths (per-token averaging)")
        d_avg = chosen_logratios / chosen_lengths.clamp(min=1) - rejected_logratios / rejected_lengths.clamp(min=1)
        return (d_avg - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown preference loss '{kind}'; built-in: sigmoid, robust, hinge, ipo")


# --------------------------------------------------------------------------------------------------
# Actor-critic (PPO): GAE, whitening, the clipped value loss
# --------------------------------------------------------------------------------------------------


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al., 2016) over right-padded token sequences.

    Args:
        rewards: [B, T] per-token rewards r_t.
        values: [B, T] value estimates V(s_t), where s_t is the prefix before token t.
        mask: [B, T] bool, the valid tokens of each row (a prefix of the row).
    Returns:
        (advantages [B, T], returns [B, T]), 0 outside the mask. delta_t = r_t + gamma V(s_{t+1}) -
        V(s_t) with V = 0 after the last token; A_t = delta_t + gamma lam A_{t+1}; returns = A + V.
    """
    m = mask.to(values.dtype)
    T = rewards.shape[1]
    advantages = torch.zeros_like(values)
    last = torch.zeros_like(values[:, 0])
    for t in reversed(range(T)):
        next_valid = m[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        next_value = values[:, t + 1] * next_valid if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last * next_valid) * m[:, t]
        advantages[:, t] = last
    return advantages, (advantages + values) * m


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8,
                  reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """(x - mean) / std over the masked entries (unbiased variance, as TRL); shift_mean=False adds the mean back.

    Entries outside the mask are returned as 0. `reduce` sums a tensor over every process holding part of the
    batch (e.g. an all-reduce); with it the mean and variance are those of all processes' entries together,
    so N processes whiten exactly as one process holding the whole batch would.
    """
    reduce = reduce or (lambda t: t)
    m = mask.to(x.dtype)
    total, n = reduce(torch.stack([(x * m).sum(), m.sum()])).unbind()
    if n < 2:
        raise ValueError("masked_whiten needs at least two valid entries; use a larger batch")
    mean = total / n
    var = reduce(((x - mean) ** 2 * m).sum()) / (n - 1)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, clip_range: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token: 0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2), and where the clip won."""
    clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped_sq, clipped_sq), (clipped_sq > unclipped_sq).detach()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, *,
                       reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """1 - Var(R - V) / Var(R) over the masked tokens: 1 = the critic predicts returns perfectly, <= 0 = useless.

    `reduce` sums over processes (see `masked_whiten`), for the variance of every process's tokens together.
    """
    reduce = reduce or (lambda t: t)
    v, r = values[mask].double(), returns[mask].double()
    d = r - v
    sums = reduce(torch.stack([r.sum(), d.sum(), torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device)]))
    n = sums[2]
    if n < 1:
        return float("nan")
    sq = reduce(torch.stack([((r - sums[0] / n) ** 2).sum(), ((d - sums[1] / n) ** 2).sum()]))
    var_r, var_d = sq[0] / n, sq[1] / n
    return float(1 - var_d / var_r) if var_r > 0 else float("nan")