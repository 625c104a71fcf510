"""The static decoder (generation_backend_kwargs.static_decode): a preallocated KV cache with fixed shapes, which on
a GPU is captured as a CUDA graph. On CPU the same steps run uncaptured: they must sample the ids the growing-cache
loop samples (with every row kept to the end, as the static decoder keeps them)."""

import logging

import pytest
import torch

from toolkit.core.errors import ConfigError
from toolkit.core.generation import SamplingParams, TransformersBackend, _check_transformers_backend_kwargs
from toolkit.testing import tiny_model, tiny_tokenizer

_STOP_APART = tuple(range(100, 140))  # ~10% of the tiny vocabulary: rows stop at different steps


def _prompts(tok, shared_start):
    head = "You are a careful assistant. Question: " if shared_start else ""
    return [tok(head + t).input_ids for t in ("What is 1 + 2?", "The quick brown fox", "Hello world! This is")]


def _run(static, prompts, params, *, n, seed, dtype=None):
    tok = tiny_tokenizer()
    model = tiny_model().eval()
    keys = []  # the key columns each decode forward attends over (the mask's last dimension)
    model.register_forward_pre_hook(lambda m, a, kw: keys.append(kw["attention_mask"].shape[-1])
                                    if kw.get("attention_mask") is not None else None, with_kwargs=True)
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id, static_decode=static, dtype=dtype)
    backend._compact_finished_rows = False
    return backend.generate(prompts, params, n=n, seed=seed), keys


@pytest.mark.parametrize("shared_start", [False, True])
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=20, temperature=1.0, stop_token_ids=_STOP_APART),
                                    SamplingParams(max_tokens=12, top_k=1)])
def test_static_decoding_samples_the_loops_ids(shared_start, params):
    prompts = _prompts(tiny_tokenizer(), shared_start)
    (eager, eager_keys), (static, static_keys) = (_run(s, prompts, params, n=3, seed=5) for s in (False, True))
    assert [[c.token_ids for c in g] for g in static] == [[c.token_ids for c in g] for g in eager]
    assert [[c.finish_reason for c in g] for g in static] == [[c.finish_reason for c in g] for g in eager]
    for ga, gb in zip(eager, static):
        for a, b in zip(ga, gb):
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=1e-5)
    if params.stop_token_ids:  # not vacuous: rows stopped at different steps, so masked columns were in play
        lengths = sorted(len(c.token_ids) for g in eager for c in g)
        assert lengths[0] < lengths[-1]
    # the static steps attend over the whole preallocated cache (fixed shapes); the loop's grow by one per step
    decode_static = static_keys[-(len(static_keys) - (2 if shared_start else 1)):]
    assert len(set(decode_static)) == 1 and len(set(eager_keys[-3:])) == 3


def test_static_decoding_in_bfloat16_matches_the_loop_in_bfloat16():
    prompts = _prompts(tiny_tokenizer(), False)
    params = SamplingParams(max_tokens=16, temperature=1.0)
    (eager, _), (static, _) = (_run(s, prompts, params, n=2, seed=3, dtype="bfloat16") for s in (False, True))
    same = sum(a.token_ids == b.token_ids for ga, gb in zip(eager, static) for a, b in zip(ga, gb))
    # bfloat16 sums over a longer (zero-padded) key axis may round differently: nearly every row is the same
    assert same >= 5, same


def test_static_decoding_falls_back_with_a_reason(caplog, monkeypatch):
    """A model the static cache cannot serve (eager attention: no ready boolean mask) decodes with the loop, and
    says why once."""
    from toolkit.core import generation

    monkeypatch.setattr(generation, "_STATIC_REFUSALS_LOGGED", set())  # said once per process: start afresh
    tok = tiny_tokenizer()
    model = tiny_model().eval()
    model.config._attn_implementation = "eager"
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id, static_decode=True)
    with caplog.at_level(logging.WARNING, logger="toolkit.core.generation"):
        out = backend.generate(_prompts(tok, False), SamplingParams(max_tokens=6, top_k=1), n=1, seed=0)
    assert all(len(g[0].token_ids) == 6 for g in out)
    assert "static_decode" in caplog.text and "not sdpa" in caplog.text


def test_static_decode_setting_is_checked():
    _check_transformers_backend_kwargs({"static_decode": True, "dtype": "bfloat16"})
    with pytest.raises(ConfigError, match="static_decode"):
        _check_transformers_backend_kwargs({"static_decode": "yes"})


def test_warming_up_a_step_before_capturing_it_leaves_the_cache_as_one_step_would():
    """What capturing relies on (the capture itself needs CUDA): the warm-up forwards run before recording write
    the step's keys at its column and set the cache's length back, so the replay that follows is the step itself."""
    from toolkit.core.generation import _StaticDecoder

    tok = tiny_tokenizer()
    model = tiny_model().eval()
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id)
    prompts, params = _prompts(tok, False), SamplingParams(max_tokens=8, top_k=1)
    runs = []
    for warm in (False, True):
        with torch.no_grad():
            st = backend._prefill(model, prompts, params, 2, False)
            dec = _StaticDecoder(model, st, params.max_tokens, capture=False)
            tok_ids, pos, active = st.logits.argmax(-1), st.last_pos + 1, torch.ones(len(st.done), dtype=torch.bool)
            if warm:
                dec.mask[:, dec.prompt] = active
                dec.tok.copy_(tok_ids[:, None])
                dec.pos.copy_(pos[:, None])
                dec._warm_up(model, dec.prompt, times=3)
            logits = dec.step(model, tok_ids, pos, active, 0)
            second = dec.step(model, logits.argmax(-1), pos + 1, active, 1)  # the step after reads what was written
        runs.append((logits, second, [layer.cumulative_length.item() for layer in dec.cache.layers],
                     dec.cache.layers[0].keys.clone()))
    (a, a2, len_a, keys_a), (b, b2, len_b, keys_b) = runs
    assert len_a == len_b == [dec.prompt + 2] * len(len_a)
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(b2, a2)
    torch.testing.assert_close(keys_b, keys_a)


def test_the_packed_attention_counts_as_sdpa_in_a_decode_step():
    """GRPO switches the model to the packed attention; its decode steps (no packed-row bounds) are sdpa's, so they
    take the ready boolean mask and the static cache."""
    from toolkit.core import attention, generation

    assert attention.VARLEN_ATTENTION in generation._SDPA_LIKE
    prompts = _prompts(tiny_tokenizer(), True)
    params = SamplingParams(max_tokens=10, temperature=1.0, stop_token_ids=_STOP_APART)
    runs = []
    for static in (False, True):
        tok, model = tiny_tokenizer(), tiny_model().eval()
        attention.use_varlen_attention(model)
        backend = TransformersBackend(model, pad_token_id=tok.pad_token_id, static_decode=static)
        backend._compact_finished_rows = False
        runs.append([[c.token_ids for c in g] for g in backend.generate(prompts, params, n=2, seed=4)])
    assert runs[0] == runs[1]
