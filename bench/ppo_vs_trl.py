"""Benchmark: our PPOTrainer against TRL's experimental PPOTrainer (TRL 1.8, its last release with PPO), one run.

    python bench/ppo_vs_trl.py               # about 5 minutes on 2 CPU cores
    python bench/ppo_vs_trl.py --steps 4     # more updates, less noise

Same policy (the embedded SmolLM2-135M-Instruct), same reference (a frozen copy), same reward model
(SmolLM2's backbone with a one-output score head, as AutoModelForSequenceClassification loads it),
same prompts (generated arithmetic, chat template), 16 completions per update, 2 epochs x 2
mini-batches of 8, max 16 new tokens, temperature 0.7, stop at EOS, same learning rate and KL
coefficient. Each trainer runs in its own process (peak RSS is per process); TRL 1.8 is the private
copy scripts/setup.sh installs in .venv/trl-1.8.0 (on PYTHONPATH for its worker only). Each side
uses its defaults otherwise (activation checkpointing is off on both sides). Printed: seconds per
update over the updates after the first, peak RSS, generated tokens (all updates) and the ratios.

Rows: `toolkit` is our default (critic="head": a value head on the policy's hidden states, one backbone
forward and backward for both); `toolkit-separate` is the layout TRL runs (a separate critic backbone
initialised from the same checkpoint), so the speed-up at equal algorithm is shown too.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_args, provenance, run_each, step_timer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SETTINGS = dict(rollout=16, per_device=8, mini_batches=2, epochs=2, max_new_tokens=16, temperature=0.7, lr=1e-5,
                kl_coef=0.05)


def worker(kind: str, steps: int) -> dict:
    import torch

    from toolkit import embedded_model_path
    from toolkit.core.tasks import arithmetic

    torch.manual_seed(0)
    path = str(embedded_model_path())
    rows = arithmetic(64, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    s = SETTINGS
    timer = step_timer()
    generated: list[int] = []  # TRL: tokens per generate call (its sample completions are off)
    if kind.startswith("toolkit"):
        from toolkit import PPOConfig, PPOTrainer

        cfg = PPOConfig(output_dir="/tmp/bench-ppo-toolkit", max_steps=steps, per_device_train_batch_size=s["per_device"],
                        num_mini_batches=s["mini_batches"], num_ppo_epochs=s["epochs"],
                        max_completion_length=s["max_new_tokens"], temperature=s["temperature"], learning_rate=s["lr"],
                        beta=s["kl_coef"], save_strategy="no", report_to="none", disable_tqdm=True, seed=0)
        separate = {"value_model": path} if kind == "toolkit-separate" else {}  # else our default critic
        trainer = PPOTrainer(path, [], cfg, train_dataset=rows, reward_model=path, callbacks=[timer], **separate)
    else:
        import trl
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
        from trl.experimental.ppo import PPOConfig, PPOTrainer
        from trl.experimental.ppo import ppo_trainer as trl_ppo

        assert trl.__version__ == "1.8.0", trl.__version__
        # Count TRL's generated tokens where it cuts each response after its stop token (measurement only).
        cut = trl_ppo.truncate_response

        def counting_cut(stop_token_id, pad_token_id, responses):
            hit = responses == stop_token_id
            first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full_like(hit[:, 0], hit.shape[1], dtype=torch.long))
            generated.append(int(first.sum()))
            return cut(stop_token_id, pad_token_id, responses)

        trl_ppo.truncate_response = counting_cut
        tok = AutoTokenizer.from_pretrained(path, padding_side="left")
        f32 = {"dtype": torch.float32}
        ids = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False)
               for r in rows]
        ids = [i["input_ids"] if isinstance(i, dict) else list(i) for i in ids]
        # TRL 1.8's rollout is per_device_train_batch_size x gradient_accumulation_steps (num_mini_batches
        # splits it), so the same 16 completions in 2 mini-batches of 8 means per_device_train_batch_size=16.
        args = PPOConfig(output_dir="/tmp/bench-ppo-trl", per_device_train_batch_size=s["rollout"],
                         gradient_accumulation_steps=1, num_mini_batches=s["mini_batches"], num_ppo_epochs=s["epochs"],
                         total_episodes=s["rollout"] * steps, response_length=s["max_new_tokens"],
                         temperature=s["temperature"], learning_rate=s["lr"], kl_coef=s["kl_coef"], stop_token="eos",
                         num_sample_generations=0, local_rollout_forward_batch_size=s["rollout"], use_cpu=True,
                         bf16=False, report_to="none", save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True)
        trainer = PPOTrainer(args=args, processing_class=tok,
                             model=AutoModelForCausalLM.from_pretrained(path, **f32),
                             ref_model=AutoModelForCausalLM.from_pretrained(path, **f32),
                             reward_model=AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **f32),
                             value_model=AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **f32),
                             train_dataset=Dataset.from_list([{"input_ids": i} for i in ids]), callbacks=[timer])
    trainer.train()
    ends = timer.ends
    if kind.startswith("toolkit"):  # mean completion length (stop token included) x completions, per update
        generated = [round(h["completions/mean_length"] * s["rollout"]) for h in trainer.state.log_history
                     if "completions/mean_length" in h]
    import importlib

    side = "toolkit" if kind.startswith("toolkit") else "trl"
    return {"kind": kind, "version": importlib.import_module(side).__version__, "updates": len(ends), "sec_per_update": (ends[-1] - ends[0]) / max(len(ends) - 1, 1),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "generated_tokens": sum(generated), "critic": getattr(trainer, "critic_kind", "separate (value_model)")}


def main() -> None:
    args = bench_args(__doc__, worker, default_steps=3)
    trl18 = REPO / ".venv" / "trl-1.8.0"
    if not trl18.exists():
        raise SystemExit(f"{trl18} is missing: run scripts/setup.sh (it installs TRL 1.8 there as the PPO reference)")
    results = run_each(__file__, ("toolkit", "toolkit-separate", "trl"), args.steps,
                       lambda r: f"{r['sec_per_update']:.1f} s/update, peak RSS {r['peak_rss_mb']:.0f} MB, "
                                 f"{r['generated_tokens']} generated tokens",
                       # prepended, not replacing: run_all's tracer and the checkout stay on the path
                       env_for={"trl": {"PYTHONPATH": os.pathsep.join(p for p in (str(trl18), os.environ.get(
                           "PYTHONPATH")) if p), "TRL_EXPERIMENTAL_SILENCE": "1"}})
    t = results["trl"]
    s = SETTINGS
    print(f"\nPPO, SmolLM2-135M-Instruct policy and reward model; {s['rollout']} completions per update, "
          f"{s['epochs']} epochs x {s['mini_batches']} mini-batches, max {s['max_new_tokens']} new tokens, "
          f"{args.steps} updates (first excluded from timing); TRL 1.8 at its defaults (separate value model)")
    print("| ours | critic | s/update ours | TRL 1.8 | speed-up (TRL/ours) | peak RSS MB ours | TRL | memory ratio "
          "(ours/TRL) | generated tokens ours | TRL |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind in ("toolkit", "toolkit-separate"):
        o = results[kind]
        print(f"| {kind} | {o['critic']} | {o['sec_per_update']:.1f} | {t['sec_per_update']:.1f} | "
              f"{t['sec_per_update'] / o['sec_per_update']:.2f}x | {o['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | "
              f"{o['peak_rss_mb'] / t['peak_rss_mb']:.2f} | {o['generated_tokens']} | {t['generated_tokens']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": s, "updates": args.steps, "results": results, "provenance": provenance()}, f,
                      indent=2)


if __name__ == "__main__":
    main()
