"""TRL's config field names: each one our configs do not have is either taken with TRL's meaning (translated to
our field), or refused with a `ConfigError` that names what to use instead or why it has no counterpart.

A TRL user's `GRPOConfig(use_vllm=True, vllm_mode="colocate", log_completions=False, ...)` should either work
or say what to write, never fail with a bare `TypeError: __init__() got an unexpected keyword argument`. The
table below is the one place these fates are written; `docs/trl-names.md` is generated from it
(`python -m toolkit._dev.trl_names_doc --write`) and `tests/unit/test_trl_names.py` walks TRL's own config
dataclasses (the installed TRL) to check that every field of theirs is a field of ours or has an entry here.

Fates:
- "same": accepted, with TRL's meaning, written to our field (`translate`).
- "default": accepted only at the value that describes what we do anyway (`accepts`); any other value is refused
  with the reason.
- "refused": refused at any value but TRL's default when that default is what we do (`accepts`), with the
  alternative (`instead`).
"""

from __future__ import annotations

__all__ = ["TRL_FIELDS", "TrlField", "accepting_trl_names", "translate_trl_kwargs"]

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

_NOTHING = object()


@dataclass(frozen=True)
class TrlField:
    """One TRL field's fate in our config (see the module docstring)."""

    fate: str                     # "same" | "default" | "refused"
    instead: str                  # what to write instead, or what it became (for the docs and the error)
    # "same": (value, the kwargs so far) -> our kwargs to add (merged into dict-valued fields)
    translate: Callable[[Any, dict[str, Any]], dict[str, Any]] | None = None
    accepts: tuple = field(default=())  # values accepted without effect: they describe what we do anyway


def _to(name: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any, dict], dict]:
    return lambda value, kwargs: {name: convert(value)}


def _into(name: str, key: str, convert: Callable[[Any], Any] = lambda v: v) -> Callable[[Any, dict], dict]:
    """Into the dict field `name` (generation_backend_kwargs, model_init_kwargs) under `key`."""
    return lambda value, kwargs: {name: {key: convert(value)}}


