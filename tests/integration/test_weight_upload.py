"""Weight uploads to `toolkit vllm-serve`: streamed from the tensors' memory, parsed without a copy, checked whole.

The server here has a recording engine (the HTTP layer is the real one, on loopback); tests/integration/test_vllm.py
uploads to the real vLLM engine (CI stage 4).
"""

import json
import struct
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch
from builders import HELPERS
from safetensors.torch import load, save

from toolkit.core.vllm_backend import (
    VLLMServerBackend,
    changing_groups,
    engine_weights,
    parse_safetensors,
    safetensors_stream,
)
from toolkit.core.vllm_server import _checkpoint_weights, _warm_up, make_server, serve_in_thread


class Recorder:
    def __init__(self):
        self.weights_version, self.last_sync_s, self.got = 0, 0.0, None

    def generate(self, prompts, params, *, n=1, seed=None):
        raise AssertionError("not used")

    def load_weights(self, weights, *, partial=False):
        import threading

        self.threads = [*getattr(self, "threads", []), threading.current_thread()]
        self.got = [(name, t.clone()) for name, t in weights]  # the views die with the request's buffer
        self.partial = partial
        self.history = [*getattr(self, "history", []), (len(self.got), partial)]
        self.weights_version += 1


def weights():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 8, generator=g)
    return [("model.embed_tokens.weight", emb),
            ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8, generator=g)[:, ::2]),  # not contiguous
            ("model.norm.weight", torch.randn(8, generator=g).to(torch.bfloat16)),
            ("buffers.step", torch.tensor(7, dtype=torch.int64)),  # 0-dim
            ("buffers.mask", torch.tensor([True, False, True])),
            ("buffers.empty", torch.zeros(0, 4)),
            ("lm_head.weight", emb)]  # tied to the embedding: the same memory


def test_the_stream_is_a_safetensors_file_with_every_name_tied_weights_included():
    chunks, length = safetensors_stream(weights())
    body = b"".join(bytes(c) for c in chunks)
    assert len(body) == length
    loaded = load(body)  # safetensors' own reader agrees with the format
    expected = dict(weights())
    assert sorted(loaded) == sorted(expected)
    for name, t in expected.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t.contiguous()), name
    ours = dict(parse_safetensors(bytearray(body)))
    assert sorted(ours) == sorted(expected)
    for name, t in expected.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t.contiguous()), name
    theirs = dict(parse_safetensors(save({"a": torch.arange(6.0).view(2, 3)})))  # a file safetensors wrote
    assert torch.equal(theirs["a"], torch.arange(6.0).view(2, 3))


def test_an_upload_through_the_server_arrives_exactly_and_bumps_the_version():
    engine, url, token, client = _served()
    client.load_weights(weights())
    assert client.weights_version == 1 and client.last_sync_s > 0
    got = dict(engine.got)
    assert sorted(got) == sorted(n for n, _ in weights())
    for name, t in weights():
        assert torch.equal(got[name], t.contiguous()), name


def test_every_load_runs_on_one_thread_and_the_reply_splits_the_time():
    """ThreadingHTTPServer answers each upload on a new thread; the engine's loads must all run on one (the
    thread the warm-up ran on), and the client learns where the seconds went."""
    engine, _, _, client = _served()
    client.load_weights(weights())
    client.load_weights(weights())
    first, second = engine.threads
    assert first is second and first.name.startswith("toolkit-vllm-load")
    split = client.last_sync_split
    assert sorted(split) == ["load_s", "parse_s", "read_s"] and all(v >= 0 for v in split.values())
    assert sum(split.values()) <= client.last_sync_s


def test_an_engine_failure_is_a_500_and_a_malformed_body_a_400():
    class Failing(Recorder):
        def load_weights(self, weights, *, partial=False):
            raise ValueError("the engine's own error")

    url, _, token = serve_in_thread(Failing())
    chunks, _ = safetensors_stream(weights())
    code, reply = _post(url, token, b"".join(bytes(c) for c in chunks))
    assert code == 500 and "the engine's own error" in reply["error"]
    code, reply = _post(url, token, b"not a safetensors file")
    assert code == 400 and reply["error"].startswith("/update_weights: ")


