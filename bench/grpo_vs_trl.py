"""Benchmark: our GRPOTrainer against TRL's GRPOTrainer (its default transformers generation), at equal work.

    python bench/grpo_vs_trl.py                  # 3 repetitions, about 18 minutes on 2 CPU cores
    python bench/grpo_vs_trl.py --repeats 5      # more repetitions
    python bench/grpo_vs_trl.py --steps 6        # more steps per run, less noise

Equal work: both sides put every completion of every step through forward and backward. Ours by default leaves
groups whose rewards all tie out of forward and backward (`zero_variance_filter`, same loss and gradients) and
skips the optimizer step of a round with no row in the loss (`skip_steps_without_signal`); TRL trains every row
and always steps. Every `toolkit*` run here turns both off; the rows each side trained per step are in the results.
The defaults' effect is its own row, `toolkit-filters-on` (ours as shipped), never the headline.

Activation checkpointing is each side's default in the headline: TRL's GRPOConfig turns it on
(gradient_checkpointing=True, the forward computed again in backward to hold fewer activations); ours leaves it off
for micro-batches this short, where recomputing costs more time than it saves memory (see
`models.apply_cpu_training_defaults` and GRPOConfig). That is a setting trading time for memory, not rows trained, so it stays at each
side's default; `toolkit-checkpointing` is ours at equal work *with* checkpointing on, TRL's setting, so the
comparison at the same setting is in the table too.

Repetitions: the kinds run in turn (A B C ... A B C ...), each run in its own process; the tables give the median
over repetitions with the min-max range, and the ratio ours/TRL per repetition (paired runs, one after the other,
so a drift of the machine's speed hits both sides of a pair alike).

Same model (the embedded SmolLM2-135M-Instruct), same prompts (generated arithmetic, conversational),
same num_generations (8), prompts per step (4), max completion length (16), temperature (0.7),
learning rate, loss (dapo), no KL, same reward (numeric match). Each trainer runs in its own process
(peak RSS is per process). Printed: seconds per step over the steps after the first, the split
into generation and training where the trainer reports it, peak RSS, the tokens each side generated
(completions/mean_length x completions, summed over every step; both trainers log it), and the ratios.

A third run, `toolkit-bf16-generation`, is ours with `generation_backend_kwargs={"dtype": "bfloat16"}`: the
same training in float32, decoding on a bfloat16 copy of the weights (a decode step streams every weight, and
this is where our step's time goes). It is not the same numerics as TRL's float32 generation, which has no such
setting on its transformers path, so it is its own row, with the sampler-trainer log-prob gap it brings (the
gap the sampler correction, importance_sampling_cap 2, corrects). It pays only where the CPU computes bfloat16
natively (AMX / AVX-512 BF16); the row prints the CPU flags.

Two more runs put both sides in bfloat16 mixed precision, which is TRL's own default (`bf16=True` unless fp16 is
set; the first two runs set bf16=False on TRL so that both train in float32): `trl-bf16` is TRL with bf16=True,
`toolkit-bf16` ours with bf16=True (autocast over the forward, float32 weights and optimizer) and the bfloat16
generation copy. Both pass `use_cpu=True`, which transformers asks for before it allows bf16 on a CPU.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench_args, provenance, run_each, step_timer  # noqa: E402

SETTINGS = dict(prompts_per_step=4, num_generations=8, max_completion_length=16, temperature=0.7, lr=1e-5)
# every completion through forward and backward, every optimizer step taken: what TRL does (see the docstring)
EQUAL_WORK = dict(zero_variance_filter=False, skip_steps_without_signal=False)
KINDS = ("toolkit", "trl", "toolkit-checkpointing", "toolkit-filters-on", "toolkit-bf16-generation", "toolkit-bf16", "trl-bf16")


def worker(kind: str, steps: int) -> dict:
    import torch

    from toolkit import embedded_model_path
    from toolkit.core.rewards import numeric_match
    from toolkit.core.tasks import arithmetic

    torch.manual_seed(0)
    path = str(embedded_model_path())
    rows = arithmetic(64, seed=0, max_value=20, max_terms=2, kind="prompt_only")
    s = SETTINGS
    common = dict(output_dir=f"/tmp/bench-grpo-{kind}", max_steps=steps, learning_rate=s["lr"], logging_steps=1,
                  save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
                  per_device_train_batch_size=s["prompts_per_step"] * s["num_generations"],
                  num_generations=s["num_generations"], max_completion_length=s["max_completion_length"],
                  temperature=s["temperature"], beta=0.0, loss_type="dapo")
    timer = step_timer()
    if kind.startswith("toolkit"):
        from toolkit import GRPOConfig, GRPOTrainer

        extra = ({"generation_backend_kwargs": {"dtype": "bfloat16"}}
                 if kind in ("toolkit-bf16-generation", "toolkit-bf16") else {})
        if kind != "toolkit-filters-on":
            extra.update(EQUAL_WORK)
        if kind == "toolkit-bf16":
            extra.update(bf16=True, use_cpu=True)
        if kind == "toolkit-checkpointing":
            extra.update(gradient_checkpointing=True)  # TRL's GRPOConfig default
        trainer = GRPOTrainer(path, [numeric_match], GRPOConfig(**common, **extra), train_dataset=rows,
                              callbacks=[timer])
    else:
        from datasets import Dataset
        from trl import GRPOConfig as TRLConfig
        from trl import GRPOTrainer as TRLTrainer

        def reward(prompts, completions, completion_ids=None, **kw):  # TRL passes extra kwargs
            return numeric_match(prompts, completions, completion_ids, answer=kw["answer"])

        trainer = TRLTrainer(model=path, reward_funcs=reward, processing_class=None,
                             args=TRLConfig(**common, use_cpu=True, bf16=kind == "trl-bf16",
                                            model_init_kwargs={"dtype": torch.float32}),
                             train_dataset=Dataset.from_list(rows), callbacks=[timer])
    trainer.train()
    ends = timer.ends
    per_step = (ends[-1] - ends[0]) / max(len(ends) - 1, 1)
    hist = [h for h in trainer.state.log_history if "loss" in h][1:]
    gen = [h.get("time/generation_s") for h in hist if h.get("time/generation_s") is not None]
    train = [h.get("time/train_s") for h in hist if h.get("time/train_s") is not None]
    gen_tps = [h.get("generation_tokens_per_s") for h in hist if h.get("generation_tokens_per_s") is not None]
    completions_per_step = s["prompts_per_step"] * s["num_generations"]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    rewards = [h.get("reward") for h in hist if h.get("reward") is not None]
    # completions through forward and backward per step: ours logs the share in the loss (the rows it trains);
    # TRL trains every completion of the step
    frac = [h["frac_rows_in_loss"] for h in hist if "frac_rows_in_loss" in h]
    completions = s["prompts_per_step"] * s["num_generations"]
    rows_trained = sum(frac) / len(frac) * completions if kind.startswith("toolkit") and frac else float(completions)
    gaps = [h["sampler/logp_abs_diff_mean"] for h in hist if "sampler/logp_abs_diff_mean" in h]
    return {"kind": kind, "sec_per_step": per_step, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "generation_s_per_step": sum(gen) / len(gen) if gen else None,
            "mean_reward": sum(rewards) / len(rewards) if rewards else None,
            "train_s_per_step": sum(train) / len(train) if train else None,
            "generation_tokens_per_s": sum(gen_tps) / len(gen_tps) if gen_tps else None,
            "generated_tokens": round(sum(lengths) * completions_per_step), "steps_with_lengths": len(lengths),
            # ours leaves out the optimizer step of a round with no row in the loss (skip_steps_without_signal, on
            # by default); TRL runs it on zero gradients. Counted over the timed steps, so equal work is visible.
            "steps_without_signal_skipped": sum(1 for h in hist if h.get("update_skipped")),
            "rows_trained_per_step": rows_trained, "completions_per_step": completions,
            "sampler_logp_gap_mean": sum(gaps) / len(gaps) if gaps else None}


def _summary(runs: list[dict]) -> dict:
    """The median run's numbers (by s/step) and each figure's range over the repetitions."""
    ordered = sorted(runs, key=lambda r: r["sec_per_step"])
    out = dict(ordered[len(ordered) // 2])
    for key in ("sec_per_step", "peak_rss_mb", "generation_s_per_step", "train_s_per_step"):
        values = sorted(r[key] for r in runs if r.get(key) is not None)
        if values:
            out[key] = statistics.median(values)
            out[f"{key}_range"] = [values[0], values[-1]]
    out["repetitions"] = len(runs)
    return out


def _ratios(ours: list[dict], theirs: list[dict], key: str) -> dict:
    """ours/TRL per repetition (paired): median, min, max."""
    values = sorted(o[key] / t[key] for o, t in zip(ours, theirs))
    return {"median": statistics.median(values), "min": values[0], "max": values[-1], "each": values}


def _table(title: str, o: dict, t: dict, speed: dict, memory: dict, steps: int, extra: list[str]) -> None:
    print(f"\n{title}")
    print("| | ours | TRL | ratio ours/TRL: median (min-max over paired runs) |")
    print("|---|---|---|---|")
    rng = lambda r, k, f: f"{f.format(r[k])} ({f.format(r[k + '_range'][0])}-{f.format(r[k + '_range'][1])})"  # noqa: E731
    print(f"| seconds per step | {rng(o, 'sec_per_step', '{:.1f}')} | {rng(t, 'sec_per_step', '{:.1f}')} | "
          f"{speed['median']:.2f} ({speed['min']:.2f}-{speed['max']:.2f}); speed-up {1 / speed['median']:.2f}x |")
    print(f"| peak RSS MB | {rng(o, 'peak_rss_mb', '{:.0f}')} | {rng(t, 'peak_rss_mb', '{:.0f}')} | "
          f"{memory['median']:.2f} ({memory['min']:.2f}-{memory['max']:.2f}) |")
    print(f"| completions trained per step (forward and backward) | {o['rows_trained_per_step']:.1f} of "
          f"{o['completions_per_step']} | {t['rows_trained_per_step']:.0f} of {t['completions_per_step']} | |")
    print(f"| generated tokens (all {steps} steps, median run) | {o['generated_tokens']} | {t['generated_tokens']} | "
          f"{o['generated_tokens'] / max(t['generated_tokens'], 1):.2f} |")
    for line in extra:
        print(line)


def main() -> None:
    repeats = 3
    if "--repeats" in sys.argv:  # (bench_args parses the arguments every bench script shares)
        i = sys.argv.index("--repeats")
        repeats = int(sys.argv[i + 1])
        del sys.argv[i:i + 2]
    args = bench_args(__doc__, worker, default_steps=4)
    runs: dict[str, list[dict]] = {k: [] for k in KINDS}
    for rep in range(repeats):
        print(f"--- repetition {rep + 1} of {repeats}", flush=True)
        for kind, result in run_each(__file__, KINDS, args.steps,
                                     lambda r: f"{r['sec_per_step']:.1f} s/step, peak RSS {r['peak_rss_mb']:.0f} MB, "
                                               f"{r['rows_trained_per_step']:.1f} completions trained/step").items():
            runs[kind].append(result)
    results = {k: _summary(v) for k, v in runs.items()}
    s = SETTINGS
    o, t = results["toolkit"], results["trl"]
    print(f"\nGRPO, SmolLM2-135M-Instruct, {s['prompts_per_step']} prompts x {s['num_generations']} completions per "
          f"step, max {s['max_completion_length']} new tokens, {args.steps} steps per run (first excluded from "
          f"timing), {repeats} repetitions; equal work (every completion trained, every step taken on both sides)")
    ratios = {}
    for ours, theirs in (("toolkit", "trl"), ("toolkit-checkpointing", "trl"), ("toolkit-filters-on", "trl"), ("toolkit-bf16-generation", "trl"),
                         ("toolkit-bf16", "trl-bf16")):
        ratios[ours] = {"speed": _ratios(runs[ours], runs[theirs], "sec_per_step"),
                        "memory": _ratios(runs[ours], runs[theirs], "peak_rss_mb"), "against": theirs}
    extra = []
    if o["generation_s_per_step"] is not None:
        extra += [f"| ours: generation s/step | {o['generation_s_per_step']:.1f} | | |",
                  f"| ours: training s/step | {o['train_s_per_step']:.1f} | | |"]
    _table("Equal work, both in float32 (the headline)", o, t, ratios["toolkit"]["speed"],
           ratios["toolkit"]["memory"], args.steps, extra)
    c = results["toolkit-checkpointing"]
    _table("Equal work with activation checkpointing on both sides (TRL's default; ours recomputes each layer's "
           "forward in backward too)", c, t, ratios["toolkit-checkpointing"]["speed"],
           ratios["toolkit-checkpointing"]["memory"], args.steps, [])
    f = results["toolkit-filters-on"]
    _table("Ours as shipped: tied groups left out of forward and backward, steps without signal skipped (not equal "
           "work: the filter's effect)", f, t, ratios["toolkit-filters-on"]["speed"],
           ratios["toolkit-filters-on"]["memory"], args.steps,
           [f"| timed steps whose update was skipped (no row in the loss), median run | "
            f"{f['steps_without_signal_skipped']} | - | |"])
    b = results["toolkit-bf16-generation"]
    flags = ", ".join(provenance().get("cpu_flags") or []) or "none of avx512f, avx512_bf16, amx_tile, avx2"
    _table(f"Ours generating on a bfloat16 copy (generation_backend_kwargs.dtype; training in float32; not TRL's "
           f"numerics, which has no such setting; CPU: {flags})", b, t, ratios["toolkit-bf16-generation"]["speed"],
           ratios["toolkit-bf16-generation"]["memory"], args.steps,
           [f"| ours: sampler-trainer log-prob gap, mean per token (float32 generation: "
            f"{o['sampler_logp_gap_mean']:.1e}) | {b['sampler_logp_gap_mean']:.1e} | | |"]
           if b.get("sampler_logp_gap_mean") is not None and o.get("sampler_logp_gap_mean") is not None else [])
    m, tb = results["toolkit-bf16"], results["trl-bf16"]
    _table("Both in bfloat16 mixed precision (bf16=True, TRL's default; ours also generating on its bfloat16 copy)",
           m, tb, ratios["toolkit-bf16"]["speed"], ratios["toolkit-bf16"]["memory"], args.steps, [])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"settings": s, "equal_work": EQUAL_WORK, "steps": args.steps, "repeats": repeats,
                       "results": results, "ratios": ratios, "runs": runs, "provenance": provenance()}, fh, indent=2)


if __name__ == "__main__":
    main()
