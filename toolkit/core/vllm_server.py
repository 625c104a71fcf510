"""`toolkit vllm-serve`: a vLLM engine behind a small HTTP API on loopback, for `generation_backend="vllm-server"`.

    toolkit vllm-serve --model <checkpoint folder> [--host 127.0.0.1] [--port 8000] [--max_model_len 1024]

Endpoints (JSON unless said otherwise):
    GET  /health          {"status": "ok", "model", "weights_version", "pid", "partial_uploads": true, "instance"}
    POST /generate        {"prompts": [[ids]], "n", "params": {max_tokens, temperature, top_p, top_k, min_p,
                           stop_token_ids}} -> {"completions": [[{"token_ids", "logprobs", "finish_reason"}]]}
    POST /update_weights  body: a safetensors file of (name -> tensor) in the checkpoint's naming (the client
                          streams it from the tensors' memory; the server reads it into one buffer it reuses)
                           -> {"weights_version": n, "seconds", "instance"}. `?partial=1`: only some of the model's
                          weights (the layers left out keep theirs; the client sends whole merged layers),
                          `&base=<instance>:<n>`: the server start and version it completes (409 otherwise).
                          The reply also splits the server's time: `read_s` (the body off the socket), `parse_s`
                          and `load_s` (the engine's reload, waiting for a generation in progress included).

Token ids in, token ids and log-probs out: no text crosses the wire, so nothing is re-tokenized. The
engine serves one request at a time (requests queue on a lock); the HTTP server is threaded, so a
health check answers while a generation runs. Prints "TOKEN <token>" and "READY <url>" once the engine
is up and warmed: on a CPU build of vLLM the first reloads of the weights cost several times the later ones
(measured 4.4, 1.3, 1.8 s before 0.6-0.7 s for the 135M model: the engine's reload allocates and repacks every
layer, and the process's memory settles over the first rounds), so before it listens the server pushes the
checkpoint's own weights through the upload path `--warm_up` times (default 2 on a CPU build, 0 on a GPU); a
trainer's first syncs then cost less (the first upload's 2 s of buffer allocation is gone). On a CPU build the
server also keeps the memory a reload frees for the next one (glibc's allocator, `_keep_freed_memory`; the reloads
run on the main thread, where that applies): after the first reloads a reload then faults (almost) no fresh pages
in, which is what made some reloads take twice the usual time (`--release_freed_memory` leaves glibc's defaults
and reloads on a thread of their own). A checkpoint whose weights cannot be read (no model.safetensors
or index) skips the warm-up with a warning; an engine error during the warm-up stops the server (the reload
may have left the engine half-loaded).

Security: whoever can reach the port can replace the model's weights, so every endpoint requires
`Authorization: Bearer <token>` (`--token`, else $TOOLKIT_VLLM_TOKEN, else a random one printed at start;
the client reads the same variable). Bodies are limited (`--max_request_mib` for /generate,
`--max_upload_gib` for /update_weights; 413 beyond, 411 without a length). Binding beyond loopback
(`--host 0.0.0.0`) works but warns loudly: put it behind a firewall or a TLS proxy.
"""

from __future__ import annotations

__all__ = [
    "is_loopback",
    "make_server",
    "serve",
    "serve_in_thread",
    "warn_if_exposed",
]

import concurrent.futures
import hmac
import ipaddress
import json
import logging
import os
import secrets
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .generation import SamplingParams

logger = logging.getLogger(__name__)


MIB = 1 << 20


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Malformed(ValueError):
    """An upload that is not a safetensors file of tensors (answered 400; an engine's failure is a 500)."""