def test_warm_up_sends_what_a_trainers_full_upload_sends_on_the_thread_later_uploads_use(tmp_path):
    """The warm-up pushes the checkpoint's weights as a trainer's full sync names them (float32, the tied head
    under its own name), so the buffer is already the size of a real upload; the engine ends at version 0."""
    from toolkit.testing import tiny_model

    model = tiny_model(seed=0)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    model.to(torch.bfloat16).save_pretrained(tmp_path)  # stored in bfloat16; a trainer sends float32
    (tmp_path / "pytorch_model.bin").write_bytes(b"")  # other files in the folder are not read
    trainer_side = engine_weights(model.float())
    ckpt = _checkpoint_weights(str(tmp_path))
    assert sorted(n for n, _ in ckpt) == sorted(n for n, _ in trainer_side)
    assert all(t.dtype == torch.float32 for _, t in ckpt)
    engine = Recorder()
    server = make_server(engine, "127.0.0.1", 0, str(tmp_path), token="t")
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()  # serve() warms up before this
    try:
        assert _warm_up(server.uploads, ckpt, 0) == [] and not hasattr(engine, "history")
        times = _warm_up(server.uploads, ckpt, 2)
        assert len(times) == 2 and all(t > 0 for t in times)
        assert engine.history == [(len(ckpt), False)] * 2 and engine.weights_version == 0
        got = dict(engine.got)
        for name, t in trainer_side:
            assert torch.equal(got[name], t.to(torch.bfloat16).float()), name
        assert len(server.uploads.buffer) >= safetensors_stream(trainer_side)[1]
        buffer = server.uploads.buffer
        client = VLLMServerBackend(f"http://127.0.0.1:{server.server_address[1]}", token="t")
        client.load_weights(trainer_side)
        assert server.uploads.buffer is buffer  # the first real upload allocated nothing
        assert len(set(engine.threads)) == 1 and engine.weights_version == 1
    finally:
        server.shutdown()
        server.server_close()
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        _checkpoint_weights(str(tmp_path / "missing"))
    other = tmp_path / "only-an-adapter"
    other.mkdir()
    (other / "adapter_model.safetensors").write_bytes(save({"lora_A": torch.zeros(2, 2)}))
    with pytest.raises(FileNotFoundError):  # an adapter beside no model is not the model's weights
        _checkpoint_weights(str(other))


