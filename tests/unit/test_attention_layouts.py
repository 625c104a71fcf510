"""Packed rows are laid out so that the attention kernel that runs them derives the intended boundaries.

flash-attention (2 and 3) cannot run here (no GPU), so the test asks transformers' own helper what the kernel
would derive from our batch: `prepare_fa_kwargs_from_position_ids` is what transformers calls to build
flash-attention's `cu_seqlens` from position_ids. If transformers changes how it derives boundaries, this
test breaks, not our users' log-probs.
"""

import pytest
import torch
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from toolkit.core.attention import VARLEN_ATTENTION, packed_layout, supports_varlen, use_varlen_attention
from toolkit.core.dpo import DPOConfig, DPOTrainer
from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.core.packing import group_by_prompt, pack_completions, pack_shared_prompts
from toolkit.testing import tiny_model, tiny_tokenizer

# 2 prompts x 2 completions, as a GRPO group (or a DPO chosen/rejected pair) lays them out.
PROMPTS = [[5, 6, 7], [5, 6, 7], [8, 9, 10, 11], [8, 9, 10, 11]]
COMPLETIONS = [[1, 2], [3, 4, 5], [6], [7, 8]]
INTENDED = [0, 5, 11, 16, 22]  # each prompt + completion its own sequence

# Every implementation transformers can select by name, and ours.
IMPLEMENTATIONS = ["eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention",
                   "paged|sdpa", VARLEN_ATTENTION]


def model_with(impl):
    model = tiny_model()
    model.config._attn_implementation = impl  # the name only: the kernels themselves need a GPU
    if supports_varlen(model):
        use_varlen_attention(model)
    return model


def flash_boundaries(position_ids):
    (cu_q, cu_k), _ = prepare_fa_kwargs_from_position_ids(position_ids)
    assert cu_q.tolist() == cu_k.tolist()
    return cu_q.tolist()


def build(layout):
    if layout == "shared_prompt":
        return pack_shared_prompts(PROMPTS, COMPLETIONS, group_by_prompt(PROMPTS))
    return pack_completions(PROMPTS, COMPLETIONS, pad_token_id=0, padding_free=layout == "separate")


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_the_layout_chosen_for_each_attention_gives_the_kernel_the_intended_boundaries(impl):
    model = model_with(impl)
    layout = packed_layout(model)
    batch = build(layout)
    final = model.config._attn_implementation
    if layout == "shared_prompt":
        # only our kernel reads the shared-prefix spans; they put each completion after its own prompt
        assert final == VARLEN_ATTENTION
        spans = batch["shared_prefix"]
        assert [(p0, p1) for p0, p1, _ in spans] == [(0, 3), (8, 12)]
        assert [c for _, _, cs in spans for c in cs] == [(3, 5), (5, 8), (12, 13), (13, 15)]
    elif layout == "separate":
        assert final.startswith("flash_attention")
        assert flash_boundaries(batch["position_ids"]) == INTENDED == batch["cu_seq_lens"].tolist()
    else:
        assert layout == "padded" and "attention_mask" in batch and "position_ids" not in batch
        assert batch["attention_mask"].sum(-1).tolist() == [5, 6, 5, 6]


def test_the_shared_prompt_layout_under_flash_attention_would_mix_siblings():
    """Why flash-attention must not get the shared layout: the boundaries it derives merge a group's completions
    into one sequence, so the second completion (DPO: the rejected answer) attends to the first."""
    batch = pack_shared_prompts(PROMPTS, COMPLETIONS, group_by_prompt(PROMPTS))
    assert flash_boundaries(batch["position_ids"]) == [0, 8, 15]  # [prompt + c1 + c2] per group, c2 sees c1
    assert packed_layout(model_with("flash_attention_2")) == "separate"


def test_models_that_disagree_get_the_layout_both_can_run():
    assert packed_layout(model_with("sdpa"), model_with("flash_attention_2")) == "separate"
    assert packed_layout(model_with("sdpa"), None) == "shared_prompt"
    assert packed_layout(model_with("flex_attention"), model_with("sdpa")) == "padded"


