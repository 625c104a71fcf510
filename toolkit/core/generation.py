"""Generation backends: prompt token ids in, completion token ids and their sampling log-probs out.

`GenerationBackend` is the seam every RL trainer generates through. This module ships the
default backend on transformers (`TransformersBackend`); the vLLM backend and an async variant
plug into the same protocol.

Sampling semantics, identical in every backend (field note 8: a temperature applied on one side
only doubles the importance ratio):
    z = logits / temperature; optional top-k, then top-p (nucleus), then min-p truncation;
    sample from softmax of the truncated z.
The returned log-prob of each sampled token is log softmax(z)[token] over the *untruncated*
temperature-scaled distribution: exactly what the trainer computes with `chunked_token_logps(...,
temperature=T)`, so sampler and trainer log-probs are comparable token by token.
"""

from __future__ import annotations

__all__ = [
    "AsyncGenerationBackend",
    "Completion",
    "GenerationBackend",
    "GenerationStats",
    "SamplingParams",
    "TransformersBackend",
    "after_generation",
    "sample_tokens",
    "truncate_logits",
]

import contextlib
import copy
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from .attention import VARLEN_ATTENTION
from .errors import ConfigError, TrainingHealthError
from .models import _CpuInferenceLinear, unwrap_model
from .packing import common_start

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. `max_tokens` bounds each completion; `stop_token_ids` end it (the stop token is kept)."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens (max_completion_length): must be >= 1, got {self.max_tokens}.")
        if self.temperature <= 0:
            raise ConfigError(f"temperature: must be > 0 (use a small value for near-greedy), got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p}.")
        if self.top_k < 0:
            raise ConfigError(f"top_k: must be >= 0 (0 = off), got {self.top_k}.")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min_p: must be in [0, 1), got {self.min_p}.")


@dataclass
class Completion:
    """One sampled completion. `logprobs[i]` is the sampler's log-prob of `token_ids[i]`."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled) or "length" (max_tokens reached)
    # versions[i]: the policy version whose weights sampled token_ids[i] (in-flight weight updates can change
    # it mid-completion); None when the backend does not track versions
    versions: list[int] | None = None


@dataclass
class GenerationStats:
    seconds: float = 0.0
    generated_tokens: int = 0
    prompt_tokens: int = 0
    extra: dict = field(default_factory=dict)


@runtime_checkable
class GenerationBackend(Protocol):
    """What a generation backend must do. Implementations do not inherit behaviour from anything.

    generate: for each prompt (a list of token ids), `n` completions, returned grouped by prompt:
        `result[i][j]` is completion j of prompt i. `seed` makes sampling reproducible. No prompts: return
        [] (multi-turn episodes call it so on a rank whose episodes ended while another rank's go on). A
        backend that runs a sharded (FSDP2) training model must run the same forwards on every rank, whatever
        each rank's prompt count, as `TransformersBackend` does; otherwise the ranks wait forever.
    sync_weights: make the backend sample from `model`'s current weights (a no-op for backends
        that sample with the training model itself).

    Optional: `sleep()`, which the trainers call once a rollout's generation is over (`after_generation`): a
    backend whose engine shares the training GPU gives its memory back for the training pass, and takes it again
    in its next sync_weights or generate (VLLMBackend's sleep mode).
    """

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, n: int = 1,
                 seed: int | None = None) -> list[list[Completion]]: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...


def after_generation(backend: Any) -> None:
    """A rollout's generation is over: let the backend release what it holds for generating (its optional
    `sleep()`; see GenerationBackend). The trainers call it between generation and the training pass."""
    sleep = getattr(backend, "sleep", None)
    if callable(sleep):
        sleep()


@runtime_checkable
class AsyncGenerationBackend(GenerationBackend, Protocol):
    """A backend that can also queue work: `submit` returns at once with a Future of `generate`'s result.

    Requests are served in submission order while the caller goes on (training, scoring). The vLLM
    backends implement it; the async GRPO trainer uses it.
    """

    def submit(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, n: int = 1,
               seed: int | None = None) -> Any: ...


# ------------------------------------------------------------------------------------------------
# Sampling transforms (pure functions)
# ------------------------------------------------------------------------------------------------


def truncate_logits(z: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """[B, V] temperature-scaled logits -> same with excluded tokens set to -inf (top-k, then top-p, then min-p)."""
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept)
        drop_sorted = probs.cumsum(-1) - probs > top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(z, dim=-1)
        z = z.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return z


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, *,
                  uniforms: torch.Tensor | None = None, not_finite: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] raw logits -> (tokens [B], log-probs [B] under the untruncated temperature-scaled softmax).

    `uniforms` ([B] or [B, 1] float64 in [0, 1)): the draws to use instead of taking B from `generator`.
    `not_finite` ([B] bool): see `inverse_cdf_sample` (the check deferred to the caller, no host read)."""
    # every full-vocabulary pass counts at decode (32 x 49k floats per step): the upcast and the division share one
    # new tensor, and nothing else of vocabulary size is written but the probabilities
    z = logits.float()
    if params.temperature != 1.0:
        z = z.div_(params.temperature) if z is not logits else z / params.temperature
    truncated = truncate_logits(z, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p)
    probs = torch.softmax(truncated, dim=-1)
    tokens = inverse_cdf_sample(probs, generator, uniforms=uniforms, not_finite=not_finite)
    if truncated is z:  # nothing truncated: the probabilities drawn from are the full softmax's
        # log of a float32 probability: within 2e-6 of log_softmax (tested; a drawn token is far from underflow)
        return tokens, probs.gather(-1, tokens[:, None]).squeeze(-1).log()
    return tokens, z.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


_CDF_BLOCK = 256  # tokens per block of the two-level cdf below


