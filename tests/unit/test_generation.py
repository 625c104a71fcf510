"""The transformers generation backend and the sampling transforms."""

import pytest
import torch

from toolkit.core.errors import ConfigError
from toolkit.core.generation import GenerationBackend, SamplingParams, TransformersBackend, truncate_logits
from toolkit.core.numerics import chunked_token_logps
from toolkit.testing import tiny_model, tiny_tokenizer


def _prompts(tok):
    texts = ["What is 1 + 2?", "The quick brown fox", "Hello world! This is"]
    return [tok(t).input_ids for t in texts]


def _shared_start_prompts(tok):
    """Prompts that start alike, as a chat template's system prompt makes them: the backend prefills the start once."""
    head = "You are a careful assistant. Think, then answer in one short line. Question: "
    return [tok(head + t).input_ids for t in ("What is 1 + 2?", "The quick brown fox", "Hello world! This is")]


def test_backend_satisfies_the_protocol():
    tok = tiny_tokenizer()
    assert isinstance(TransformersBackend(tiny_model(), pad_token_id=tok.pad_token_id), GenerationBackend)


@pytest.mark.parametrize("shared_start", [False, True])
def test_greedy_matches_transformers_generate(shared_start):
    tok, model = tiny_tokenizer(), tiny_model()
    model.eval()
    forwards = []
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id, on_decode_step=lambda: forwards.append(1))
    prompts = _shared_start_prompts(tok) if shared_start else _prompts(tok)
    out = backend.generate(prompts, SamplingParams(max_tokens=12, top_k=1), n=1, seed=0)
    # 11 decode forwards after the prefill, which is two forwards when the shared start is prefilled on its own
    assert len(forwards) == 11 + (2 if shared_start else 1)
    for p, group in zip(prompts, out):
        ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
        assert group[0].token_ids == ref
        assert group[0].finish_reason == "length"


def test_the_shared_start_is_prefilled_apart_only_for_plain_attention_caches():
    """Pad columns after the shared start would shift a sliding window or a recurrent layer: such models prefill
    each prompt whole (one prefill forward). The attributes are set on a tiny Llama only to steer the check."""
    from types import SimpleNamespace

    from toolkit.core.generation import _plain_kv_cache

    tok, model = tiny_tokenizer(), tiny_model().eval()
    assert _plain_kv_cache(model)
    model.config.sliding_window = 4
    assert not _plain_kv_cache(model)
    forwards = []
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id, on_decode_step=lambda: forwards.append(1))
    backend.generate(_shared_start_prompts(tok), SamplingParams(max_tokens=12, top_k=1), n=1, seed=0)
    assert len(forwards) == 11 + 1
    model.config.use_sliding_window = False  # Qwen2-style: a window configured but switched off
    assert _plain_kv_cache(model)
    for types in (["full_attention", "linear_attention"], ["sliding_attention", "full_attention"]):
        model.config.layer_types = types
        assert not _plain_kv_cache(model)
    model.config.layer_types = ["full_attention"] * 2
    assert _plain_kv_cache(model)

    class Composite:  # a vision-language model: the decoder's settings live in text_config
        config = SimpleNamespace(get_text_config=lambda decoder: SimpleNamespace(layer_types=["sliding_attention"]))

    assert not _plain_kv_cache(Composite())


@pytest.mark.parametrize("shared_start", [False, True])
def test_sampler_logprobs_equal_trainer_logprobs_of_the_same_ids(shared_start):
    """Token ids end to end: the trainer's log-prob of each sampled id equals the sampler's (same temperature)."""
    tok, model = tiny_tokenizer(), tiny_model()
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id)
    params = SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9)
    prompts = _shared_start_prompts(tok) if shared_start else _prompts(tok)
    groups = backend.generate(prompts, params, n=3, seed=1)
    for p, group in zip(prompts, groups):
        assert len(group) == 3
        for c in group:
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                hidden = model(ids, output_hidden_states=True).hidden_states[-1][0]
            lp = chunked_token_logps(hidden[len(p) - 1:-1], model.lm_head.weight, torch.tensor(c.token_ids),
                                     temperature=0.7)
            torch.testing.assert_close(lp, torch.tensor(c.logprobs), rtol=1e-4, atol=1e-4)