def _post(url, token, body):
    req = urllib.request.Request(url + "/update_weights", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _file(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


@pytest.mark.parametrize("body,reason", [
    (b"abc", "shorter than its 8-byte header length"),
    (struct.pack("<Q", 1000) + b"{}", "past the end"),
    (struct.pack("<Q", 3) + b"{x}", "not JSON"),
    (_file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8), "do not hold"),
    (_file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}}, b"\0" * 16), "do not hold"),
    (_file({"w": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "not a safetensors entry"),
    (_file({"w": {"dtype": "F32", "shape": [-2, -2], "data_offsets": [0, 16]}}, b"\0" * 16), "sizes >= 0"),
    (_file({"w": {"dtype": "F32", "shape": [float("inf")], "data_offsets": [0, 8]}}, b"\0" * 8), "sizes >= 0"),
    (_file({"w": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8), "whole numbers"),
])
def test_a_malformed_upload_is_refused_whole_with_the_reason(body, reason):
    engine = Recorder()
    url, _, token = serve_in_thread(engine)
    code, reply = _post(url, token, body)
    assert code == 400 and reason in reply["error"], reply
    assert engine.weights_version == 0 and engine.got is None
    code, reply = _post(url, token, save({"ok": torch.ones(2)}))  # the server still takes a good one
    assert code == 200 and reply["weights_version"] == 1


def test_views_of_one_storage_and_tied_names_are_each_sent():
    flat = torch.arange(24.0)  # as a checkpoint loaded from one file can lay parameters out
    a, b = flat[:12].view(3, 4), flat[12:].view(3, 4)
    chunks, _ = safetensors_stream([("a", a), ("b", b), ("a_tied", a), ("a_t", a.t())])
    got = load(b"".join(bytes(c) for c in chunks))
    assert sorted(got) == ["a", "a_t", "a_tied", "b"]
    assert torch.equal(got["b"], b) and torch.equal(got["a_t"], a.t()) and torch.equal(got["a_tied"], a)


def test_successive_uploads_through_the_reused_buffer_each_arrive_exactly():
    engine, url, token, client = _served()
    small = [("w", torch.full((4,), 1.0))]
    big = [("w", torch.arange(16.0)), ("v", torch.ones(3, dtype=torch.int64))]
    for weights_ in (big, small, big):  # a smaller upload after a larger one uses the front of the buffer
        client.load_weights(weights_)
        got = dict(engine.got)
        assert sorted(got) == sorted(n for n, _ in weights_)
        for name, t in weights_:
            assert torch.equal(got[name], t), name
    assert engine.weights_version == 3


def test_a_client_that_hangs_up_mid_upload_leaves_the_server_taking_the_next_one():
    import socket
    from urllib.parse import urlparse

    engine = Recorder()
    url, _, token = serve_in_thread(engine)
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(f"POST /update_weights HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
                     f"Content-Length: 100000\r\n\r\n".encode() + b"\0" * 100)  # then hangs up
    code, reply = _post(url, token, save({"ok": torch.ones(2)}))
    assert code == 200 and reply["weights_version"] == 1 and engine.weights_version == 1
    assert torch.equal(dict(engine.got)["ok"], torch.ones(2))


def test_a_name_listed_twice_is_refused_before_anything_is_sent():
    from toolkit import ConfigError

    with pytest.raises(ConfigError, match="'w' is listed twice"):
        safetensors_stream([("w", torch.ones(2)), ("w", torch.zeros(2))])


# ----------------------------------------------------------------- what a sync sends: all, then what can change


def _names(pairs):
    return {n for n, _ in pairs}


def _changing(model):
    return engine_weights(model, only=changing_groups(model))


def _served(**kwargs):
    """A recording engine behind the real HTTP server on loopback, and a client: (engine, url, token, client)."""
    engine = Recorder()
    url, _, token = serve_in_thread(engine)
    return engine, url, token, VLLMServerBackend(url, token=token, **kwargs)


def _lora_q(seed=0):
    from peft import LoraConfig, get_peft_model

    from toolkit.testing import tiny_model

    return get_peft_model(tiny_model(seed=seed), LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))


def test_full_fine_tuning_sends_every_weight_and_frozen_blocks_are_left_out():
    from toolkit.testing import tiny_model

    model = tiny_model()  # tied: lm_head.weight is the embedding's memory
    everything = _names(engine_weights(model))
    assert "lm_head.weight" in everything and "model.embed_tokens.weight" in everything
    assert _names(_changing(model)) == everything
    frozen = [model.model.embed_tokens, model.model.layers[0], model.model.norm]
    for module in frozen:
        module.requires_grad_(False)
    part = _names(_changing(model))
    # layer 1 changes, so the parent of its modules, the whole layer, goes; layer 0, the final norm and the
    # embedding do not, and neither does the tied head, which is the embedding's memory
    assert part == {n for n in everything if n.startswith("model.layers.1.")}
    # the final norm's parent is the whole model: training it sends everything (the rule is conservative)
    model.model.norm.requires_grad_(True)
    assert _names(_changing(model)) == everything


def test_lora_sends_the_merged_blocks_that_hold_adapters_whole_and_the_tied_head_with_its_embedding():
    from peft import LoraConfig, get_peft_model

    from toolkit.testing import tiny_model

    model = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    full = dict(engine_weights(model))
    part = dict(_changing(model))
    # every attention projection of every layer (q/k/v are one merged layer in vLLM), nothing else
    assert set(part) == {n for n in full if ".self_attn." in n}
    assert len(part) == 2 * 4
    merged = model.get_base_model().model.layers[0].self_attn
    for name in ("q_proj", "v_proj"):
        w = part[f"model.layers.0.self_attn.{name}.weight"]
        lin = getattr(merged, name)
        delta = (lin.lora_B["default"].weight @ lin.lora_A["default"].weight) * lin.scaling["default"]
        assert torch.allclose(w, lin.base_layer.weight + delta, atol=1e-6)  # merged, and the model unmerged again
    assert torch.equal(part["model.layers.0.self_attn.k_proj.weight"], merged.k_proj.weight)
    # an adapted embedding brings the tied head with it
    emb = get_peft_model(tiny_model(), LoraConfig(r=2, target_modules=["embed_tokens"], task_type="CAUSAL_LM"))
    assert _names(_changing(emb)) == {"model.embed_tokens.weight", "lm_head.weight"} | {
        n for n in full if n.startswith("model.") and n != "model.embed_tokens.weight"}


