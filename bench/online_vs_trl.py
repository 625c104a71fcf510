"""Benchmark: the experimental trainers that sample (online DPO, GKD) against TRL's, on the embedded
SmolLM2-135M-Instruct, one run.

    python bench/online_vs_trl.py                # about 10 minutes on 2 CPU cores
    python bench/online_vs_trl.py --steps 3      # quicker, noisier

Rows:
- online DPO: toolkit.experimental.online_dpo.OnlineDPOTrainer against trl.experimental.online_dpo
  .OnlineDPOTrainer; 8 prompts x 2 completions per step, sigmoid loss, beta 0.1, a frozen reference copy on
  both sides, the same reward function (numeric match on the answer), transformers generation on both sides.
  Equal work: ours keeps tied pairs in the loss (zero_variance_filter=False, TRL's behaviour: the first
  completion is "chosen"), so both sides train every pair; ours by default leaves ties out.
- GKD: toolkit.experimental.gkd.GKDTrainer against trl.experimental.gkd.GKDTrainer; 8 prompts x 1 sample per
  step, lmbda 1 (every step on-policy), beta 0.5; the teacher is a second copy of the same model (what is
  measured is the cost of a step, not what is learnt).

Same generated +/- prompts (chat format), max 32 new tokens, temperature 0.9, optimizer and learning rate; TRL at
its defaults otherwise, activation checkpointing included: TRL's configs turn it on, ours leave it off for
micro-batches this short (recomputing costs more time than it saves memory here); the table says which side
recomputed. The sampled completions differ between the two sides (different samplers), so each
row also records the completion tokens each side generated per step: a step that sampled fewer tokens is
cheaper for that reason alone. Each trainer runs in its own process (peak RSS is per process). Printed:
seconds per step over the steps after the first, peak RSS, tokens generated per step, and ours/TRL.
"""

from __future__ import annotations

import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_args, run_each, step_timer  # noqa: E402

SETTINGS = dict(prompts_per_step=8, max_new_tokens=32, temperature=0.9, lr=1e-6, rows=128)
KINDS = ("online_dpo-toolkit", "online_dpo-trl", "gkd-toolkit", "gkd-trl")


def _count_tokens(end_id: int):
    """A reward function counting the completion tokens it sees, the end token and padding (the same id on this
    model) left out on both sides; numeric match is the reward it returns."""
    from toolkit.core.rewards import numeric_match

    seen = []

    def numeric_match_counted(prompts, completions, completion_ids, **kw):
        seen.append(sum(len([t for t in ids if t != end_id]) for ids in completion_ids))
        return numeric_match(prompts, completions, completion_ids, **kw)

    return numeric_match_counted, seen


