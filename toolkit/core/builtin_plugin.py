"""toolkit's own losses, estimators, rewards and backends, registered through the public hooks.

The built-ins are the first users of the plugin API: a plugin's names are found exactly like
these. The losses and estimators come from the objectives room (toolkit.core.objectives); heavy
backends import inside their factories, so loading the registry imports no trainer and no vLLM.
"""

from __future__ import annotations

from .hookspecs import hookimpl
from .objectives import BUILTIN_ADVANTAGE_ESTIMATORS, BUILTIN_POLICY_LOSSES, BUILTIN_PREFERENCE_LOSSES
from .rewards import format_reward, number_list_match, numeric_match

__all__: list[str] = []  # a plugin module: its hooks are found by pluggy, nothing here is imported by name


@hookimpl
def toolkit_register_policy_losses():
    return dict(BUILTIN_POLICY_LOSSES)


@hookimpl
def toolkit_register_preference_losses():
    return dict(BUILTIN_PREFERENCE_LOSSES)


@hookimpl
def toolkit_register_advantage_estimators():
    return dict(BUILTIN_ADVANTAGE_ESTIMATORS)


@hookimpl
def toolkit_register_rewards():
    from .gym_tasks import reasoning_gym_reward  # (reasoning-gym itself is imported when a row is scored)

    return {"numeric_match": numeric_match, "number_list_match": number_list_match,
            "reasoning_gym": reasoning_gym_reward}


@hookimpl
def toolkit_make_reward(spec):
    if spec.startswith("format:"):
        return format_reward(spec[len("format:"):])
    if spec.startswith("reward_model:"):
        from .rewards import RewardModelReward

        return RewardModelReward(spec[len("reward_model:"):])
    if spec.startswith("judge:"):
        from .rewards import HTTPJudge

        return HTTPJudge(spec[len("judge:"):])
    return None


@hookimpl
def toolkit_register_generation_backends():
    def transformers(model, tokenizer, config):
        """Generation with the training model itself (no copy, no weight sync needed; kwargs: dtype, to decode
        with a copy of the weights in that dtype; static_decode, a preallocated KV cache and CUDA graphs)."""
        from .generation import TransformersBackend, _warn_mixed_precision_generation

        kwargs = config.generation_backend_kwargs or {}
        _warn_mixed_precision_generation(model, config, kwargs)
        from .vision import is_vision_processor, text_tokenizer

        vision = {"processor": tokenizer} if is_vision_processor(tokenizer) else {}  # prompts with images
        return TransformersBackend(model, pad_token_id=text_tokenizer(tokenizer).pad_token_id,
                                   max_batch_size=config.generation_batch_size, **kwargs, **vision)

    def vllm(model, tokenizer, config):
        """A vLLM engine in the training process; weights pushed in place, a LoRA run's adapters alone (kwargs:
        model_path, sync_every, max_model_len, kv_cache_gib, lora_sync, ...)."""
        from .models import unwrap_model
        from .vllm_backend import VLLMBackend, gpu_engine_kwargs, peft_lora_rank, require_vllm, vllm_context_length

        require_vllm()
        kwargs = gpu_engine_kwargs(model, config, dict(config.generation_backend_kwargs or {}))
        path = kwargs.pop("model_path", None) or unwrap_model(model).config._name_or_path
        rank = peft_lora_rank(model)
        if rank is not None:  # VLLMBackend builds the engine with LoRA support where lora_sync means the adapter
            kwargs.setdefault("max_lora_rank", rank)
        kwargs.setdefault("max_model_len", vllm_context_length(config))
        kwargs.setdefault("seed", config.seed)
        from .vision import is_vision_processor

        if is_vision_processor(tokenizer):  # prompts with images: vLLM's multimodal inputs (docs/vision.md)
            kwargs.setdefault("processor", tokenizer)
        return VLLMBackend(path, **kwargs)

    def vllm_server(model, tokenizer, config):
        """A `toolkit vllm-serve` process over HTTP (kwargs: url, timeout, startup_timeout, sync_every)."""
        from .vllm_backend import VLLMServerBackend

        return VLLMServerBackend(**(config.generation_backend_kwargs or {}))

    return {"transformers": transformers, "vllm": vllm, "vllm-server": vllm_server}


@hookimpl
def toolkit_register_environments():
    from .environments import GymnasiumEnvironment, TextArenaEnvironment, calculator_environment

    return {"calculator": calculator_environment, "gymnasium": GymnasiumEnvironment, "textarena": TextArenaEnvironment}
