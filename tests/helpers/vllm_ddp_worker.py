"""Run by tests/integration/test_vllm.py under torchrun: one GRPO trainer rank on the embedded model, generating through a
shared `toolkit vllm-serve` (URL and token from the environment). Each rank writes what it saw."""

import json
import sys
from pathlib import Path

import torch

from toolkit import GRPOConfig, GRPOTrainer, embedded_model_path
from toolkit.core.distributed import exit_process
from toolkit.core.tasks import arithmetic


def varied(completions, completion_ids, **kw):
    """Rewards that differ within every group (numeric match is mostly 0 for 8 tokens), so each step has a
    gradient and the weights change between steps."""
    return [float(sum(ids) % 5) for ids in completion_ids]


def main(out_dir: str, url: str) -> None:
    torch.set_num_threads(1)
    rows = arithmetic(16, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    cfg = GRPOConfig(output_dir=out_dir, max_steps=2, per_device_train_batch_size=8, num_generations=4,
                     max_completion_length=8, temperature=0.7, learning_rate=1e-3, save_strategy="no",
                     report_to="none", disable_tqdm=True, generation_backend="vllm-server",
                     generation_backend_kwargs={"url": url, "startup_timeout": 120})
    trainer = GRPOTrainer(str(embedded_model_path()), [varied], cfg, train_dataset=rows)
    trainer.train()
    rank = trainer.accelerator.process_index
    logs = [h for h in trainer.state.log_history if "loss" in h]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "world_size": trainer.accelerator.num_processes, "weights_version": trainer.generation_backend.weights_version,
        "steps": len(logs), "logp_diff": [h["sampler/logp_abs_diff_mean"] for h in logs],
        "loss": [h["loss"] for h in logs]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)  # not the interpreter's teardown, where a rank can abort after finishing (see exit_process)