def test_stop_tokens_end_completions_and_seed_reproduces():
    tok, model = tiny_tokenizer(), tiny_model()
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id)
    # make token 5 overwhelmingly likely so it gets sampled early, then stop on it
    with torch.no_grad():
        model.lm_head.weight[5] = model.model.norm.weight * 0 + 3.0
    params = SamplingParams(max_tokens=16, stop_token_ids=(5,))
    a = backend.generate(_prompts(tok), params, n=4, seed=7)
    b = backend.generate(_prompts(tok), params, n=4, seed=7)
    assert [[c.token_ids for c in g] for g in a] == [[c.token_ids for c in g] for g in b]
    stopped = [c for g in a for c in g if c.finish_reason == "stop"]
    assert stopped and all(c.token_ids[-1] == 5 and 5 not in c.token_ids[:-1] for c in stopped)


def _generate_with_and_without_dropping(prompts, params, make_backend, *, seed):
    """{drop finished rows?: (groups, [rows, columns] of each forward)}, each with a backend from make_backend()."""
    runs = {}
    for compact in (False, True):
        backend, model = make_backend()
        shapes = []  # [rows, columns] of each forward's input_ids
        model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
        backend._compact_finished_rows = compact
        runs[compact] = (backend.generate(prompts, params, n=4, seed=seed), shapes)
    return runs


_STOP_APART = tuple(range(100, 140))  # ~10% of the tiny vocabulary: rows stop at different steps


@pytest.mark.parametrize("shared_start", [False, True])
def test_finished_rows_leave_the_batch_and_the_others_sample_the_same_tokens(shared_start):
    """Once a quarter of the batch has stopped, those rows are dropped from it and from the KV cache. Every step
    still draws one uniform per sequence of the whole batch, so the rows left sample what they would have sampled
    with every row kept (tokens equal; log-probs equal up to the rounding of a smaller batch's kernels)."""
    tok = tiny_tokenizer()

    def make_backend():
        model = tiny_model().eval()
        return TransformersBackend(model, pad_token_id=tok.pad_token_id), model

    prompts = _shared_start_prompts(tok) if shared_start else _prompts(tok)
    params = SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=_STOP_APART)
    runs = _generate_with_and_without_dropping(prompts, params, make_backend, seed=11)
    (kept, kept_shapes), (compacted, compacted_shapes) = runs[False], runs[True]
    kept_rows, compacted_rows = [r for r, _ in kept_shapes], [r for r, _ in compacted_shapes]
    assert [[c.token_ids for c in g] for g in compacted] == [[c.token_ids for c in g] for g in kept]
    assert [[c.finish_reason for c in g] for g in compacted] == [[c.finish_reason for c in g] for g in kept]
    for g_kept, g_compacted in zip(kept, compacted):
        for a, b in zip(g_kept, g_compacted):
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=1e-5)
    lengths = sorted(len(c.token_ids) for g in kept for c in g)
    assert lengths[0] < lengths[-1] and lengths[2] < 24  # the check is not vacuous: rows did stop at different steps
    prefill = 2 if shared_start else 1  # forwards before the first decode step
    decode_kept, decode_compacted = kept_rows[prefill:], compacted_rows[prefill:]
    assert set(decode_kept) == {12} and len(decode_compacted) == len(decode_kept)  # as many steps, the longest row's
    assert decode_compacted == sorted(decode_compacted, reverse=True) and decode_compacted[-1] < 12
    # each decode forward runs on the rows not yet finished, plus those finished since the last drop (under a
    # quarter of the batch: at a quarter they are dropped)
    for step, rows in enumerate(decode_compacted, start=1):
        running = sum(1 for n in lengths if n > step)
        assert running <= rows and 4 * (rows - running) < rows, (step, rows, running)


