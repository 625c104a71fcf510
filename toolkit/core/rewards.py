"""Reward functions: the protocol, built-in verifiable rewards, and a runner that never lets one kill a run.

A reward function is any callable (plain or `async def`) with this signature, TRL-compatible:

    def reward(prompts, completions, completion_ids, **columns) -> list[float | None]

- `prompts`: the dataset's prompts (strings, or lists of turns for conversational data);
- `completions`: the decoded completions (strings, or `[{"role": "assistant", "content": text}]`);
- `completion_ids`: the sampled token ids (lists of ints) - the ids the loss is computed on;
- `columns`: every other dataset column, one value per row (for example `answer`).

Return one float per row, or None for rows the function does not judge (excluded for that row).
A function that raises, exceeds its timeout or returns NaN is excluded for that batch (counted, and
logged with its traceback once per function); one that fails `max_consecutive_failures` batches in a
row stops the run with an error naming it (see `RewardRunner`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import re
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from .errors import ConfigError, TrainingHealthError

__all__ = [
    "HTTPJudge",
    "check_reward_columns",
    "required_columns",
    "RewardFunction",
    "RewardModelReward",
    "RewardOutcome",
    "RewardRunner",
    "format_reward",
    "length_penalty",
    "number_list_match",
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
# In a list "3, 7, 12" the commas separate numbers, so no thousands separators here
_INTEGER_OR_DECIMAL = re.compile(r"-?\d+(?:\.\d+)?")
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


def number_list_match(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any], *,
                      answer: Sequence[Any], **_: Any) -> list[float | None]:
    """1.0 when the numbers in the completion, in order, are exactly the numbers of the `answer` column (a list
    such as "3, 7, 12": builtin:sorting), else 0.0. Separators and surrounding words do not matter; a missing,
    extra or misplaced number does. Rows whose `answer` holds no number get None (not judged)."""
    out: list[float | None] = []
    for completion, expected in zip(completions, answer):
        target = [Fraction(t) for t in _INTEGER_OR_DECIMAL.findall(str(expected))]
        if not target:
            out.append(None)
            continue
        got = [Fraction(t) for t in _INTEGER_OR_DECIMAL.findall(_text(completion))]
        out.append(1.0 if got == target else 0.0)
    return out


def format_reward(pattern: str, *, full_match: bool = True) -> RewardFunction:
    """A reward of 1.0 when the completion matches the regex `pattern` (whole text by default), else 0.0."""
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"reward_funcs: 'format:{pattern}' is not a valid regular expression ({e}).") from None

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
    abandoned: int = 0   # calls still running past their timeout (left behind on daemon threads)


class _Call:
    """One reward call on its own daemon thread (an `async def` reward gets its own event loop there).

    Python cannot kill a thread, so a call that outlives its timeout is abandoned: the batch goes on without
    it, the next batch gets fresh threads (nothing queues behind a hung call), and a daemon thread never
    keeps the process from exiting.
    """

    def __init__(self, fn: RewardFunction, kwargs: dict[str, Any], name: str):
        self.fn, self.kwargs = fn, kwargs
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.name = name
        self.thread = threading.Thread(target=self._run, name=f"toolkit-reward-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None)):
                self.value = asyncio.run(self.fn(**self.kwargs))
            else:
                self.value = self.fn(**self.kwargs)
        except BaseException as e:  # noqa: BLE001 (reported to the runner, never raised in this thread)
            self.error = e
        finally:
            self.done.set()


#: A function with this many calls still running past their timeout stops the run (threads would pile up).
MAX_ABANDONED_CALLS = 4


class RewardRunner:
    """Calls every reward function on a batch, concurrently, each under `timeout` seconds.

    Failures never kill a run quietly and never hang it:
    - a function that raises, times out, returns the wrong length or a non-number, or returns NaN, is
      excluded for that batch (its rows get NaN), counted, and logged with its traceback once. (Unlike TRL,
      which treats NaN like None: NaN is what a bug produces, None is how a function says "not mine";
      numpy arrays and tensors are accepted as lists);
    - a hung or blocking function (sync, or an `async def` that blocks its loop) is abandoned at its timeout
      on a daemon thread: later batches do not wait behind it and the process can still exit; one with
      `MAX_ABANDONED_CALLS` calls still hung stops the run;
    - a function that fails on `max_consecutive_failures` batches in a row stops the run with a
      TrainingHealthError naming the function, its last error and the columns it was given (a wrong column
      name or a narrow signature fails on every batch; training on without it would learn nothing).
    """

    def __init__(self, funcs: Sequence[RewardFunction], *, timeout: float = 60.0, max_consecutive_failures: int = 3,
                 allow_empty: bool = False):
        named = [f for f in funcs if not callable(f)]
        if named:
            raise ConfigError(f"reward_funcs: RewardRunner takes callables; resolve names such as {named[0]!r} with "
                              "toolkit.core.plugins.resolve_reward first (the trainers do).")
        self.funcs = list(funcs)
        if not self.funcs and not allow_empty:  # allow_empty: a trainer that only logs rewards (GKD)
            raise ConfigError("reward_funcs: give at least one reward function.")
        if not timeout > 0:
            raise ConfigError(f"reward_timeout: must be > 0 seconds, got {timeout}.")
        if max_consecutive_failures < 1:
            raise ConfigError(f"reward_max_consecutive_failures: must be >= 1, got {max_consecutive_failures}.")
        self.names = [reward_name(f) for f in self.funcs]
        if len(set(self.names)) != len(self.names):
            self.names = [f"{n}_{i}" for i, n in enumerate(self.names)]
        self.timeout = timeout
        self.max_consecutive_failures = max_consecutive_failures
        self.failures = {n: 0 for n in self.names}
        self.consecutive = {n: 0 for n in self.names}
        self.last_error: dict[str, str] = {}
        self.abandoned: list[_Call] = []
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def _fail(self, name: str, n_rows: int, error: BaseException | str) -> list[float]:
        self.failures[name] += 1
        self.consecutive[name] += 1
        self.last_error[name] = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        if name not in self._logged:
            self._logged.add(name)
            detail = error if isinstance(error, str) else "".join(
                traceback.format_exception(type(error), error, error.__traceback__))
            logger.error("reward function '%s' failed; its rows are excluded from this batch (logged once per "
                         "function, counted in rewards/%s/failures):\n%s", name, name, detail)
        return [math.nan] * n_rows

    def _clean(self, name: str, values: Any, n_rows: int) -> list[float]:
        if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # numpy arrays, tensors
            values = values.tolist()
        if not isinstance(values, (list, tuple)) or len(values) != n_rows:
            got = f"{type(values).__name__} of length {len(values)}" if hasattr(values, "__len__") else type(values).__name__
            return self._fail(name, n_rows, f"it returned {got}; a reward must return a list with one value per row "
                                            f"({n_rows}).")
        out = []
        for i, v in enumerate(values):
            if v is None:
                out.append(math.nan)
                continue
            try:
                x = float(v)
            except (TypeError, ValueError):
                return self._fail(name, n_rows, f"it returned {v!r} for row {i}, which is not a number or None.")
            if math.isnan(x):
                # NaN is not "no reward" (that is None): it is a bug in the function, so the batch counts as failed.
                # (inf passes through: the trainers stop on it at once, naming the function.)
                return self._fail(name, n_rows, f"it returned nan for row {i}; return a number, or None to leave a "
                                                "row unjudged.")
            out.append(x)
        self.consecutive[name] = 0
        return out

    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any],
                 columns: dict[str, Sequence[Any]]) -> RewardOutcome:
        started = time.perf_counter()
        n = len(completions)
        kwargs = dict(prompts=list(prompts), completions=list(completions), completion_ids=list(completion_ids),
                      **{k: list(v) for k, v in columns.items()})
        # Each call gets its own lists: a function that edits its inputs cannot disturb another.
        calls = [_Call(fn, {k: list(v) for k, v in kwargs.items()}, name) for fn, name in zip(self.funcs, self.names)]
        deadline = started + self.timeout
        for call in calls:
            call.done.wait(timeout=max(0.0, deadline - time.perf_counter()))
        with self._lock:  # the async worker scores several batches at once: one bookkeeping at a time
            return self._collect(calls, n, columns, started)

    def _collect(self, calls: list[_Call], n: int, columns: dict[str, Sequence[Any]], started: float
                 ) -> RewardOutcome:
        results: list[list[float]] = []
        for call, name in zip(calls, self.names):
            if not call.done.is_set():
                self.abandoned.append(call)
                results.append(self._fail(name, n, f"it took longer than reward_timeout={self.timeout}s; the call "
                                                   "was abandoned (it keeps a daemon thread until it returns)."))
            elif call.error is not None:
                results.append(self._fail(name, n, call.error))
            else:
                results.append(self._clean(name, call.value, n))
        self.abandoned = [c for c in self.abandoned if not c.done.is_set()]
        for name in self.names:
            hung = sum(c.name == name for c in self.abandoned)
            if hung >= MAX_ABANDONED_CALLS:
                raise TrainingHealthError(
                    f"reward function '{name}' has {hung} calls still running past reward_timeout={self.timeout}s "
                    "(each holds a thread and its batch); it hangs rather than fails. Fix it, or raise reward_timeout.")
        for name in self.names:
            if self.consecutive[name] >= self.max_consecutive_failures:
                raise TrainingHealthError(
                    f"reward function '{name}' failed on {self.consecutive[name]} batches in a row (last: "
                    f"{self.last_error.get(name)}). It is called as {name}(prompts, completions, completion_ids, "
                    f"**columns) with columns {sorted(columns)}; a misspelt column or a signature without **kwargs "
                    "fails every time. Fix it, or raise reward_max_consecutive_failures to tolerate flaky calls.")
        return RewardOutcome(rewards=results, names=list(self.names), failures=dict(self.failures),
                             seconds=time.perf_counter() - started, abandoned=len(self.abandoned))


class HTTPJudge:
    """A reward served over HTTP: an LLM judge, a verifier service, a sandbox farm. One POST per batch.

    Request (JSON): {"prompts": [...], "completions": [...], "columns": {name: [...]}}, texts as the trainer
    decoded them (conversational completions as message lists). Response: {"rewards": [number | null, ...]},
    one per completion. It is picklable (a URL and settings), so AsyncGRPOTrainer's rollout worker calls it from
    its own process, where the wait overlaps training and the next round's generation (scoring_concurrency). Any failure (connection refused, an HTTP error status, a body that is
    not that JSON, a wrong length) fails the batch the usual way: excluded and counted, and after
    reward_max_consecutive_failures batches in a row the run stops naming the judge and the error. In a run
    file: reward_funcs = ["judge:http://127.0.0.1:8000/score"].
    """

    def __init__(self, url: str, *, timeout: float = 60.0, headers: dict[str, str] | None = None,
                 name: str = "judge"):
        from urllib.parse import urlparse

        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ConfigError(f"reward_funcs: judge URL {url!r} is not an http(s)://host[:port]/path URL.")
        if not timeout > 0:
            raise ConfigError(f"HTTPJudge timeout: must be > 0 seconds, got {timeout}.")
        self.url, self.timeout, self.headers, self.__name__ = url, timeout, dict(headers or {}), name

    def _post(self, body: bytes) -> list[Any]:
        import json
        import urllib.error
        import urllib.request

        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", **self.headers})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"judge {self.url} answered HTTP {e.code}: {e.read()[:200]!r}") from None
        except json.JSONDecodeError as e:
            raise RuntimeError(f"judge {self.url} answered with a body that is not JSON ({e})") from None
        if not isinstance(payload, dict) or not isinstance(payload.get("rewards"), list):
            raise RuntimeError(f'judge {self.url} answered {str(payload)[:200]}; expected {{"rewards": [...]}}')
        return payload["rewards"]

    async def __call__(self, prompts, completions, completion_ids, **columns) -> list[Any]:
        import json

        body = json.dumps({"prompts": list(prompts), "completions": list(completions), "columns": columns},
                          default=str).encode("utf-8")
        return await asyncio.to_thread(self._post, body)

    def __repr__(self) -> str:
        return f"HTTPJudge({self.url!r})"


def required_columns(fn: Any) -> list[str]:
    """The dataset columns reward function `fn` cannot run without: its parameters after (prompts, completions,
    completion_ids) that have no default (`answer` for numeric_match). A function taking only **kwargs needs none
    it names; one whose signature cannot be read is assumed to need none."""
    import inspect

    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else getattr(fn, "__call__", fn)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return []
    named = [q for q in params if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)]
    return [q.name for q in named[3:] if q.default is q.empty]


def check_reward_columns(funcs: Sequence[Any], names: Sequence[str], columns: Sequence[str], *, where: str) -> None:
    """A DataError before any model loads when a reward function needs a column the dataset lacks (it would fail on
    every batch; the run would stop at its third step, after the model had loaded and sampled)."""
    from .errors import DataError

    for fn, name in zip(funcs, names):
        missing = [c for c in required_columns(fn) if c not in columns]
        if missing:
            raise DataError(f"{where}: reward function '{name}' needs the column(s) {missing}, which the dataset does "
                            f"not have (its columns: {sorted(columns)}). Add them (e.g. an 'answer' column for "
                            "numeric_match), or give the function a default or **kwargs.")


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


def _default_device() -> torch.device:
    """This process's GPU where there is one (torchrun's LOCAL_RANK picks it), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


