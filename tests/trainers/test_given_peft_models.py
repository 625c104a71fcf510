"""A model a wrapper already adapted (a PeftModel, as Unsloth hands over) goes into every trainer as it is:
no re-wrapping, no path lookup, the adapters train, the base stays, and the reference is the base with the
adapters disabled instead of a second copy."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from toolkit.core.dpo import DPOConfig, DPOTrainer
from toolkit.core.errors import ConfigError
from toolkit.core.grpo import GRPOConfig, GRPOTrainer
from toolkit.core.ppo import PPOConfig, PPOTrainer
from toolkit.core.sft import SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer

COMMON = dict(max_steps=2, learning_rate=5e-2, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)


def adapted():
    model = get_peft_model(tiny_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                    task_type="CAUSAL_LM"))
    # LoRA's B starts at zero; nudge it so that adapters-on differs from adapters-off from step 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return model


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def rewards(completions, **kw):
    return [float(len(str(c)) % 5) for c in completions]


def build(kind, model, tmp_path):
    tok = tiny_tokenizer()
    out = str(tmp_path / kind)
    if kind == "sft":
        return SFTTrainer(model, SFTConfig(output_dir=out, **COMMON),
                          train_dataset=[{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(8)],
                          processing_class=tok)
    if kind == "dpo":
        return DPOTrainer(model, args=DPOConfig(output_dir=out, per_device_train_batch_size=4, **COMMON),
                          train_dataset=[{"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": "no"} for i in range(8)],
                          processing_class=tok)
    prompts = [{"prompt": f"Count to {i}:"} for i in range(8)]
    if kind == "grpo":
        return GRPOTrainer(model, [rewards], GRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=2,
                                                        max_completion_length=4, beta=0.1, **COMMON),
                           train_dataset=prompts, processing_class=tok)
    return PPOTrainer(model, [rewards], PPOConfig(output_dir=out, per_device_train_batch_size=4, max_completion_length=4,
                                                  num_ppo_epochs=1, **COMMON), train_dataset=prompts,
                      processing_class=tok)


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo", "ppo"])
def test_a_wrapper_adapted_model_trains_its_adapters_in_place(kind, tmp_path):
    model = adapted()
    before = snapshot(model)
    trainer = build(kind, model, tmp_path)
    assert trainer.model is model  # not re-wrapped, not copied
    assert getattr(trainer, "ref_model", None) is None  # the reference is the base with adapters off, not a second model
    trainer.train()
    after = snapshot(model)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved and all("lora_" in k for k in moved), moved


def test_the_reference_is_the_base_with_the_adapters_off(tmp_path):
    """Not the policy itself: reference log-probs equal the plain base model's and differ from the adapted ones."""
    model = adapted()
    base_copy = tiny_model()  # same seed: the weights under the adapters
    dpo = build("dpo", model, tmp_path)
    batch = dpo.data_collator([dpo.train_dataset[i] for i in range(4)])
    with torch.no_grad():
        ref_c, ref_r = dpo.compute_reference_logps(batch)
        pol_c, pol_r, _ = dpo.compute_sequence_logps(dpo.model, batch)
        base_c, base_r, _ = dpo.compute_sequence_logps(base_copy, batch)
    torch.testing.assert_close(ref_c, base_c, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ref_c, pol_c, atol=1e-4)

    grpo = build("grpo", adapted(), tmp_path)
    rollout = grpo.generate_rollout([0, 1])
    ref = torch.cat(grpo._score_rows(None, rollout))
    pol = torch.cat(grpo._score_rows(grpo.model, rollout))
    assert not torch.allclose(ref, pol, atol=1e-4)


def test_a_frozen_peft_model_is_refused_instead_of_training_nothing(tmp_path):
    model = adapted().requires_grad_(False)  # what PeftModel.from_pretrained(...) gives without is_trainable=True
    with pytest.raises(ConfigError, match="is_trainable=True"):
        build("sft", model, tmp_path)


def test_adding_adapters_over_a_wrappers_adapters_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="peft_config: the model already has PEFT adapters"):
        SFTTrainer(adapted(), SFTConfig(output_dir=str(tmp_path / "o"), **COMMON),
                   train_dataset=[{"text": "hello"}], processing_class=tiny_tokenizer(),
                   peft_config=LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
