"""Run by tests/test_multiprocess.py under torchrun: one SGD step of SFT, parameters saved by rank 0."""

import json
import sys

import torch

from toolkit import SFTConfig, SFTTrainer
from toolkit.testing import tiny_model, tiny_tokenizer


def rows():
    short = [{"prompt": f"What is {i} + {i + 1}? ", "completion": str(2 * i + 1)} for i in range(4)]
    long = [{"prompt": "Say a long thing: ", "completion": "The quick brown fox jumps " * (i + 1)} for i in range(4)]
    return short + long


def main(out_dir: str, per_device: int) -> None:
    torch.set_num_threads(1)
    cfg = SFTConfig(output_dir=out_dir, max_steps=1, per_device_train_batch_size=per_device, optim="sgd",
                    learning_rate=1.0, max_grad_norm=0.0, lr_scheduler_type="constant", weight_decay=0.0,
                    logging_steps=1, save_strategy="no", seed=0, disable_tqdm=True, report_to="none")
    trainer = SFTTrainer(tiny_model(), cfg, train_dataset=rows(), processing_class=tiny_tokenizer())
    trainer.train()
    if trainer.is_world_process_zero():
        torch.save({k: v.detach().clone() for k, v in trainer.model.named_parameters()}, f"{out_dir}/params.pt")
        loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][0]
        with open(f"{out_dir}/result.json", "w") as f:
            json.dump({"loss": loss, "world_size": trainer.args.world_size}, f)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