def test_rows_dropped_before_an_in_flight_update_leave_the_others_tokens_and_versions_as_they_were():
    """New weights arrive after rows were dropped: the rebuilt cache holds the rows left only, and every row's
    tokens, log-probs and versions equal those of the loop that kept every row."""
    tok = tiny_tokenizer()
    new = tiny_model(seed=1)

    def make_backend():
        model = tiny_model(seed=0).eval()
        calls = []

        def refresh():
            calls.append(1)
            if len(calls) == 8:  # after the 8th sampled token: version 1
                model.load_state_dict(new.state_dict())
                return 1
            return None

        return TransformersBackend(model, pad_token_id=tok.pad_token_id, refresh_weights=refresh, version=0), model

    params = SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=_STOP_APART)
    runs = _generate_with_and_without_dropping(_prompts(tok), params, make_backend, seed=11)
    (kept, kept_shapes), (compacted, compacted_shapes) = runs[False], runs[True]
    for g_kept, g_compacted in zip(kept, compacted):
        for a, b in zip(g_kept, g_compacted):
            assert (b.token_ids, b.versions, b.finish_reason) == (a.token_ids, a.versions, a.finish_reason)
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=1e-5)
    versions = [c.versions for g in kept for c in g]
    assert any(1 in v for v in versions) and any(v and 1 not in v for v in versions)  # some rows saw the update
    # the refresh prefill is the 9th forward (prefill + 7 decode steps before it): many columns, and fewer rows
    # than the batch where finished rows were dropped
    assert kept_shapes[8][1] > 1 and compacted_shapes[8][1] > 1 and all(c == 1 for _, c in kept_shapes[1:8])
    assert kept_shapes[8][0] == 12 and compacted_shapes[8][0] < 12


def test_a_bfloat16_copy_drops_finished_rows_too():
    """The cast copy decodes with the same loop: each completion ends at its first stop token or at the cap, with
    a log-prob per token (its tokens may differ from the kept loop's by bfloat16 rounding at another batch size,
    so they are not compared)."""
    tok, model = tiny_tokenizer(), tiny_model().eval()
    rows_per_forward = []
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id, dtype="bfloat16")
    backend._generation_model().register_forward_pre_hook(
        lambda m, a, kw: rows_per_forward.append(kw["input_ids"].shape[0]), with_kwargs=True)
    params = SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=_STOP_APART)
    groups = backend.generate(_prompts(tok), params, n=4, seed=11)
    copy = backend._generation_model()
    for prompt, group in zip(_prompts(tok), groups):
        for c in group:
            assert all(t not in _STOP_APART for t in c.token_ids[:-1])
            assert (c.finish_reason == "stop" and c.token_ids[-1] in _STOP_APART
                    or c.finish_reason == "length" and len(c.token_ids) == 24)
            # each token's log-prob is the copy's, given this row's own prefix: a row whose cache was mixed up
            # with another's when rows were dropped would be far off
            with torch.no_grad():
                logits = copy(input_ids=torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(c.logprobs), want, atol=5e-2, rtol=0)
    assert rows_per_forward[1] == 12 and min(rows_per_forward[1:]) < 12  # rows dropped on the copy too (0: prefill)


def test_rows_are_dropped_only_from_caches_of_plain_keys_and_values():
    """Full-attention, sliding-window and shared (dummy) layers are cut down row by row; a layer that also keeps a
    recurrent or convolutional state has no such cut (or would cut its keys alone): such caches keep every row."""
    from types import SimpleNamespace

    from transformers import cache_utils

    from toolkit.core.generation import _rows_can_be_dropped

    def cache(*layers):
        return SimpleNamespace(layers=list(layers))

    full, window = cache_utils.DynamicLayer(), cache_utils.DynamicSlidingWindowLayer(sliding_window=4)
    assert _rows_can_be_dropped(cache(full, window, cache_utils.DummyLayer()))
    assert not _rows_can_be_dropped(cache(full, cache_utils.LinearAttentionLayer()))
    assert not _rows_can_be_dropped(cache(full, cache_utils.LinearAttentionAndFullAttentionLayer()))
    assert not _rows_can_be_dropped(cache())  # no layers known: nothing to go by
    assert _rows_can_be_dropped(cache_utils.DynamicCache(config=tiny_model().config))  # the tiny Llama's own cache