def test_modules_to_save_sends_the_trained_copy_under_the_module_name():
    from peft import LoraConfig, get_peft_model

    from toolkit.testing import tiny_model

    model = get_peft_model(tiny_model(tie_word_embeddings=False),
                           LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                      task_type="CAUSAL_LM"))
    head = model.get_base_model().lm_head
    with torch.no_grad():
        head.modules_to_save["default"].weight.add_(1.0)  # the trained copy differs from the frozen original
    full = dict(engine_weights(model))
    assert "lm_head.weight" in full and not any("original_module" in n or "modules_to_save" in n for n in full)
    assert torch.equal(full["lm_head.weight"], head.modules_to_save["default"].weight)
    part = _names(_changing(model))
    assert "lm_head.weight" in part and "model.embed_tokens.weight" not in part


def test_a_sync_sends_all_weights_first_then_only_what_training_changes_through_the_server():


    engine, url, token, client = _served()
    model = _lora_q()
    everything = _names(engine_weights(model))
    client.sync_weights(model)
    assert _names(engine.got) == everything and engine.partial is False
    full_bytes = client.last_sync_bytes
    client.sync_weights(model)
    assert _names(engine.got) == {n for n in everything if ".self_attn." in n} and engine.partial is True
    assert client.last_sync_bytes < full_bytes
    client.load_weights(weights())  # the engine got something else: the next sync sends everything again
    client.sync_weights(model)
    assert _names(engine.got) == everything and engine.partial is False
    other = _lora_q(seed=1)
    client.sync_weights(other)  # a different model: everything
    assert _names(engine.got) == everything and engine.partial is False


def test_a_module_frozen_since_the_last_full_sync_still_gets_its_new_weights_once_more():
    from toolkit.testing import tiny_model

    engine, url, token, client = _served()
    model = tiny_model()
    model.requires_grad_(False)
    model.model.layers[0].requires_grad_(True)
    client.sync_weights(model)  # first: all
    everything = _names(engine.got)
    client.sync_weights(model)
    assert _names(engine.got) == {n for n in everything if ".layers.0." in n} and engine.partial
    # layer 0 trained until now and is frozen from here on (a freezing schedule; switching PEFT adapters): its
    # last update still goes, and from now on so does layer 1
    model.model.layers[0].requires_grad_(False)
    model.model.layers[1].requires_grad_(True)
    client.sync_weights(model)
    assert _names(engine.got) == {n for n in everything if ".layers.0." in n or ".layers.1." in n}


def test_a_partial_upload_on_top_of_other_weights_is_refused_and_the_client_sends_all():


    engine, url, token, client = _served()
    model = _lora_q()
    everything = _names(engine_weights(model))
    client.sync_weights(model)
    # the server restarted (its weights are the checkpoint's again, version 0): the client's check sees it
    engine.weights_version = 0
    client.sync_weights(model)
    assert _names(engine.got) == everything and not engine.partial
    client.sync_weights(model)
    assert engine.partial  # the engine holds this client's weights again: partial
    # another client uploads between this client's check and its upload: the server refuses the partial upload
    # (409, naming both) and the client sends everything
    client._engine_unchanged = lambda: True
    engine.weights_version += 5
    uploads = len(engine.history)
    client.sync_weights(model)
    assert len(engine.history) == uploads + 1  # the refused partial upload never reached the engine
    assert _names(engine.got) == everything and not engine.partial
    assert client.weights_version == engine.weights_version
    chunks, _ = safetensors_stream(weights())
    status, answer = _post_to(url, "/update_weights?partial=1&base=ab:3", token, b"".join(bytes(c) for c in chunks))
    assert status == 409 and "completes weights ab:3" in answer["error"]