def worker(kind: str, steps: int) -> dict:
    import torch

    os.environ.setdefault("TOOLKIT_EXPERIMENTAL_SILENCE", "1")
    from toolkit import embedded_model_path
    from toolkit.core.tasks import arithmetic

    torch.manual_seed(0)
    path = str(embedded_model_path())
    s = SETTINGS
    rows = arithmetic(s["rows"], seed=0, max_value=20, max_terms=2, kind="prompt_completion")
    common = dict(output_dir=f"/tmp/bench-online-{kind}", max_steps=steps, learning_rate=s["lr"], logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, disable_tqdm=True, optim="adamw_torch_fused",
                  temperature=s["temperature"])
    timer = step_timer()
    from transformers import AutoTokenizer

    end_id = AutoTokenizer.from_pretrained(path).eos_token_id
    reward, seen = _count_tokens(end_id)
    generated: list[int] = []
    if kind == "online_dpo-toolkit":
        from toolkit.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        trainer = OnlineDPOTrainer(path, [reward], OnlineDPOConfig(
            **common, per_device_train_batch_size=2 * s["prompts_per_step"], num_generations=2, beta=0.1,
            max_completion_length=s["max_new_tokens"], zero_variance_filter=False), train_dataset=[{"prompt": r["prompt"], "answer": r["answer"]}
                                                                       for r in rows], callbacks=[timer])
    elif kind == "gkd-toolkit":
        from toolkit.experimental.gkd import GKDConfig, GKDTrainer

        trainer = GKDTrainer(path, teacher_model=path, args=GKDConfig(
            **common, per_device_train_batch_size=s["prompts_per_step"], num_generations=1, lmbda=1.0, beta=0.5,
            max_completion_length=s["max_new_tokens"]), reward_funcs=[reward], train_dataset=rows,
            callbacks=[timer])
    else:
        from datasets import Dataset
        from transformers import AutoModelForCausalLM

        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if kind == "online_dpo-trl":
            from trl.experimental.online_dpo import OnlineDPOConfig as TRLConfig
            from trl.experimental.online_dpo import OnlineDPOTrainer as TRLTrainer

            trainer = TRLTrainer(model=model, reward_funcs=[reward], args=TRLConfig(
                **common, per_device_train_batch_size=s["prompts_per_step"], beta=0.1, max_new_tokens=s["max_new_tokens"],
                use_cpu=True, bf16=False), train_dataset=Dataset.from_list(
                    [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]),
                processing_class=tok, callbacks=[timer])
        else:
            from trl.experimental.gkd import GKDConfig as TRLConfig
            from trl.experimental.gkd import GKDTrainer as TRLTrainer

            teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            messages = [{"messages": r["prompt"] + r["completion"]} for r in rows]
            trainer = TRLTrainer(model=model, teacher_model=teacher, args=TRLConfig(
                **common, per_device_train_batch_size=s["prompts_per_step"], lmbda=1.0, beta=0.5,
                max_new_tokens=s["max_new_tokens"], use_cpu=True, bf16=False),
                train_dataset=Dataset.from_list(messages), processing_class=tok, callbacks=[timer])
            original = trainer.generate_on_policy_outputs

            def counted(model, inputs, generation_config):
                out = original(model, inputs, generation_config)
                labels = out[2]  # the completion tokens of the step, the end token left out as on our side
                generated.append(int(((labels != -100) & (labels != end_id)).sum()))
                return out

            trainer.generate_on_policy_outputs = counted
    trainer.train()
    if kind != "gkd-trl":
        generated = seen
    ends = timer.ends
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    a = trainer.args
    checkpointing = bool(getattr(a, "activation_checkpointing", None) or getattr(a, "gradient_checkpointing", None))
    return {"kind": kind, "activation_checkpointing": checkpointing, "sec_per_step": (ends[-1] - ends[0]) / max(len(ends) - 1, 1),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "first_loss": losses[0],
            "generated_tokens_per_step": sum(generated[1:]) / max(len(generated) - 1, 1) if generated else None}


def main() -> None:
    import subprocess

    args = bench_args(__doc__, worker, default_steps=4)
    results = run_each(__file__, KINDS, args.steps,
                       lambda r: f"{r['sec_per_step']:.1f} s/step, peak RSS {r['peak_rss_mb']:.0f} MB, "
                                 f"generated {r['generated_tokens_per_step']} tokens/step, "
                                 f"first loss {r['first_loss']:.4f}")
    s = SETTINGS
    print(f"\nSmolLM2-135M-Instruct, {s['prompts_per_step']} prompts per step, up to {s['max_new_tokens']} new tokens, "
          f"{args.steps} steps (first excluded from timing and token counts)")
    print("| trainer | ours s/step | TRL s/step | speed ratio (ours/TRL) | ours peak RSS MB | TRL peak RSS MB | "
          "memory ratio (ours/TRL) | generated tokens/step ours | TRL | activation checkpointing ours | TRL |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("online_dpo", "gkd"):
        o, t = results[f"{name}-toolkit"], results[f"{name}-trl"]
        print(f"| {name} | {o['sec_per_step']:.1f} | {t['sec_per_step']:.1f} | "
              f"{o['sec_per_step'] / t['sec_per_step']:.2f} | {o['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | "
              f"{o['peak_rss_mb'] / t['peak_rss_mb']:.2f} | {o['generated_tokens_per_step']} | "
              f"{t['generated_tokens_per_step']} | {o.get('activation_checkpointing')} | "
              f"{t.get('activation_checkpointing')} |")
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "settings": s, "steps": args.steps, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