def test_grpo_and_dpo_pack_by_the_layout_of_their_models():
    tok = tiny_tokenizer()
    common = dict(output_dir="unused", max_steps=1, report_to="none", save_strategy="no")
    flash = model_with("flash_attention_2")
    grpo = GRPOTrainer(flash, [lambda completions, **kw: [0.0] * len(completions)],
                       GRPOConfig(per_device_train_batch_size=4, num_generations=2, **common),
                       train_dataset=[{"prompt": "a"}] * 4, processing_class=tok)
    assert grpo.packed_layout == "separate"
    dpo = DPOTrainer(model_with("flash_attention_2"), args=DPOConfig(**common),
                     train_dataset=[{"prompt": "a ", "chosen": "b", "rejected": "c"}], processing_class=tok)
    assert dpo.packed_layout == "separate"
    assert GRPOTrainer(tiny_model(), grpo.reward_runner.funcs, grpo.args, train_dataset=[{"prompt": "a"}] * 4,
                       processing_class=tok).packed_layout == "shared_prompt"
    from toolkit.core.ppo import PPOConfig, PPOTrainer

    ppo_args = PPOConfig(per_device_train_batch_size=2, **common)
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    ppo = PPOTrainer(model_with("flash_attention_2"), grpo.reward_runner.funcs, ppo_args, train_dataset=rows,
                     processing_class=tok)
    head = list(range(30, 50))
    assert ppo.packed_layout == "separate" and "cu_seq_lens" in ppo._pack([head + [6], head + [7]], [[1], [2]])
    ppo = PPOTrainer(tiny_model(), grpo.reward_runner.funcs, ppo_args, train_dataset=rows, processing_class=tok)
    assert ppo.packed_layout == "shared_prompt"
    assert ppo._pack([head + [6], head + [7]], [[1], [2]])["shared_context"] == (0, 20)


def test_separate_layout_log_probs_equal_the_shared_layout_on_cpu():
    """The flash layout is not only well delimited but computes the same numbers (run through toolkit_varlen here)."""
    from toolkit.core.packing import completion_logps

    model = model_with("sdpa").eval()
    with torch.no_grad():
        shared = completion_logps(model, build("shared_prompt"))
        separate = completion_logps(model, build("separate"))
    torch.testing.assert_close(shared, separate, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_small_low_precision_segments_on_cpu_attend_in_float32(dtype):
    """Packed layouts make one sdpa call per segment; on CPU a small bf16/fp16 one runs in float32 (torch's
    low-precision CPU kernel pays a fixed cost per call) and comes back in the dtype that kernel would return,
    forward and backward, also inside an autocast region. Large segments keep the low-precision kernel."""
    import torch.nn.functional as F

    from toolkit.core.attention import _CPU_FLOAT32_BELOW, _segment_sdpa

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 12, 16, generator=g).to(dtype).requires_grad_()
    k = torch.randn(1, 2, 20, 16, generator=g).to(dtype).requires_grad_()
    v = torch.randn(1, 2, 20, 16, generator=g).to(dtype).requires_grad_()
    mask = torch.ones(12, 20, dtype=torch.bool)
    mask[:, 8:] = torch.ones(12, 12, dtype=torch.bool).tril()
    out = _segment_sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    assert out.dtype == dtype
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask, enable_gqa=True)
    assert torch.equal(out.float(), ref.to(dtype).float())  # computed in float32, rounded once at the end
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad.to(dtype))
    ref.backward(grad.to(dtype).float())
    for low, full in ((q, q32), (k, k32), (v, v32)):
        assert low.grad.dtype == dtype
        torch.testing.assert_close(low.grad.float(), full.grad.to(dtype).float(), rtol=0, atol=0)
    # bf16=True training: autocast on, query and key in float32 (the rotary embedding promotes them), value in bf16
    q32, k32 = (t.detach().float() for t in (q, k))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = _segment_sdpa(q32, k32, v.detach(), attn_mask=mask, enable_gqa=True)
    assert mixed.dtype == torch.bfloat16
    expected = F.scaled_dot_product_attention(q32, k32, v.detach().float(), attn_mask=mask, enable_gqa=True)
    assert torch.equal(mixed, expected.bfloat16())
    additive = torch.zeros(12, 20).masked_fill(~mask, float("-inf")).to(dtype)  # a float mask in the inputs' dtype
    torch.testing.assert_close(_segment_sdpa(q.detach(), k.detach(), v.detach(), attn_mask=additive, enable_gqa=True),
                               out.detach())  # (cast down to the query's float32, else sdpa refuses the mask)
    big = torch.randn(1, 1, 300, 8, dtype=dtype)
    assert 300 * 300 >= _CPU_FLOAT32_BELOW
    torch.testing.assert_close(_segment_sdpa(big, big, big, is_causal=True),
                               F.scaled_dot_product_attention(big, big, big, is_causal=True), rtol=0, atol=0)


