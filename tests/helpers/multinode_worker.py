"""Run by tests/integration/test_multinode.py: SFT with a checkpoint every step into one output folder, alone or as
one rank of a `torchrun --nnodes 2` run (two agents on this machine, rendezvous on loopback).

8 examples per optimizer step (1 process x 8 or 2 nodes x 1 process x 4), SGD without clipping, so a difference
in how ranks share the batch or the loss's token count shows in the weights. Each rank writes what it saw of its
place (global rank, node rank, local rank; world/local process zero) to rank<k>.json; global rank 0 writes the
parameters.
"""

import json
import os
import sys
from pathlib import Path

import torch
from builders import conv_pc

from toolkit import SFTConfig, SFTTrainer
from toolkit.core.distributed import exit_process, leave_process_group
from toolkit.testing import tiny_model, tiny_tokenizer


def main(out: str, world: int, max_steps: int, resume: bool) -> None:
    torch.set_num_threads(1)
    cfg = SFTConfig(output_dir=out, max_steps=max_steps, per_device_train_batch_size=8 // world, optim="sgd",
                    learning_rate=0.5, max_grad_norm=0.0, lr_scheduler_type="constant", weight_decay=0.0,
                    logging_steps=1, save_strategy="steps", save_steps=1, seed=0, disable_tqdm=True, report_to="none")
    trainer = SFTTrainer(tiny_model(), cfg, train_dataset=conv_pc(32), processing_class=tiny_tokenizer())
    trainer.train(resume_from_checkpoint=True if resume else None)
    rank = int(os.environ.get("RANK", 0))
    info = {"rank": rank, "node_rank": int(os.environ.get("GROUP_RANK", 0)),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "world_size": trainer.args.world_size,
            "world_zero": trainer.is_world_process_zero(), "local_zero": trainer.is_local_process_zero(),
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    Path(out, f"rank{rank}.json").write_text(json.dumps(info))
    if trainer.is_world_process_zero():
        torch.save({k: v.detach().clone() for k, v in trainer.model.named_parameters()}, Path(out) / "params.pt")


if __name__ == "__main__":
    try:
        main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "resume")
    except BaseException:
        leave_process_group()
        raise
    exit_process(0)
