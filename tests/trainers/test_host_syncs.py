"""GRPO's loss path reads nothing back to the host before backward is queued.

On a GPU a host read (`.item()`, `float(t)`, `bool(t)`, a boolean index, which needs the count of `True`s) waits
for every kernel queued before it, so each one in the loss path stalls the step. They are counted here on the CPU
through the same dispatcher calls a GPU run would make (`aten._local_scalar_dense`, `aten.nonzero`,
`aten.masked_select`, `aten.index` with a boolean index). The loss's NaN/inf check is read after backward
(`TrainingHealth.raise_if_not_finite`), still before any optimizer step.
"""

import math
import traceback
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from toolkit import TrainingHealthError
from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.testing import tiny_model, tiny_tokenizer

_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}


class HostReads(TorchDispatchMode):
    """Counts host reads, each by the innermost frame that is not torch's: toolkit's own, or a library's."""

    def __init__(self):
        super().__init__()
        self.ours: Counter = Counter()
        self.theirs: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        boolean_index = name.startswith("aten.index.") and any(
            getattr(i, "dtype", None) == torch.bool for i in (args[1] if len(args) > 1 else ()) if i is not None)
        if name in _READS or boolean_index:
            frames = [f for f in traceback.extract_stack()
                      if "/torch/" not in f.filename and f.filename != __file__]
            where = f"{frames[-1].filename.rsplit('/', 2)[-1]}:{frames[-1].lineno}" if frames else "?"
            inner = frames[-1].filename if frames else ""
            (self.ours if "/toolkit/" in inner and "site-packages" not in inner else self.theirs)[f"{name} @ {where}"] += 1
        return func(*args, **(kwargs or {}))


def _reward(completions, **kw):
    return [float(len(c) % 3) for c in completions]


class Counting(GRPOTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with HostReads() as reads:
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.reads.append(reads)
        return out


def _trainer(tmp_path, trainer=Counting, **kw):
    cfg = GRPOConfig(output_dir=str(tmp_path), num_generations=4, per_device_train_batch_size=8,
                     max_completion_length=8, max_steps=2, learning_rate=1e-2, save_strategy="no", report_to="none",
                     disable_tqdm=True, **kw)
    t = trainer(tiny_model(), _reward, cfg, train_dataset=[{"prompt": f"Count {i}"} for i in range(8)],
                processing_class=tiny_tokenizer())
    t.reads = []
    return t


@pytest.mark.parametrize("kw", [
    {},  # dapo, clipping metrics, entropy, sampler gap
    {"num_iterations": 2, "importance_sampling_mode": "mask", "beta": 0.04, "off_policy_mask_threshold": 0.5},
], ids=["default", "reuse-mask-kl-offpolicy"])
def test_the_grpo_loss_path_reads_nothing_back_before_backward(tmp_path, kw):
    t = _trainer(tmp_path, **kw)
    t.train()
    assert t.reads, "compute_loss ran"
    ours = sum((r.ours for r in t.reads), Counter())
    theirs = sum((r.theirs for r in t.reads), Counter())
    assert not ours, f"host reads in toolkit's loss path: {dict(ours)} (library reads, not ours: {dict(theirs)})"
    # the metrics are still there, and still skip what had nothing to describe
    logged = [h for h in t.state.log_history if "loss" in h]
    assert logged and all(math.isfinite(h["entropy"]) and math.isfinite(h["sampler/logp_abs_diff_mean"])
                          for h in logged)
    if "beta" in kw:
        assert all("kl" in h and "importance_ratio/masked_frac" in h for h in logged)


def test_a_nan_loss_still_stops_the_run_before_the_optimizer_moves_a_weight(tmp_path):
    class NaNLoss(GRPOTrainer):
        def compute_policy_loss(self, inputs):
            per_token, masks = super().compute_policy_loss(inputs)
            return per_token * float("nan"), masks

    t = _trainer(tmp_path, trainer=NaNLoss)
    before = {k: v.detach().clone() for k, v in t.model.named_parameters()}
    with pytest.raises(TrainingHealthError, match="GRPO step 0: 'loss' holds NaN or inf"):
        t.train()
    assert all(torch.equal(v, before[k]) for k, v in t.model.named_parameters())


# ------------------------------------------------------------------------------------------------ decoding

@pytest.mark.parametrize("every", [1, 8])
def test_decoding_reads_the_host_once_per_check(every):
    """The transformers backend's decode loop reads the device once every `host_check_every` steps (8 by default
    on a GPU; every step on CPU, where a read is free and a step past the end is not): finished rows, compaction
    and the NaN check all wait for that read. Counted on CPU through the dispatcher (`.item()`, `nonzero`, boolean
    indexing), transformers' own included (its sdpa mask asks whether any key is padding, unless handed a 4D mask);
    copies to the host (`.cpu()`) do not dispatch on a CPU tensor: the outputs stay on the device until the end
    (one copy per chunk, in `_completions`), which this count cannot see."""
    from toolkit.core.generation import SamplingParams, TransformersBackend

    torch.manual_seed(0)
    model = tiny_model(vocab_size=384)
    backend = TransformersBackend(model, pad_token_id=2)
    backend.host_check_every = every
    steps = 32
    params = SamplingParams(max_tokens=steps, temperature=1.0, stop_token_ids=())  # no stop: all 32 steps run
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with HostReads() as reads:
        out = backend.generate(prompts, params, n=4, seed=0)
    assert all(len(c.token_ids) == steps for group in out for c in group)
    every_read = {**reads.ours, **reads.theirs}  # transformers' reads count too (a GPU waits for them alike)
    # one read per check, plus the prefill's handful (transformers' mask checks; none per decode step)
    assert sum(every_read.values()) <= steps // every + 4, every_read


def test_decoding_with_sparse_checks_samples_what_every_step_checking_samples():
    """Checking every 8 steps instead of every step changes when the host learns a row stopped, not what is
    sampled: same ids and log-probs, a row's tokens ending at its stop token either way."""
    from toolkit.core.generation import SamplingParams, TransformersBackend

    model = tiny_model(vocab_size=384, seed=3)
    params = SamplingParams(max_tokens=24, temperature=1.0, stop_token_ids=(7, 11, 13, 17, 19))
    prompts = [[5, 6, 7, 8], [9, 10, 11], [3, 4]]
    runs = []
    for every in (1, 8):
        backend = TransformersBackend(model, pad_token_id=2)
        backend.host_check_every = every
        runs.append(backend.generate(prompts, params, n=4, seed=1))
    ids = [[c.token_ids for c in g] for g in runs[0]]
    assert ids == [[c.token_ids for c in g] for g in runs[1]]
    assert any(len(t) < 24 for g in ids for t in g), "no row stopped early: the test would not test the stop"
    for a, b in zip(runs[0], runs[1]):
        for x, y in zip(a, b):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5) and x.finish_reason == y.finish_reason