def _post_to(url, path, token, body):
    req = urllib.request.Request(url + path, data=body, method="POST", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_a_server_without_partial_uploads_always_gets_all_weights():


    engine, url, token, client = _served()
    assert client.info["partial_uploads"] is True
    del client.info["partial_uploads"]  # what /health of a server before partial uploads answers
    model = _lora_q()
    for _ in range(2):
        client.sync_weights(model)
        assert _names(engine.got) == _names(engine_weights(model)) and not engine.partial


def test_experts_go_as_one_list_and_a_root_parameter_sends_everything():
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Module()
            self.mlp.gate = nn.Linear(4, 3, bias=False)
            self.mlp.experts = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(3))
            self.norm = nn.LayerNorm(4)

    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList(Block() for _ in range(2))
    model.requires_grad_(False)
    model.model.layers[1].mlp.experts[2].requires_grad_(True)
    # vLLM fuses a block's experts into one layer: the whole list goes, not expert 2's own parent (itself)
    assert changing_groups(model) == {"model.layers.1.mlp.experts"}
    assert _changing(model) and {n for n, _ in _changing(model)} == {
        f"model.layers.1.mlp.experts.{i}.weight" for i in range(3)}
    model.scale = nn.Parameter(torch.ones(1))  # a parameter of the root module: everything
    assert changing_groups(model) == {"model.layers.1.mlp.experts", ""}
    assert _names(_changing(model)) == _names(engine_weights(model))


def test_partial_reload_warnings_are_dropped_in_the_loading_thread_only(caplog):
    import logging
    import threading

    from toolkit.core.vllm_backend import _QUIET

    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    caplog.set_level(logging.WARNING)
    _QUIET.local.partial = True
    try:
        log.warning("%s: Failed to load weights", "RMSNorm")  # dropped
        logging.getLogger("vllm.model_executor.model_loader.reload.inplace").warning(
            "Following weights were not loaded from checkpoint: %s", {"a"})  # dropped
        elsewhere = threading.Thread(target=log.warning, args=("%s: Failed to load weights", "Other thread"))
        elsewhere.start()
        elsewhere.join()
        log.warning("something else")
    finally:
        _QUIET.local.partial = False
    log.warning("%s: Failed to load weights", "After")  # a full load's warning stays
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["Other thread: Failed to load weights", "something else", "After: Failed to load weights"]


def test_full_fine_tuning_syncs_are_full_ones_without_a_check():
    from toolkit.testing import tiny_model

    engine, url, token, client = _served()
    client._engine_unchanged = lambda: pytest.fail("full fine-tuning needs no check of the server")
    model = tiny_model()  # tied: the head goes with the embedding, so everything is selected
    for _ in range(2):
        client.sync_weights(model)
        assert _names(engine.got) == _names(engine_weights(model)) and engine.partial is False


def test_sync_every_remembers_what_trained_between_pushes():
    from toolkit.testing import tiny_model

    engine, url, token, client = _served(sync_every=2)
    model = tiny_model()
    model.requires_grad_(False)
    model.model.layers[1].requires_grad_(True)
    client.sync_weights(model)  # pushes: all
    model.model.layers[1].requires_grad_(False)
    model.model.layers[0].requires_grad_(True)
    client.sync_weights(model)  # no push; layer 0 is trainable now
    model.model.layers[0].requires_grad_(False)
    client.sync_weights(model)  # pushes: layer 1 (trained since the full sync) and layer 0 (trained since)
    assert engine.partial and _names(engine.got) == {n for n in _names(engine_weights(model))
                                                     if ".layers.0." in n or ".layers.1." in n}


