"""Multi-turn episodes with token-exact bookkeeping: the ids trained on are the ids sampled.

An environment is anything with `reset(row) -> messages` and `step(text) -> EnvResponse` (the `Environment`
protocol, version `ENVIRONMENT_PROTOCOL_VERSION`). An episode (`run_episode`) renders the starting messages with
the tokenizer's chat template once, then alternates:

1. the policy samples a turn as token ids from the current ids (prompt + everything so far);
2. the environment answers the turn's text (tool results, observations, a reward, done);
3. its messages are turned into ids by `TemplateDelta`: exactly the ids the chat template puts between the end of
   an assistant turn and the start of the next one (e.g. "\\n<|im_start|>tool\\n...<|im_end|>\\n<|im_start|>
   assistant\\n"), computed from a fixed anchor conversation, never by re-rendering this episode's history.

The next turn's prompt is the previous ids extended by the sampled ids and the environment's ids, so what the
policy saw when it sampled is what the trainer scores. `Episode.mask` is 1 on sampled ids (trained) and 0 on
prompt and environment ids (in the context, excluded from the loss: zero gradient).

Why not re-render: chat templates change history when they render it. Qwen3-style templates drop `<think>` blocks
from earlier assistant turns, some merge or strip whitespace, some insert tokens between turns, and decoding then
re-encoding text does not return the sampled ids (a different but equal-text tokenization). A trainer that
re-renders computes the loss on ids the policy never produced (TRL issues #2712, #3367; docs/agents.md).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .errors import ConfigError, ToolkitError
from .generation import Completion

ENVIRONMENT_PROTOCOL_VERSION = 1

__all__ = ["CALCULATOR_SYSTEM_PROMPT", "ENVIRONMENT_PROTOCOL_VERSION", "EnvResponse", "Environment", "Episode",
           "TOOL_CALL_FORMATS", "TemplateDelta", "ToolBox", "ToolCall", "ToolEnvironment", "calc",
           "GymnasiumEnvironment", "TextArenaEnvironment", "calculator_environment", "calculator_tool_call",
           "episode_metrics", "episode_reward", "fresh_environments", "group_sampler", "parse_tool_calls",
           "run_episode", "run_episodes", "check_messages", "checked_reset", "checked_step"]


@dataclass
class EnvResponse:
    """The environment's answer to one model turn. `messages`: chat messages that follow the turn (role "tool",
    "user", ...), rendered by the chat template. `reward`: this turn's reward (None: none yet; the episode's reward
    is the sum of the turns' rewards). `done`: the episode ends after this turn (no messages are rendered then).
    `info`: counters for the report (`tool_calls`, `tool_errors`) and anything else, kept per turn."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment. `reset(row)` gets the dataset row and returns the starting messages (the prompt
    conversation); `step(text)` gets the model's turn (decoded; special tokens such as tool-call markers kept, the
    stop token that ended the turn dropped) and answers it. `tools`
    (optional attribute): tool schemas or functions passed to `apply_chat_template(tools=...)`."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]: ...

    def step(self, text: str) -> EnvResponse: ...


@dataclass
class Episode:
    """A finished episode, token-exact. `prompt_ids`: the rendered starting messages. `ids`: everything after the
    prompt, in order: sampled turns and environment answers. `mask[i]`: 1 when `ids[i]` was sampled by the policy
    (trained), 0 for environment/template ids. `logprobs[i]`: the sampler's log-prob of a sampled id (0.0
    elsewhere). `turns`: the sampled turns' (start, end) spans in `ids`."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    finish: str = "done"   # done | max_turns | max_tokens | length (a turn hit its token limit) | env_error
    truncated: bool = False  # the last sampled turn was cut at its token limit (no stop token)

    @property
    def reward(self) -> float | None:
        """The sum of the turns' rewards; None when no turn was rewarded."""
        given = [r for r in self.rewards if r is not None]
        return float(math.fsum(given)) if given else None

    def sampled_turns(self) -> list[list[int]]:
        return [self.ids[a:b] for a, b in self.turns]

    def count(self, key: str) -> int:
        return int(sum(info.get(key, 0) for info in self.infos))