def test_truncate_logits_top_k_top_p_min_p():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(truncate_logits(z, top_k=2)[0, 2:]).all()
    assert torch.isfinite(truncate_logits(z, top_k=2)[0, :2]).all()
    kept = torch.isfinite(truncate_logits(z, top_p=0.7)[0]).tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.3 reaches it
    kept = torch.isfinite(truncate_logits(z, min_p=0.5)[0]).tolist()
    assert kept == [True, True, False, False]  # 0.15 < 0.5 * 0.5


@pytest.mark.parametrize("kw, field", [({"temperature": 0}, "temperature"), ({"top_p": 0}, "top_p"),
                                       ({"max_tokens": 0}, "max_tokens"), ({"top_k": -1}, "top_k"),
                                       ({"min_p": 1.0}, "min_p")])
def test_sampling_params_name_the_bad_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kw)


class _RecordMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten matmuls a region runs, with their operands' shapes: which layout `F.linear` really took."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            operands = args[-2:]
            self.calls.append((func.__name__.split(".")[0], tuple(operands[0].shape), tuple(operands[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(32, 1, 24), (5, 24), (24,)])
def test_inference_linear_is_the_same_product_with_the_weight_first(bias, shape):
    from toolkit.core.generation import _CpuInferenceLinear

    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 40, bias=bias)
    x = torch.randn(shape)
    with torch.no_grad():
        expected = layer(x)
        with _CpuInferenceLinear(), _RecordMatmuls() as seen:
            got = layer(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert got.shape == expected.shape and got.is_contiguous()
    rows = x.numel() // 24
    assert seen.calls == [("addmm" if bias else "mm", (40, 24), (24, rows))]


def test_inference_linear_leaves_everything_else_to_the_ordinary_path():
    from toolkit.core.generation import _CpuInferenceLinear

    layer = torch.nn.Linear(24, 40)
    cases = {"autograd on": (torch.randn(8, 24), torch.enable_grad, layer),
             "more rows than decode": (torch.randn(65, 24), torch.no_grad, layer),
             "float64": (torch.randn(8, 24, dtype=torch.float64), torch.no_grad, torch.nn.Linear(24, 40).double())}
    for name, (x, grad_mode, module) in cases.items():
        with grad_mode(), _CpuInferenceLinear(), _RecordMatmuls() as seen:
            module(x)
        assert seen.calls and all(call[1][0] == x.shape[0] for call in seen.calls), name  # rows first: untouched
    # bfloat16 weights: untouched, same result as without the mode
    half = torch.nn.Linear(24, 40).to(torch.bfloat16)
    xh = torch.randn(4, 24, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = half(xh)
        with _CpuInferenceLinear():
            torch.testing.assert_close(half(xh), expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_linear_folds_a_non_contiguous_last_position_into_rows(dtype):
    # hidden[:, -1:] (what logits_to_keep=1 hands the LM head): without autograd torch would multiply it as a
    # batched product with the weight expanded once per row (measured 641 ms against 6 in bfloat16 at B=4)
    from toolkit.core.generation import _CpuInferenceLinear

    torch.manual_seed(0)
    # frozen, as a cast generation copy or a reference model is: with a weight that requires grad, torch folds
    layer = torch.nn.Linear(24, 40, bias=False).to(dtype).requires_grad_(False)
    hidden = torch.randn(70, 5, 24, dtype=dtype)  # 70 rows: above max_rows, so float32 folds too
    x = hidden[:, -1:]
    assert not x.is_contiguous()
    with torch.no_grad():
        expected = layer(x.contiguous())
        with _CpuInferenceLinear(), _RecordMatmuls() as seen:
            got = layer(x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert got.shape == (70, 1, 40)
    assert seen.calls == [("mm", (70, 24), (24, 40))]  # one product of rows, no batched product


def test_inference_linear_takes_keyword_calls_inference_mode_and_empty_batches():
    from toolkit.core.generation import _CpuInferenceLinear

    torch.manual_seed(0)
    w, b, x = torch.randn(40, 24), torch.randn(40), torch.randn(3, 24)
    F = torch.nn.functional
    expected = F.linear(x, w, b)
    with torch.inference_mode(), _CpuInferenceLinear(), _RecordMatmuls() as seen:
        by_keyword = F.linear(input=x, weight=w, bias=b)
        mixed = F.linear(x, weight=w)
        empty = F.linear(torch.empty(0, 24), w, b)
    torch.testing.assert_close(by_keyword, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mixed, expected - b, rtol=1e-5, atol=1e-5)
    assert empty.shape == (0, 40)
    with torch.no_grad(), _CpuInferenceLinear():  # no input features: the bias alone, as F.linear gives
        torch.testing.assert_close(F.linear(torch.empty(3, 0), torch.empty(40, 0), b), b.expand(3, 40))
    assert [c[1] for c in seen.calls[:2]] == [(40, 24), (40, 24)]  # the weight first in both


def test_generation_runs_decode_matmuls_with_the_weight_first_on_cpu():
    tok, model = tiny_tokenizer(), tiny_model()
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id)
    with _RecordMatmuls() as seen:
        backend.generate(_prompts(tok), SamplingParams(max_tokens=4), n=2, seed=0)
    lm_head = tuple(model.lm_head.weight.shape)
    # the LM head of every decode step (6 rows: 3 prompts x 2 samples) ran as W @ x.T
    assert sum(1 for _, a, b in seen.calls if a == lm_head and b == (lm_head[1], 6)) == 3


def test_a_bfloat16_copy_samples_with_its_own_log_probs_and_follows_the_training_weights():
    """generation_backend_kwargs.dtype: decoding runs on a cast copy (the training model stays float32, with no
    second float32 copy of anything), the log-probs returned are the copy's, and each generate call first brings
    the copy up to the training weights."""
    import copy

    tok, model = tiny_tokenizer(), tiny_model()
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id, dtype="bfloat16")
    params = SamplingParams(max_tokens=10, temperature=0.7)
    prompts = _prompts(tok)
    groups = backend.generate(prompts, params, n=2, seed=1)
    cast = backend._copy
    assert cast is not None and cast is not model
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in cast.parameters())
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    if model.config.tie_word_embeddings:
        assert cast.lm_head.weight is cast.model.embed_tokens.weight  # one memo entry: still tied
    # buffers (rotary frequencies) keep their float32: rounded, they would turn long prompts' positions
    assert [b.dtype for b in cast.buffers()] == [b.dtype for b in model.buffers()]
    reference = copy.deepcopy(model).eval()
    for p in reference.parameters():
        p.data = p.data.to(torch.bfloat16)
    gap_to_fp32 = []
    for p, group in zip(prompts, groups):
        for c in group:
            ids = torch.tensor([p + c.token_ids])
            with torch.no_grad():
                bf16 = torch.log_softmax(reference(ids).logits[0, len(p) - 1:-1].float() / 0.7, -1)
                fp32 = torch.log_softmax(model(ids).logits[0, len(p) - 1:-1].float() / 0.7, -1)
            t = torch.tensor(c.token_ids)[:, None]
            # the copy's own numbers (a cached decode against one full forward, both in bfloat16: rounding only)
            torch.testing.assert_close(torch.tensor(c.logprobs), bf16.gather(-1, t)[:, 0], rtol=0, atol=0.1)
            gap_to_fp32 += (torch.tensor(c.logprobs) - fp32.gather(-1, t)[:, 0]).abs().tolist()
    assert max(gap_to_fp32) > 1e-4  # not the float32 model's log-probs: the copy really sampled
    # the training weights move (an optimizer step's worth of noise): the next call decodes with them
    _perturb(model)
    backend.generate(prompts, SamplingParams(max_tokens=2), n=1, seed=0)
    assert backend._copy is cast  # refreshed in place, not rebuilt
    _assert_copy_holds(cast, model)


def _perturb(model):
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))