def _with_vllm(translate: Callable[[Any, dict], dict], mode: str | None = None) -> Callable[[Any, dict], dict]:
    """A vLLM setting: TRL reads it only with use_vllm (and, for `mode`, in that vllm_mode); so do we."""

    def apply(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        backend = kwargs.get("generation_backend")
        if kwargs.get("use_vllm"):
            current = kwargs.get("vllm_mode", "colocate")
        elif backend in ("vllm", "vllm-server"):  # our own name for the backend
            current = "colocate" if backend == "vllm" else "server"
        else:
            return {}
        return translate(value, kwargs) if mode is None or current == mode else {}

    return apply


def _vllm_backend(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if not value:
        return {}
    mode = kwargs.get("vllm_mode", "colocate")
    if mode not in ("colocate", "server"):
        raise ConfigError(f"vllm_mode: {mode!r} is not colocate or server.")
    return {"generation_backend": "vllm" if mode == "colocate" else "vllm-server"}


def _vllm_mode(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    return {}  # read by use_vllm


def _server_url(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    return {} if value is None else {"generation_backend_kwargs": {"url": str(value).rstrip("/")}}


def _server_host_port(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    if kwargs.get("vllm_server_base_url") is not None:
        return {}  # TRL: the base URL wins over host and port
    host, port = kwargs.get("vllm_server_host", "0.0.0.0"), kwargs.get("vllm_server_port", 8000)
    host = "127.0.0.1" if host == "0.0.0.0" else host
    return {"generation_backend_kwargs": {"url": f"http://{host}:{port}"}}


def _is_correction(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    return {} if value else {"importance_sampling_cap": None, "importance_sampling_min": None}


def _is_mode(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    # TRL 1.x: token_truncate | token_mask | sequence_truncate | sequence_mask
    level, _, mode = str(value).partition("_")
    if level not in ("token", "sequence") or mode not in ("truncate", "mask"):
        raise ConfigError(f"vllm_importance_sampling_mode: {value!r} is not one of token_truncate, token_mask, "
                          "sequence_truncate, sequence_mask.")
    return {"importance_sampling_level": level, "importance_sampling_mode": mode}


def _trust_remote_code(value: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"model_init_kwargs": {"trust_remote_code": bool(value)}} if value else {}


_DATA_PREP = ("datasets are tokenized in this process, once, before training; pass a tokenized dataset to skip "
              "that")
_TOKENIZER = "set it on the tokenizer and pass it as processing_class"
_NOT_YET = "not implemented yet"

# Fields every trainer config of TRL has that ours lack, shared by the three tables.
_COMMON: dict[str, TrlField] = {
    "trust_remote_code": TrlField("same", "model_init_kwargs={'trust_remote_code': True}", _trust_remote_code),
    "dataset_num_proc": TrlField("default", "nothing: " + _DATA_PREP, accepts=(None, 1)),
    "pad_to_multiple_of": TrlField("default", "nothing: the trainers pack rows without padding (padding-free), so "
                                   "there is no padded length to round", accepts=("auto", None)),
    "router_aux_loss_coef": TrlField("refused", "a plugin loss (toolkit_register_policy_losses / a custom "
                                     "compute_loss): the MoE router's auxiliary loss is not added", accepts=(None, 0.0)),
    "pad_token": TrlField("refused", _TOKENIZER, accepts=(None,)),
    "truncation_mode": TrlField("default", "nothing: prompts keep their end (cut from the left) and completions "
                                "their start, as TRL's keep_start does for the whole sequence",
                                accepts=("keep_start",)),
}

_SFT: dict[str, TrlField] = {
    **_COMMON,
    "shuffle_dataset": TrlField("default", "nothing: TRL's flag shuffles the dataset once while preparing it; "
                                "the batches are drawn in random order either way (train_sampling_strategy), as in "
                                "TRL", accepts=(False, True)),
    "packing_strategy": TrlField("default", "packing=True packs best-fit decreasing (TRL's bfd); 'wrapped' "
                                 "(examples cut across rows) is not offered: every example stays whole",
                                 accepts=("bfd",)),
    "eval_packing": TrlField("default", "nothing: evaluation packs as training does", accepts=(None,)),
    "dataset_text_field": TrlField("default", "rename the column to 'text' (dataset.rename_column(name, 'text')), "
                                   "or pass formatting_func", accepts=("text",)),
    "dataset_kwargs": TrlField("default", "nothing: " + _DATA_PREP, accepts=(None,)),
    "chat_template_path": TrlField("refused", "set tokenizer.chat_template and pass the tokenizer as "
                                   "processing_class", accepts=(None,)),
    "eos_token": TrlField("refused", _TOKENIZER, accepts=(None,)),
    "loss_type": TrlField("default", "nothing: SFT's loss is the negative log-likelihood (TRL's nll); dft: "
                          + _NOT_YET, accepts=("nll",)),
}

_DPO: dict[str, TrlField] = {
    **_COMMON,
    "padding_free": TrlField("default", "nothing: DPO is always padding-free (one row per pair, the prompt once)",
                             accepts=(False, True)),
    "use_weighting": TrlField("refused", "loss_type plus a plugin loss (WPO weighting: " + _NOT_YET + ")",
                              accepts=(False,)),
    "ld_alpha": TrlField("refused", "a plugin preference loss (LD-DPO: " + _NOT_YET + ")", accepts=(None,)),
    "discopop_tau": TrlField("refused", "a plugin preference loss (DiscoPOP: " + _NOT_YET + ")", accepts=(0.05,)),
    "f_divergence_type": TrlField("refused", "a plugin preference loss (f-DPO: " + _NOT_YET + ")",
                                  accepts=("reverse_kl",)),
    "f_alpha_divergence_coef": TrlField("refused", "a plugin preference loss (f-DPO: " + _NOT_YET + ")",
                                        accepts=(0.5,)),
    "sync_ref_model": TrlField("refused", "TR-DPO's reference sync: " + _NOT_YET, accepts=(False,)),
    "ref_model_mixup_alpha": TrlField("refused", "TR-DPO's reference sync: " + _NOT_YET, accepts=(0.6,)),
    "ref_model_sync_steps": TrlField("refused", "TR-DPO's reference sync: " + _NOT_YET, accepts=(512,)),
    "precompute_ref_batch_size": TrlField("default", "nothing: precompute_ref_log_probs uses the training batch "
                                          "size", accepts=(None,)),
}

_GRPO: dict[str, TrlField] = {
    **{k: v for k, v in _COMMON.items() if k not in ("pad_token", "truncation_mode")},
    "use_vllm": TrlField("same", "generation_backend='vllm' (colocate) or 'vllm-server' (server)", _vllm_backend),
    "vllm_mode": TrlField("same", "generation_backend (with use_vllm)", _vllm_mode),
    "vllm_server_base_url": TrlField("same", "generation_backend_kwargs={'url': ...}",
                                    _with_vllm(_server_url, "server")),
    "vllm_server_host": TrlField("same", "generation_backend_kwargs={'url': 'http://host:port'}",
                                _with_vllm(_server_host_port, "server")),
    "vllm_server_port": TrlField("same", "generation_backend_kwargs={'url': 'http://host:port'}",
                                 _with_vllm(_server_host_port, "server")),
    "vllm_server_timeout": TrlField("same", "generation_backend_kwargs={'startup_timeout': ...}",
                                    _with_vllm(_into("generation_backend_kwargs", "startup_timeout", float),
                                               "server")),
    "vllm_gpu_memory_utilization": TrlField("same", "generation_backend_kwargs={'gpu_memory_utilization': ...}",
                                            _with_vllm(_into("generation_backend_kwargs",
                                                             "gpu_memory_utilization", float), "colocate")),
    "vllm_max_model_length": TrlField("same", "generation_backend_kwargs={'max_model_len': ...}",
                                      _with_vllm(lambda v, kw: {} if v is None else
                                                 {"generation_backend_kwargs": {"max_model_len": int(v)}},
                                                 "colocate")),
    "vllm_tensor_parallel_size": TrlField("same", "generation_backend_kwargs={'tensor_parallel_size': ...}",
                                          _with_vllm(lambda v, kw: {} if v == 1 else
                                                     {"generation_backend_kwargs": {"tensor_parallel_size": int(v)}},
                                                     "colocate")),
    "vllm_model_impl": TrlField("same", "generation_backend_kwargs={'model_impl': ...}",
                                _with_vllm(lambda v, kw: {} if v == "vllm" else
                                           {"generation_backend_kwargs": {"model_impl": v}}, "colocate")),
    "vllm_enable_sleep_mode": TrlField("same", "generation_backend_kwargs={'sleep_mode': ...} (on by default for "
                                       "a GPU engine)", _with_vllm(_into("generation_backend_kwargs", "sleep_mode",
                                                                         bool), "colocate")),
    "vllm_group_port": TrlField("default", "nothing: weights reach `toolkit vllm-serve` over HTTP, not a NCCL "
                                "group", accepts=(51216,)),
    "vllm_structured_outputs_regex": TrlField("refused", "a format reward ('format:<regex>') rewards the form "
                                              "instead of forcing it; constrained decoding: " + _NOT_YET,
                                              accepts=(None,)),
    "vllm_importance_sampling_correction": TrlField("same", "importance_sampling_cap=None and "
                                                    "importance_sampling_min=None turn the correction off (False "
                                                    "wins over the clip settings, as in TRL)", _is_correction),
    "vllm_importance_sampling_cap": TrlField("same", "importance_sampling_cap (TRL's deprecated alias of "
                                             "clip_max; None: unset)", lambda v, kw: {} if v is None or kw.get(
                                                 "vllm_importance_sampling_correction", True) is False else
                                             {"importance_sampling_cap": v}),
    "vllm_importance_sampling_mode": TrlField("same", "importance_sampling_level + importance_sampling_mode",
                                              _is_mode),
    "vllm_importance_sampling_clip_min": TrlField("same", "importance_sampling_min",
                                                  lambda v, kw: {} if v is None or kw.get(
                                                      "vllm_importance_sampling_correction", True) is False
                                                  else {"importance_sampling_min": v}),
    "vllm_importance_sampling_clip_max": TrlField("same", "importance_sampling_cap (None: no upper bound)",
                                                  lambda v, kw: {} if kw.get("vllm_importance_sampling_cap")
                                                  is not None or kw.get("vllm_importance_sampling_correction",
                                                                        True) is False
                                                  else {"importance_sampling_cap": v}),
    "cast_lm_head_to_fp32": TrlField("same", "fp32_lm_head (ours: on by default)", _to("fp32_lm_head", bool)),
    "use_bias_correction_kl": TrlField("same", "kl_bias_correction", _to("kl_bias_correction", bool)),
    "max_tool_calling_iterations": TrlField("same", "max_turns (an environment's tool turns; TRL's None, no "
                                            "limit, keeps our max_turns)",
                                            lambda v, kw: {} if v is None else {"max_turns": int(v)}),
    "shuffle_dataset": TrlField("default", "nothing: prompts are drawn in a seeded random order (RoundSampler)",
                                accepts=(True,)),
    "ds3_gather_for_generation": TrlField("default", "nothing: generation under DeepSpeed ZeRO-3 is not offered "
                                          "(FSDP2 is)", accepts=(True,)),
    "cache_implementation": TrlField("refused", "generation_backend_kwargs={'static_decode': True} for a static "
                                     "KV cache", accepts=(None,)),
    "generation_kwargs": TrlField("refused", "the sampling fields: temperature, top_p, top_k, min_p, "
                                  "stop_token_ids, max_completion_length", accepts=(None,)),
    "repetition_penalty": TrlField("refused", "nothing: a repetition penalty would make the sampler's "
                                   "log-probs differ from the trainer's (the loss assumes they agree)",
                                   accepts=(1.0,)),
    "steps_per_generation": TrlField("refused", "num_iterations (optimizer steps per rollout) or async GRPO's "
                                     "max_staleness; one generation batch is one optimizer step here",
                                     accepts=(None,)),
    "log_completions_hub_repo": TrlField("refused", "log_completions (the table goes to the console, TensorBoard "
                                         "and trackio; pushing it to a Hub dataset: " + _NOT_YET + ")",
                                         accepts=(None,)),
    "log_unique_prompts": TrlField("refused", "log_completions with num_completions_to_print = num_generations "
                                   "shows one prompt's group", accepts=(False,)),
    "log_multimodal": TrlField("refused", "text models only so far (issue 59)", accepts=(True, False)),
    "num_generations_eval": TrlField("refused", "held-out evaluation is greedy, one completion per prompt "
                                     "(eval_dataset on the command line, report_accuracy)", accepts=(None,)),
    "multi_objective_aggregation": TrlField("default", "reward_weights: the weighted sum of the rewards, then "
                                            "advantages (TRL's sum_then_normalize)",
                                            accepts=("sum_then_normalize",)),
    "delta": TrlField("refused", "loss_kwargs of a plugin loss (two-sided clipping: " + _NOT_YET + ")",
                      accepts=(None,)),
    "top_entropy_quantile": TrlField("refused", _NOT_YET, accepts=(1.0,)),
    "entropy_coef": TrlField("refused", "an entropy bonus: " + _NOT_YET, accepts=(0.0,)),
    "use_adaptive_entropy": TrlField("refused", "an entropy bonus: " + _NOT_YET, accepts=(False,)),
    "entropy_target": TrlField("refused", "an entropy bonus: " + _NOT_YET, accepts=(0.2,)),
    "entropy_coef_min": TrlField("refused", "an entropy bonus: " + _NOT_YET, accepts=(0.0,)),
    "entropy_coef_max": TrlField("refused", "an entropy bonus: " + _NOT_YET, accepts=(1.0,)),
    "entropy_coef_delta": TrlField("refused", "an entropy bonus: " + _NOT_YET, accepts=(0.005,)),
    "sapo_temperature_pos": TrlField("refused", "loss_type='sapo': " + _NOT_YET, accepts=(1.0,)),
    "sapo_temperature_neg": TrlField("refused", "loss_type='sapo': " + _NOT_YET, accepts=(1.05,)),
    "vespo_k_pos": TrlField("refused", "loss_type='vespo': " + _NOT_YET, accepts=(2.0,)),
    "vespo_k_neg": TrlField("refused", "loss_type='vespo': " + _NOT_YET, accepts=(3.0,)),
    "vespo_lambda_pos": TrlField("refused", "loss_type='vespo': " + _NOT_YET, accepts=(3.0,)),
    "vespo_lambda_neg": TrlField("refused", "loss_type='vespo': " + _NOT_YET, accepts=(2.0,)),
    "sync_ref_model": TrlField("refused", "TR-DPO's reference sync: " + _NOT_YET, accepts=(False,)),
    "ref_model_mixup_alpha": TrlField("refused", "TR-DPO's reference sync: " + _NOT_YET, accepts=(0.6,)),
    "ref_model_sync_steps": TrlField("refused", "TR-DPO's reference sync: " + _NOT_YET, accepts=(512,)),
    "use_transformers_paged": TrlField("refused", "generation_backend_kwargs={'static_decode': True} (a static "
                                       "KV cache, CUDA graphs); paged attention: the vLLM backends",
                                       accepts=(False,)),
    "use_transformers_continuous_batching": TrlField("refused", "the vLLM backends (continuous batching)",
                                                     accepts=(False,)),
    "transformers_continuous_batching_config": TrlField("refused", "the vLLM backends (continuous batching)",
                                                        accepts=(None,)),
}

_ASYNC_GRPO: dict[str, TrlField] = {
    **_GRPO,
    "vllm_enable_sleep_mode": TrlField("refused", "nothing: async GRPO's worker generates while the trainer trains, "
                                       "so its engine never sleeps", accepts=(False,)),
}

#: Our config class name -> {TRL field name: its fate}. Async GRPO takes GRPO's but for sleep mode.
TRL_FIELDS: dict[str, dict[str, TrlField]] = {"SFTConfig": _SFT, "DPOConfig": _DPO, "GRPOConfig": _GRPO,
                                              "AsyncGRPOConfig": _ASYNC_GRPO}


def _merge(into: dict[str, Any], add: dict[str, Any]) -> None:
    for key, value in add.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            into[key] = {**value, **into[key]}  # the user's own setting of a key wins
        elif isinstance(value, dict):
            into[key] = dict(value)
        elif key not in into:
            into[key] = value


def _same_value(value: Any, accepted: Any) -> bool:
    if isinstance(accepted, bool) or isinstance(value, bool) or accepted is None or value is None:
        return value is accepted  # True is not 1, None is not 0
    return value == accepted


def translate_trl_kwargs(config: str, fields: set[str], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` for our `config` (a class name of TRL_FIELDS) with TRL's names translated, or a ConfigError naming
    the field and what to write. `fields`: our config's field names (kept as given)."""
    foreign = [k for k in kwargs if k not in fields]
    if not foreign:
        return kwargs
    table = TRL_FIELDS.get(config, {})
    ours = {k: v for k, v in kwargs.items() if k in fields}
    added: dict[str, Any] = {}
    for name in foreign:
        value, entry = kwargs[name], table.get(name)
        if entry is None:
            close = difflib.get_close_matches(name, sorted(fields), n=3)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(f"{config}: no field '{name}'.{hint} (TRL's names that we take or refuse are listed in "
                              "docs/trl-names.md.)")
        if entry.fate == "same":
            _merge(added, entry.translate(value, kwargs))
        elif not any(_same_value(value, accepted) for accepted in entry.accepts):
            what = ("is not supported" if entry.fate == "refused" else
                    f"can only be {' or '.join(repr(v) for v in entry.accepts)} here")
            raise ConfigError(f"{config}: TRL's '{name}' = {value!r} {what}; instead: {entry.instead}.")
    for key, value in added.items():
        mine = ours.get(key)
        clash = ([k for k in value if k in mine and mine[k] != value[k]] if isinstance(value, dict)
                 and isinstance(mine, dict) else [] if key not in ours or mine == value else [key])
        if clash:
            raise ConfigError(f"{config}: '{key}' = {mine!r} and TRL's {sorted(set(foreign))} (which set "
                              f"{clash} to {value!r}) disagree; give one of them.")
    _merge(ours, added)
    return ours


def accepting_trl_names(cls: type) -> type:
    """Class decorator for a config dataclass (applied over @dataclass): its constructor takes TRL's names as
    TRL_FIELDS[cls.__name__] says, and a name of neither gets a ConfigError with our closest names instead of
    Python's bare TypeError. The signature seen by `inspect` stays the dataclass's own (functools.wraps)."""
    import dataclasses
    import functools

    init = cls.__init__
    names = frozenset(f.name for f in dataclasses.fields(cls))

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **translate_trl_kwargs(cls.__name__, names, kwargs))

    cls.__init__ = __init__
    return cls