def test_float32_and_large_segments_reach_the_kernel_untouched(monkeypatch):
    """Float32 outside autocast, and segments at or above the threshold, go to sdpa as they are: same tensors."""
    import toolkit.core.attention as attention
    from toolkit.core.attention import _segment_sdpa

    got = []
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", lambda q, k, v, **kw: got.append((q, k, v, kw)))
    small = torch.randn(1, 2, 10, 8)
    _segment_sdpa(small, small, small, is_causal=True)
    big = torch.randn(1, 1, 256, 8, dtype=torch.bfloat16)
    _segment_sdpa(big, big, big, is_causal=True)
    mixed_q, bf16 = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8, dtype=torch.bfloat16)
    _segment_sdpa(mixed_q, bf16, bf16)  # mixed dtypes outside autocast: the kernel's own error, not a silent cast
    double = torch.randn(1, 2, 10, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast leaves float64 alone, and so do we
        _segment_sdpa(double, double, double)
    expected = [(small,) * 3, (big,) * 3, (mixed_q, bf16, bf16), (double,) * 3]
    assert len(got) == 4
    assert all(a is x and b is y and c is z for (a, b, c, _), (x, y, z) in zip(got, expected))
    assert got[0][3] == {"is_causal": True}


def test_grpo_with_bf16_true_trains_its_packed_segments_in_float32_attention(tmp_path, monkeypatch):
    """bf16=True on CPU: accelerate wraps the forward in autocast and the rotary embedding hands query and key over
    in float32 (value in bfloat16). Every packed segment of the training forward reaches the kernel in float32
    with autocast off."""
    import torch.nn.functional as F

    import toolkit.core.attention as attention

    seen, inside, entered = [], [], []
    real_kernel, real_segment = F.scaled_dot_product_attention, attention._segment_sdpa

    def kernel(q, k, v, **kwargs):
        if inside:  # only what our packed layouts hand the kernel (transformers' own sdpa calls pass here too)
            seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), q.dtype, k.dtype, v.dtype))
        return real_kernel(q, k, v, **kwargs)

    def segment(q, k, v, **kwargs):
        entered.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), v.dtype))
        inside.append(1)
        try:
            return real_segment(q, k, v, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", kernel)
    monkeypatch.setattr(attention, "_segment_sdpa", segment)
    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    args = GRPOConfig(output_dir=str(tmp_path), max_steps=1, report_to="none", save_strategy="no", bf16=True,
                      use_cpu=True, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                      learning_rate=1e-2, temperature=1.0, generation_backend_kwargs={"dtype": "bfloat16"})
    trainer = GRPOTrainer(model, [lambda completions, **kw: [float(len(c)) for c in completions]], args,
                          train_dataset=[{"prompt": "a b"}, {"prompt": "c d e"}] * 2, processing_class=tiny_tokenizer())
    assert model.config._attn_implementation == VARLEN_ATTENTION and trainer.packed_layout == "shared_prompt"
    trainer.train()
    # the training forward came in under autocast with a bfloat16 value (the case the float32 path is for) ...
    assert (True, True, torch.bfloat16) in entered, set(entered)
    # ... and every packed segment of it reached the kernel in float32 with autocast off
    training = [s for s in seen if s[0]]
    assert training and all(s[1:] == (False, torch.float32, torch.float32, torch.float32) for s in training), set(
        training)
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))  # it did train