def inverse_cdf_sample(probs: torch.Tensor, generator: torch.Generator | None, *,
                       uniforms: torch.Tensor | None = None, not_finite: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row of [B, V] probabilities: the first token whose cumulative probability exceeds u x total.

    `u` is drawn from `generator` (B float64 uniforms), or given as `uniforms` ([B] or [B, 1]): the decode loop
    draws one per sequence of the whole batch at every step and passes the rows still decoding, so a row's draws
    do not depend on which other rows have finished.

    Exactly a categorical draw, like torch.multinomial, but from one uniform per row: multinomial draws an
    exponential per vocabulary entry (B x 49k random numbers per decode step, measured at 30 ms of a 135 ms
    decode step at batch 32 on 2 CPU cores). A token of probability 0 is never drawn: the row's pick has
    cdf > x >= the previous cdf, so its own mass is positive (x is kept strictly below the total).

    The cdf is taken in two levels, in float64: the sums of blocks of 256 tokens, then the cumulative sum inside
    the one block each row lands in. A flat float64 cumulative sum over the vocabulary casts and scans every entry
    one after another (11.5 ms of a 150 ms decode step at batch 32 x 49k on 2 cores, more than the LM head's
    softmax); block sums vectorize. The two levels add the same masses in another order, so the residual inside
    the block is kept strictly below the block's own total: the pick is still a token of positive mass.

    Rows whose probabilities are not finite or sum to 0 raise TrainingHealthError, or, given `not_finite` ([B]
    bool), are marked there for the caller to raise on (their draw is then meaningless).
    """
    rows, vocab = probs.shape
    if vocab == 0:
        raise ValueError("inverse_cdf_sample: probabilities over an empty vocabulary")
    if rows == 0:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    # float64: monotone and exact enough however the sum is scheduled (MPS has no float64: float32 there)
    wide = torch.float32 if probs.device.type == "mps" else torch.float64
    block = _CDF_BLOCK if vocab > 4 * _CDF_BLOCK else vocab  # a small vocabulary is one block: a flat cdf
    pad = -vocab % block
    blocks = torch.nn.functional.pad(probs, (0, pad)) if pad else probs  # zeros at the end: never drawn
    blocks = blocks.reshape(rows, (vocab + pad) // block, block)
    # float64 block sums (float32 ones would move ~1e-7 of the mass across block edges: a token of mass 1e-9
    # there drawn 100x too often); the cast costs a copy of the vocabulary, about 1 ms of it
    block_cdf = blocks.sum(-1, dtype=wide).cumsum(-1)  # [B, blocks]
    total = block_cdf[:, -1:]
    bad = ~(torch.isfinite(total) & (total > 0))
    if not_finite is not None:  # the caller reads it later (the decode loop, every few tokens): no host read here
        not_finite |= bad.squeeze(-1)
    elif bad.any():  # what torch.multinomial refused too: a NaN/inf logit upstream, or every token truncated away
        bad_rows = bad.squeeze(-1).nonzero().squeeze(-1).tolist()
        raise TrainingHealthError(f"sampling: the probabilities of row(s) {bad_rows[:8]} are not finite or sum to 0 "
                                  "(NaN or inf logits: the model diverged; lower the learning rate or check the "
                                  "loss). Nothing was sampled from them.")
    # the uniforms come from the generator's own device (the backend seeds a CPU one), then move: a seed draws
    # the same numbers wherever the model runs
    if uniforms is None:
        gen_device = generator.device if generator is not None else probs.device
        uniforms = torch.rand(total.shape, generator=generator, device=gen_device, dtype=torch.float64)
    elif uniforms.numel() != rows:
        raise ValueError(f"inverse_cdf_sample: {uniforms.numel()} uniforms for {rows} rows")
    u = uniforms.reshape(total.shape).to(probs.device, wide)
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    j = torch.searchsorted(block_cdf, x, right=True).clamp_(max=block_cdf.shape[-1] - 1)  # [B, 1]: its block
    before = torch.where(j > 0, block_cdf.gather(-1, (j - 1).clamp(min=0)), torch.zeros_like(x))
    inner = blocks.gather(1, j[..., None].expand(-1, -1, block)).squeeze(1).to(wide).cumsum(-1)  # [B, block]
    last = inner[:, -1:]
    r = torch.minimum((x - before).clamp(min=0), torch.nextafter(last, torch.zeros_like(last)))
    k = torch.searchsorted(inner, r, right=True).clamp_(max=block - 1)
    return (j * block + k).squeeze(-1).clamp_(max=vocab - 1)


# ------------------------------------------------------------------------------------------------
# The transformers backend
# ------------------------------------------------------------------------------------------------


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5.2x renamed `past_key_values` to `cache` (old name deprecated until 5.40)."""
    import inspect

    from .models import unwrap_model

    params = inspect.signature(unwrap_model(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _decodes_in_lockstep(model: torch.nn.Module) -> bool:
    """Whether every rank must run the same number of forwards: a sharded (FSDP2) model all-gathers its weights
    in each forward, a collective, so a rank that stopped decoding early would leave the others waiting forever."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def _plain_kv_cache(model: torch.nn.Module) -> bool:
    """Whether every layer keeps plain full-attention keys and values, so that pad columns between the shared start
    and the rest of a prompt are only masked out. Recurrent or convolutional layers (hybrid models) and sliding
    windows would count them: those prefill each prompt whole, left-padded."""
    config = getattr(unwrap_model(model), "config", None)
    if hasattr(config, "get_text_config"):  # composite models (vision-language) keep the decoder's in text_config
        config = config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return False
    return getattr(config, "sliding_window", None) is None or getattr(config, "use_sliding_window", True) is False


def _max_over_ranks(value: int, device: torch.device) -> int:
    """The largest `value` of all ranks (a collective: every rank must call it)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl" and device.type != "cuda":  # e.g. an FSDP2 model offloaded to CPU
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([value], dtype=torch.int64, device=device)  # on the device nccl needs
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _all_ranks_finished(finished: bool, device: torch.device) -> bool:
    """True when every rank's sequences are done; a rank that finished first keeps stepping its (padded) rows."""
    return _max_over_ranks(0 if finished else 1, device) == 0


def any_rank_if_sharded(flag: bool, model: torch.nn.Module) -> bool:
    """For callers that must keep a sharded model's ranks in step (multi-turn episodes: every rank runs a turn while
    any rank has an episode left, see `TransformersBackend`): with a sharded (FSDP2) model, whether `flag` holds on
    any rank (a collective: every rank must call it); without one (one process, DDP), `flag` itself, with no
    collective. Internal (not in `__all__`)."""
    if not _decodes_in_lockstep(model):
        return flag
    return _max_over_ranks(int(bool(flag)), next(model.parameters()).device) == 1


_GENERATION_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _generation_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype) and dtype in _GENERATION_DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _GENERATION_DTYPES:
        return _GENERATION_DTYPES[dtype]
    raise ConfigError(f"generation_backend_kwargs.dtype: {dtype!r} is not one of "
                      f"{' | '.join(_GENERATION_DTYPES)} (or None: the model's own dtype).")


def _check_transformers_backend_kwargs(kwargs: dict[str, Any] | None) -> None:
    """A config's `generation_backend_kwargs` for the transformers backend, checked before any model loads (async
    GRPO's worker builds its backend itself and would otherwise drop a setting it does not know without a word)."""
    unknown = sorted(set(kwargs or {}) - {"dtype", "static_decode"})
    if unknown:
        raise ConfigError(f"generation_backend_kwargs: the transformers backend takes only 'dtype' (decode with a "
                          "copy of the weights in that dtype) and 'static_decode' (a preallocated KV cache, CUDA "
                          f"graphs on a GPU); got {unknown}. Settings of another backend need generation_backend set "
                          "to it (e.g. 'vllm').")
    _generation_dtype((kwargs or {}).get("dtype"))
    static = (kwargs or {}).get("static_decode")
    if static is not None and not isinstance(static, bool):
        raise ConfigError(f"generation_backend_kwargs.static_decode: true or false (or unset), got {static!r}.")


def _warn_mixed_precision_generation(model: torch.nn.Module, config: Any, kwargs: dict[str, Any]) -> None:
    """Warn when `bf16=True` / `fp16=True` meets float32 weights and no generation dtype: the transformers backend
    then decodes with the training model, whose forward accelerate wraps in autocast, so every decode step casts
    every weight (a scratch run of bench/grpo_vs_trl.py's setting on CPU: 3.9 s of generation a step, against
    2.0-2.6 s on a bfloat16 copy and 2.7-3.2 s in float32). Not changed silently: the copy costs memory."""
    low = "bfloat16" if getattr(config, "bf16", False) else "float16" if getattr(config, "fp16", False) else None
    if low is None or kwargs.get("dtype") is not None or not getattr(config, "_generation_under_autocast", True):
        return
    # DeepSpeed casts the module itself (accelerate's autocast is off there); other ranks would say it again
    if getattr(config, "deepspeed", None) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return
    if os.environ.get("RANK", "0") != "0":
        return
    weights = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if weights == {torch.float32}:
        logger.warning(
            "%s=True with float32 weights: generation runs under the autocast that wraps the model's forward, which "
            "casts every weight at every decode step. generation_backend_kwargs={'dtype': '%s'} decodes with a %s "
            "copy of the weights instead (faster; costs the weights once more in %s; the sampler correction weighs "
            "the gap to the trained weights).", "bf16" if low == "bfloat16" else "fp16", low, low, low)


def _cast_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of `model` whose floating-point parameters are in `dtype`, without gradients.

    Built through deepcopy's memo, so the float32 weights are never duplicated on the way (a `deepcopy` and then
    `.to` would briefly hold two float32 copies) and tied weights stay tied (one tensor, one memo entry). Buffers
    keep their dtype, as when transformers loads a model in bfloat16: the rotary frequencies stay float32
    (rounded to bfloat16 they would turn a position's angle by ~0.2% of it, growing with the prompt's length)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo and p.is_floating_point():
            memo[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=False)
    return copy.deepcopy(model, memo)


def _refresh_copy(dst: torch.nn.Module, src: torch.nn.Module) -> bool:
    """Copy `src`'s current weights into its cast copy `dst` (built by `_cast_copy`), converting dtype.

    False, with nothing copied, when the two no longer match (the model was resized, re-tied, given adapters or
    moved to another device since the copy was made): the caller builds a new copy."""
    pairs = list(zip(itertools.chain(dst.parameters(), dst.buffers()),
                     itertools.chain(src.parameters(), src.buffers())))
    if (len(pairs) != sum(1 for _ in itertools.chain(src.parameters(), src.buffers()))
            or len(pairs) != sum(1 for _ in itertools.chain(dst.parameters(), dst.buffers()))
            or any(d.shape != s_.shape or d.device != s_.device for d, s_ in pairs)):
        return False
    with torch.no_grad():
        for d, s_ in pairs:
            if d.is_floating_point():
                d.copy_(s_)
    return True


# The share of a decoding batch's rows that have finished at which they are dropped from it (see _generate_chunk).
_DROP_FINISHED_AT = 0.25
# On a GPU: decode steps between host checks (up to this many - 1 steps may run past the batch's end, as padding)
_HOST_CHECK_EVERY_GPU = 8


def _decode_mask(model: torch.nn.Module, mask: torch.Tensor, *, padded: bool = True,
                 four_d: bool | None = None) -> torch.Tensor | None:
    """A decode step's attention mask: [rows, keys] 0/1, or for sdpa the same as a ready [rows, 1, 1, keys] boolean
    mask. Given the 2D one, transformers asks the device whether any key is padding (`padding_mask.all()`, to skip
    the mask): a host read at every decode step, which on a GPU waits for the step's kernels. A 4D mask is used as
    given (one query position attends to every key the mask lets through: the same attention).

    On a GPU, prompts without padding (`padded=False`, known on the host from the prompts' lengths) get no mask at
    all: a finished row's later keys are its own padding, which no other row attends to and whose outputs are
    dropped, so every row's attention is the same, and sdpa keeps its flash kernel and grouped-query heads.
    `four_d`: whether the model takes the 4D mask (`_decode_mask_4d`, computed once per chunk)."""
    if not padded and mask.device.type == "cuda":
        return None
    if four_d if four_d is not None else _decode_mask_4d(model):
        return mask[:, None, None, :].bool()
    return mask  # a sliding window's cache holds fewer keys than the mask has columns: transformers cuts it


# Attention implementations that take sdpa's ready 4D boolean mask in a decode step: sdpa, and the trainers' packed
# attention, whose calls without packed-row bounds are sdpa's.
_SDPA_LIKE = ("sdpa", VARLEN_ATTENTION)


def _decode_mask_4d(model: torch.nn.Module) -> bool:
    return getattr(unwrap_model(model).config, "_attn_implementation", None) in _SDPA_LIKE and _plain_kv_cache(model)


def _rows_can_be_dropped(cache: Any) -> bool:
    """Whether every layer of a (prefilled) cache holds only keys and values, which `batch_select_indices` cuts
    down. A layer that also keeps a recurrent or convolutional state (hybrid models) has no such method or would
    cut the keys alone; those caches keep every row to the end."""
    from transformers import cache_utils

    plain = tuple(getattr(cache_utils, name) for name in ("DynamicLayer", "DynamicSlidingWindowLayer", "DummyLayer")
                  if hasattr(cache_utils, name))
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in plain for layer in layers)


