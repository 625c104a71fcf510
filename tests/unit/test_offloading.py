"""Activation offloading (`memory.OffloadActivations`) and the memory model's settings for long rows.

On CPU the trainers leave offloading off (host memory is the CPU's own); the hooks' round trip runs here by
naming the CPU as the device to offload from, which exercises the same pack and unpack."""

import pytest
import torch

from toolkit.core.memory import OffloadActivations, estimate_step_memory
from toolkit.testing import tiny_model


def _grads(model, ids, ctx=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        out = model(input_ids=ids, labels=ids)
    else:
        with ctx:
            out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_offloaded_activations_come_back_for_backward_with_the_same_gradients():
    model, ids = tiny_model(), torch.randint(3, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    plain = _grads(model, ids)
    off = OffloadActivations(devices={"cpu"}, min_bytes=0)
    offloaded = _grads(model, ids, off)
    assert off.moved_bytes > 0
    for k in plain:
        torch.testing.assert_close(plain[k], offloaded[k], rtol=0, atol=0, msg=k)


def test_backward_reads_the_host_copy_not_the_device_tensor():
    # exp saves its output; zeroing that output's memory behind autograd's back leaves the offloaded copy intact
    a = torch.randn(4096, requires_grad=True)
    with OffloadActivations(devices={"cpu"}, min_bytes=0):
        b = a.exp()
    b.data.zero_()
    b.sum().backward()
    torch.testing.assert_close(a.grad, a.detach().exp())
    a.grad = None
    b = a.exp()  # without offloading, backward reads the zeroed tensor: the check above can fail
    b.data.zero_()
    b.sum().backward()
    assert a.grad.abs().max() == 0


def test_a_tensor_saved_by_several_ops_is_copied_once():
    x = torch.randn(16, 64, requires_grad=True)
    weights = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(3)]
    with OffloadActivations(devices={"cpu"}, min_bytes=0) as off:
        h = x * 2  # the shared input of three projections (q, k, v)
        out = sum(torch.nn.functional.linear(h, w) for w in weights)
    out.sum().backward()
    assert off.moved_bytes == h.numel() * 4


def test_weights_and_small_tensors_stay():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(8, 64, requires_grad=True)
    off = OffloadActivations(devices={"cpu"}, min_bytes=0)
    with off:
        y = torch.nn.functional.linear(x, weight)  # saves x and the weight
    y.sum().backward()
    assert off.moved_bytes == x.numel() * 4  # the input moved, the weight did not
    big_only = OffloadActivations(devices={"cpu"}, min_bytes=1 << 20)
    with big_only:
        torch.nn.functional.linear(x, weight).sum().backward()
    assert big_only.moved_bytes == 0
    default = OffloadActivations(min_bytes=0)  # default devices: anything but the CPU
    with default:
        torch.nn.functional.linear(x, weight).sum().backward()
    assert default.moved_bytes == 0


def test_with_checkpointing_only_the_layer_inputs_move():
    ids = torch.randint(3, 300, (2, 48), generator=torch.Generator().manual_seed(0))
    model = tiny_model()
    model.train()
    plain = _grads(model, ids)
    without = OffloadActivations(devices={"cpu"}, min_bytes=0)
    _grads(model, ids, without)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with_ckpt = OffloadActivations(devices={"cpu"}, min_bytes=0)
    grads = _grads(model, ids, with_ckpt)
    assert 0 < with_ckpt.moved_bytes < without.moved_bytes / 2
    for k in plain:
        torch.testing.assert_close(plain[k], grads[k], rtol=1e-5, atol=1e-7, msg=k)


def test_the_memory_model_counts_offloading_and_a_sequence_parallel_rank():
    base = dict(batch_size=1, seq_len=16384)  # saved tensors of 4 MiB: above the 1 MiB that offloading moves
    model = tiny_model().config
    plain = estimate_step_memory(model, "sft", **base)
    offloaded = estimate_step_memory(model, "sft", activation_offloading=True, **base)
    split = estimate_step_memory(model, "sft", sequence_parallel_size=2, **base)
    assert offloaded.activations < plain.activations / 2
    assert split.details["tokens_per_micro_batch"] == 8192
    assert split.activations == pytest.approx(plain.activations / 2, rel=0.1)
    assert offloaded.weights == plain.weights == split.weights
    with pytest.raises(ValueError, match="sequence_parallel_size"):
        estimate_step_memory(model, "sft", sequence_parallel_size=0, **base)


def test_toolkit_estimate_names_the_first_setting_that_fits(tmp_path, capsys):
    from toolkit.core.cli import main

    model = tmp_path / "tiny"
    tiny_model().config.save_pretrained(model)
    args = ["estimate", "--model", str(model), "--trainer", "sft", "--batch_size", "1", "--seq_len", "16384"]
    assert main(args) == 0
    peak = float(capsys.readouterr().out.split("peak of the step")[1].split("GiB")[0])
    # a card just too small for the step without checkpointing: the ladder's first rung fits it
    assert main([*args, "--gpu_gib", f"{peak * 0.9:.3f}"]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "fits with activation_checkpointing=True, activation_offloading=False" in out
    assert main([*args, "--gpu_gib", "0.0001"]) == 0  # nothing fits: says what else to do
    assert "no setting tried fits" in capsys.readouterr().out


def test_a_trainer_on_cpu_says_offloading_moves_nothing(tmp_path, caplog):
    from toolkit import SFTConfig, SFTTrainer
    from toolkit.testing import tiny_tokenizer

    rows = [{"prompt": "a b", "completion": " c d"}] * 4
    with caplog.at_level("WARNING"):
        trainer = SFTTrainer(tiny_model(), SFTConfig(output_dir=str(tmp_path), activation_offloading=True, max_steps=1,
                                                     report_to="none"),
                             train_dataset=rows, processing_class=tiny_tokenizer())
    assert "activation_offloading: training on CPU" in caplog.text
    with trainer.compute_loss_context_manager():  # no saved-tensor hooks on CPU: nothing would be gained
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    # on a GPU (its device stood in for by a CUDA device object: nothing runs on it) the hooks are installed
    trainer.args.__dict__["_setup_devices"] = torch.device("cuda")  # what `args.device` reads (a cached property)
    assert trainer.args.device.type == "cuda"
    with trainer.compute_loss_context_manager():
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def test_a_tensor_changed_in_place_between_two_saves_is_copied_again():
    a = torch.randn(4096, requires_grad=True)
    with OffloadActivations(devices={"cpu"}, min_bytes=0) as off:
        h = a * 1.0
        first = h.exp()       # saves its output (not h)
        y = h * h             # saves h
        with torch.no_grad():
            h.mul_(2.0)       # h changes in place (outside autograd's view: the test's stand-in for a buffer reused)
        z = h * h             # saves h again, now doubled
    assert off.moved_bytes == 4 * 4096 * 3  # exp's output, h, and h again after the change
    del first, y, z
