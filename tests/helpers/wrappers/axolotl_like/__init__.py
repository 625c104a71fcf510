"""An Axolotl-like wrapper: trainers built from a nested YAML config, data tokenized by the wrapper itself and
handed over pre-tokenized with the wrapper's own collator."""

from __future__ import annotations

from typing import Any

import yaml
from transformers import DataCollatorForSeq2Seq

from toolkit import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer

COLLATED = {"batches": 0}


class WrapperCollator(DataCollatorForSeq2Seq):
    """The wrapper's own padding (right, labels -100), counting its batches."""

    def __call__(self, features, return_tensors=None):
        COLLATED["batches"] += 1
        return super().__call__(features, return_tensors)


def _tokenize(tokenizer, rows: list[dict[str, str]], template: str) -> list[dict[str, list[int]]]:
    """The wrapper's prompt strategy: `template` formats the instruction; loss on the response only."""
    out = []
    for r in rows:
        prompt = tokenizer(template.format(**r), add_special_tokens=False)["input_ids"]
        answer = tokenizer(r["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        out.append({"input_ids": prompt + answer, "labels": [-100] * len(prompt) + answer,
                    "attention_mask": [1] * (len(prompt) + len(answer))})
    return out


def build_trainer(config_yaml: str, rows: list[dict[str, Any]], output_dir: str):
    """`config_yaml` is the wrapper's own nested config; toolkit sees only trainer configs and token ids."""
    cfg = yaml.safe_load(config_yaml)
    tokenizer = tiny_tokenizer()
    model = tiny_model(seed=cfg["base_model"]["seed"])
    train = cfg["training"]
    common = dict(output_dir=output_dir, learning_rate=train["optimizer"]["lr"], max_steps=train["max_steps"],
                  per_device_train_batch_size=train["micro_batch_size"], report_to="none", save_strategy="no",
                  disable_tqdm=True, logging_steps=1, seed=train.get("seed", 0))
    if cfg["rl"] is None:
        data = _tokenize(tokenizer, rows, cfg["datasets"][0]["prompt_template"])
        return SFTTrainer(model, SFTConfig(**common), train_dataset=data, processing_class=tokenizer,
                          data_collator=WrapperCollator(tokenizer, label_pad_token_id=-100))
    rl = cfg["rl"]
    return GRPOTrainer(model, rl["rewards"], GRPOConfig(num_generations=rl["num_generations"],
                                                        max_completion_length=rl["max_new_tokens"], **common),
                       train_dataset=[{"prompt": cfg["datasets"][0]["prompt_template"].format(**r), **r} for r in rows],
                       processing_class=tokenizer)
