"""Benchmark: multi-turn episodes per second when the environment waits (tools, sandboxes, judges).

    python bench/agent_rollouts.py                 # about 3 minutes on 2 CPU cores
    python bench/agent_rollouts.py --prompts 8     # 8 prompts x 8 episodes per round

The embedded SmolLM2-135M-Instruct plays the calculator environment (examples/grpo_tools.toml: the system prompt,
the `calc` tool, up to 3 turns), with every environment step taking a uniformly drawn 0.2-1.0 s (a latency-bound
tool, as a sandbox or a remote judge is; the draw is seeded, so both rows wait the same). One round is what a GRPO
step generates: `--prompts` prompts x 8 episodes, through `toolkit.core.environments.run_episodes`, the function
GRPOTrainer calls. Rows:

- `sequential`: environment_concurrency = 1: each episode's step waits for the previous one's.
- `concurrent`: environment_concurrency = 32 (the default): the steps of one turn wait together on threads.

Both rows sample the same ids (generation is seeded per turn and the environment is deterministic), so their
success rates are equal by construction; the table shows them. What this does NOT measure: async GRPO (rollouts
overlapping training in a worker process) on episodes, which is not built yet (docs/agents.md).
Writes bench/results/agent_rollouts.{json,txt}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import provenance  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency", type=float, nargs=2, default=(0.2, 1.0))
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.core.environments import TemplateDelta, ToolEnvironment, calculator_environment, run_episodes
    from toolkit.core.generation import SamplingParams, TransformersBackend
    from toolkit.core.models import embedded_model_path
    from toolkit.core.tasks import task_rows

    torch.manual_seed(0)
    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(max_tokens=40, temperature=1.0, stop_token_ids=(stop,))
    rows = task_rows("calculator", args.prompts * args.rounds, max_value=99, kind="prompt_only")
    lo, hi = args.latency

    class Slow(ToolEnvironment):
        """The calculator environment, each step waiting a seeded 0.2-1.0 s first."""

        lock = threading.Lock()
        draws = random.Random(0)

        def step(self, text):
            time.sleep(self.delay)
            return super().step(text)

        def reset(self, row):
            with self.lock:
                self.delay = self.draws.uniform(lo, hi)
            return super().reset(row)

    def make() -> ToolEnvironment:
        base = calculator_environment(max_tool_turns=2)
        return Slow(base.toolbox, base.reward_fn, fmt=base.fmt, system_prompt=base.system_prompt,
                    max_tool_turns=base.max_tool_turns)

    delta = TemplateDelta(tok, end_text="<|im_end|>")
    results = {}
    for name, concurrency in (("sequential", 1), ("concurrent", 32)):
        Slow.draws = random.Random(0)
        episodes, started, waited = [], time.perf_counter(), 0.0
        for r in range(args.rounds):
            batch = [row for row in rows[r * args.prompts:(r + 1) * args.prompts] for _ in range(args.generations)]
            turn = [0]

            def sample(contexts):
                turn[0] += 1
                return [g[0] for g in backend.generate(contexts, params, n=1, seed=1000 * r + turn[0])]

            envs = [make() for _ in batch]
            done = run_episodes(envs, batch, sample, delta, max_turns=3, max_tokens=160, concurrency=concurrency)
            waited += sum(e.delay * len(ep.turns) for e, ep in zip(envs, done))
            episodes += done
        seconds = time.perf_counter() - started
        success = sum((ep.reward or 0.0) >= 1.0 for ep in episodes) / len(episodes)
        results[name] = {"episodes": len(episodes), "seconds": round(seconds, 2),
                         "episodes_per_s": round(len(episodes) / seconds, 3), "success": round(success, 4),
                         "environment_wait_s": round(waited, 1),
                         "turns_mean": round(sum(len(ep.turns) for ep in episodes) / len(episodes), 3),
                         "ids": [ep.ids for ep in episodes]}
        print(f"{name}: {results[name]['episodes_per_s']} episodes/s ({seconds:.1f} s, success {success:.3f})",
              flush=True)
    same = results["sequential"].pop("ids") == results["concurrent"].pop("ids")
    ratio = results["concurrent"]["episodes_per_s"] / results["sequential"]["episodes_per_s"]
    out = {"settings": vars(args) | {"latency": list(args.latency), "model": "smollm2-135m-instruct",
                                     "environment": "calculator (each step waits the latency first)"},
           "results": results, "concurrent_over_sequential": round(ratio, 3), "same_episodes": same,
           "provenance": provenance()}
    lines = [f"# bench/agent_rollouts.py at {out['provenance']['commit'][:10]} ({out['provenance']['date']}, "
             f"{out['provenance']['cpu_cores']} cores): {args.prompts} prompts x {args.generations} episodes x "
             f"{args.rounds} rounds, environment steps waiting {lo}-{hi} s",
             "| row | episodes/s | seconds | success | turns/episode | environment wait (s, summed) |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['episodes_per_s']} | {r['seconds']} | {r['success']} | {r['turns_mean']} | "
                     f"{r['environment_wait_s']} |")
    lines.append(f"concurrent / sequential: {ratio:.2f}x; the same episodes (ids) in both rows: {same}")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "agent_rollouts.json"), "w") as f:
        json.dump(out, f, indent=1)
    with open(os.path.join(ROOT, "bench", "results", "agent_rollouts.txt"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
