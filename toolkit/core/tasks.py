"""Small tasks the project generates itself, so examples and tests need no download.

`arithmetic`: additions and subtractions of two or three numbers with a verifiable integer answer.
The same generator feeds the SFT main job (prompt-completion rows) and, later, RL (prompt-only
rows with an `answer` column). Splits are disjoint by construction (different seeds, and held-out
problems are removed from the training set).
"""

from __future__ import annotations

__all__ = [
    "PROMPT_SUFFIX",
    "arithmetic",
    "arithmetic_splits",
    "greedy_accuracy",
]

import random
from typing import Any

import torch

from .errors import ConfigError

PROMPT_SUFFIX = "Answer with just the number."


def _problem(rng: random.Random, max_value: int, max_terms: int) -> tuple[str, int]:
    n_terms = rng.randint(2, max_terms)
    terms = [rng.randint(1, max_value) for _ in range(n_terms)]
    ops = [rng.choice("+-") for _ in range(n_terms - 1)]
    expr, value = str(terms[0]), terms[0]
    for op, t in zip(ops, terms[1:]):
        expr += f" {op} {t}"
        value = value + t if op == "+" else value - t
    return expr, value


def arithmetic(n: int, *, seed: int = 0, max_value: int = 20, max_terms: int = 3, kind: str = "prompt_completion",
               exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """`n` conversational rows. kind="prompt_completion" adds the answer as the completion; "prompt_only"
    keeps it in an `answer` column for reward functions; "preference" pairs it (chosen) with a near miss."""
    if kind not in ("prompt_completion", "prompt_only", "preference"):
        raise ConfigError(f"kind must be 'prompt_completion', 'prompt_only' or 'preference', got {kind!r}")
    rng = random.Random(seed)
    rows, seen = [], set(exclude or ())
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n:
            raise ConfigError(f"dataset_size: cannot draw {n} distinct problems with task_max_value={max_value} and "
                              f"task_max_terms={max_terms} (about {len(seen)} exist outside the held-out set); "
                              "lower dataset_size or raise task_max_value.")
        expr, value = _problem(rng, max_value, max_terms)
        if expr in seen:
            continue
        seen.add(expr)
        prompt = [{"role": "user", "content": f"What is {expr}? {PROMPT_SUFFIX}"}]
        row: dict[str, Any] = {"prompt": prompt, "answer": str(value)}
        if kind == "prompt_completion":
            row["completion"] = [{"role": "assistant", "content": str(value)}]
        elif kind == "preference":  # the right answer against an off-by-a-little one
            wrong = value + rng.choice([-3, -2, -1, 1, 2, 3])
            row["chosen"] = [{"role": "assistant", "content": str(value)}]
            row["rejected"] = [{"role": "assistant", "content": str(wrong)}]
        rows.append(row)
    return rows


def arithmetic_splits(n_train: int, n_eval: int, *, seed: int = 0, **kwargs: Any) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out sets."""
    held_out = arithmetic(n_eval, seed=seed + 1_000_003, **kwargs)
    exprs = {_expr_of(r) for r in held_out}
    return arithmetic(n_train, seed=seed, exclude=exprs, **kwargs), held_out


def _expr_of(row: dict[str, Any]) -> str:
    text = row["prompt"][-1]["content"]
    return text[len("What is "): text.index("?")]


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict[str, Any]], *, max_new_tokens: int = 16,
                    batch_size: int = 64) -> float:
    """Fraction of rows whose greedy completion holds the right number (parsed as the reward parses it)."""
    from .generation import SamplingParams, TransformersBackend
    from .rewards import parse_number

    backend = TransformersBackend(model, pad_token_id=tokenizer.pad_token_id, max_batch_size=batch_size)
    params = SamplingParams(max_tokens=max_new_tokens, top_k=1, stop_token_ids=(tokenizer.eos_token_id,))
    prompts = [tokenizer(tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"] for r in rows]
    groups = backend.generate(prompts, params, n=1, seed=0)
    correct = 0
    for r, group in zip(rows, groups):
        got = parse_number(tokenizer.decode(group[0].token_ids, skip_special_tokens=True))
        correct += int(got is not None and got == parse_number(str(r["answer"])))
    return correct / max(len(rows), 1)