_STATIC_REFUSALS_LOGGED: set[str] = set()


def _static_decode_refused(model: torch.nn.Module, st: _DecodeState, refreshes_weights: bool) -> str | None:
    """Why a chunk cannot decode on a static cache (None: it can)."""
    from transformers import cache_utils

    if st.lockstep:
        return "the model is sharded (FSDP2): its ranks decode in lockstep with the growing cache"
    if refreshes_weights:
        return "in-flight weight updates rebuild the KV cache mid-generation"
    if getattr(unwrap_model(model).config, "_attn_implementation", None) not in _SDPA_LIKE:
        return "the model's attention is not sdpa (the static decoder hands attention a ready boolean mask)"
    if not _plain_kv_cache(model):
        return "the model has sliding-window, recurrent or convolutional layers"
    if type(st.cache) is not cache_utils.DynamicCache or not _rows_can_be_dropped(st.cache):
        return "the prefilled cache is not a plain key/value cache"
    return None


class _StaticDecoder:
    """Decode steps on a preallocated KV cache with fixed shapes, for CUDA graphs.

    On a GPU a small model's decode step is launch-bound: a few hundred small kernels, each launched from Python,
    for a few microseconds of work each. Here every step has the same shapes and reads and writes the same
    buffers: the cache is transformers' StaticCache (keys and values preallocated for the prompt and `max_tokens`
    tokens, each step's written at the column its length counter says, on the device), the attention mask a
    preallocated [rows, columns] boolean buffer whose column is set before the step, and the step's token and
    position are copied into fixed input tensors. So on CUDA the step is captured once per batch as a CUDA graph
    and then replayed, one launch per token. On CPU the same steps run uncaptured (tests compare their ids with
    the growing-cache loop's).

    Rows stay in the batch to the end (the graph's shapes are fixed): the loop's dropping of finished rows is off.
    Under autocast (a float32 model trained with bf16=True, which accelerate wraps in autocast) the graph is not
    captured: autocast caches its casts of the weights, which a graph must not. Decode with a bf16 copy
    (generation_backend_kwargs.dtype = "bfloat16") to capture."""

    def __init__(self, model: torch.nn.Module, st: _DecodeState, max_tokens: int, *, capture: bool):
        from transformers import StaticCache

        rows, prompt = st.mask.shape
        self.prompt, self.cache_kwarg = prompt, _cache_kwarg(model)
        self.cache = StaticCache(config=unwrap_model(model).config, max_cache_len=prompt + max_tokens)
        for src, dst in zip(st.cache.layers, self.cache.layers, strict=True):  # the prefilled keys and values
            dst.lazy_initialization(src.keys, src.values)
            dst.keys[:, :, :prompt].copy_(src.keys)
            dst.values[:, :, :prompt].copy_(src.values)
            dst.cumulative_length.fill_(prompt)
        st.cache = None  # the growing cache is freed
        self.mask = torch.zeros((rows, prompt + max_tokens), dtype=torch.bool, device=st.device)
        self.mask[:, :prompt] = st.mask.bool()
        self.tok = torch.zeros((rows, 1), dtype=torch.long, device=st.device)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=st.device)
        self.capture = capture and not hasattr(model, "_original_forward") and not torch.is_autocast_enabled("cuda")
        self.graph: Any = None
        self.logits: torch.Tensor | None = None

    def _inputs(self) -> dict[str, Any]:
        # one query position attends to every key the mask lets through (sdpa takes the 4D boolean mask as given)
        return {"input_ids": self.tok, "attention_mask": self.mask[:, None, None, :], "position_ids": self.pos,
                "use_cache": True, self.cache_kwarg: self.cache}

    def _set_length(self, length: int) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)

    def step(self, model: torch.nn.Module, tok: torch.Tensor, pos: torch.Tensor, active: torch.Tensor,
             step: int) -> torch.Tensor:
        """The next token's logits [rows, vocab] after `tok` (sampled at `step`) at positions `pos`. With a graph,
        the tensor returned is the graph's output buffer, overwritten by the next step."""
        column = self.prompt + step
        self.mask[:, column] = active  # the token just sampled is real for every row that was active
        self.tok.copy_(tok[:, None])
        self.pos.copy_(pos[:, None])
        if not self.capture:
            return TransformersBackend._forward(model, **self._inputs()).logits[:, -1]
        if self.graph is None:
            self._capture(model, column)
        self.graph.replay()
        return self.logits

    def _warm_up(self, model: torch.nn.Module, column: int, times: int = 2) -> None:
        """Run the step `times` over without moving on: the forward writes this step's keys and values at `column`
        (the same ones each time) and the cache's length is set back to `column` after each."""
        for _ in range(times):
            model(**self._inputs())
            self._set_length(column)

    def _capture(self, model: torch.nn.Module, column: int) -> None:
        """Warm up on a side stream (cuBLAS handles, kernel selection), then record one step. Each warm-up forward
        writes this step's keys at `column` and advances the cache's length, which is set back; recording runs
        nothing, and the first replay writes them for real."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._warm_up(model, column)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model(**self._inputs()).logits[:, -1]


@dataclass
class _DecodeState:
    """One chunk's decoding in progress (TransformersBackend._generate_chunk): rows are the b x n sequences."""

    device: torch.device
    ids: torch.Tensor            # [b, prompt] the left-padded prompts (the shared start first)
    mask: torch.Tensor           # [rows, so far] attention mask of the rows still in the batch
    cache: Any                   # the KV cache of those rows
    stop: torch.Tensor           # the stop token ids
    last_pos: torch.Tensor       # [rows] position of each row's last token
    logits: torch.Tensor         # [rows, vocab] the next token's logits
    done: torch.Tensor           # [b x n] bool, on the device
    tokens_out: torch.Tensor     # [b x n, max_tokens] sampled ids (on the device; read once, at the end)
    logps_out: torch.Tensor      # [b x n, max_tokens] their sampling log-probs (device)
    lengths: torch.Tensor        # [b x n] tokens sampled per sequence (device)
    versions_out: torch.Tensor   # [b x n, max_tokens] the weights' version that sampled each token (device)
    not_finite: torch.Tensor     # [b x n] bool: a row's probabilities were NaN/inf or all zero (device)
    rows: torch.Tensor           # indices (into b x n, CPU) of the rows still in the batch
    lockstep: bool               # several ranks step together (FSDP2)
    padded: bool                 # some prompt is shorter than another (left padding in the batch)
    compact: bool                # finished rows are dropped from the batch


