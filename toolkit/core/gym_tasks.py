"""reasoning-gym's tasks as data and rewards: tasks no one here wrote, scored by their own verifiers.

`reasoning-gym` (PyPI, offline; `pip install 'toolkit[tasks]'`) holds about a hundred procedural generators, each
with its own `score_answer`. Here a task becomes rows like the builtin tasks' (`toolkit.core.tasks`):

    dataset = "reasoning_gym:chain_sum"            # in a run file, with the task's own settings:
    task_kwargs = {min_terms = 2, max_terms = 3}
    reward_funcs = ["reasoning_gym"]               # the task's score_answer, under the reward timeout

Each row carries the question as a user turn (with `GYM_PROMPT_SUFFIX`), the task's answer (`answer`; SFT's
completion) and a `reasoning_gym` column naming the entry (task, settings, seed, index) so that the reward
rebuilds the exact entry, metadata included, in whatever process scores it (the async worker too), and asks the
task's own `score_answer`. Held-out accuracy is then the task's own scoring (a score of 1.0 counts as solved).
Train and held-out rows come from different seeds, with every held-out question removed from training.
"""

from __future__ import annotations

__all__ = ["GYM_PROMPT_SUFFIX", "gym_answer", "gym_rows", "gym_splits", "reasoning_gym_reward",
           "require_reasoning_gym"]

import functools
import json
import logging
from collections.abc import Sequence
from typing import Any

from .errors import ConfigError

logger = logging.getLogger(__name__)
_SAID: set[str] = set()  # tasks whose verifier raised (warned once each)

GYM_PROMPT_SUFFIX = "Give only the final answer, with no explanation."
_HELD_OUT_SEED = 1_000_003  # held-out rows come from seed + this (the builtin tasks' convention)
# reasoning-gym draws item i from Random(seed + i): seeds 0 and 1 would give the same problems shifted by one. A
# task_seed is therefore spaced this far apart in generator seeds (and held-out rows sit 1_000_003 above them).
_SEED_STRIDE = 10_000_019