def _assert_copy_holds(cast, model):
    """Every parameter of the cast copy is the model's current one, rounded to the copy's dtype."""
    pairs = list(zip(cast.parameters(), model.parameters(), strict=True))
    assert pairs and all(torch.equal(c, p.detach().to(c.dtype)) for c, p in pairs)


def test_a_generation_dtype_the_backend_cannot_use_is_refused_naming_the_setting():
    tok, model = tiny_tokenizer(), tiny_model()
    with pytest.raises(ConfigError, match=r"generation_backend_kwargs.dtype: 'bf16' is not one of bfloat16 \| float16"):
        TransformersBackend(model, pad_token_id=tok.pad_token_id, dtype="bf16")
    # the model's own dtype: no copy is made
    same = TransformersBackend(model, pad_token_id=tok.pad_token_id, dtype=torch.float32)
    same.generate(_prompts(tok), SamplingParams(max_tokens=2), n=1, seed=0)
    assert same._copy is None


def test_a_cast_copy_follows_in_flight_updates_and_is_rebuilt_for_another_model():
    """An in-flight weight refresh (between decode steps) reaches the cast copy at once; a model handed over by
    sync_weights, or one whose shapes changed, gets a new copy."""
    tok, model = tiny_tokenizer(), tiny_model()
    refreshed = []

    def refresh_weights():
        if refreshed:
            return None
        refreshed.append(1)
        _perturb(model)  # new weights published between decode steps
        return 1

    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id, dtype="bfloat16",
                                  refresh_weights=refresh_weights)
    out = backend.generate(_prompts(tok), SamplingParams(max_tokens=4), n=1, seed=0)
    # the first token under the old weights, the rest under the new ones (version 1); the copy was brought to
    # them inside the call (it is refreshed at a call's start, before these weights existed)
    assert all(g[0].versions == [0, 1, 1, 1] for g in out)
    _assert_copy_holds(backend._copy, model)
    first = backend._copy
    other = tiny_model()
    backend.sync_weights(other)
    backend.refresh_weights = None
    backend.generate(_prompts(tok), SamplingParams(max_tokens=2), n=1, seed=0)
    assert backend._copy is not first and backend._copy_of is other
    other.resize_token_embeddings(other.config.vocab_size + 8)  # shapes changed in place: a new copy
    second = backend._copy
    backend.generate(_prompts(tok), SamplingParams(max_tokens=2), n=1, seed=0)
    assert backend._copy is not second
    assert backend._copy.lm_head.weight.shape[0] == other.config.vocab_size


def test_bf16_true_with_float32_weights_and_no_generation_dtype_warns(tmp_path, caplog):
    """bf16=True alone decodes under accelerate's autocast with float32 weights (a cast of every weight at every
    decode step): the trainer says so and names the setting; not when a dtype is given or training is float32."""
    import logging

    from toolkit.core.grpo import GRPOConfig, GRPOTrainer

    def build(**kw):
        args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no",
                          per_device_train_batch_size=2, num_generations=2, use_cpu=True, **kw)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="toolkit.core.generation"):
            GRPOTrainer(tiny_model(), [lambda completions, **k: [0.0] * len(completions)], args,
                        train_dataset=[{"prompt": "a"}] * 2, processing_class=tiny_tokenizer())
        return [r.getMessage() for r in caplog.records if r.name == "toolkit.core.generation"]

    said = build(bf16=True)
    assert len(said) == 1 and "generation_backend_kwargs={'dtype': 'bfloat16'}" in said[0]
    assert build(bf16=True, generation_backend_kwargs={"dtype": "bfloat16"}) == []
    assert build() == []