@pytest.mark.slow
def test_several_ranks_agree_on_partial_syncs_share_a_refusal_and_fail_together(tmp_path):
    """Two processes (torchrun, gloo) syncing one LoRA model to one server, rank 0 uploading: full, then
    partial; a partial upload refused because another client uploaded makes every rank gather all weights
    again; a failed upload on rank 0 raises on both ranks instead of leaving rank 1 waiting."""
    import os
    import shutil
    import subprocess
    import sys

    engine = Recorder()
    url, _, token = serve_in_thread(engine)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    worker = str((HELPERS / "sync_ranks_worker.py"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOOLKIT_VLLM_TOKEN": token}
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", "29541", worker, url, str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    n = ranks[0]["names"]
    # full; partial (the attention blocks); the other client's one tensor; all again after the refusal
    assert engine.history == [(n, False), (ranks[0]["partial_names"], True), (1, False), (n, False)]
    assert ranks[0]["partial_names"] < n
    assert ranks[0]["version"] == ranks[1]["version"] == engine.weights_version
    assert ranks[0]["error"] and "another rank" not in ranks[0]["error"]  # its own reason (401, or the hang-up)
    assert "another rank's upload failed" in ranks[1]["error"]


def test_a_negative_warm_up_is_refused_before_the_engine_starts(capsys):
    from toolkit.core.vllm_server import serve

    with pytest.raises(SystemExit) as e:  # a model path that does not exist: the check comes first
        serve(["--model", "/nonexistent/checkpoint", "--warm_up", "-1"])
    assert e.value.code == 2
    assert "--warm_up: must be >= 0, got -1." in capsys.readouterr().err


def test_checkpoint_weights_read_every_shard_an_index_lists_and_nothing_beside_it(tmp_path):
    from toolkit.testing import tiny_model

    model = tiny_model(seed=1)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    shards = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1  # really sharded
    (tmp_path / "critic.safetensors").write_bytes(save({"v_head.weight": torch.zeros(1, 64)}))  # not listed
    ckpt = dict(_checkpoint_weights(str(tmp_path)))
    trainer_side = dict(engine_weights(model))
    assert sorted(ckpt) == sorted(trainer_side)  # the tied head added under its own name, the critic left out
    for name, t in trainer_side.items():
        assert torch.equal(ckpt[name], t), name


def test_checkpoint_weights_add_a_head_only_where_the_config_ties_it(tmp_path):
    from toolkit.testing import tiny_model

    untied = tiny_model(seed=2, tie_word_embeddings=False)
    untied.save_pretrained(tmp_path / "untied")
    ckpt = dict(_checkpoint_weights(str(tmp_path / "untied")))
    assert sorted(ckpt) == sorted(dict(engine_weights(untied)))
    assert not torch.equal(ckpt["lm_head.weight"], ckpt["model.embed_tokens.weight"])  # its own head, as saved
    folder = tmp_path / "embedding-only"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(save({"model.embed_tokens.weight": torch.randn(10, 4)}))
    for config, head in (({}, True),  # transformers ties by default
                         ({"tie_word_embeddings": False}, False),
                         ({"text_config": {"tie_word_embeddings": False}}, False),  # a multimodal config's text part
                         ({"text_config": {"tie_word_embeddings": True}}, True),
                         ({"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": True}}, False)):
        (folder / "config.json").write_text(json.dumps(config))
        assert ("lm_head.weight" in dict(_checkpoint_weights(str(folder)))) is head, config


def test_an_engine_error_during_the_warm_up_is_raised_not_swallowed():
    from toolkit.core.vllm_server import _Uploads

    class Failing(Recorder):
        def load_weights(self, weights, *, partial=False):
            raise ValueError("the engine's own error")

    uploads = _Uploads(Failing())
    try:
        with pytest.raises(ValueError, match="the engine's own error"):  # serve() lets it stop the server (below)
            _warm_up(uploads, weights(), 2)
    finally:
        uploads.loader.shutdown()


def test_serve_warms_up_by_default_only_on_a_cpu_build_and_skips_an_unreadable_checkpoint(tmp_path, monkeypatch,
                                                                                          caplog):
    """serve() with a recording engine in place of vLLM (tests/integration/test_vllm.py starts the real server, warm-up
    included): how many warm-up rounds reach the engine, and the warning when the weights cannot be read."""
    import logging

    import toolkit.core.vllm_backend as vllm_backend
    import toolkit.core.vllm_server as vllm_server
    from toolkit.testing import tiny_model

    engines, made = [], []

    class Engine(Recorder):
        def __init__(self, path, **kwargs):
            super().__init__()
            engines.append(self)

    class Stopped:  # the server serve() would run: it stops at once, as on Ctrl-C
        server_address = ("127.0.0.1", 0)

        def serve_forever(self):
            raise KeyboardInterrupt

        def shutdown(self):
            raise AssertionError("serve_forever has stopped: nothing to shut down")

        def server_close(self):
            made[-1].loader.shutdown()

    def make_server(backend, *args, **kwargs):  # what the engine had loaded when the port would open
        made.append(kwargs["uploads"])
        made[-1].history_at_listen = list(getattr(backend, "history", []))
        return Stopped()

    kept = []  # serve() would set this process's malloc options: recorded instead (the test below sets them)
    monkeypatch.setattr(vllm_server, "_keep_freed_memory", lambda: kept.append(1) or True)
    monkeypatch.setattr(vllm_backend, "VLLMBackend", Engine)
    monkeypatch.setattr(vllm_server, "make_server", make_server)
    tiny_model(seed=0).save_pretrained(tmp_path / "model")
    full = (len(_checkpoint_weights(str(tmp_path / "model"))), False)  # every weight, not partial
    for cpu, flags, rounds, keeps in ((True, [], 2, True), (False, [], 0, False), (False, ["--warm_up", "1"], 1, False),
                                      (True, ["--warm_up", "0"], 0, True),
                                      (True, ["--release_freed_memory"], 2, False)):
        monkeypatch.setattr(vllm_server, "_cpu_build", lambda cpu=cpu: cpu)
        calls = len(kept)
        assert vllm_server.serve(["--model", str(tmp_path / "model"), "--token", "t", *flags]) == 0
        assert getattr(engines[-1], "history", []) == [full] * rounds, (cpu, flags)
        assert made[-1].history_at_listen == [full] * rounds  # warmed before it listens
        assert engines[-1].weights_version == 0 and made[-1].backend is engines[-1]
        # a CPU build keeps freed memory and reloads on the main thread (the warm-up's included), unless told not to
        assert (len(kept) > calls) is keeps, (cpu, flags)
        assert isinstance(made[-1].loader, vllm_server._MainThreadLoader) is keeps
        assert all(t is threading.main_thread() for t in getattr(engines[-1], "threads", [])) or not keeps

    class Failing(Engine):
        def load_weights(self, weights, *, partial=False):
            raise ValueError("the engine's own error")

    monkeypatch.setattr(vllm_backend, "VLLMBackend", Failing)
    servers = len(made)
    with pytest.raises(ValueError, match="the engine's own error"):  # the server stops: it never listens
        vllm_server.serve(["--model", str(tmp_path / "model"), "--token", "t", "--warm_up", "1"])
    assert len(made) == servers
    monkeypatch.setattr(vllm_backend, "VLLMBackend", Engine)
    (tmp_path / "no-weights").mkdir()
    with caplog.at_level(logging.WARNING, logger=vllm_server.logger.name):
        assert vllm_server.serve(["--model", str(tmp_path / "no-weights"), "--token", "t", "--warm_up", "2"]) == 0
    assert "warm-up skipped (FileNotFoundError: no model.safetensors" in caplog.text
    assert not hasattr(engines[-1], "history")  # served unwarmed


def test_the_main_thread_loader_runs_other_threads_loads_on_the_main_thread_and_refuses_leftovers():
    """`toolkit vllm-serve` on a CPU build: request threads queue their loads, the main thread runs them (glibc's
    main arena is the one whose freed memory is kept), an error reaches the request that asked, and loads still
    queued when the server closes are refused rather than left waiting."""
    from toolkit.core.vllm_server import _MainThreadLoader

    loader = _MainThreadLoader()
    assert loader.submit(threading.current_thread).result(timeout=1) is threading.main_thread()  # the warm-up: at once
    seen = {}

    def request_threads():  # what the HTTP server's threads do (serve(): loader.run while it serves)
        seen["ran_on"] = loader.submit(threading.current_thread).result(timeout=30)
        failing = loader.submit(int, "not a number")
        seen["error"] = failing.exception(timeout=30)

    serving = threading.Thread(target=request_threads)
    serving.start()
    loader.run(serving)  # returns once the serving thread has ended
    assert seen["ran_on"] is threading.main_thread()
    assert isinstance(seen["error"], ValueError)
    left = []
    late = threading.Thread(target=lambda: left.append(loader.submit(threading.current_thread)))
    late.start()
    late.join()
    loader.shutdown()
    with pytest.raises(RuntimeError, match="shutting down"):
        left[0].result(timeout=1)


def test_ctrl_c_during_a_main_thread_reload_stops_the_loop_and_tells_the_request():
    """Ctrl-C lands on the main thread, which may be running a reload: the server must stop (the interrupt goes
    on) and the request that asked must get an error, not the KeyboardInterrupt and not a hang."""
    from toolkit.core.vllm_server import _MainThreadLoader

    loader = _MainThreadLoader()
    seen = {}

    def interrupted():
        raise KeyboardInterrupt

    def request_thread():
        seen["error"] = loader.submit(interrupted).exception(timeout=30)

    serving = threading.Thread(target=request_thread)
    serving.start()
    with pytest.raises(KeyboardInterrupt):
        loader.run(serving)
    serving.join(timeout=30)
    assert isinstance(seen["error"], RuntimeError) and "interrupted during the reload" in str(seen["error"])


def test_closing_the_server_refuses_a_load_no_loop_will_run_instead_of_hanging():
    """The real HTTP server with the main-thread loader whose loop has stopped (Ctrl-C): an upload already
    queued is refused when the server closes, so its client gets a 500 naming the shutdown instead of waiting
    for ever on a loop that will not run it; a later load is refused at once."""
    import time

    from toolkit.core.vllm_server import _MainThreadLoader, _Uploads

    engine = Recorder()
    loader = _MainThreadLoader()
    server = make_server(engine, "127.0.0.1", 0, "", token="t", uploads=_Uploads(engine, loader))
    http = threading.Thread(target=server.serve_forever, daemon=True)
    http.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    chunks, _ = safetensors_stream(weights())
    got = []
    client = threading.Thread(target=lambda: got.append(_post(url, "t", b"".join(bytes(c) for c in chunks))))
    client.start()
    deadline = time.monotonic() + 30
    while not loader._waiting and time.monotonic() < deadline:  # the upload has been read and its load queued
        time.sleep(0.01)
    assert loader._waiting, "the upload never reached the loader"
    server.shutdown()
    closing = threading.Thread(target=server.server_close, daemon=True)
    closing.start()
    closing.join(timeout=30)
    assert not closing.is_alive(), "server_close hung"
    client.join(timeout=30)
    assert got and got[0][0] == 500 and "shutting down" in got[0][1]["error"], got
    assert not hasattr(engine, "history")  # nothing reached the engine
    late = []

    def submit_late():  # from a request's thread (from the main thread a submit runs at once)
        try:
            loader.submit(int, "1")
        except RuntimeError as e:
            late.append(e)

    t = threading.Thread(target=submit_late)
    t.start()
    t.join(timeout=30)
    assert late and "shutting down" in str(late[0])  # refused at once, not queued for a loop that has stopped


_CYCLES = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from toolkit.core.vllm_server import _keep_freed_memory
    assert _keep_freed_memory()
faults = []
for _ in range(5):  # a reload's allocations on the main thread: many layer-sized blocks and one embedding-sized
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(576, 1536) for _ in range(40)] + [torch.ones(49152, 576)]
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults)
"""


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or __import__("platform").libc_ver()[0] != "glibc",
                    reason="glibc's allocator options")
@pytest.mark.slow
@pytest.mark.skipif(_thp_always(), reason="transparent huge pages always on: faults are counted in 2 MiB pages")
def test_kept_freed_memory_is_reused_without_page_faults_where_the_default_faults_it_in_again():
    """The invariant the server's steadier reloads rest on: after `_keep_freed_memory`, blocks the main thread
    frees (the 113 MB embedding included, which glibc would otherwise map and unmap each time) are reused by
    the next allocations of the same sizes without the kernel faulting fresh pages in. Each in a process of its
    own: the options are process-wide."""
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _CYCLES, mode], capture_output=True, text=True, timeout=300,
                             check=False)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    pages = (40 * 576 * 1536 + 49152 * 576) * 4 // 4096  # one cycle's blocks, in 4 KiB pages
    default, kept = faults("default"), faults("keep")
    assert default[-1] > pages // 5, default  # glibc's default maps the embedding afresh every time
    assert kept[-1] < pages // 100, kept  # kept: the last cycles fault (almost) nothing in