def require_reasoning_gym() -> Any:
    """The reasoning_gym module, or a ConfigError saying how to install it."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ConfigError("dataset 'reasoning_gym:<task>' needs the reasoning-gym package: "
                          "pip install 'toolkit[tasks]' (or pip install reasoning-gym).") from e
    return reasoning_gym


@functools.lru_cache(maxsize=64)
def _dataset(task: str, settings_json: str, seed: int, size: int) -> Any:
    reasoning_gym = require_reasoning_gym()
    names = reasoning_gym.factory.DATASETS
    if task not in names:
        close = [n for n in sorted(names) if task.replace("-", "_") in n or n in task][:5]
        raise ConfigError(f"dataset: reasoning_gym has no task '{task}'"
                          + (f"; close: {', '.join(close)}" if close else "")
                          + f" ({len(names)} tasks: reasoning_gym.factory.DATASETS).")
    settings = json.loads(settings_json)
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **settings)
    except (TypeError, ValueError, AssertionError) as e:
        raise ConfigError(f"task_kwargs: reasoning_gym's '{task}' refused the settings {settings} "
                          f"({type(e).__name__}: {e}); the task's config class lists what it takes.") from e


def _settings_json(settings: dict[str, Any] | None) -> str:
    return json.dumps(dict(settings or {}), sort_keys=True)


def gym_rows(task: str, n: int, *, seed: int = 0, settings: dict[str, Any] | None = None,
             kind: str = "prompt_only", exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """`n` distinct rows of reasoning-gym's `task` (see the module docstring). kind: "prompt_only" (the answer in
    an `answer` column) or "prompt_completion" (the answer also as the assistant's completion, for SFT).
    `exclude`: questions to leave out."""
    if kind not in ("prompt_only", "prompt_completion"):
        raise ConfigError(f"dataset 'reasoning_gym:{task}': {kind} data is not offered (prompt_only for RL, "
                          "prompt_completion for SFT); preference pairs would need a wrong answer per task.")
    settings_json = _settings_json(settings)
    size = max(2 * n + len(exclude or ()), 16)
    data = _dataset(task, settings_json, seed, size)
    rows: list[dict[str, Any]] = []
    seen = set(exclude or ())
    for index in range(size):
        try:
            entry = data[index]
        except Exception as e:  # a task that builds its items on access: the settings are the likely cause
            raise ConfigError(f"task_kwargs: reasoning_gym's '{task}' could not build item {index} with the "
                              f"settings {json.loads(settings_json)} ({type(e).__name__}: {e}).") from e
        question = str(entry["question"])
        if question in seen:
            continue
        seen.add(question)
        row: dict[str, Any] = {
            "prompt": [{"role": "user", "content": f"{question}\n\n{GYM_PROMPT_SUFFIX}"}],
            "answer": str(entry["answer"]),
            "reasoning_gym": json.dumps({"task": task, "settings": json.loads(settings_json), "seed": seed,
                                         "size": size, "index": index}),
        }
        if kind == "prompt_completion":
            row["completion"] = [{"role": "assistant", "content": str(entry["answer"])}]
        rows.append(row)
        if len(rows) == n:
            return rows
    raise ConfigError(f"dataset_size / eval_size: reasoning_gym's '{task}' gave {len(rows)} distinct questions of "
                      f"the {n} asked (seed {seed}, settings {json.loads(settings_json)}); ask for fewer, or widen "
                      "the task's settings (task_kwargs).")


def gym_splits(task: str, n_train: int, n_eval: int, *, seed: int = 0, settings: dict[str, Any] | None = None,
               kind: str = "prompt_only") -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Disjoint train and held-out rows of a reasoning-gym task (no held-out question is trained on). `seed`
    (task_seed) picks the problems: different seeds give different problems (see _SEED_STRIDE)."""
    base = seed * _SEED_STRIDE
    held_out = gym_rows(task, n_eval, seed=base + _HELD_OUT_SEED, settings=settings, kind=kind) if n_eval else []
    questions = {r["prompt"][0]["content"].rsplit("\n\n", 1)[0] for r in held_out}
    return gym_rows(task, n_train, seed=base, settings=settings, kind=kind, exclude=questions), held_out


def gym_answer(text: str) -> str:
    """The answer in a completion: the text inside <answer>...</answer> when the model used the tags (the format
    reasoning-gym's own prompts ask for), else the completion's last non-empty line, stripped."""
    if "<answer>" in text:
        inside = text.split("<answer>", 1)[1].split("</answer>", 1)[0]
        return inside.strip()
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def reasoning_gym_reward(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any], *,
                         reasoning_gym: Sequence[str], **_: Any) -> list[float | None]:
    """The task's own `score_answer` (0.0 to 1.0; some tasks give partial credit) for each completion, against the
    entry its row names (the `reasoning_gym` column of `gym_rows`). Rows without that column's entry get None
    (not judged)."""
    from .rewards import _text

    out: list[float | None] = []
    for completion, ref in zip(completions, reasoning_gym):
        if not ref:
            out.append(None)
            continue
        spec = json.loads(ref)
        data = _dataset(spec["task"], _settings_json(spec["settings"]), int(spec["seed"]), int(spec["size"]))
        entry = data[int(spec["index"])]
        answer = gym_answer(_text(completion))
        try:
            out.append(float(data.score_answer(answer=answer, entry=entry)))
        except Exception as e:  # noqa: BLE001 - a verifier that chokes on one malformed answer: that answer is wrong
            if spec["task"] not in _SAID:
                _SAID.add(spec["task"])
                logger.warning("reasoning_gym reward: %s's score_answer raised %s: %s on the answer %r; such "
                               "answers score 0.0 (said once per task).", spec["task"], type(e).__name__, e,
                               answer[:80])
            out.append(0.0)
    return out


reasoning_gym_reward.__name__ = "reasoning_gym"
