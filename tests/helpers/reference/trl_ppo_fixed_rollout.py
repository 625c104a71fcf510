"""Run TRL 1.8's experimental PPOTrainer for one update on a *fixed* rollout and print its metrics as JSON.

Usage (needs TRL 1.8 on PYTHONPATH, e.g. the copy scripts/setup.sh puts in .venv/trl-1.8.0):
    python trl_ppo_fixed_rollout.py WORKDIR
WORKDIR holds policy/, value/, reward/ (saved models), the tokenizer in policy/, and spec.json with
prompts, responses and settings. Generation is replaced by the fixed responses (TRL's own
`batch_generation` is swapped for one that returns them, logits from a policy forward); everything
after generation (log-probs, reference, values, scores, KL reward, GAE, whitening, epochs and
losses) is TRL's code. Reference-only: toolkit never imports this.
"""

import json
import sys
from pathlib import Path

import torch

work = Path(sys.argv[1])
spec = json.loads((work / "spec.json").read_text())

import trl  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

assert trl.__version__ == "1.8.0", trl.__version__
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: E402
from trl.experimental.ppo import ppo_trainer as ppo_module  # noqa: E402

responses = {tuple(p): r for p, r in zip(spec["prompts"], spec["responses"])}


def fixed_generation(model, queries, local_rollout_forward_batch_size, pad_token_id, generation_config):
    rows = [responses[tuple(q.tolist())] for q in queries]
    query_responses = torch.cat([queries, torch.tensor(rows)], 1)
    with torch.no_grad():
        logits = model(input_ids=query_responses).logits[:, queries.shape[1] - 1:-1]
    return query_responses, logits / (generation_config.temperature + 1e-7)


ppo_module.batch_generation = fixed_generation

tok = AutoTokenizer.from_pretrained(work / "policy")
f32 = {"dtype": torch.float32}
policy = AutoModelForCausalLM.from_pretrained(work / "policy", **f32)
ref = AutoModelForCausalLM.from_pretrained(work / "ref", **f32)
value = AutoModelForSequenceClassification.from_pretrained(work / "value", num_labels=1, **f32)
reward = AutoModelForSequenceClassification.from_pretrained(work / "reward", num_labels=1, **f32)
s = spec["settings"]
args = PPOConfig(
    output_dir=str(work / "trl-out"), per_device_train_batch_size=len(spec["prompts"]), gradient_accumulation_steps=1,
    num_mini_batches=1, num_ppo_epochs=s["num_ppo_epochs"], total_episodes=len(spec["prompts"]),
    response_length=len(spec["responses"][0]), temperature=1.0, kl_coef=s["kl_coef"], kl_estimator=s["kl_estimator"],
    cliprange=s["cliprange"], cliprange_value=s["cliprange_value"], vf_coef=s["vf_coef"], gamma=s["gamma"],
    lam=s["lam"], learning_rate=s["learning_rate"], lr_scheduler_type="constant", optim="adamw_torch",
    stop_token=None, missing_eos_penalty=None, num_sample_generations=0,
    local_rollout_forward_batch_size=len(spec["prompts"]), use_cpu=True, bf16=False, report_to="none",
    save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True)
trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                     value_model=value, train_dataset=Dataset.from_list([{"input_ids": p} for p in spec["prompts"]]))
trainer.train()
logged = [h for h in trainer.state.log_history if "loss/policy_avg" in h][0]
print("TRL_METRICS " + json.dumps(logged))
