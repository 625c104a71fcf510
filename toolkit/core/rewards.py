"""Reward functions: the protocol, built-in verifiable rewards, and a runner that never lets one kill a run.

A reward function is any callable (plain or `async def`) with this signature, TRL-compatible:

    def reward(prompts, completions, completion_ids, **columns) -> list[float | None]

- `prompts`: the dataset's prompts (strings, or lists of turns for conversational data);
- `completions`: the decoded completions (strings, or `[{"role": "assistant", "content": text}]`);
- `completion_ids`: the sampled token ids (lists of ints) - the ids the loss is computed on;
- `columns`: every other dataset column, one value per row (for example `answer`).

Return one float per row, or None for rows the function does not judge (excluded for that row).
A function that raises or exceeds its timeout is excluded for the whole batch; the failure is
counted, and logged with its traceback once per function.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import re
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from .errors import ConfigError

__all__ = [
    "RewardFunction",
    "RewardOutcome",
    "RewardRunner",
    "format_reward",
    "length_penalty",
    "numeric_match",
    "parse_number",
    "reward_name",
    "score_completions",
    "weighted_total",
]

logger = logging.getLogger(__name__)

RewardFunction = Callable[..., Any]


def _text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


# ------------------------------------------------------------------------------------------------
# Built-in verifiable rewards
# ------------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?")


def parse_number(text: str) -> Fraction | None:
    """The answer a completion gives: the last `\\boxed{...}` if any, else the last number in the text.

    Integers, decimals (`2.50`), thousands separators (`1,234`) and fractions (`3/4`) are read
    exactly as `Fraction`s, so `0.5`, `1/2` and `\\boxed{2/4}` are all equal.
    """
    boxed = _BOXED.findall(text)
    source = boxed[-1] if boxed else text
    found = _NUMBER.findall(source)
    if not found:
        return None
    token = found[-1].replace(",", "").replace(" ", "")
    try:
        if "/" in token:
            num, den = token.split("/")
            return None if Fraction(den) == 0 else Fraction(num) / Fraction(den)
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def numeric_match(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any], *,
                  answer: Sequence[Any], **_: Any) -> list[float | None]:
    """1.0 when the completion's number (see `parse_number`) equals the `answer` column, else 0.0.

    Rows whose `answer` cannot be read as a number get None (not judged), never a silent 0.
    """
    out: list[float | None] = []
    for completion, expected in zip(completions, answer):
        target = parse_number(str(expected))
        if target is None:
            out.append(None)
            continue
        got = parse_number(_text(completion))
        out.append(1.0 if got is not None and got == target else 0.0)
    return out


def format_reward(pattern: str, *, full_match: bool = True) -> RewardFunction:
    """A reward of 1.0 when the completion matches the regex `pattern` (whole text by default), else 0.0."""
    regex = re.compile(pattern, re.DOTALL)

    def reward(prompts, completions, completion_ids, **_):
        check = regex.fullmatch if full_match else regex.search
        return [1.0 if check(_text(c).strip()) else 0.0 for c in completions]

    reward.__name__ = "format_reward"
    return reward


def length_penalty(max_tokens: int, *, target: int | None = None, scale: float = 1.0) -> RewardFunction:
    """A penalty in [-scale, 0]: 0 up to `target` tokens (default: half of max_tokens), then linear to -scale."""
    start = target if target is not None else max_tokens // 2
    if not 0 <= start < max_tokens:
        raise ConfigError(f"length_penalty: target must be in [0, max_tokens), got {start} for max_tokens={max_tokens}.")

    def reward(prompts, completions, completion_ids, **_):
        return [-scale * min(1.0, max(0, len(ids) - start) / (max_tokens - start)) for ids in completion_ids]

    reward.__name__ = "length_penalty"
    return reward


def reward_name(fn: RewardFunction) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


# ------------------------------------------------------------------------------------------------
# Running rewards
# ------------------------------------------------------------------------------------------------


@dataclass
class RewardOutcome:
    """`rewards[f][i]`: value of function f for row i (NaN = excluded). `failures[f]`: batches lost to errors."""

    rewards: list[list[float]]
    names: list[str]
    failures: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


class RewardRunner:
    """Calls every reward function on a batch; async ones run concurrently, each under `timeout` seconds."""

    def __init__(self, funcs: Sequence[RewardFunction], *, timeout: float = 60.0):
        named = [f for f in funcs if not callable(f)]
        if named:
            raise ConfigError(f"reward_funcs: RewardRunner takes callables; resolve names such as {named[0]!r} with "
                              "toolkit.core.plugins.resolve_reward first (the trainers do).")
        self.funcs = list(funcs)
        if not self.funcs:
            raise ConfigError("reward_funcs: give at least one reward function.")
        self.names = [reward_name(f) for f in self.funcs]
        if len(set(self.names)) != len(self.names):
            self.names = [f"{n}_{i}" for i, n in enumerate(self.names)]
        self.timeout = timeout
        self.failures = {n: 0 for n in self.names}
        self._logged: set[str] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(self.funcs)),
                                                           thread_name_prefix="toolkit-reward")

    def _fail(self, name: str, n_rows: int, error: BaseException | str) -> list[float]:
        self.failures[name] += 1
        if name not in self._logged:
            self._logged.add(name)
            detail = error if isinstance(error, str) else "".join(
                traceback.format_exception(type(error), error, error.__traceback__))
            logger.error("reward function '%s' failed; its rows are excluded from this batch (logged once per "
                         "function, counted in rewards/%s/failures):\n%s", name, name, detail)
        return [math.nan] * n_rows

    def _clean(self, name: str, values: Any, n_rows: int) -> list[float]:
        if not isinstance(values, (list, tuple)) or len(values) != n_rows:
            got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else type(values).__name__
            return self._fail(name, n_rows, f"it returned {got}; a reward must return a list with one value per row "
                                            f"({n_rows}).")
        out = []
        for v in values:
            if v is None:
                out.append(math.nan)
            else:
                try:
                    out.append(float(v))
                except (TypeError, ValueError):
                    return self._fail(name, n_rows, f"it returned {v!r}, which is not a number or None.")
        return out

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any],
                 columns: dict[str, Sequence[Any]]) -> RewardOutcome:
        import time

        started = time.perf_counter()
        n = len(completions)
        kwargs = dict(prompts=list(prompts), completions=list(completions), completion_ids=list(completion_ids),
                      **{k: list(v) for k, v in columns.items()})
        results: list[list[float] | None] = [None] * len(self.funcs)
        futures = {}
        async_idx = []
        for i, (fn, name) in enumerate(zip(self.funcs, self.names)):
            if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
                async_idx.append(i)
            else:
                futures[i] = self._pool.submit(fn, **kwargs)
        if async_idx:
            async def run_all():
                async def one(i):
                    return await asyncio.wait_for(self.funcs[i](**kwargs), timeout=self.timeout)
                return await asyncio.gather(*(one(i) for i in async_idx), return_exceptions=True)

            for i, value in zip(async_idx, asyncio.run(run_all())):
                if isinstance(value, asyncio.TimeoutError):
                    results[i] = self._fail(self.names[i], n, f"it took longer than reward_timeout={self.timeout}s.")
                elif isinstance(value, BaseException):
                    results[i] = self._fail(self.names[i], n, value)
                else:
                    results[i] = self._clean(self.names[i], value, n)
        deadline = time.perf_counter() + self.timeout
        for i, fut in futures.items():
            try:
                value = fut.result(timeout=max(0.0, deadline - time.perf_counter()))
                results[i] = self._clean(self.names[i], value, n)
            except concurrent.futures.TimeoutError:
                results[i] = self._fail(self.names[i], n, f"it took longer than reward_timeout={self.timeout}s.")
            except Exception as e:
                results[i] = self._fail(self.names[i], n, e)
        return RewardOutcome(rewards=[r for r in results], names=list(self.names), failures=dict(self.failures),
                             seconds=time.perf_counter() - started)


def score_completions(runner: RewardRunner, tokenizer: Any, rows: Sequence[dict[str, Any]],
                      completion_ids: Sequence[Sequence[int]], *, conversational: bool,
                      extra_columns: Sequence[str]) -> tuple[RewardOutcome, list[str]]:
    """Decode sampled ids and run every reward function on them: the one scoring path of GRPO, PPO and the
    async worker. Returns the outcome and the decoded texts (for logs).

    Conversational data gets completions as `[{"role": "assistant", "content": text}]`; every extra dataset
    column arrives as a keyword argument with one value per completion.
    """
    texts = tokenizer.batch_decode([list(ids) for ids in completion_ids], skip_special_tokens=True)
    completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    columns = {c: [r[c] for r in rows] for c in extra_columns}
    outcome = runner([r["prompt"] for r in rows], completions, [list(ids) for ids in completion_ids], columns)
    return outcome, texts


def weighted_total(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[R] sum of weight x reward over the functions that judged each row ([F, R] in, NaN = not judged);
    NaN where no function did."""
    judged = ~torch.isnan(rewards_per_func)
    total = (torch.where(judged, rewards_per_func, torch.zeros_like(rewards_per_func)) * weights[:, None]).sum(0)
    return torch.where(judged.any(0), total, torch.full_like(total, float("nan")))
