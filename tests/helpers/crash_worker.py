"""Run by tests/integration/test_crash_resume.py: train a tiny model with a checkpoint every step (save_total_limit=1),
resuming from the newest complete checkpoint if there is one, then write the per-step training losses to a
JSON file. The test kills runs (SIGKILL) at named points of a checkpoint write.

    python tests/helpers/crash_worker.py <sft|dpo|grpo|ppo> <output_dir> <losses.json>   # one run
    python tests/helpers/crash_worker.py serve                                           # many runs, see serve()

Importing transformers costs ~12 s on the CI machines, so `serve` imports once and forks one child process
per run (a real process: SIGKILL ends it exactly as it would end a training run).
"""

import json
import os
import sys
import traceback

import torch

from toolkit import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, PPOConfig, PPOTrainer, SFTConfig, SFTTrainer
from toolkit.core.checkpoint import latest_complete_checkpoint
from toolkit.testing import tiny_model, tiny_tokenizer

STEPS = 4


def reward(prompts, completions, completion_ids, **kw):
    return [float(sum(ids) % 4) for ids in completion_ids]


def build(kind: str, out: str):
    common = dict(output_dir=out, max_steps=STEPS, save_strategy="steps", save_steps=1, save_total_limit=1, seed=0,
                  logging_steps=1, report_to="none", disable_tqdm=True)
    tok = tiny_tokenizer()
    if kind == "sft":
        rows = [{"prompt": f"What is {i} + {i + 1}? ", "completion": str(2 * i + 1)} for i in range(16)]
        return SFTTrainer(tiny_model(), SFTConfig(per_device_train_batch_size=4, learning_rate=1e-3, **common),
                          train_dataset=rows, processing_class=tok)
    if kind == "dpo":
        rows = [{"prompt": f"Q{i}?", "chosen": f" yes {i}", "rejected": f" no {i} no"} for i in range(16)]
        return DPOTrainer(tiny_model(), args=DPOConfig(per_device_train_batch_size=4, learning_rate=1e-3, **common),
                          train_dataset=rows, processing_class=tok)
    prompts = [{"prompt": f"Count {i}"} for i in range(16)]
    if kind == "grpo":
        return GRPOTrainer(tiny_model(), reward, GRPOConfig(per_device_train_batch_size=8, num_generations=4,
                                                            max_completion_length=6, learning_rate=1e-3, **common),
                           train_dataset=prompts, processing_class=tok)
    if kind == "ppo":
        return PPOTrainer(tiny_model(), reward, PPOConfig(per_device_train_batch_size=4, max_completion_length=6,
                                                          num_ppo_epochs=1, learning_rate=1e-3, **common),
                          train_dataset=prompts, processing_class=tok)
    raise SystemExit(f"unknown trainer {kind}")


def main(kind: str, out: str, losses_path: str) -> None:
    torch.set_num_threads(1)
    trainer = build(kind, out)
    trainer.train(resume_from_checkpoint=True if latest_complete_checkpoint(out) else None)
    losses = {int(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h and "step" in h}
    with open(losses_path, "w") as f:
        json.dump(losses, f)


def serve() -> None:
    """Read one JSON request per stdin line ({"kind", "out", "losses", "fault"}); for each, fork a run and answer
    {"pid": ...} at once, then {"status": exit code, or -signal} when it ends."""
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the run; its prints go to stderr, stdout carries the protocol
            os.dup2(2, 1)
            sys.stdout = sys.stderr
            try:
                os.environ.pop("TOOLKIT_FAULT_AT", None)
                if req.get("fault"):
                    os.environ["TOOLKIT_FAULT_AT"] = req["fault"]
                main(req["kind"], req["out"], req["losses"])
                code = 0
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print(json.dumps({"status": code}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        main(*sys.argv[1:4])