class _Uploads:
    """Weight uploads: one at a time, read into one reused buffer, loaded on one long-lived thread.

    A fresh 500 MB buffer per upload cost its page faults every step (up to a second for 135M fp32 parameters);
    the engine copies the weights out before the buffer is reused. The loads run on one thread rather than on
    each request's thread (ThreadingHTTPServer starts one per request), so the warm-up's reloads and every
    later one run where the engine's per-thread state (malloc arena, oneDNN and OpenMP state) is the same:
    a thread of their own (`loader` None), or `toolkit vllm-serve`'s main thread (a `_MainThreadLoader`, where
    glibc keeps the memory a reload frees for the next one: see `_keep_freed_memory`)."""

    def __init__(self, backend, loader=None):
        self.backend = backend
        self.lock = threading.Lock()
        self.buffer = bytearray()
        self.loader = loader if loader is not None else concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="toolkit-vllm-load")

    def view(self, length: int) -> memoryview:
        """The first `length` bytes of the buffer (grown to fit, with 1 MiB to spare: the same weights in another
        order have a header a few bytes longer or shorter; call under `lock`)."""
        if len(self.buffer) < length:
            self.buffer = bytearray(length + MIB)
        return memoryview(self.buffer)[:length]

    def load(self, body: memoryview, partial: bool) -> dict:
        """Parse `body` (views, no copy) and load it into the engine on the loader's thread; the seconds of each
        (load_s includes waiting for a generation in progress: the engine does one thing at a time).
        _Malformed for a body that is not a safetensors file (nothing loaded). Call under `lock`."""
        from .vllm_backend import parse_safetensors

        started = time.perf_counter()
        try:
            weights = parse_safetensors(body)
        except ValueError as e:
            raise _Malformed(str(e)) from e
        parsed = time.perf_counter()
        self.loader.submit(self.backend.load_weights, weights, partial=partial).result()
        del weights  # views of the buffer: none outlives the upload
        return {"parse_s": round(parsed - started, 4), "load_s": round(time.perf_counter() - parsed, 4)}


class _MainThreadLoader:
    """The loader of `toolkit vllm-serve` on a CPU build: the engine's reloads run on the process's main thread
    (`run`, while the HTTP server answers from threads of its own). glibc serves the main thread from its main
    arena, the one `_keep_freed_memory` can make keep freed memory; another thread may be handed one of the
    other arenas, whose memory glibc maps and unmaps per block (measured: a loader thread of its own got the
    main arena in one of three runs, and re-faulted every reload's 110k pages in the other two). submit() from
    the main thread itself (the warm-up, before the port opens) runs at once. After shutdown() every load not
    yet started is refused (its request gets an error): a request never waits on a loop that has stopped."""

    def __init__(self):
        import queue

        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiting: set[concurrent.futures.Future] = set()  # submitted, not finished (taken or not)
        self._closed = False

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if threading.current_thread() is threading.main_thread():
            self._run(future, fn, args, kwargs)
            return future
        with self._lock:
            if self._closed:
                raise RuntimeError("the server is shutting down: the weights were not loaded")
            self._waiting.add(future)
            self._jobs.put((future, fn, args, kwargs))
        return future

    def _run(self, future, fn, args, kwargs) -> None:
        try:
            try:
                if not future.set_running_or_notify_cancel():
                    return
            except RuntimeError:  # already refused by shutdown()
                return
            try:
                result = fn(*args, **kwargs)
            except Exception as e:  # the engine's error: the request's thread raises it (a 500), the loop goes on
                future.set_exception(e)
            except BaseException:  # Ctrl-C during a reload: the request is told, and the server stops
                future.set_exception(RuntimeError("the server was interrupted during the reload; the engine may "
                                                  "hold a partial update"))
                raise
            else:
                future.set_result(result)
        finally:
            with self._lock:
                self._waiting.discard(future)

    def run(self, serving: threading.Thread) -> None:
        """Run queued loads on this (the main) thread for as long as `serving` (the HTTP server's thread) lives.
        A job taken but not run (an interrupt in between) stays in `_waiting`, so shutdown() refuses it."""
        import queue

        while serving.is_alive():
            try:
                job = self._jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            self._run(*job)

    def shutdown(self, wait: bool = True) -> None:
        """Refuse every load not yet started (the server is closing: `_Server.server_close` calls this; their
        requests would otherwise wait for ever on a loop that has stopped) and any submitted later."""
        with self._lock:
            self._closed = True
            waiting, self._waiting = list(self._waiting), set()
        for future in waiting:
            try:
                claimed = future.set_running_or_notify_cancel()
            except RuntimeError:  # running on the main thread right now: it finishes it
                continue
            if claimed:
                future.set_exception(RuntimeError("the server is shutting down: the weights were not loaded"))


