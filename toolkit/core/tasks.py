"""Small tasks the project generates itself, so examples and tests need no download.

`arithmetic`: additions and subtractions of `task_max_terms` numbers with a verifiable integer answer.
`multiplication`: a number times a one-digit number. `calculator`: a two-digit number times a digit plus a
number, for the calculator tool (its prompt-completion rows are a warm-up: 15% use the tool, the rest answer at
once). `sorting`: a few numbers to put in increasing order
(the answer is the list; `number_list_match` scores it). `shapes`: a 56x56 picture of one to four red squares on
a 4x4 grid (one per cell, of varying size and place), asked "how many red squares?" (rows carry the picture in an
`images` column; for the embedded vision-language model, docs/vision.md). The same generators feed SFT
(prompt-completion rows), RL (prompt-only rows with an `answer` column) and preference training (the answer against a near
miss). Splits are disjoint by construction (different seeds, and held-out problems are removed from the
training set; for sorting, a problem is its set of numbers, so no reordering of a held-out list is trained on).
"""

from __future__ import annotations

__all__ = [
    "PROMPT_SUFFIX",
    "TASKS",
    "arithmetic",
    "arithmetic_splits",
    "SHAPES_QUESTION",
    "greedy_accuracy",
    "shapes_image",
    "task_rows",
    "task_splits",
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


def _multiplication(rng: random.Random, max_value: int, max_terms: int) -> tuple[str, int]:
    a, b = rng.randint(2, max_value), rng.randint(2, 9)
    return f"{a} * {b}", a * b


def _sorting(rng: random.Random, max_value: int, max_terms: int) -> tuple[str, list[int]]:
    if max_value < max_terms:
        raise ConfigError(f"task_max_value: sorting draws {max_terms} distinct numbers up to task_max_value, so it "
                          f"must be >= task_max_terms ({max_terms}); got {max_value}.")
    return "", rng.sample(range(1, max_value + 1), max_terms)


def _calculator(rng: random.Random, max_value: int, max_terms: int) -> tuple[str, int]:
    """Beyond the embedded model's head arithmetic, easy with a calculator: a two-digit number times a digit, plus
    another number."""
    a, b, c = rng.randint(11, max(11, max_value)), rng.randint(3, 9), rng.randint(10, max(10, max_value))
    return f"{a} * {b} + {c}", a * b + c


def _question(task: str, key: str, values: Any) -> str:
    if task == "sorting":
        return (f"Sort these numbers from smallest to largest: {', '.join(map(str, values))}. "
                "Answer with just the numbers, separated by commas.")
    return f"What is {key}? {PROMPT_SUFFIX}"


def _near_miss(task: str, rng: random.Random, value: Any) -> str:
    if task == "sorting":  # two neighbours swapped: every number right, the order wrong
        wrong = sorted(value)
        i = rng.randrange(len(wrong) - 1)
        wrong[i], wrong[i + 1] = wrong[i + 1], wrong[i]
        return ", ".join(map(str, wrong))
    return str(value + rng.choice([-3, -2, -1, 1, 2, 3]))


# name -> problem generator (rng, max_value, max_terms) -> (expression, value); sorting's "expression" is its list
SHAPES_QUESTION = "How many red squares are in the picture? " + PROMPT_SUFFIX
_SHAPES_CELL = 14  # one square per 14x14 cell: a vision patch of the embedded vision-language model


def shapes_image(squares: tuple[tuple[int, int, int, int], ...]) -> Any:
    """A 56x56 white picture with a red square for each (cell, dx, dy, side): cell 0..15 row-major on a 4x4 grid
    of 14x14 cells, the square's side (6..10 pixels) and its offset inside the cell (it never leaves it)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (4 * _SHAPES_CELL, 4 * _SHAPES_CELL), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for c, dx, dy, side in squares:
        x, y = (c % 4) * _SHAPES_CELL + dx, (c // 4) * _SHAPES_CELL + dy
        draw.rectangle([x, y, x + side - 1, y + side - 1], fill=(220, 30, 30))
    return image


def _shapes(rng: random.Random, max_value: int, max_terms: int) -> tuple[tuple[tuple[int, int, int, int], ...], int]:
    # the count first, uniformly: drawing distinct pictures from a space where one square has few arrangements
    # would skew the counts (a first version, cells only, gave 50% fours in training and 2 rows of one square);
    # sizes and offsets make every count's space large
    count = rng.randint(1, 4)
    squares = []
    for c in sorted(rng.sample(range(16), count)):
        side = rng.randint(6, 10)
        squares.append((c, rng.randint(1, _SHAPES_CELL - side - 1), rng.randint(1, _SHAPES_CELL - side - 1), side))
    return tuple(squares), count


TASKS = {"arithmetic": _problem, "multiplication": _multiplication, "sorting": _sorting, "calculator": _calculator,
         "shapes": _shapes}


def _key(task: str, question: Any, answer: str) -> str:
    """What makes two problems the same: the question, except for sorting, where any order of the same numbers
    has the same answer, and shapes, where it is the squares' places."""
    return f"sorted:{answer}" if task == "sorting" else str(question)


def task_rows(task: str, n: int, *, seed: int = 0, max_value: int = 20, max_terms: int = 3,
              kind: str = "prompt_completion", exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """`n` distinct conversational rows of a builtin task (see TASKS). kind="prompt_completion" adds the answer
    as the completion; "prompt_only" keeps it in an `answer` column for reward functions; "preference" pairs it
    (chosen) with a near miss (rejected). `exclude`: problems to leave out (see `_key`)."""
    if task not in TASKS:
        raise ConfigError(f"dataset: unknown builtin '{task}'; the builtin datasets are: "
                          f"{', '.join('builtin:' + t for t in TASKS)}.")
    if kind not in ("prompt_completion", "prompt_only", "preference"):
        raise ConfigError(f"kind must be 'prompt_completion', 'prompt_only' or 'preference', got {kind!r}")
    rng = random.Random(seed)
    coin = random.Random(seed + 7_919)
    rows, seen = [], set(exclude or ())
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n:
            shape = (f"task_max_value={max_value}" if task == "multiplication"
                     else f"task_max_value={max_value} and task_max_terms={max_terms}")
            raise ConfigError(f"dataset_size / eval_size: cannot draw {n} distinct builtin:{task} problems with "
                              f"{shape} ({len(rows)} drawn, {len(exclude or ())} held out); lower dataset_size or "
                              "eval_size, or raise task_max_value.")
        expr, value = TASKS[task](rng, max_value, max_terms)
        question = expr if task == "shapes" else _question(task, expr, value)
        answer = ", ".join(map(str, sorted(value))) if task == "sorting" else str(value)
        key = _key(task, question, answer)
        if key in seen:
            continue
        seen.add(key)
        prompt = [{"role": "user", "content": question}]
        row: dict[str, Any] = {"prompt": prompt, "answer": answer}
        if task == "shapes":  # the picture is the question; the squares' places make the problem
            prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": SHAPES_QUESTION}]}]
            row = {"prompt": prompt, "answer": answer, "images": [shapes_image(expr)],
                   "squares": [list(q) for q in expr]}
        if kind == "prompt_completion" and task == "calculator":
            # the SFT warm-up of examples/tools_pipeline.toml, under the calculator environment's system prompt:
            # 15% of the rows use the tool (the call, its result, the answer), the rest answer at once with the
            # right number. The warm-started model knows the call format but rarely calls the tool; answering
            # a * b + c in its head mostly fails, so what RL has to learn is to use the tool. The coin has its own
            # generator, so the problems drawn (and the held-out split) are those of the prompt-only rows.
            from .environments import CALCULATOR_SYSTEM_PROMPT, calculator_tool_call

            turns = ([{"role": "assistant", "content": calculator_tool_call(expr)}, {"role": "tool", "content": answer}]
                     if coin.random() < 0.15 else [])
            row = {"messages": [{"role": "system", "content": CALCULATOR_SYSTEM_PROMPT}, *prompt, *turns,
                                {"role": "assistant", "content": answer}], "answer": answer}
        elif kind == "prompt_completion":
            row["completion"] = [{"role": "assistant", "content": answer}]
        elif kind == "preference":  # the right answer against an off-by-a-little one
            row["chosen"] = [{"role": "assistant", "content": answer}]
            row["rejected"] = [{"role": "assistant", "content": _near_miss(task, rng, value)}]
        rows.append(row)
    return rows


def task_splits(task: str, n_train: int, n_eval: int, *, seed: int = 0, **kwargs: Any
                ) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out sets of a builtin task."""
    held_out = task_rows(task, n_eval, seed=seed + 1_000_003, **kwargs)
    keys = {_key(task, tuple(tuple(q) for q in r["squares"]) if task == "shapes" else
                 (r["prompt"] if "prompt" in r else r["messages"][:2])[-1]["content"], r["answer"]) for r in held_out}
    return task_rows(task, n_train, seed=seed, exclude=keys, **kwargs), held_out


def arithmetic(n: int, *, seed: int = 0, max_value: int = 20, max_terms: int = 3, kind: str = "prompt_completion",
               exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """`n` arithmetic rows (see `task_rows`); `exclude` holds expressions ("3 + 4") to leave out."""
    return task_rows("arithmetic", n, seed=seed, max_value=max_value, max_terms=max_terms, kind=kind,
                     exclude={_question("arithmetic", e, None) for e in exclude or ()})


def arithmetic_splits(n_train: int, n_eval: int, *, seed: int = 0, **kwargs: Any) -> tuple[list[dict], list[dict]]:
    """Disjoint train and held-out sets."""
    return task_splits("arithmetic", n_train, n_eval, seed=seed, **kwargs)


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
