"""The memory model (`estimate_step_memory`, fake tensors) against the measured peak tensor memory of a real step.

Each trainer runs two optimizer steps on the embedded SmolLM2-135M in bf16 mixed precision; step 2's peak is
measured from torch's allocator (`PeakAllocatorMemory` through `PeakTensorMemoryCallback`; the steady state: Adam's
state exists). The shapes of that step's training micro-batch (tokens in the row, positions scored) are recorded
from the trainer's own inputs and handed to the estimate, which must come within 15% of the measurement (issue
56's bound; measured: within 3% for every case here).
"""

from __future__ import annotations

import random

import pytest
import torch

from toolkit import embedded_model_path
from toolkit.core.memory import PeakTensorMemoryCallback, estimate_step_memory

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

COMMON = dict(max_steps=2, logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
              bf16=True, use_cpu=True)


def _words(rng: random.Random, k: int) -> str:
    words = "the model learns to prefer the better answer while the reference keeps it close".split()
    return " ".join(rng.choice(words) for _ in range(k))


def _check(measured: int, estimate, shapes: dict) -> None:
    ratio = estimate.peak / measured
    print(f"measured {measured / 2**20:.0f} MiB, estimated {estimate.peak / 2**20:.0f} MiB ({ratio:.2f}); {shapes}")
    print(estimate.table())
    assert 0.85 <= ratio <= 1.15, (f"memory model off by {ratio - 1:+.0%}: estimated {estimate.peak / 2**20:.0f} MiB, "
                                   f"measured {measured / 2**20:.0f} MiB for {shapes}")


@pytest.mark.parametrize(("checkpointing", "lora_r"), [(True, 0), (False, 0), (False, 16)],
                         ids=["checkpointing", "no-checkpointing", "lora"])
def test_sft(tmp_path, checkpointing, lora_r):
    from toolkit import SFTConfig, SFTTrainer

    shapes = {}

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, **kw):
            if model.training and self.state.global_step == 1:
                shapes["tokens"] = int(inputs["input_ids"].numel())
            return super().compute_loss(model, inputs, **kw)

    rng = random.Random(0)
    rows = [{"text": _words(rng, 200)} for _ in range(16)]
    meter = PeakTensorMemoryCallback(step=2)
    cfg = SFTConfig(output_dir=str(tmp_path), **COMMON, learning_rate=1e-5, per_device_train_batch_size=4,
                    max_length=512, activation_checkpointing=checkpointing)
    peft = None
    if lora_r:
        from peft import LoraConfig

        peft = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = Recording(str(embedded_model_path()), cfg, train_dataset=rows, callbacks=[meter], peft_config=peft)
    trainer.train()
    est = estimate_step_memory(str(embedded_model_path()), "sft", batch_size=1, seq_len=shapes["tokens"],
                               activation_checkpointing=bool(cfg.gradient_checkpointing), lora_r=lora_r)
    _check(meter.peak_bytes, est, shapes)


def test_dpo(tmp_path):
    from toolkit import DPOConfig, DPOTrainer

    shapes = {}

    class Recording(DPOTrainer):
        def compute_sequence_logps(self, model, inputs):
            if torch.is_grad_enabled() and self.state.global_step == 1:
                batch = self._batch(inputs)
                shapes.update(tokens=int(batch["input_ids"].numel()),
                              scored=int(batch["completion_lengths"].sum()), pairs=len(inputs["prompt_ids"]))
            return super().compute_sequence_logps(model, inputs)

    rng = random.Random(0)
    rows = [{"prompt": _words(rng, 60) + "\n", "chosen": _words(rng, 90), "rejected": _words(rng, 90)}
            for _ in range(16)]
    meter = PeakTensorMemoryCallback(step=2)
    cfg = DPOConfig(output_dir=str(tmp_path), **COMMON, learning_rate=1e-6, per_device_train_batch_size=4,
                    max_length=512, activation_checkpointing=False)
    trainer = Recording(str(embedded_model_path()), args=cfg, train_dataset=rows, callbacks=[meter])
    trainer.train()
    b = shapes["pairs"]
    est = estimate_step_memory(str(embedded_model_path()), "dpo", batch_size=b,
                               completion_len=round(shapes["scored"] / (2 * b)),
                               prompt_len=round((shapes["tokens"] - shapes["scored"]) / b),
                               activation_checkpointing=bool(cfg.gradient_checkpointing))
    _check(meter.peak_bytes, est, shapes)


def test_grpo(tmp_path):
    from toolkit import GRPOConfig, GRPOTrainer
    from toolkit.core.rewards import numeric_match
    from toolkit.core.tasks import arithmetic

    shapes = {}

    class Recording(GRPOTrainer):
        def compute_loss(self, model, inputs, **kw):
            if model.training and self.state.global_step == 1:
                shapes.update(tokens=int(inputs["input_ids"].numel()), scored=int(inputs["completion_mask"].sum()))
            return super().compute_loss(model, inputs, **kw)

    meter = PeakTensorMemoryCallback(step=2)
    cfg = GRPOConfig(output_dir=str(tmp_path), **COMMON, learning_rate=1e-5, per_device_train_batch_size=32,
                     num_generations=8, max_completion_length=32, temperature=1.0, beta=0.0,
                     zero_variance_filter=False, skip_steps_without_signal=False)
    rows = arithmetic(16, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    trainer = Recording(str(embedded_model_path()), [numeric_match], cfg, train_dataset=rows, callbacks=[meter])
    trainer.train()
    b, g = 32, 8
    est = estimate_step_memory(str(embedded_model_path()), "grpo", batch_size=b, num_generations=g,
                               completion_len=round(shapes["scored"] / b),
                               prompt_len=round((shapes["tokens"] - shapes["scored"]) / (b // g)),
                               activation_checkpointing=bool(cfg.gradient_checkpointing))
    _check(meter.peak_bytes, est, shapes)


def test_ppo(tmp_path):
    from toolkit import PPOConfig, PPOTrainer
    from toolkit.core.tasks import arithmetic

    shapes = {}

    class Recording(PPOTrainer):
        def compute_loss(self, model, inputs, **kw):
            if torch.is_grad_enabled() and self.state.global_step == 1 and "rows" not in shapes:
                shapes.update(rows=int(inputs["input_ids"].shape[0]), length=int(inputs["input_ids"].shape[-1]),
                              scored=int(inputs["mask"].sum()))
            return super().compute_loss(model, inputs, **kw)

    meter = PeakTensorMemoryCallback(step=2)
    cfg = PPOConfig(output_dir=str(tmp_path), **COMMON, per_device_train_batch_size=8, num_mini_batches=2,
                    num_ppo_epochs=1, max_completion_length=16, temperature=1.0, learning_rate=1e-5, beta=0.05)
    rows = arithmetic(16, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    path = str(embedded_model_path())
    trainer = Recording(path, [], cfg, train_dataset=rows, reward_model=path, callbacks=[meter])
    trainer.train()
    completion = round(shapes["scored"] / shapes["rows"])
    est = estimate_step_memory(path, "ppo", batch_size=shapes["rows"], completion_len=completion,
                               prompt_len=shapes["length"] - completion,
                               activation_checkpointing=bool(cfg.gradient_checkpointing))
    _check(meter.peak_bytes, est, shapes)