def _keep_freed_memory() -> bool:
    """glibc only: keep the memory the main thread frees for its next allocations instead of handing it back to
    the kernel (no mmap for blocks under 1 GiB, where this glibc allows it, else under 32 MiB; no trimming of the
    heap's top under 2 GiB free). Whether it was set (a warning says why not).

    Why: a CPU build of vLLM rebuilds every layer on a weight reload (fresh tensors, repacked for oneDNN) and
    frees the old ones. With glibc's defaults every reload of the 135M model faulted ~110k fresh pages in, and
    the kernel's share of a reload varied from 0.2 to 0.7 s of system time: the reloads over the usual 0.38 s
    (up to 0.95 s) were those. Kept, the reloads reuse the freed blocks: (almost) no page faults after the first
    reloads, 0.28-0.44 s each (measured on a 2-core Intel Xeon, docs/vllm.md). The process keeps up to one
    model's worth of freed memory between reloads (its peak, old and new weights during a reload, is as before);
    a model whose reload frees more than 2 GiB at the heap's top gets some of it trimmed and faulted in again.
    Process-wide: only for the process that runs the server. Not with another allocator preloaded (tcmalloc,
    jemalloc): glibc's options would not reach it."""
    import ctypes

    preloaded = os.environ.get("LD_PRELOAD", "")
    if "malloc" in preloaded:  # libtcmalloc, libjemalloc, libmimalloc: malloc is not glibc's
        logger.info("LD_PRELOAD names another allocator (%s): glibc's options left alone.", preloaded)
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    # glibc before 2.35 or so refuses thresholds over 32 MiB (HEAP_MAX_SIZE / 2 on 64-bit): the embedding of a
    # large vocabulary is then mapped afresh each time, the layers still reuse their blocks
    mapped = mallopt(M_MMAP_THRESHOLD, 1 << 30) or mallopt(M_MMAP_THRESHOLD, 32 << 20)
    trimmed = mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    if not (mapped and trimmed):
        logger.warning("glibc refused its malloc options (mmap threshold set: %s, trim threshold set: %s); weight "
                       "reloads may be slower and less steady.", bool(mapped), bool(trimmed))
    return bool(mapped and trimmed)


def _warm_up(uploads: _Uploads, weights: list, rounds: int) -> list[float]:
    """Before serving only: push `weights` (the checkpoint's own, `_checkpoint_weights`) through the upload path
    (buffer, parse, load) `rounds` times; the seconds of each round. The engine ends holding the weights it
    started with, so its weights_version is set back to 0. An engine error is raised: a reload that fails on
    the engine's own weights would fail on a trainer's, and may have left the engine half-loaded."""
    from .vllm_backend import safetensors_stream

    if rounds <= 0:
        return []
    chunks, length = safetensors_stream(weights)
    times = []
    with uploads.lock:
        for _ in range(rounds):
            started = time.perf_counter()
            view, at = uploads.view(length), 0
            for chunk in chunks:  # what a client's upload writes into the buffer
                view[at:at + len(chunk)] = chunk
                at += len(chunk)
            uploads.load(view, partial=False)
            del view
            times.append(time.perf_counter() - started)
        uploads.backend.weights_version = 0
    return times


# names of an input embedding that a tied output head shares (Llama-style, GPT-2, BLOOM)
_EMBEDDING_SUFFIXES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight")