class TemplateDelta:
    """The ids a chat template places after an assistant turn that ended with `end_text` (the stop token the policy
    sampled, e.g. "<|im_end|>") up to and including the next generation prompt, for given new messages.

    Rendered against an anchor conversation (a user turn, then an assistant turn holding a sentinel string): the
    delta is what follows sentinel + `end_text` in the rendering of anchor + messages with the generation prompt.
    Only that tail is used, so templates that render earlier turns differently once more follow (Qwen3 drops
    `<think>` from them) work; it is rendered at every call, so templates that print the date stay right. The
    text after a special token is tokenized on its own, which is how the template's rendering tokenizes it too
    (BPE does not merge across special tokens). Checked at construction with a tool and a user message: a
    template whose assistant turns are not closed by `end_text` raises ConfigError before any episode runs.
    """

    _SENTINEL = "\u2063toolkit-anchor-7f3a\u2063"  # invisible separators around a string no template produces

    def __init__(self, tokenizer: Any, *, end_text: str | None = None, tools: Sequence[Any] | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None):
        self.tokenizer = tokenizer
        self.end_text = end_text if end_text is not None else tokenizer.eos_token
        self.tools = list(tools) if tools else None
        self.kwargs = dict(chat_template_kwargs or {})
        self._anchor = [{"role": "user", "content": "A"}, {"role": "assistant", "content": self._SENTINEL}]
        for probe in ([{"role": "tool", "content": "1"}], [{"role": "user", "content": "2"}]):
            self.after_turn(probe)
        # the id of the end-of-turn token: the policy samples it as one token, so it must be one
        if self.end_text in tokenizer.get_vocab():
            self.end_id: int = tokenizer.convert_tokens_to_ids(self.end_text)
        else:
            ids = tokenizer(self.end_text, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ConfigError(f"end_text: {self.end_text!r} is {len(ids)} tokens of this tokenizer, not one; the "
                                  "end of a turn is the one stop token the policy samples (e.g. '<|im_end|>').")
            self.end_id = ids[0]
        try:  # the template apply_chat_template uses (a name in chat_template_kwargs picks a stored one)
            self._template_source = tokenizer.get_chat_template(self.kwargs.get("chat_template"), self.tools)
        except Exception:  # noqa: BLE001 (no template to read: nothing counts as written by it)
            self._template_source = ""

    def closes_turn(self, token_id: int) -> bool:
        """Whether the template's ids between turns may follow `token_id` directly: the end-of-turn token, or a
        special token the chat template writes itself (Llama 3.1 closes a tool-call turn with <|eom_id|>, not
        <|eot_id|>).
        After any other stop token (an <|endoftext|> in `stop_token_ids`) `run_episodes` places the end-of-turn
        token first."""
        if token_id == self.end_id:
            return True
        added = getattr(self.tokenizer, "added_tokens_decoder", {}).get(int(token_id))
        # special tokens only: Qwen's <tool_call> and </tool_call> are in its template too, but as non-special added
        # tokens inside a turn, and a turn stopped on </tool_call> still needs its <|im_end|>
        if added is None or not getattr(added, "special", False):
            return False
        return bool(added.content) and added.content in self._template_source

    def _render(self, messages: list[dict[str, Any]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt, **self.kwargs)

    def prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The starting conversation, rendered once with the generation prompt."""
        text = self._render(messages, generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def after_turn(self, messages: list[dict[str, Any]]) -> list[int]:
        """Ids after an assistant turn's stop token: `messages` rendered, then the next generation prompt."""
        full = self._render(self._anchor + list(messages), generation_prompt=True)
        at = full.rfind(self._SENTINEL)
        cut = at + len(self._SENTINEL)
        if at < 0 or not full[cut:].startswith(self.end_text):
            shown = full[max(0, at - 40):cut + 40] if at >= 0 else full[-120:]
            raise ConfigError(f"chat template: an assistant turn is not closed by {self.end_text!r} (the stop token "
                              f"the policy samples) when {[m.get('role') for m in messages]} messages follow it, so "
                              f"the ids between turns cannot be placed after it; rendered {shown!r}. Set the stop "
                              "token (end_text) to the template's end-of-turn token.")
        return self.tokenizer(full[cut + len(self.end_text):], add_special_tokens=False)["input_ids"]


# A sampler: prompt ids -> one Completion (ids, sampler log-probs, finish reason). GRPO's backends provide it.
Sampler = Callable[[list[int]], Completion]
# A batched sampler: one Completion per context, all contexts of a turn in one call (one batched generate).
BatchSampler = Callable[[list[list[int]]], list[Completion]]


def run_episode(env: Environment, row: dict[str, Any], sample: Sampler, delta: TemplateDelta, *,
                max_turns: int = 8, max_tokens: int = 1024, decode: Callable[[list[int]], str] | None = None,
                stop_token_ids: Sequence[int] = ()) -> Episode:
    """Run one episode (see the module docstring). `max_turns`: model turns at most. `max_tokens`: the episode's
    ids after the prompt (sampled + environment) before a new turn starts (a turn may take the episode past it
    by its own token limit). `stop_token_ids`: ids that end a turn (default: the template's `end_text`; the
    sampled one is kept in the ids: it is what the policy produced)."""
    return run_episodes([env], [row], lambda contexts: [sample(c) for c in contexts], delta, max_turns=max_turns,
                        max_tokens=max_tokens, decode=decode, stop_token_ids=stop_token_ids, concurrency=1)[0]


def run_episodes(envs: Sequence[Environment], rows: Sequence[dict[str, Any]], sample: BatchSampler,
                 delta: TemplateDelta, *, max_turns: int = 8, max_tokens: int = 1024,
                 decode: Callable[[list[int]], str] | None = None, stop_token_ids: Sequence[int] = (),
                 concurrency: int = 32, step_timeout: float | None = None,
                 on_wait: Callable[[], None] | None = None,
                 any_rank: Callable[[bool], bool] | None = None,
                 timings: dict[str, float] | None = None, answer_reserve: int | None = None) -> list[Episode]:
    """Run one episode per (environment, row) in lockstep, token-exact as `run_episode`.

    Each turn, the contexts of all unfinished episodes go to `sample` together (one batched generate), then their
    environments answer concurrently, at most `concurrency` at a time, so environments that wait (tools,
    sandboxes, remote judges) overlap each other instead of adding up; resets run the same way. A `step` must
    therefore not rely on process-wide state such as the global random generator (TextArenaEnvironment guards
    its games' own). An environment whose `reset` or `step` raises, whose answer the chat template refuses, or
    that takes longer than `step_timeout` seconds (counted from when its call starts) ends its episode
    (`finish="env_error"`, the error in the last `infos` entry's "env_error"): the run goes on, and a trainer
    leaves the episode out of the loss. A call that timed out is abandoned on a daemon thread (Python cannot stop
    one; it neither holds a slot nor keeps the process alive). `on_wait` is called about every 0.1 s while
    environments are being waited for (async GRPO's worker reports its progress with it).

    `any_rank(flag)` (a collective: whether flag holds on any rank) keeps the ranks of a sharded model in step:
    every rank then runs a turn while any rank has an unfinished episode, a rank without one calling `sample`
    with no contexts (the backend's generate still takes part in the other ranks' forwards; see
    `toolkit.core.generation.any_rank_if_sharded`). Ranks without a sharded model pass nothing and end when they
    are done.

    `timings`, when given, gets the wall seconds spent in `sample` ("generate_s") and in waiting for the
    environments' resets and steps ("environment_s", which includes rendering the starting prompts' chat
    template on the reset threads), added to what it holds. In lockstep nothing is sampled while
    environments answer, so "environment_s" is time the sampler's compute stood idle: how much a round waits, and
    so the most that overlapping those waits with other work (async GRPO on the same cores) can win back.

    What an environment returns is checked (`checked_reset`, `checked_step`): a wrong type, or a message whose
    content is not text, ends that episode as `env_error` naming the environment, the method and what was
    expected. `answer_reserve` (GRPO passes max_completion_length): an environment's answer is cut in tokens (its
    messages' contents shortened, with a note saying so) so that at least this many of `max_tokens` are left for
    the model's next turn; the tokens cut are counted in the turn's info ("env_tokens_cut"). None: never cut.
    """
    if answer_reserve is None:
        answer_reserve = -(10**9)  # nothing is cut
    if max_turns < 1:
        raise ConfigError(f"max_turns: must be >= 1, got {max_turns}.")
    if len(envs) != len(rows):
        raise ValueError(f"run_episodes: {len(envs)} environments for {len(rows)} rows")
    tok = delta.tokenizer
    stops = set(stop_token_ids) if stop_token_ids else {delta.end_id}
    # The text the environment reads keeps special tokens (tool-call markers such as [TOOL_CALLS] or
    # <|python_tag|> are special in their tokenizers) and drops only the stop token that ended the turn.
    decode = decode or (lambda ids: tok.decode(ids[:-1] if ids and ids[-1] in stops else ids))
    calls = _Calls(concurrency, step_timeout, on_wait)
    clock = {"generate_s": 0.0, "environment_s": 0.0}

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            clock[key] += time.perf_counter() - started

    episodes = []
    resets = timed("environment_s", lambda: calls.run([lambda e=env, r=row: delta.prompt_ids(checked_reset(e, r))
                                                        for env, row in zip(envs, rows)]))
    for (ids, error) in resets:
        # a failed reset leaves no prompt to sample from: an empty episode, out of the loss
        episodes.append(Episode(prompt_ids=ids) if error is None else
                        Episode(prompt_ids=[], infos=[{"env_error": f"reset: {error}"}], finish="env_error"))
    active = [i for i, ep in enumerate(episodes) if ep.finish != "env_error"]
    for turn in range(max_turns):
        for i in [i for i in active if len(episodes[i].ids) >= max_tokens]:
            episodes[i].finish = "max_tokens"
        active = [i for i in active if len(episodes[i].ids) < max_tokens]
        if not (any_rank(bool(active)) if any_rank is not None else active):
            break
        outs = timed("generate_s", lambda: sample([episodes[i].prompt_ids + episodes[i].ids for i in active]))
        if len(outs) != len(active):
            raise ValueError(f"run_episodes: the sampler returned {len(outs)} completions for {len(active)} contexts")
        for i, out in zip(active, outs):
            _append_sampled(episodes[i], out, stops)
        texts = [decode(list(out.token_ids)) for out in outs]
        answers = timed("environment_s",
                        lambda: calls.run([lambda e=envs[i], t=text: checked_step(e, t) for i, text in zip(active, texts)]))
        active = [i for i, (response, error) in zip(active, answers)
                  if _append_answer(episodes[i], response, error, delta, last_turn=turn == max_turns - 1,
                                    room=max_tokens - answer_reserve)]
    if timings is not None:
        for key, seconds in clock.items():
            timings[key] = timings.get(key, 0.0) + seconds
    return episodes


def _append_sampled(ep: Episode, out: Any, stops: set[int]) -> None:
    """A turn the policy sampled: its ids in the loss (mask 1) with their sampling log-probs."""
    start = len(ep.ids)
    ep.ids += list(out.token_ids)
    ep.mask += [1] * len(out.token_ids)
    ep.logprobs += [float(x) for x in out.logprobs]
    ep.turns.append((start, len(ep.ids)))
    ep.truncated = not (out.token_ids and out.token_ids[-1] in stops)


def _append_answer(ep: Episode, response: Any, error: str | None, delta: TemplateDelta, *, last_turn: bool,
                   room: int) -> bool:
    """The environment's answer to the turn just sampled: its reward and info, and unless the episode ends, its
    messages as context ids (mask 0), cut to leave `room` - len(ids) for what follows. Returns whether the
    episode goes on."""
    ids: list[int] | None = None
    ends = error is None and (response.done or ep.truncated or last_turn)
    cut = 0
    if error is None and not ends:
        try:
            # (one id less where the end of turn goes in first, below)
            ids, cut = _fit_answer(response.messages, delta,
                                   room - len(ep.ids) - (0 if delta.closes_turn(ep.ids[-1]) else 1))
        except Exception as e:  # messages the chat template refuses (an unknown role, a missing field)
            error = f"the chat template refused the environment's messages: {type(e).__name__}: {e}"[:500]
    if error is not None:
        ep.rewards.append(None)
        ep.infos.append({"env_error": error})
        ep.finish = "env_error"
        return False
    ep.rewards.append(response.reward)
    ep.infos.append(dict(response.info) | ({"env_tokens_cut": cut} if cut else {}))
    if ends:
        # done; or cut at its token limit (no end of turn to append an answer to); or out of turns
        ep.finish = "done" if response.done else ("length" if ep.truncated else "max_turns")
        return False
    if not delta.closes_turn(ep.ids[-1]):
        # the turn ended on a stop token the template does not close turns with (an <|endoftext|> where it closes
        # them with <|im_end|>): its end of turn goes in as an environment id, so the next turn reads the turn
        # closed as the template closes turns; the sampled stop token stays, as sampled
        ids = [delta.end_id] + ids
    ep.ids += ids
    ep.mask += [0] * len(ids)
    ep.logprobs += [0.0] * len(ids)
    return True


def _fit_answer(messages: list[dict[str, Any]], delta: TemplateDelta, budget: int) -> tuple[list[int], int]:
    """The answer's ids, its longest message content shortened (in tokens, from its original text, with a note)
    until the ids fit in `budget` tokens; and how many tokens were cut. An answer that cannot fit even cut is left
    whole: the episode then ends at its token budget, as before."""
    whole = delta.after_turn(messages)
    if len(whole) <= budget:
        return whole, 0
    tok = delta.tokenizer
    texts = [(len(tok(m["content"], add_special_tokens=False)["input_ids"]), k)
             for k, m in enumerate(messages) if isinstance(m.get("content"), str) and m["content"]]
    if not texts:
        return whole, 0
    _, k = max(texts)
    original = tok(messages[k]["content"], add_special_tokens=False)["input_ids"]
    note = " [... {} tokens cut: the episode's budget (max_episode_tokens) keeps room for the answer]"
    keep, ids, cut = len(original), whole, [dict(m) for m in messages]
    for _ in range(4):  # each pass cuts the original text shorter by what is still over (the note's tokens too)
        over = len(ids) - budget
        if over <= 0:
            break
        keep = max(0, keep - over - (2 if keep < len(original) else
                                     len(tok(note.format(len(original)), add_special_tokens=False)["input_ids"]) + 2))
        cut[k]["content"] = tok.decode(original[:keep]) + note.format(len(original) - keep)
        ids = delta.after_turn(cut)
        if keep == 0:
            break
    if len(ids) > budget:
        return whole, 0
    return ids, len(whole) - len(ids)


def _environment_name(env: Any) -> str:
    return type(env).__name__


def _short(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 (a repr that raises)
        text = "(no repr)"
    return text if len(text) <= 80 else text[:77] + "..."


def check_messages(messages: Any, env: Any, method: str) -> None:
    """Raise a TypeError naming the environment and method when `messages` is not a list of chat messages with text
    content (a dict as content is rendered as a Python repr by some templates and refused by others)."""
    where = f"{_environment_name(env)}.{method}"
    if not isinstance(messages, list):
        raise TypeError(f"{where} returned {type(messages).__name__} {_short(messages)} as its messages; expected a "
                        "list of chat messages, e.g. [{'role': 'user', 'content': '...'}]")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TypeError(f"{where}: a message is {_short(m)}; each must be a dict with a 'role' (str) and a "
                            "'content'")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise TypeError(f"{where}: a {m['role']!r} message's content is a {type(content).__name__} "
                            f"({_short(content)}); chat templates render text: give a string (json.dumps it for "
                            "structured data)")


def checked_reset(env: Any, row: dict[str, Any]) -> list[dict[str, Any]]:
    """`env.reset(row)`, its return value checked (`check_messages`)."""
    messages = env.reset(row)
    check_messages(messages, env, "reset")
    return messages


def checked_step(env: Any, text: str) -> EnvResponse:
    """`env.step(text)`, its return value checked: an EnvResponse whose messages are chat messages with text."""
    response = env.step(text)
    if not isinstance(response, EnvResponse):
        raise TypeError(f"{_environment_name(env)}.step returned {type(response).__name__} {_short(response)}; "
                        "expected toolkit.core.environments.EnvResponse(messages=[...], reward=..., done=...)")
    if not response.done:
        check_messages(response.messages, env, "step")
    return response


class _Calls:
    """Environment calls, at most `concurrency` running at once on daemon threads, each within `timeout` seconds
    of its own start. A call that times out is abandoned: its slot goes to the next call, and its thread (a daemon)
    neither blocks later calls nor the interpreter's exit."""

    def __init__(self, concurrency: int, timeout: float | None, on_wait: Callable[[], None] | None):
        self.concurrency, self.timeout, self.on_wait = max(1, concurrency), timeout, on_wait

    def run(self, fns: Sequence[Callable[[], Any]]) -> list[tuple[Any, str | None]]:
        import time

        results: list[tuple[Any, str | None] | None] = [None] * len(fns)
        finished = threading.Condition()
        pending = list(range(len(fns)))[::-1]
        running: dict[int, float] = {}  # call -> start time

        def work(k: int) -> None:
            try:
                outcome: tuple[Any, str | None] = (fns[k](), None)
            except BaseException as e:  # a broken environment costs its episode, not the run
                outcome = (None, f"{type(e).__name__}: {e}"[:500])
            with finished:
                if results[k] is None:  # not given up on meanwhile
                    results[k] = outcome
                finished.notify_all()

        with finished:
            while pending or running:
                while pending and len(running) < self.concurrency:
                    k = pending.pop()
                    running[k] = time.monotonic()
                    threading.Thread(target=work, args=(k,), name="toolkit-env", daemon=True).start()
                finished.wait(timeout=0.1)
                now = time.monotonic()
                for k, began in list(running.items()):
                    if results[k] is not None:
                        del running[k]
                    elif self.timeout is not None and now - began > self.timeout:
                        results[k] = (None, f"no answer within environment_step_timeout={self.timeout:g} s")
                        del running[k]
                if self.on_wait is not None:
                    self.on_wait()
        return [r if r is not None else (None, "lost") for r in results]


class _FactoryFailed:
    """Stands in for an environment whose factory raised: its reset raises the same error, so the episode ends as
    `env_error` (out of the loss) like any failed reset, and the run and the other ranks go on."""

    def __init__(self, error: str):
        self.error = error

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        raise RuntimeError(self.error)

    def step(self, text: str) -> EnvResponse:  # never reached: the episode ends at its reset
        raise RuntimeError(self.error)


def fresh_environments(factory: Callable[[], Any], n: int) -> list[Any]:
    """`n` fresh environments from `factory`. One whose construction raises becomes a failed episode (`env_error`)
    instead of an exception, as a failed reset does: a transient failure (a sandbox slot, a connection) costs its
    episode, not the run. When every one of the `n` raises, nothing could be trained on and the failure is not
    transient: that raises a ToolkitError with the last error."""
    envs: list[Any] = []
    failed = 0
    for _ in range(n):
        try:
            envs.append(factory())
        except Exception as e:  # noqa: BLE001 (a broken environment costs its episode, not the run)
            failed += 1
            last = e
            envs.append(_FactoryFailed(f"the environment factory raised {type(e).__name__}: {e}"[:500]))
    if n and failed == n:
        raise ToolkitError(f"environment: the factory raised for every one of the {n} episodes of this round "
                           f"(last: {type(last).__name__}: {last}); nothing could be trained on.") from last
    return envs


def group_sampler(backend: Any, sampling: Any, *, seed: int, n_rows: int, group_size: int = 1) -> BatchSampler:
    """The batched sampler GRPO's episodes use (in the trainer and in async GRPO's worker): each turn one
    `backend.generate` call seeded by (seed, turn). Rows come in groups of `group_size`; when a turn's contexts
    are all the rows and a group's contexts are equal (the first turn of a deterministic reset), the group is one
    prompt with `n = group_size` (one prefill)."""
    turn = [0]

    def sample(contexts: list[list[int]]) -> list[Completion]:
        k, turn[0] = turn[0], turn[0] + 1
        s = (seed + 104_729 * k) % (2**63)
        firsts = contexts[::group_size]
        if group_size > 1 and len(contexts) == n_rows and all(
                contexts[i] == firsts[i // group_size] for i in range(len(contexts))):
            groups = backend.generate(firsts, sampling, n=group_size, seed=s)
            return [c for g in groups for c in g]
        return [g[0] for g in backend.generate(contexts, sampling, n=1, seed=s)]

    return sample


def episode_reward(ep: Episode, unfinished: float | None) -> float:
    """The reward an episode trains with: NaN (out of the loss) when its environment failed, whatever it had given
    before; its reward otherwise; `unfinished` (NaN when None) when it ran out of turns or tokens before any."""
    if ep.finish == "env_error":
        return float("nan")
    if ep.reward is not None:
        return ep.reward
    return float("nan") if unfinished is None else float(unfinished)


def environment_wait_metrics(environment_s: float, generation_s: float) -> dict[str, float]:
    """What a round logs about its waits (`run_episodes(timings=...)`): the seconds its episodes waited for their
    environments, and their share of the round's generation time. In lockstep nothing decodes during those waits,
    so the share says how latency-bound the rollouts are. Async GRPO overlaps waits with training; on cores
    that generation and training share, the waits are the idle time overlap can win back (their share of the
    whole step, training included, bounds that gain at equal work)."""
    return {"episodes/environment_s": environment_s,
            "episodes/environment_share": environment_s / generation_s if generation_s > 0 else 0.0}


def episode_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    """What a round of episodes logs: turns, tool calls and errors per episode, sampled ids, how they ended."""
    n = max(len(episodes), 1)
    return {
        "episodes/turns_mean": sum(len(ep.turns) for ep in episodes) / n,
        "episodes/tool_calls_mean": sum(ep.count("tool_calls") for ep in episodes) / n,
        "episodes/tool_errors_mean": sum(ep.count("tool_errors") for ep in episodes) / n,
        "episodes/sampled_tokens_mean": sum(sum(ep.mask) for ep in episodes) / n,
        "episodes/env_errors": float(sum(ep.finish == "env_error" for ep in episodes)),
        # environment tokens cut so an answer still fits the episode's budget (answer_reserve), per episode
        "episodes/env_tokens_cut_mean": sum(ep.count("env_tokens_cut") for ep in episodes) / n,
        **{f"episodes/finish_{k}": sum(ep.finish == k for ep in episodes) / n
           for k in ("done", "max_turns", "max_tokens", "length")},
    }


# ----------------------------------------------------------------------------------------------- tools

@dataclass
class ToolCall:
    """A tool call parsed from a model turn. `error`: why it could not be parsed (then `name`/`arguments` may be
    empty); the environment answers it with that error as a tool message instead of failing the episode."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


# format -> (opening tag, closing tag or None: to the end of the turn, key of the arguments)
TOOL_CALL_FORMATS = {
    "hermes": ("<tool_call>", "</tool_call>", "arguments"),     # Hermes 2 Pro, Qwen 2.5/3, SmolLM3
    "llama3": ("<|python_tag|>", None, "parameters"),           # Llama 3.1+ (also a bare JSON object, see below)
    "mistral": ("[TOOL_CALLS]", None, "arguments"),             # a JSON list of calls
}


def _decode_json_values(text: str) -> list[Any]:
    """Every top-level JSON value in `text` separated by whitespace, ';' or ','; raises ValueError otherwise."""
    import json

    decoder = json.JSONDecoder()
    values, i = [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
        if i >= len(text):
            break
        value, i = decoder.raw_decode(text, i)
        values.append(value)
    return values


def _as_call(obj: Any, key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, f"a tool call is a JSON object with a \"name\" string, got {str(obj)[:200]!r}")
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            import json

            args = json.loads(args)
        except ValueError:
            return ToolCall(obj["name"], {}, f"the arguments of {obj['name']!r} are not JSON: {args[:200]!r}")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, f"the arguments of {obj['name']!r} must be a JSON object, got {args!r}")
    return ToolCall(obj["name"], args)


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall]:
    """The tool calls in a model turn, in order ([] when it makes none: a final answer).

    hermes: each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. llama3: `<|python_tag|>` then
    JSON objects separated by ';', or the whole turn one JSON object with "name" and "parameters". mistral:
    `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}. A call that does not parse becomes a ToolCall with
    `error` set, so the model is told what was wrong."""
    if fmt not in TOOL_CALL_FORMATS:
        raise ConfigError(f"tool_call_format: {fmt!r} is not one of {sorted(TOOL_CALL_FORMATS)}.")
    start, end, key = TOOL_CALL_FORMATS[fmt]
    calls: list[ToolCall] = []
    if end is not None:
        pos = 0
        while (a := text.find(start, pos)) >= 0:
            b = text.find(end, a + len(start))
            body = text[a + len(start): b if b >= 0 else len(text)]
            pos = len(text) if b < 0 else b + len(end)
            try:
                values = _decode_json_values(body.strip())
            except ValueError as e:
                calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e}): {body.strip()[:200]!r}"))
                continue
            calls += [_as_call(v, key) for v in values] or [ToolCall("", {}, "an empty tool call")]
        return calls
    stripped = text.strip()
    if start in stripped:
        body = stripped.split(start, 1)[1]
    elif fmt == "llama3" and stripped.startswith("{") and '"name"' in stripped:
        body = stripped  # Llama 3's JSON-only tool call, no tag
    else:
        return []
    try:
        values = _decode_json_values(body.strip())
    except ValueError as e:
        return [ToolCall("", {}, f"the tool call is not valid JSON ({e}): {body.strip()[:200]!r}")]
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return [_as_call(v, key) for v in flat] or [ToolCall("", {}, "an empty tool call")]


class ToolBox:
    """Named Python functions the model may call. `run(call)` -> (text for the tool message, failed?).

    Each call runs in a worker thread with `timeout` seconds; an exception, a wrong argument, an unknown tool or a
    timeout becomes an error message to the model ("error: ..."), never an exception in the trainer. A thread
    cannot be killed: a tool that can hang or run untrusted code belongs in the sandbox (toolkit.core.sandbox),
    which kills the process on its own timeout. Results are cut to `max_chars`."""

    def __init__(self, tools: Sequence[Callable[..., Any]] | dict[str, Callable[..., Any]], *, timeout: float = 10.0,
                 max_chars: int = 4000):
        self.tools = dict(tools) if isinstance(tools, dict) else {t.__name__: t for t in tools}
        self.timeout, self.max_chars = timeout, max_chars

    @property
    def schemas(self) -> list[Callable[..., Any]]:
        """What `apply_chat_template(tools=...)` takes: the functions (their docstrings give the JSON schema)."""
        return list(self.tools.values())

    def run(self, call: ToolCall) -> tuple[str, bool]:
        import inspect
        import threading

        if call.error:
            return f"error: {call.error}", True
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: there is no tool named {call.name!r}; the tools are {sorted(self.tools)}", True
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return f"error: wrong arguments for {call.name}: {e}", True
        outcome: dict[str, Any] = {}

        def work():
            try:
                outcome["result"] = fn(**call.arguments)
            except BaseException as e:  # the tool's own failure is the model's information, not the trainer's crash
                outcome["error"] = e

        # a daemon thread per call: a tool that never returns is abandoned, and neither blocks later calls nor
        # the interpreter's exit
        worker = threading.Thread(target=work, name=f"toolkit-tool-{call.name}", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            return f"error: {call.name} gave no result within {self.timeout:g} s", True
        if "error" in outcome:
            e = outcome["error"]
            return f"error: {type(e).__name__}: {e}", True
        result = outcome.get("result")
        text = result if isinstance(result, str) else str(result)
        if len(text) > self.max_chars:
            text = text[:self.max_chars] + f"... [cut at {self.max_chars} characters]"
        return text, False


class ToolEnvironment:
    """A tool-use episode: the model either calls tools (answered with tool messages) or gives its final answer,
    which `reward(text, row)` scores (the episode ends). `max_tool_turns`: after this many tool turns the next
    turn is the last (its text is scored whatever it holds). Counts `tool_calls` and `tool_errors` per turn."""

    def __init__(self, tools: ToolBox, reward: Callable[[str, dict[str, Any]], float], *, fmt: str = "hermes",
                 system_prompt: str | None = None, max_tool_turns: int = 4):
        if fmt not in TOOL_CALL_FORMATS:
            raise ConfigError(f"tool_call_format: {fmt!r} is not one of {sorted(TOOL_CALL_FORMATS)}.")
        self.toolbox, self.reward_fn, self.fmt = tools, reward, fmt
        self.system_prompt, self.max_tool_turns = system_prompt, max_tool_turns
        self.tools = tools.schemas
        self.row: dict[str, Any] = {}
        self.tool_turns = 0

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        self.row, self.tool_turns = dict(row), 0
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, text: str) -> EnvResponse:
        calls = parse_tool_calls(text, self.fmt)
        if not calls or self.tool_turns >= self.max_tool_turns:
            return EnvResponse(reward=float(self.reward_fn(text, self.row)), done=True,
                               info={"tool_calls": 0, "tool_errors": 0})
        self.tool_turns += 1
        messages, errors = [], 0
        for call in calls:
            content, failed = self.toolbox.run(call)
            errors += failed
            messages.append({"role": "tool", "name": call.name or "unknown", "content": content})
        return EnvResponse(messages=messages, info={"tool_calls": len(calls), "tool_errors": errors})


# ----------------------------------------------------------------------------------------- calculator

def calc(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with + - * / and parentheses.

    Args:
        expression: The expression to evaluate, for example "17 + 5 * (3 - 1)".
    """
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.USub: operator.neg, ast.UAdd: operator.pos}

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Mult) and max(abs(left), abs(right)) > 1e12:
                raise ValueError("numbers too large")
            return ops[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.operand))
        raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = ev(ast.parse(expression.strip(), mode="eval"))
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


# The calculator environment (builtin "calculator"). Models whose chat template renders `tools` see the schema
# there too; the embedded SmolLM2's template ignores `tools`, so the system prompt says how to call the tool.
CALCULATOR_SYSTEM_PROMPT = (
    'You have a calculator. To use it, reply with only <tool_call>{"name": "calc", "arguments": {"expression": '
    '"12 * 7"}}</tool_call> and you will get the result. Then reply with just the final number.')


def calculator_tool_call(expression: str) -> str:
    """The Hermes-format call of `calc` on `expression`, as the system prompt shows it (warm-up demonstrations)."""
    import json

    return "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expression": expression}}) + "</tool_call>"


def calculator_environment(*, max_tool_turns: int = 2, system_prompt: str | None = CALCULATOR_SYSTEM_PROMPT,
                           fmt: str = "hermes", timeout: float = 5.0,
                           latency: Sequence[float] | None = None) -> ToolEnvironment:
    """Multi-step arithmetic with a `calc` tool: the model may call it (up to `max_tool_turns` turns) and is
    rewarded 1.0 when its final answer's number equals the row's `answer`, else 0.0 (builtin:calculator rows).
    `latency` = (low, high): every step first waits a time drawn uniformly from that range, as a remote tool, a
    sandbox or a judge does (bench/agent_rollouts.py)."""
    from .rewards import parse_number

    def reward(text: str, row: dict[str, Any]) -> float:
        got = parse_number(text)
        return float(got is not None and got == parse_number(str(row["answer"])))

    if latency is not None:
        if len(latency) != 2 or not 0 <= latency[0] <= latency[1]:
            raise ConfigError(f"environment_kwargs: latency must be [low, high] seconds with 0 <= low <= high, got "
                              f"{list(latency)}.")
        return _SlowToolEnvironment(tuple(latency), ToolBox([calc], timeout=timeout), reward, fmt=fmt,
                                    system_prompt=system_prompt, max_tool_turns=max_tool_turns)
    return ToolEnvironment(ToolBox([calc], timeout=timeout), reward, fmt=fmt, system_prompt=system_prompt,
                           max_tool_turns=max_tool_turns)


class _SlowToolEnvironment(ToolEnvironment):
    """A ToolEnvironment whose every step waits first (calculator_environment(latency=...))."""

    def __init__(self, latency: tuple[float, float], *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        import random

        self.latency, self.draws = latency, random.Random()

    def step(self, text: str) -> EnvResponse:
        import time

        time.sleep(self.draws.uniform(*self.latency))
        return super().step(text)


# ------------------------------------------------------------------------------------------- adapters

class GymnasiumEnvironment:
    """A Gymnasium text environment as an `Environment`, unmodified: `env.reset(seed=..., options=row)` returns the
    first observation (a string: the user's opening message), `env.step(text)` returns (observation, reward,
    terminated, truncated, info); each turn's reward adds to the episode's, and the next observation is a `role`
    message. `env` is a `gymnasium.Env` (or an id for `gymnasium.make(env, **make_kwargs)`, so registered
    environments run by name: builtin environment "gymnasium"). The row's `seed` column seeds `reset`."""

    def __init__(self, env: Any, *, role: str = "user", system_prompt: str | None = None, **make_kwargs: Any):
        if isinstance(env, str):
            try:
                import gymnasium
            except ImportError as e:
                raise ConfigError("environment 'gymnasium' needs the gymnasium package: pip install 'toolkit[agents]'"
                                  ) from e
            try:
                env = gymnasium.make(env, **make_kwargs)
            except gymnasium.error.Error as e:
                raise ConfigError(f"environment_kwargs: gymnasium cannot make {env!r}: {e}") from None
        self.env, self.role, self.system_prompt = env, role, system_prompt

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        seed = row.get("seed")
        observation, _ = self.env.reset(seed=None if seed is None else int(seed), options=dict(row))
        messages = [{"role": "user", "content": _observation_text(observation, "reset")}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, text: str) -> EnvResponse:
        observation, reward, terminated, truncated, info = self.env.step(text)
        done = bool(terminated or truncated)
        counters = {k: info[k] for k in ("tool_calls", "tool_errors") if isinstance(info, dict) and k in info}
        return EnvResponse(messages=[] if done else [{"role": self.role, "content": _observation_text(observation,
                                                                                                    "step")}],
                           reward=float(reward), done=done, info=counters)


class TextArenaEnvironment:
    """A single-player TextArena game (`textarena.make(env_id)`, e.g. "GuessTheNumber-v0-raw"), unmodified: the
    game's observations since the model's last move become one user message; the episode's reward is the game's
    reward for player 0 when it ends (`env.close()`). The row's `seed` column seeds the game (builtin environment
    "textarena", environment_kwargs = {env_id = ...}). Use the "-raw" ids: TextArena's default wrappers re-send
    the whole history as each observation, which an episode that extends its ids would hold twice.

    TextArena games draw from Python's global random generator (and seed it in reset). Episodes run on threads,
    so every call into a game holds one lock and runs with that game's own generator state (saved and restored
    around the call): each game sees the draws it would see alone, whatever the threads' order."""

    def __init__(self, env_id: str, **make_kwargs: Any):
        try:
            import textarena
        except ImportError as e:
            raise ConfigError("environment 'textarena' needs the textarena package: pip install 'toolkit[agents]'"
                              ) from e
        try:
            self.env = textarena.make(env_id, **make_kwargs)
        except (ValueError, ImportError, TypeError) as e:
            raise ConfigError(f"environment_kwargs: textarena cannot make {env_id!r}: {e}") from None
        self.env_id = env_id
        self._random_state: Any = None

    def _in_own_random(self, fn: Callable[[], Any]) -> Any:
        import random

        with _TEXTARENA_LOCK:
            outer = random.getstate()
            if self._random_state is not None:
                random.setstate(self._random_state)
            try:
                return fn()
            finally:
                self._random_state = random.getstate()
                random.setstate(outer)

    def _observation(self) -> str:
        import textarena

        _, observation = self.env.get_observation()
        if isinstance(observation, str):
            return observation
        # raw observations: (from_id, message, type) since the last call; the model's own moves are already in
        # its context (as the ids it sampled), so they are not repeated
        return "\n".join(str(message) for from_id, message, kind in observation
                         if kind != textarena.ObservationType.PLAYER_ACTION)

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        seed = row.get("seed")
        self._random_state = None

        def reset() -> str:
            self.env.reset(num_players=1, seed=None if seed is None else int(seed))
            return self._observation()

        return [{"role": "user", "content": self._in_own_random(reset)}]

    def step(self, text: str) -> EnvResponse:
        return self._in_own_random(lambda: self._step(text))

    def _step(self, text: str) -> EnvResponse:
        done, _ = self.env.step(text)
        if done:
            rewards, _ = self.env.close()
            return EnvResponse(reward=float(rewards[0]), done=True)
        return EnvResponse(messages=[{"role": "user", "content": self._observation() or "(no change)"}])


_TEXTARENA_LOCK = threading.Lock()


def _observation_text(observation: Any, where: str) -> str:
    if not isinstance(observation, str):
        raise TypeError(f"a Gymnasium text environment returns string observations; {where}() returned "
                        f"{type(observation).__name__}")
    return observation
