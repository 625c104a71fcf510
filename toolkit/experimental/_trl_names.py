"""TRL's config names for the experimental trainers' configs: the counterparts of TRL's `CPOConfig`, `KTOConfig`,
`ORPOConfig`, `OnlineDPOConfig`, `GKDConfig` and `RewardConfig`, each field of theirs that ours lack taken or refused
as `toolkit.core.trl_names` does for the core configs. Importing this module adds the tables to `TRL_FIELDS`
(the core never imports the experimental tier, so it cannot list them itself); each experimental config is
decorated with `accepting_trl_names`, imported from here so the tables are in place first.

Entries TRL's configs share with the core ones (trust_remote_code, dataset_num_proc, the vLLM settings, ...) are
the core tables' own entries, looked up by name; a name whose meaning differs for a trainer (trust_remote_code for
the reward model, which loads no causal LM; max_length and packing for GKD) has an entry of its own.
"""

from __future__ import annotations

from toolkit.core.errors import ConfigError
from toolkit.core.trl_names import TRL_FIELDS, TrlField, accepting_trl_names

__all__ = ["accepting_trl_names"]

_NOT_YET = "not implemented yet"


def _pick(config: str, *names: str) -> dict[str, TrlField]:
    return {name: TRL_FIELDS[config][name] for name in names}


def _to_max_completion_length(value: object, kwargs: dict) -> dict:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"max_new_tokens (TRL's name of max_completion_length): a positive integer, got {value!r}.")
    return {"max_completion_length": value}


_ENCODER_DECODER = TrlField("default", "nothing: decoder-only causal language models only", accepts=(None, False))
_GENERATE_DURING_EVAL = TrlField("refused", "evaluation reports the loss and the preference metrics; sampling "
                                 "completions during evaluation: " + _NOT_YET, accepts=(False,))
_MAX_COMPLETION_LENGTH = TrlField("default", "max_length (prompt + completion; a pair that is too long is cut at the "
                                  "completions' end)", accepts=(None,))
_MAX_NEW_TOKENS = TrlField("same", "max_completion_length", _to_max_completion_length)
_OFFLOADING = TrlField("refused", "activation_checkpointing (activation_offloading is a field of the other "
                       "trainers' configs; not yet of this trainer's)", accepts=(False,))
_PROMPT_CAP = ("nothing: a prompt longer than max_prompt_length is cut from the left and completions stop at "
               "max_completion_length (no cap on their sum)")

_CPO = {
    **_pick("DPOConfig", "trust_remote_code", "dataset_num_proc"),
    "max_completion_length": _MAX_COMPLETION_LENGTH,
    "alpha": TrlField("refused", "AlphaPO's reward shaping: " + _NOT_YET, accepts=(0.0,)),
    "generate_during_eval": _GENERATE_DURING_EVAL,
    "is_encoder_decoder": _ENCODER_DECODER,
}

_ORPO = {
    **_pick("DPOConfig", "trust_remote_code", "dataset_num_proc"),
    "max_completion_length": _MAX_COMPLETION_LENGTH,
    "padding_value": TrlField("default", "nothing: rows are packed without padding", accepts=(None,)),
    "generate_during_eval": _GENERATE_DURING_EVAL,
    "is_encoder_decoder": _ENCODER_DECODER,
}

_KTO = _pick("DPOConfig", "trust_remote_code", "router_aux_loss_coef", "dataset_num_proc", "pad_to_multiple_of",
             "precompute_ref_batch_size", "sync_ref_model", "ref_model_mixup_alpha",
             "ref_model_sync_steps")

_ONLINE_DPO = {
    **_pick("GRPOConfig", "trust_remote_code", "repetition_penalty", "generation_kwargs", "cache_implementation",
            "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_structured_outputs_regex", "vllm_gpu_memory_utilization",
            "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_group_port",
            "vllm_tensor_parallel_size", "vllm_enable_sleep_mode", "ds3_gather_for_generation"),
    "reward_model_path": TrlField("refused", "reward_funcs=['reward_model:<path>'] (the trainer's argument; several "
                                  "reward functions and models may be combined)", accepts=(None,)),
    "max_new_tokens": _MAX_NEW_TOKENS,
    "max_length": TrlField("default", _PROMPT_CAP, accepts=(512, None)),
    "missing_eos_penalty": TrlField("refused", "a reward function that penalises a completion without an "
                                    "end-of-sequence token, added to reward_funcs", accepts=(None,)),
}

_GKD = {
    **_pick("SFTConfig", "trust_remote_code", "router_aux_loss_coef", "chat_template_path", "dataset_text_field",
            "dataset_kwargs", "dataset_num_proc", "eos_token", "truncation_mode", "shuffle_dataset", "packing_strategy",
            "pad_to_multiple_of", "eval_packing", "loss_type", "pad_token"),
    "max_length": TrlField("default", _PROMPT_CAP, accepts=(1024, None)),
    "packing": TrlField("default", "nothing: each step's rows (sampled or from the dataset) go through the forward "
                        "padding-free; rows are not packed across examples ahead of time", accepts=(False,)),
    "padding_free": TrlField("default", "nothing: the forward is always padding-free", accepts=(False, True)),
    "completion_only_loss": TrlField("default", "nothing: the divergence is taken over completion tokens only",
                                     accepts=(None, True)),
    "assistant_only_loss": TrlField("default", "nothing: the divergence covers the completion", accepts=(False,)),
    "max_new_tokens": _MAX_NEW_TOKENS,
    "teacher_model_init_kwargs": TrlField("refused", "load the teacher yourself and pass it as GKDTrainer("
                                          "teacher_model=...)", accepts=(None,)),
    "seq_kd": TrlField("refused", "sequence-level KD (SFT on the teacher's samples): " + _NOT_YET, accepts=(False,)),
}

_REWARD = {
    **_pick("SFTConfig", "chat_template_path", "dataset_num_proc", "eos_token", "pad_to_multiple_of", "pad_token"),
    "activation_offloading": _OFFLOADING,
    "model_init_kwargs": TrlField("refused", "load the model yourself (AutoModelForSequenceClassification."
                                  "from_pretrained(..., **kwargs)) and pass it to RewardTrainer", accepts=(None,)),
    "trust_remote_code": TrlField("refused", "load the model yourself with trust_remote_code=True and pass it to "
                                  "RewardTrainer", accepts=(False,)),
}

TRL_FIELDS.update({"CPOConfig": _CPO, "ORPOConfig": _ORPO, "KTOConfig": _KTO, "OnlineDPOConfig": _ONLINE_DPO,
                   "GKDConfig": _GKD, "RewardConfig": _REWARD})