def _checkpoint_weights(model_path: str) -> list:
    """(name, tensor) of the checkpoint's safetensors weights, as a trainer's full upload names them: the files
    `model.safetensors.index.json` lists, else `model.safetensors` (never other *.safetensors files: an adapter
    or a critic saved beside the model is not the model's), floating point as
    float32 (what a trainer sends by default: the buffer is then the size of a full upload, and the engine casts
    them as it did at start), and the tied output head under its own name (`lm_head.weight`) where the config
    ties it. FileNotFoundError without safetensors weights."""
    from pathlib import Path

    from safetensors.torch import load_file

    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    elif (folder / "model.safetensors").exists():
        files = [folder / "model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_path}")
    weights = {}
    for f in files:
        weights.update({n: t.float() if t.is_floating_point() else t for n, t in load_file(str(f)).items()})
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    # transformers ties by default; a multimodal config may say it in its text part
    tied = config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings", True))
    embedding = next((n for n in weights if n.endswith(_EMBEDDING_SUFFIXES)), None)
    if tied and embedding and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights[embedding]
    return list(weights.items())


class _Server(ThreadingHTTPServer):
    """The HTTP server and what its request handlers read: the engine, the upload path, the token, the limits."""

    uploads: _Uploads
    backend: Any
    model_path: str
    expected: bytes              # b"Bearer <token>"
    instance: str                # this server start: weights versions count from 0 again after a restart
    max_request_bytes: int
    max_upload_bytes: int

    def server_close(self):
        # refuse the loads no loop will run: their requests answer (an error) instead of waiting for ever (the
        # request threads are daemons, so nothing joins them: a waiting one would only hold its client)
        self.uploads.loader.shutdown(wait=False)
        super().server_close()


