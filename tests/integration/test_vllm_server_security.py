"""`toolkit vllm-serve`'s HTTP layer: a token on every endpoint, bounded bodies, a loud warning beyond loopback.

The engine behind the server here is toolkit's TransformersBackend on a tiny model (real generation, in this
process), so these checks run in the fast suite; tests/integration/test_vllm.py runs the same server with the real vLLM
engine (CI stage 4), with the token taken from the environment.
"""

import json
import logging
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import save

from toolkit import SamplingParams, ToolkitError
from toolkit.core.generation import TransformersBackend
from toolkit.core.vllm_backend import VLLMServerBackend
from toolkit.core.vllm_server import is_loopback, make_server, serve_in_thread, warn_if_exposed
from toolkit.testing import tiny_model, tiny_tokenizer


class TinyEngine:
    """What the server needs from an engine, on a tiny transformers model."""

    def __init__(self):
        self.model = tiny_model().eval()
        self.backend = TransformersBackend(self.model, pad_token_id=tiny_tokenizer().pad_token_id)
        self.weights_version, self.last_sync_s = 0, 0.0

    def generate(self, prompts, params, *, n=1, seed=None):
        return self.backend.generate(prompts, params, n=n, seed=0)

    def load_weights(self, weights):
        self.model.load_state_dict(dict(weights), strict=False)
        self.weights_version += 1


@pytest.fixture(scope="module")
def server():
    engine = TinyEngine()
    url, _, token = serve_in_thread(engine)
    return url, token, engine


def _call(url, path, *, token=None, body=None, headers=None):
    h = dict(headers or {})
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url + path, data=body, method="POST" if body is not None else "GET", headers=h)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


GEN = json.dumps({"prompts": [[5, 9, 11]], "n": 2, "params": {"max_tokens": 3, "temperature": 1.0, "top_p": 1.0,
                                                               "top_k": 0, "min_p": 0.0, "stop_token_ids": [2]}}).encode()


def test_every_endpoint_refuses_a_request_without_the_right_token(server):
    url, token, engine = server
    weights = save({"model.norm.weight": torch.ones(64)})
    for path, body in (("/health", None), ("/generate", GEN), ("/update_weights", weights)):
        for given in (None, "wrong-" + token):
            code, reply = _call(url, path, token=given, body=body)
            assert code == 401 and "missing or wrong token" in reply["error"], (path, given)
    assert engine.weights_version == 0  # nothing got through
    assert _call(url, "/health", token=token)[0] == 200
    code, reply = _call(url, "/generate", token=token, body=GEN)
    assert code == 200 and len(reply["completions"][0]) == 2


def test_oversized_bodies_are_refused_before_they_are_read():
    engine = TinyEngine()
    server = make_server(engine, "127.0.0.1", 0, "", token="t", max_request_bytes=512, max_upload_bytes=1024)
    import threading

    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    code, reply = _call(url, "/generate", token="t", body=b" " * 4096)
    assert code == 413 and "over this endpoint's limit of 512 bytes" in reply["error"]
    code, reply = _call(url, "/update_weights", token="t", body=save({"x": torch.zeros(1024)}))
    assert code == 413 and engine.weights_version == 0
    server.shutdown()


def test_the_client_sends_the_token_and_names_it_when_refused(server, monkeypatch):
    url, token, _ = server
    monkeypatch.delenv("TOOLKIT_VLLM_TOKEN", raising=False)
    with pytest.raises(ToolkitError, match=r"refused the request: no token.*TOOLKIT_VLLM_TOKEN"):
        VLLMServerBackend(url)
    monkeypatch.setenv("TOOLKIT_VLLM_TOKEN", token)
    client = VLLMServerBackend(url)
    groups = client.generate([[5, 9, 11]], SamplingParams(max_tokens=3, stop_token_ids=(2,)), n=2)
    assert len(groups) == 1 and len(groups[0]) == 2 and all(len(c.token_ids) >= 1 for c in groups[0])


def test_binding_beyond_loopback_warns_loudly(caplog, capsys):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    with caplog.at_level(logging.WARNING, logger="toolkit.core.vllm_server"):
        warn_if_exposed("0.0.0.0")
        warn_if_exposed("127.0.0.1")
    assert len([r for r in caplog.records if "beyond loopback" in r.getMessage()]) == 1
    assert "REPLACE THE MODEL'S WEIGHTS" in capsys.readouterr().err
    with pytest.raises(ValueError, match="a token is required"):
        make_server(TinyEngine(), "127.0.0.1", 0, "", token="")
