"""`toolkit vllm-serve`: a vLLM engine behind a small HTTP API on loopback, for `generation_backend="vllm-server"`.

    toolkit vllm-serve --model <checkpoint folder> [--host 127.0.0.1] [--port 8000] [--max_model_len 1024]

Endpoints (JSON unless said otherwise):
    GET  /health          {"status": "ok", "model", "weights_version", "pid"}
    POST /generate        {"prompts": [[ids]], "n", "params": {max_tokens, temperature, top_p, top_k, min_p,
                           stop_token_ids}} -> {"completions": [[{"token_ids", "logprobs", "finish_reason"}]]}
    POST /update_weights  body: a safetensors file of (name -> tensor) in the checkpoint's naming
                           -> {"weights_version": n}

Token ids in, token ids and log-probs out: no text crosses the wire, so nothing is re-tokenized. The
engine serves one request at a time (requests queue on a lock); the HTTP server is threaded, so a
health check answers while a generation runs. Prints "READY <url>" once the engine is up.
"""

from __future__ import annotations

__all__ = [
    "make_server",
    "serve",
    "serve_in_thread",
]

import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .generation import SamplingParams

logger = logging.getLogger(__name__)


def make_server(backend, host: str, port: int, model_path: str) -> ThreadingHTTPServer:
    from .vllm_backend import parse_safetensors

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt, *args):  # route through logging, quietly
            logger.debug("%s " + fmt, self.address_string(), *args)

        def _send(self, code: int, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"status": "ok", "model": model_path, "weights_version": backend.weights_version,
                                 "pid": os.getpid()})
            else:
                self._send(404, {"error": f"no such endpoint {self.path}; GET /health"})

        def do_POST(self):
            try:
                if self.path == "/generate":
                    req = json.loads(self._body())
                    p = req["params"]
                    params = SamplingParams(**{**p, "stop_token_ids": tuple(p["stop_token_ids"])})
                    groups = backend.generate(req["prompts"], params, n=int(req.get("n", 1)))
                    self._send(200, {"completions": [[{"token_ids": c.token_ids, "logprobs": c.logprobs,
                                                       "finish_reason": c.finish_reason} for c in g] for g in groups]})
                elif self.path == "/update_weights":
                    backend.load_weights(parse_safetensors(self._body()))
                    self._send(200, {"weights_version": backend.weights_version, "seconds": backend.last_sync_s})
                else:
                    self._send(404, {"error": f"no such endpoint {self.path}; POST /generate or /update_weights"})
            except Exception as e:  # the client gets the reason, the server keeps serving
                logger.exception("request %s failed", self.path)
                self._send(500, {"error": f"{type(e).__name__}: {e}"})

    return ThreadingHTTPServer((host, port), Handler)


def serve(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="toolkit vllm-serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder (or 'smollm2-135m-instruct')")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max_model_len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv_cache_gib", type=int, default=1)
    args = ap.parse_args(argv)
    from .models import resolve_model_path
    from .vllm_backend import VLLMBackend

    path = str(resolve_model_path(args.model))
    backend = VLLMBackend(path, max_model_len=args.max_model_len, seed=args.seed, kv_cache_gib=args.kv_cache_gib)
    server = make_server(backend, args.host, args.port, path)
    url = f"http://{args.host}:{server.server_address[1]}"
    print(f"READY {url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def serve_in_thread(backend, host: str = "127.0.0.1", port: int = 0,
                    model_path: str = "") -> tuple[str, threading.Thread]:
    """Serve `backend` from a daemon thread of this process (tests, notebooks); returns (url, thread)."""
    server = make_server(backend, host, port, model_path)
    t = threading.Thread(target=server.serve_forever, daemon=True, name="toolkit-vllm-serve")
    t.start()
    return f"http://{host}:{server.server_address[1]}", t