class _Handler(BaseHTTPRequestHandler):
    """GET /health, POST /generate and /update_weights, each behind the token (`_Server` holds the settings)."""

    server: _Server
    # Seconds any one socket read or write may wait: a client that stalls mid-upload is dropped instead of
    # holding the upload lock (a 500 MB upload moves in well under a second on loopback).
    timeout = 120

    def log_message(self, fmt, *args):  # route through logging, quietly
        logger.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, code: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        from .vllm_backend import TOKEN_ENV

        given = (self.headers.get("Authorization") or "").encode()
        if hmac.compare_digest(given, self.server.expected):
            return True
        self.close_connection = True
        self._send(401, {"error": "missing or wrong token: send 'Authorization: Bearer <token>' (printed by "
                                  f"`toolkit vllm-serve` at start; clients read ${TOKEN_ENV})."})
        return False

    def _body(self, limit: int) -> bytes | None:
        """The request body, or None after answering 411/413 (nothing over `limit` bytes is read)."""
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._send(411, {"error": "a Content-Length header is required."})
            return None
        if int(length) > limit:
            self.close_connection = True
            self._send(413, {"error": f"body of {int(length)} bytes is over this endpoint's limit of {limit} "
                                      "bytes (--max_request_mib / --max_upload_gib)."})
            return None
        if self._route()[0] != "/update_weights":
            return self.rfile.read(int(length))
        # Weights (under uploads.lock): read into the reused buffer that the tensors then view
        # (parse_safetensors makes no copy).
        view, got = self.server.uploads.view(int(length)), 0
        while got < len(view):
            n = self.rfile.readinto(view[got:])
            if not n:
                raise ConnectionError(f"upload ended after {got} of {len(view)} bytes")
            got += n
        return view

    def _route(self) -> tuple[str, dict]:
        parts = urllib.parse.urlsplit(self.path)
        return parts.path, urllib.parse.parse_qs(parts.query)

    def do_GET(self):
        if not self._authorized():
            return
        srv = self.server
        if self._route()[0] == "/health":
            backend = srv.backend
            self._send(200, {"status": "ok", "model": srv.model_path, "weights_version": backend.weights_version,
                             "pid": os.getpid(), "partial_uploads": True, "instance": srv.instance,
                             # adapter-only syncs (POST /load_adapter) where the engine has LoRA support
                             "lora_rank": getattr(backend, "_lora_rank", None) or 0,
                             "dtype": str(getattr(backend, "dtype", None) or "").removeprefix("torch.")})
        else:
            self._send(404, {"error": f"no such endpoint {self.path}; GET /health"})

    def do_POST(self):
        if not self._authorized():
            return
        path, query = self._route()
        try:
            if path == "/generate":
                self._generate()
            elif path == "/update_weights":
                self._update_weights(query)
            elif path == "/load_adapter":
                self._load_adapter(query)
            else:
                self._send(404, {"error": f"no such endpoint {self.path}; POST /generate, /update_weights or "
                                          "/load_adapter"})
        except Exception as e:  # the client gets the reason, the server keeps serving
            logger.exception("request %s failed", self.path)
            self._send(500, {"error": f"{type(e).__name__}: {e}"})

    def _generate(self) -> None:
        body = self._body(self.server.max_request_bytes)
        if body is None:
            return
        req = json.loads(body)
        p = req["params"]
        params = SamplingParams(**{**p, "stop_token_ids": tuple(p["stop_token_ids"])})
        groups = self.server.backend.generate(req["prompts"], params, n=int(req.get("n", 1)))
        self._send(200, {"completions": [[{"token_ids": c.token_ids, "logprobs": c.logprobs,
                                           "finish_reason": c.finish_reason} for c in g] for g in groups]})

    def _update_weights(self, query: dict) -> None:
        srv = self.server
        backend, uploads = srv.backend, srv.uploads
        partial = query.get("partial") == ["1"]
        refused, split = None, {}
        with uploads.lock:
            started = time.perf_counter()
            body = self._body(srv.max_upload_bytes)
            if body is None:
                return
            split["read_s"] = round(time.perf_counter() - started, 4)
            # A partial upload completes the version its client last uploaded; on top of any other (this server
            # restarted, another client uploaded) it would mix two models: refused, and the client sends all
            # weights. Checked under the lock, where the version changes.
            held = f"{srv.instance}:{backend.weights_version}"
            if partial and query.get("base") != [held]:
                refused = (409, f"/update_weights: this partial upload completes weights "
                                f"{(query.get('base') or ['none'])[0]} (server start:version), but the server holds "
                                f"{held}; upload all weights.")
            else:
                try:
                    split.update(uploads.load(body, partial))
                except _Malformed as e:
                    refused = (400, f"/update_weights: {e}")
            del body  # a view of the buffer: none outlives the upload
        # answered after the lock is released: a client slow to read its reply holds no one up
        if refused is not None:
            self._send(refused[0], {"error": refused[1], "weights_version": backend.weights_version})
            return
        self._send(200, {"weights_version": backend.weights_version, "seconds": backend.last_sync_s, **split,
                         "instance": srv.instance})


    def _load_adapter(self, query: dict) -> None:
        """A LoRA adapter (safetensors body, PEFT names; its adapter_config as JSON in `config`) loaded as the LoRA
        every later /generate applies. Like a partial upload it names the weights it goes on (`base`): the base
        weights this client uploaded; refused (409) on any other."""
        srv = self.server
        backend, uploads = srv.backend, srv.uploads
        refused = None
        with uploads.lock:
            started = time.perf_counter()
            body = self._body(srv.max_upload_bytes)
            if body is None:
                return
            held = f"{srv.instance}:{backend.weights_version}"
            if query.get("base") != [held]:
                refused = (409, f"/load_adapter: this adapter goes on weights {(query.get('base') or ['none'])[0]} "
                                f"(server start:version), but the server holds {held}; upload the base weights.")
            else:
                from .vllm_backend import parse_safetensors

                try:
                    config = json.loads((query.get("config") or ["{}"])[0])
                    tensors = {name: t.clone() for name, t in parse_safetensors(body)}
                except ValueError as e:
                    refused = (400, f"/load_adapter: {e}")
                else:  # on the loader's thread, as weight loads (the engine does one thing at a time)
                    uploads.loader.submit(backend.load_adapter, tensors, config).result()
            seconds = round(time.perf_counter() - started, 4)
        if refused is not None:
            self._send(refused[0], {"error": refused[1], "weights_version": backend.weights_version})
            return
        self._send(200, {"weights_version": backend.weights_version, "seconds": seconds, "instance": srv.instance})