class RewardModelReward:
    """A reward function that scores prompt + completion with a sequence-classification reward model.

    What `toolkit.experimental.reward.RewardTrainer` trains (and TRL's RewardTrainer, or any
    `AutoModelForSequenceClassification` with one output) used as a GRPO/PPO reward function, or by spec
    `reward_model:<path>` in a run file. Token-exact: the prompt is rendered the way the RL trainers render
    it (`data.tokenize_prompts`), the completion is the sampled ids as they are (never decoded and
    re-tokenized), and the score is read at the last token of prompt + completion, where the reward trainer
    trains it and where PPOTrainer's `reward_model=` reads it.
    """

    def __init__(self, model: Any, tokenizer: Any = None, *, batch_size: int = 16, dtype: str = "float32",
                 chat_template_kwargs: dict | None = None, device: str | torch.device | None = None):
        from .models import load_classifier, load_tokenizer, sequence_classifier_parts

        source = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        # A model loaded here goes to `device`, by default this process's GPU where there is one (scoring at CPU
        # speed beside a GPU policy would be the slowest part of a step); a model given as an object stays put.
        self.model = (load_classifier(model, dtype).to(device if device is not None else _default_device())
                      if isinstance(model, str) else model)
        self.model.eval().requires_grad_(False)
        if tokenizer is None:
            if not source:
                raise ConfigError("RewardModelReward: pass the reward model's tokenizer (the model was given as an "
                                  "object without a name to load one from).")
            tokenizer = load_tokenizer(source)
        self.tokenizer = tokenizer
        self.backbone, self.head = sequence_classifier_parts(self.model)
        self.batch_size = batch_size
        self.chat_template_kwargs = chat_template_kwargs
        self.__name__ = "reward_model"

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Any],
                 **_: Any) -> list[float]:
        from .data import tokenize_prompts

        prompt_ids, _cut = tokenize_prompts([{"prompt": p} for p in prompts], self.tokenizer, max_prompt_length=None,
                                            chat_template_kwargs=self.chat_template_kwargs)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        device = next(self.model.parameters()).device
        scores: list[float] = []
        for start in range(0, len(prompt_ids), self.batch_size):
            seqs = [list(p) + list(c) for p, c in zip(prompt_ids[start:start + self.batch_size],
                                                      completion_ids[start:start + self.batch_size])]
            longest = max(len(q) for q in seqs)
            ids = torch.full((len(seqs), longest), pad, dtype=torch.long)
            mask = torch.zeros((len(seqs), longest), dtype=torch.long)
            for i, q in enumerate(seqs):  # right-padded: each sequence's last token at len - 1
                ids[i, :len(q)] = torch.tensor(q, dtype=torch.long)
                mask[i, :len(q)] = 1
            hidden = self.backbone(input_ids=ids.to(device), attention_mask=mask.to(device),
                                   use_cache=False).last_hidden_state
            last = hidden[torch.arange(len(seqs), device=device), mask.sum(1).to(device) - 1]
            scores += self.head(last.to(self.head.weight.dtype)).squeeze(-1).float().tolist()
        return scores
