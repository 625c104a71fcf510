"""An Unsloth-like wrapper: its own model loading and LoRA, its own log-prob kernel and loss, via public seams."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from toolkit import GRPOTrainer, SFTTrainer
from toolkit.core.attention import varlen_kwargs
from toolkit.core.models import unwrap_model
from toolkit.core.objectives import PolicyLossInputs
from toolkit.core.packing import completion_hidden
from toolkit.testing import tiny_model, tiny_tokenizer

CALLS = {"sft_logps": 0, "sft_loss": 0, "grpo_logps": 0, "grpo_loss": 0}


class FastModel:
    @staticmethod
    def from_pretrained(seed: int = 0, r: int = 4):
        """The wrapper loads the model and applies its own adapters; the trainer gets a ready PeftModel."""
        torch.manual_seed(seed)  # LoRA's A matrices come from the global generator
        model = get_peft_model(tiny_model(seed=seed), LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"],
                                                                  task_type="CAUSAL_LM"))
        return model, tiny_tokenizer()


class FastSFTTrainer(SFTTrainer):
    def compute_token_logps(self, model, inputs):
        CALLS["sft_logps"] += 1
        labels = inputs["labels"]
        shifted = labels[:, 1:]
        selected = shifted != -100
        if "cu_seq_lens" in inputs:  # toolkit's packed rows: the boundaries go to its varlen attention
            forward = {"position_ids": inputs["position_ids"], **varlen_kwargs(inputs["cu_seq_lens"])}
        else:
            forward = {"attention_mask": inputs["attention_mask"]}
        logits = model(input_ids=inputs["input_ids"], **forward).logits[:, :-1]
        logps = torch.log_softmax(logits.float(), -1)[selected].gather(-1, shifted[selected][:, None])[:, 0]
        return logps, shifted[selected]

    def compute_sft_loss(self, logps, num_items_in_batch):
        CALLS["sft_loss"] += 1
        return super().compute_sft_loss(logps, num_items_in_batch)


class FastGRPOTrainer(GRPOTrainer):
    def compute_token_logps(self, model, batch):
        """Replaces the default entirely (no super()): toolkit's hidden states at the completion positions, then
        the wrapper's own head: full logits, log_softmax, gather."""
        CALLS["grpo_logps"] += 1
        hidden = completion_hidden(model, batch)
        head = unwrap_model(model).get_output_embeddings()
        logits = (hidden.float() @ head.weight.float().T) / self.args.temperature
        return torch.log_softmax(logits, -1).gather(-1, batch["completion_targets"][:, None])[:, 0]

    def compute_policy_loss(self, inputs: PolicyLossInputs):
        CALLS["grpo_loss"] += 1
        return super().compute_policy_loss(inputs)