def make_server(backend, host: str, port: int, model_path: str, *, token: str, max_request_bytes: int = 16 * MIB,
                max_upload_bytes: int = 64 * 1024 * MIB, uploads: _Uploads | None = None) -> ThreadingHTTPServer:
    """The HTTP server around `backend` (listening once this returns); every request must carry
    `Authorization: Bearer <token>`. `uploads`: the upload path, if already made (serve() warms it up first)."""
    if not token:
        raise ValueError("make_server: a token is required (every endpoint checks it).")
    uploads = uploads if uploads is not None else _Uploads(backend)
    if uploads.backend is not backend:
        raise ValueError("make_server: `uploads` was made for another backend (its loads would go to that engine).")
    server = _Server((host, port), _Handler)
    server.uploads, server.backend, server.model_path = uploads, backend, model_path
    server.expected = f"Bearer {token}".encode()
    server.instance = secrets.token_hex(8)  # partial uploads name it: versions count from 0 after a restart
    server.max_request_bytes, server.max_upload_bytes = max_request_bytes, max_upload_bytes
    return server


def serve(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="toolkit vllm-serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder (or 'smollm2-135m-instruct')")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max_model_len", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tensor_parallel_size", type=int, default=1,
                    help="GPUs the engine's shards spread over (vLLM starts a worker per GPU; GPU builds only)")
    ap.add_argument("--kv_cache_gib", type=int, default=1, help="KV cache on a CPU build of vLLM (whole GiB)")
    ap.add_argument("--dtype", default="float32",
                    help="engine weights: float32 (the default, as the trainer's weights) or bfloat16 / auto on a GPU")
    ap.add_argument("--gpu_memory_utilization", type=float, default=0.1,
                    help="share of the GPU's memory the engine may take (weights + KV cache); on a GPU of its own, "
                         "e.g. 0.85. A CPU build of vLLM sizes its cache by --kv_cache_gib instead")
    ap.add_argument("--max_lora_rank", type=int, default=0,
                    help="LoRA support in the engine for adapter-only syncs (POST /load_adapter) of adapters up to "
                         "this rank; 0 (default): merged syncs only. On vLLM's CPU engine LoRA layers make generation "
                         "~4x slower (docs/vllm.md)")
    ap.add_argument("--no_enforce_eager", action="store_true",
                    help="capture CUDA graphs for decoding (faster on a GPU; start-up takes longer)")
    ap.add_argument("--token", default=None, help="the token every request must carry (default: $TOOLKIT_VLLM_TOKEN, "
                                                   "else a random one, printed)")
    ap.add_argument("--max_request_mib", type=int, default=16, help="largest /generate body")
    ap.add_argument("--max_upload_gib", type=int, default=64, help="largest /update_weights body")
    ap.add_argument("--release_freed_memory", action="store_true",
                    help="on a CPU build, leave glibc's allocator at its defaults (by default the server keeps the "
                         "memory a weight reload frees for the next reload, and reloads on its main thread)")
    ap.add_argument("--warm_up", type=int, default=None,
                    help="push the starting weights through the upload path this many times before READY "
                         "(default: 2 on a CPU build of vLLM, whose first reloads are slow; 0 on a GPU)")
    args = ap.parse_args(argv)
    if args.warm_up is not None and args.warm_up < 0:
        ap.error(f"--warm_up: must be >= 0, got {args.warm_up}.")
    from .vllm_backend import TOKEN_ENV

    token = args.token or os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)
    warn_if_exposed(args.host)
    from .models import resolve_model_path
    from .vllm_backend import VLLMBackend

    path = str(resolve_model_path(args.model))
    cpu = _cpu_build()
    # before the engine exists: its first weights are then freed into the kept heap by the first reload
    # the main thread runs the reloads (below): serve() called from another thread (embedded) keeps a loader thread
    kept = (cpu and not args.release_freed_memory and threading.current_thread() is threading.main_thread()
            and _keep_freed_memory())
    backend = VLLMBackend(path, max_model_len=args.max_model_len, seed=args.seed, kv_cache_gib=args.kv_cache_gib,
                          dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                          enforce_eager=not args.no_enforce_eager, max_lora_rank=args.max_lora_rank or None,
                          lora_sync="adapter" if args.max_lora_rank else "merged",
                          tensor_parallel_size=args.tensor_parallel_size,
                          sleep_mode=False)  # serves clients whenever they ask: nothing to give back in between
    # warmed before the port listens: a client's /health then finds nothing rather than a socket nobody answers
    if kept:
        logger.info("weight reloads run on the main thread, and the memory they free is kept for the next one "
                    "(--release_freed_memory to not).")
    loader = _MainThreadLoader() if kept else None
    uploads = _Uploads(backend, loader)
    rounds = args.warm_up if args.warm_up is not None else (2 if cpu else 0)
    weights = []
    if rounds:
        try:
            weights = _checkpoint_weights(path)
        except Exception as e:  # noqa: BLE001 - unreadable (safetensors' own errors included): serve unwarmed
            logger.warning("warm-up skipped (%s: %s); the first weight uploads will be slower (--warm_up 0 to not "
                           "try).", type(e).__name__, e)
    times = _warm_up(uploads, weights, rounds) if weights else []
    del weights
    if times:
        logger.info("warm-up: %d reloads of the starting weights, %s s.", len(times), ", ".join(f"{t:.2f}" for t in times))
    server = make_server(backend, args.host, args.port, path, token=token, max_request_bytes=args.max_request_mib * MIB,
                         max_upload_bytes=args.max_upload_gib * 1024 * MIB, uploads=uploads)
    url = f"http://{args.host}:{server.server_address[1]}"
    print(f"TOKEN {token}", flush=True)
    print(f"READY {url}", flush=True)
    try:
        if loader is None:
            server.serve_forever()
        else:  # the HTTP server answers from a thread, the reloads run here (the main thread: _MainThreadLoader)
            failed = []

            def answer():
                try:
                    server.serve_forever()
                except BaseException as e:  # noqa: BLE001 - raised below, on the main thread
                    failed.append(e)

            serving = threading.Thread(target=answer, name="toolkit-vllm-http", daemon=True)
            serving.start()
            try:
                loader.run(serving)
            finally:
                if serving.is_alive():
                    server.shutdown()
            if failed:
                raise failed[0]
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def _cpu_build() -> bool:
    """Whether vLLM runs on the CPU here (its own platform check; without it, no CUDA device)."""
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - an older vLLM without the check
        import torch

        return not torch.cuda.is_available()


def warn_if_exposed(host: str) -> None:
    if not is_loopback(host):
        message = (f"toolkit vllm-serve: binding to {host}, beyond loopback. Anyone who can reach this port and has "
                   "the token can read generations and REPLACE THE MODEL'S WEIGHTS; the token travels in clear HTTP. "
                   "Use 127.0.0.1 with an SSH tunnel, or a firewall plus a TLS proxy.")
        logger.warning(message)
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


def serve_in_thread(backend, host: str = "127.0.0.1", port: int = 0, model_path: str = "",
                    token: str | None = None) -> tuple[str, threading.Thread, str]:
    """Serve `backend` from a daemon thread of this process (tests, notebooks); returns (url, thread, token)."""
    token = token or secrets.token_urlsafe(24)
    warn_if_exposed(host)
    server = make_server(backend, host, port, model_path, token=token)
    t = threading.Thread(target=server.serve_forever, daemon=True, name="toolkit-vllm-serve")
    t.start()
    return f"http://{host}:{server.server_address[1]}", t, token