class TransformersBackend:
    """Batched, KV-cached sampling with the training model itself (so weights never need syncing), or with a copy
    of it in another dtype, refreshed at each call (`dtype`, below).

    Efficient on CPU: each prompt is prefilled once and its KV cache shared by its `n` samples
    (GRPO's G generations of one prompt differ only after the prompt), and the start all of a batch's prompts
    share (a chat template's system prompt) is prefilled once for all of them; all sequences then decode
    together, one forward per token, computing the LM head for the last position only; finished sequences stop
    counting and leave the batch and its KV cache once a quarter of it has finished (each step still draws one
    uniform per sequence, finished or not, so a sequence's draws do not depend on when the others finished), and
    the loop ends when all are done. Under FSDP2 no row is dropped and the loop ends when all are done on every
    rank: each forward all-gathers the sharded weights, so the ranks decode in lockstep. Under FSDP2 a
    call also runs as many batches (chunks of `max_batch_size` sequences) on every rank: a rank with fewer
    prompts, none included (multi-turn episodes end at different turns on different ranks), steps a one-token
    placeholder batch that is done from its first token and returns nothing.

    `dtype` (generation_backend_kwargs.dtype; default None, the model's own): decode with a copy of the weights
    in this dtype, refreshed from the model at each generate call (and after an in-flight weight refresh). On
    CPU a decode step streams every weight from memory, so bfloat16 weights decode faster where the CPU computes
    bfloat16 natively (AMX / AVX-512 BF16; on plain AVX2 it may be slower: measure). The copy costs the weights
    once more in that dtype. The log-probs returned are the copy's (the policy that really sampled): GRPO's
    sampler correction (importance_sampling_cap / mode) weighs the gap to its float32 weights and logs it as
    `sampler/logp_abs_diff_*`; PPO logs it but does not correct it. Not for sharded (FSDP2) or quantized
    models, where a copy is not a cast of the weights.

    `static_decode` (generation_backend_kwargs.static_decode; default False): decode on a preallocated KV cache
    with fixed shapes (`_StaticDecoder`), which on a GPU is captured once per batch as a CUDA graph and replayed
    at every token. Opt-in until it has been measured on a GPU (scripts/gpu_check.py does). On CPU it runs the same
    steps uncaptured: the same ids as the loop above (tests/unit/test_static_decode.py), and no faster.
    """

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, max_batch_size: int = 256,
                 on_decode_step: Callable[[], None] | None = None,
                 refresh_weights: Callable[[], int | None] | None = None, version: int = 0,
                 dtype: str | torch.dtype | None = None, static_decode: bool | None = None, processor: Any = None):
        self.dtype = _generation_dtype(dtype)
        # A vision-language processor: prompts may come with images (generate(images=...)); the tokens images
        # expand to are never sampled (a sampled one would have no image behind it).
        self.processor = processor
        self._banned: torch.Tensor | None = None
        if processor is not None:  # on every call, a batch of text-only prompts too
            from .vision import vision_token_ids

            self._banned = torch.tensor(sorted(vision_token_ids(processor)), dtype=torch.long)
        self.static_decode = bool(static_decode)
        self._copy: torch.nn.Module | None = None     # the weights in `dtype` (when the model's differs)
        self._copy_of: torch.nn.Module | None = None  # the model it was cast from
        if self.dtype is not None:
            base = unwrap_model(model)
            if getattr(base, "hf_quantizer", None) is not None or getattr(base, "is_quantized", False):
                raise ConfigError("generation_backend_kwargs.dtype: the model is quantized, so its weights cannot be "
                                  "cast to another dtype; leave dtype unset (the model's own).")
            if _decodes_in_lockstep(model):
                raise ConfigError("generation_backend_kwargs.dtype: the model is sharded (FSDP2); a copy in another "
                                  "dtype would hold every rank's shard only; leave dtype unset.")
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        # Called once per forward (prefill and every decode step): a supervisor's proof that decoding moves.
        self.on_decode_step = on_decode_step
        # In-flight weight updates (PipelineRL): called between decode steps; it loads newer weights into
        # `model` in place and returns their version, or returns None (nothing new). Each token records the
        # version that sampled it (Completion.versions); `version` is the weights' version at the start.
        self.refresh_weights = refresh_weights
        self.version = version
        self.last_stats = GenerationStats()

    # Drop finished sequences from the batch and its KV cache as decoding goes on (see _generate_chunk). The
    # tokens are the same either way up to the rounding of batch-size-dependent kernels; False keeps every row to
    # the end (the comparison in tests/unit/test_generation.py and bench/decode_batch.py).
    _compact_finished_rows: bool = True
    # Steps between the host's reads of "has every row stopped?" (one read per check): None means every step on
    # CPU (a read costs nothing there, and a step past the end costs a whole forward) and _HOST_CHECK_EVERY_GPU on
    # a GPU. tests/trainers/test_host_syncs.py counts the reads with it set on CPU. The steps a batch runs past its
    # end (at most host_check_every - 1) draw their uniforms too: with several chunks in one call, a later chunk's
    # draws differ between settings (each still a proper draw; one chunk's own tokens do not change).
    host_check_every: int | None = None

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model

    def _generation_model(self) -> torch.nn.Module:
        """The model decoding runs on: the training model itself, or its copy in `dtype`, refreshed from it."""
        if self.dtype is None or next(self.model.parameters()).dtype == self.dtype:
            return self.model
        if _decodes_in_lockstep(self.model):  # sharded after this backend was built (accelerate prepares later)
            raise ConfigError("generation_backend_kwargs.dtype: the model is sharded (FSDP2); a copy in another "
                              "dtype would hold this rank's shard only; leave dtype unset.")
        if self._copy is None or self._copy_of is not self.model or not _refresh_copy(self._copy, self.model):
            self._copy = self._copy_of = None  # the old copy is freed before the new one is built
            self._copy, self._copy_of = _cast_copy(self.model, self.dtype), self.model
        return self._copy

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, n: int = 1,
                 seed: int | None = None, images: Sequence[Sequence[Any]] | None = None) -> list[list[Completion]]:
        """`n` completions per prompt. `images`: per prompt, the images its (expanded) ids show, for a
        vision-language model built with a `processor`; each prompt's images are encoded once for its n samples."""
        started = time.perf_counter()
        if images is not None and any(images):
            self._check_images(images, len(prompts))
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed if seed is not None else torch.seed() % (2**63))
        per_call = max(1, self.max_batch_size // n)
        results: list[list[Completion]] = []
        chunks = [[list(p) for p in prompts[s:s + per_call]] for s in range(0, len(prompts), per_call)]
        # (a chunk none of whose prompts shows an image runs as text)
        image_chunks = [list(images[s:s + per_call]) if images is not None and any(images[s:s + per_call]) else None
                        for s in range(0, len(prompts), per_call)]
        # Under FSDP2 every rank must run the same forwards (each all-gathers): the batch count is agreed first,
        # before any forward (a collective issued while another rank is in a forward would be matched against its
        # all-gather), and placeholder batches make up the difference after this rank's own. A rank whose rows
        # are done draws no more samples while the others decode, so its samples never depend on theirs.
        batches = len(chunks)
        if _decodes_in_lockstep(self.model):
            batches = _max_over_ranks(len(chunks), next(self.model.parameters()).device)
        model = self._generation_model()
        for chunk, chunk_images in zip(chunks, image_chunks):
            results += self._generate_chunk(model, chunk, params, n, generator, images=chunk_images)
        for _ in range(batches - len(chunks)):
            self._generate_chunk(model, [[self.pad_token_id]], params, 1, generator, placeholder=True)
        self.last_stats = GenerationStats(
            seconds=time.perf_counter() - started,
            generated_tokens=sum(len(c.token_ids) for group in results for c in group),
            prompt_tokens=sum(len(p) for p in prompts),
            extra={"placeholder_batches": batches - len(chunks)} if batches > len(chunks) else {},
        )
        return results

    def _check_images(self, images: Sequence[Sequence[Any]], n_prompts: int) -> None:
        if self.processor is None:
            raise ConfigError("generate(images=...): this backend was built without a vision-language processor "
                              "(TransformersBackend(..., processor=...)); the images cannot reach the model.")
        if len(images) != n_prompts:
            raise ConfigError(f"generate(images=...): {len(images)} image lists for {n_prompts} prompts; give one "
                              "list per prompt (empty for a prompt without images).")
        if self.static_decode or self.refresh_weights is not None:
            raise ConfigError("generate(images=...): generation_backend_kwargs.static_decode and in-flight weight "
                              "updates re-run prompts without their images; turn them off for vision-language "
                              "models.")

    def _generate_chunk(self, model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, n: int,
                        generator: torch.Generator, *, placeholder: bool = False,
                        images: list[list[Any]] | None = None) -> list[list[Completion]]:
        """n completions of each prompt: one prefill (the prompts' shared start once), then the decode loop."""
        was_training = model.training
        model.eval()
        try:
            state = self._prefill(model, prompts, params, n, placeholder, images=images)
            self._decode(model, state, params, n, generator)
        finally:
            model.train(was_training)
        return self._completions(state, len(prompts), n, params)

    @staticmethod
    def _forward(model: torch.nn.Module, **kwargs: Any) -> Any:
        with _CpuInferenceLinear() if next(model.parameters()).device.type == "cpu" else contextlib.nullcontext():
            return model(**kwargs)

    def _prefill(self, model: torch.nn.Module, prompts: list[list[int]], params: SamplingParams, n: int,
                 placeholder: bool, images: list[list[Any]] | None = None) -> _DecodeState:
        """The prompts' forward into a fresh KV cache, then each prompt's cache shared by its n samples."""
        from transformers import DynamicCache

        device = next(model.parameters()).device
        b = len(prompts)
        lockstep = _decodes_in_lockstep(model)
        # The start all prompts share (a chat template's system prompt) is prefilled once and its cache copied to
        # every row: prefill is most of a PPO rollout's generation (16 prompts of 45 tokens, 27 of them shared,
        # against 16 new tokens each). Not under FSDP2, where every rank must run the same forwards. Not with
        # images either (the shared ids may hold an image's tokens, whose features differ per prompt).
        shared = common_start(prompts) if not lockstep and _plain_kv_cache(model) and not images else 0
        longest = max(len(p) for p in prompts) - shared
        ids = torch.full((b, shared + longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((b, shared + longest), dtype=torch.long)
        ids[:, :shared] = torch.tensor(prompts[0][:shared], dtype=torch.long)
        mask[:, :shared] = 1
        for i, p in enumerate(prompts):  # left padding after the shared start: every prompt ends at the last column
            ids[i, shared + longest - (len(p) - shared):] = torch.tensor(p[shared:], dtype=torch.long)
            mask[i, shared + longest - (len(p) - shared):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        image_kwargs: dict[str, Any] = {}
        if images:
            from .vision import prompt_image_inputs

            # each prompt's images through the vision tower once (its n samples share the KV cache below); M-RoPE
            # models get their 3-D positions, and decoding continues from each row's largest position
            image_kwargs, positions = prompt_image_inputs(model, self.processor, images, ids, mask, positions)
        last_pos = positions[..., -1] if positions.dim() == 2 else positions[..., -1].max(0).values
        cache = DynamicCache(config=model.config)
        if shared:
            self._forward(model, input_ids=ids[:1, :shared], position_ids=positions[:1, :shared], use_cache=True,
                          logits_to_keep=1, **{_cache_kwarg(model): cache})
            if self.on_decode_step is not None:
                self.on_decode_step()
            cache.batch_repeat_interleave(b)
        out = self._forward(model, input_ids=ids[:, shared:], attention_mask=mask, position_ids=positions[..., shared:],
                            use_cache=True, logits_to_keep=1, **{_cache_kwarg(model): cache}, **image_kwargs)
        if self.on_decode_step is not None:
            self.on_decode_step()
        # Share each prompt's cache with its n samples: repeat_interleave the batch dimension.
        if n > 1:
            cache.batch_repeat_interleave(n)
        total = b * n
        stop = torch.tensor(list(params.stop_token_ids), dtype=torch.long, device=device)
        # The rows still in the batch (indices into the `total` sequences): once a quarter of them have finished
        # they are dropped from the batch and its KV cache, so the late decode steps of a batch with a few long
        # completions run on those rows only (each step also copies the cache, in DynamicCache's concatenation).
        # bench/decode_batch.py measures it. Not under FSDP2 (each rank keeps stepping its rows in lockstep, see
        # above), and only when every cache layer is a plain key/value one (a recurrent or convolutional state
        # would keep every row). Each step still draws one uniform per sequence of the whole batch, finished or
        # not, and samples the rows in the batch with theirs: a sequence's draws do not depend on when the others
        # finished (its tokens, up to the rounding of a smaller batch's kernels).
        compact = not lockstep and self._compact_finished_rows and bool(stop.numel()) and _rows_can_be_dropped(cache)
        return _DecodeState(
            device=device, ids=ids, mask=mask.repeat_interleave(n, dim=0), cache=cache, stop=stop,
            last_pos=last_pos.repeat_interleave(n, dim=0), logits=out.logits[:, -1].repeat_interleave(n, dim=0),
            # a placeholder batch (lockstep padding, see generate) is done before it starts: it only keeps the
            # forwards (and their all-gathers) in step with the other ranks until they finish
            done=torch.full((total,), placeholder, dtype=torch.bool, device=device),
            tokens_out=torch.full((total, params.max_tokens), self.pad_token_id, dtype=torch.long, device=device),
            logps_out=torch.zeros((total, params.max_tokens), dtype=torch.float32, device=device),
            lengths=torch.zeros(total, dtype=torch.long, device=device),
            versions_out=torch.zeros((total, params.max_tokens), dtype=torch.long, device=device),
            not_finite=torch.zeros(total, dtype=torch.bool, device=device),
            rows=torch.arange(total), lockstep=lockstep, compact=compact,
            padded=any(len(p) != len(prompts[0]) for p in prompts))

    def _decode(self, model: torch.nn.Module, st: _DecodeState, params: SamplingParams, n: int,
                generator: torch.Generator) -> None:
        """The decode loop: one token per row and step until every row stopped or max_tokens.

        The host learns whether every row has stopped (and whether a row's probabilities went NaN) only every
        `host_check_every` steps, in one read: on a GPU each read waits for every kernel queued before it, so a
        check per token serializes the loop. Between checks the finished rows step along as padding (nothing of
        theirs is recorded) and their uniforms are drawn as usual; finished rows leave the batch at the checks.
        """
        total, device = len(st.done), st.device
        every = max(1, self.host_check_every if self.host_check_every is not None
                    else (1 if device.type == "cpu" else _HOST_CHECK_EVERY_GPU))
        rows_dev = st.rows.to(device)
        four_d = _decode_mask_4d(model)
        static = self._static_decoder(model, st, params) if self.static_decode else None
        # lockstep: this rank's rows are all done (known at the last check; a placeholder batch is from the start)
        stepping_along = st.lockstep and bool(st.done.all())
        for step in range(params.max_tokens):
            if stepping_along:
                # this rank is done and only steps along with the others: no draw from the generator (the number of
                # steps depends on the other ranks, and the next batch samples from it)
                tok = torch.full((len(st.rows),), self.pad_token_id, dtype=torch.long, device=device)
                lp = torch.zeros(len(st.rows), device=device)
            else:
                u = torch.rand((total, 1), generator=generator, device=generator.device, dtype=torch.float64)
                bad = torch.zeros(len(st.rows), dtype=torch.bool, device=device)
                logits = st.logits if self._banned is None else st.logits.index_fill(
                    -1, self._banned.to(st.logits.device), float("-inf"))
                tok, lp = sample_tokens(logits, params, generator, not_finite=bad,
                                        uniforms=u if len(st.rows) == total else u[st.rows.to(u.device)])
                st.not_finite[rows_dev] |= bad
            was_done = st.done[rows_dev]
            tok = torch.where(was_done, torch.full_like(tok, self.pad_token_id), tok)
            active = ~was_done
            st.tokens_out[rows_dev, step] = tok
            st.logps_out[rows_dev, step] = torch.where(active, lp, torch.zeros_like(lp))
            st.versions_out[rows_dev, step] = self.version
            st.lengths[rows_dev] += active.long()
            if st.stop.numel():
                st.done[rows_dev] = was_done | (active & torch.isin(tok, st.stop))
            last = step == params.max_tokens - 1
            checking = last or (step + 1) % every == 0
            if checking:  # the one host read of these `every` steps
                status = int((st.done.all().long() + 2 * st.not_finite.any().long()).item())
                all_done, any_bad = status & 1, status & 2
                if any_bad:
                    bad_rows = st.not_finite.nonzero().squeeze(-1).tolist()
                    raise TrainingHealthError(
                        f"sampling: the probabilities of row(s) {bad_rows[:8]} are not finite or sum to 0 (NaN or inf "
                        "logits: the model diverged; lower the learning rate or check the loss). Nothing was "
                        "sampled from them.")
                finished = bool(all_done) or last
                if st.lockstep:
                    stepping_along = bool(all_done)
                    finished = _all_ranks_finished(finished, device)
                if finished:
                    return
            st.last_pos = st.last_pos + 1
            if static is not None:  # fixed shapes: every row stays, its mask column is written in place
                st.logits = static.step(model, tok, st.last_pos, active, step)
                if self.on_decode_step is not None:
                    self.on_decode_step()
                continue
            # the token just sampled is real for every row that was active at this step
            st.mask = torch.cat([st.mask, active.long()[:, None]], dim=1)
            if st.compact and checking:
                keep = (~st.done[rows_dev]).nonzero().squeeze(-1)
                if len(st.rows) - len(keep) >= _DROP_FINISHED_AT * len(st.rows):
                    st.cache.batch_select_indices(keep)
                    st.mask, st.last_pos, tok, active = st.mask[keep], st.last_pos[keep], tok[keep], active[keep]
                    st.rows, rows_dev = st.rows[keep.cpu()], rows_dev[keep]
            new_version = self.refresh_weights() if self.refresh_weights is not None else None
            if new_version is not None:
                model, out = self._refill(model, st, new_version, n, step, rows_dev, active)
            else:
                mask = _decode_mask(model, st.mask, padded=st.padded, four_d=four_d)
                out = self._forward(model, input_ids=tok[:, None], attention_mask=mask,
                                    position_ids=st.last_pos[:, None], use_cache=True,
                                    **{_cache_kwarg(model): st.cache})
            if self.on_decode_step is not None:
                self.on_decode_step()
            st.logits = out.logits[:, -1]

    def _static_decoder(self, model: torch.nn.Module, st: _DecodeState, params: SamplingParams
                        ) -> _StaticDecoder | None:
        """The static decoder for this chunk, or None (with the reason logged once) where the model or the run
        needs the loop's growing cache."""
        reason = _static_decode_refused(model, st, self.refresh_weights is not None)
        if reason is not None:
            if reason not in _STATIC_REFUSALS_LOGGED:
                _STATIC_REFUSALS_LOGGED.add(reason)
                logger.warning("static_decode: decoding with the growing KV cache instead, because %s.", reason)
            return None
        st.compact = False
        return _StaticDecoder(model, st, params.max_tokens, capture=st.device.type == "cuda")

    def _refill(self, model: torch.nn.Module, st: _DecodeState, new_version: int, n: int, step: int,
                rows_dev: torch.Tensor, active: torch.Tensor) -> tuple[torch.nn.Module, Any]:
        """New weights mid-generation: the rows continue under them (partial rollouts, nothing is dropped or
        restarted). The KV cache of the prefix was computed by the old weights, so it is rebuilt with the new ones
        (one prefill of prompt + tokens so far): the next token's log-prob is then exactly the new policy's, as the
        loss's behaviour term assumes. PipelineRL keeps the stale cache instead; at 135M on CPU the refill costs
        about one prefill."""
        from transformers import DynamicCache

        self.version = new_version
        if model is not self.model:  # decoding on a cast copy: bring it to the new weights
            model = self._generation_model().eval()  # (a rebuilt copy starts in train mode)
        prompt_ids = st.ids.repeat_interleave(n, dim=0)[rows_dev]
        sofar = torch.cat([prompt_ids, st.tokens_out[rows_dev, :step + 1]], dim=1)
        full_pos = (st.mask.cumsum(-1) - 1).clamp(min=0)
        st.cache = DynamicCache(config=model.config)
        out = self._forward(model, input_ids=sofar, attention_mask=st.mask, position_ids=full_pos, use_cache=True,
                            logits_to_keep=1, **{_cache_kwarg(model): st.cache})
        st.last_pos = torch.where(active, full_pos[:, -1], st.last_pos)
        return model, out

    def _completions(self, st: _DecodeState, b: int, n: int, params: SamplingParams) -> list[list[Completion]]:
        results: list[list[Completion]] = []
        stop_set = set(params.stop_token_ids)
        # one copy to the host for the whole chunk
        lengths, tokens, logps = st.lengths.tolist(), st.tokens_out.cpu(), st.logps_out.cpu()
        versions = st.versions_out.cpu() if self.refresh_weights is not None else None
        for i in range(b):
            group = []
            for j in range(n):
                r = i * n + j
                k = lengths[r]
                toks = tokens[r, :k].tolist()
                reason = "stop" if toks and toks[-1] in stop_set else "length"
                group.append(Completion(token_ids=toks, logprobs=logps[r, :k].tolist(), finish_reason=reason,
                                        versions=versions[r, :k].tolist() if versions is not None else None))
            results.append(group)
        return results
