"""Token-exact multi-turn episodes: over 1,000 generated episodes (>= 8 turns each) on 5 chat templates, the
context each turn was sampled from and the ids sampled are exactly the ids the trainer scores, the environment's
ids are the template's, and the loss gives environment ids exactly zero gradient.

The policy here samples random token ids (the subject is the bookkeeping, not the model); a real-model episode
with the embedded SmolLM2 and the transformers backend is the last test. The control test shows that
re-rendering the conversation from text, what a trainer without token bookkeeping does, mismatches.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoTokenizer

from toolkit import embedded_model_path
from toolkit.core.environments import EnvResponse, Episode, TemplateDelta, run_episode
from toolkit.core.errors import ConfigError
from toolkit.core.generation import Completion
from toolkit.core.numerics import aggregate, clipped_surrogate

# Five templates, written for this test in the shape of widely used families (not copied from any model):
# ChatML with a default system prompt (the embedded model's own), a Qwen3-like one that drops <think> blocks from
# earlier assistant turns and wraps tool results in a user turn, Llama-3-like headers, a Mistral-like one that
# trims content and has no end-of-turn token but </s>, and a Gemma-like one (assistant -> "model", no system role).
QWEN3_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set c = m.content %}"
    "{%- if not loop.last and '</think>' in c %}{%- set c = c.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.last and '</think>' not in c %}{%- set c = '<think>\\n\\n</think>\\n\\n' + c %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
LLAMA3_LIKE = (
    "{{- '<|begin_of_text|>' }}"
    "{%- for m in messages %}{%- set role = 'ipython' if m.role == 'tool' else m.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + m.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
MISTRAL_LIKE = (
    "{{- '<s>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '[INST] ' + m.content | trim + ' [/INST]' }}"
    "{%- elif m.role == 'tool' %}{{- '[TOOL_RESULTS] ' + m.content | trim + ' [/TOOL_RESULTS]' }}"
    "{%- else %}{{- m.content | trim + '</s>' }}{%- endif %}"
    "{%- endfor %}")
GEMMA_LIKE = (
    "{%- for m in messages %}{%- set role = 'model' if m.role == 'assistant' else 'user' %}"
    "{{- '<start_of_turn>' + role + '\\n' + m.content | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}")

EXTRA_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>",
                 "<end_of_turn>", "[INST]", "[/INST]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "<s>", "</s>"]
# name -> (template or None for the tokenizer's own, end-of-turn text, renders history as sampled?)
TEMPLATES = {
    "chatml-default-system": (None, "<|im_end|>", True),
    "qwen3-like-drops-think": (QWEN3_LIKE, "<|im_end|>", False),
    "llama3-like": (LLAMA3_LIKE, "<|eot_id|>", False),
    "mistral-like-trims": (MISTRAL_LIKE, "</s>", False),
    "gemma-like": (GEMMA_LIKE, "<end_of_turn>", False),
}
# Tool results with the edge cases that break text round trips
EDGE_TEXTS = ["", " ", "  leading spaces", "trailing spaces  ", "\n\nnewlines\n\n", "\t tab\tinside", "a\r\nb",
              "emoji 🤖🔧 and ZWJ 👩‍💻", "zero\u200bwidth", "CJK 漢字かな", "RTL مرحبا", "combining e\u0301 vs é",
              "{\"json\": [1, 2, {\"k\": null}]}", "tokens</think> and <think>", "   ", "1e-5 * 3.0 = 0.00003",
              "very " * 40 + "long"]


@pytest.fixture(scope="module")
def tokenizer():
    tok = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    tok.add_special_tokens({"additional_special_tokens": EXTRA_SPECIAL})
    return tok


def make_delta(tokenizer, name):
    template, end_text, _ = TEMPLATES[name]
    kwargs = {"chat_template": template} if template else None
    return TemplateDelta(tokenizer, end_text=end_text, chat_template_kwargs=kwargs)


class RandomEnv:
    """Answers every turn with 1-3 tool/user messages of edge-case text; done after `turns` turns."""

    def __init__(self, rng: random.Random, turns: int):
        self.rng, self.turns, self.seen = rng, turns, 0
        self.answers: list[list[dict]] = []  # the messages of each answer, in order

    def reset(self, row):
        return [{"role": "user", "content": row["question"]}]

    def step(self, text):
        self.seen += 1
        if self.seen >= self.turns:
            return EnvResponse(reward=1.0, done=True)
        messages = [{"role": self.rng.choice(["tool", "user"]), "content": self.rng.choice(EDGE_TEXTS)}
                    for _ in range(self.rng.randint(1, 3))]
        self.answers.append(messages)
        return EnvResponse(messages=messages, reward=0.0, info={"tool_calls": 1})


def conversation(tokenizer, question: str, ep: Episode, env: RandomEnv) -> list[dict]:
    """The episode as chat messages: each sampled turn's text (its stop token left out) and the answers."""
    messages = [{"role": "user", "content": question}]
    for i, (a, b) in enumerate(ep.turns):
        messages.append({"role": "assistant", "content": tokenizer.decode(ep.ids[a:b - 1])})
        if i < len(env.answers):
            messages += env.answers[i]
    return messages


_ORDINARY: dict[int, list[int]] = {}


def ordinary_ids(tokenizer) -> list[int]:
    """The vocabulary without special tokens (computed once per tokenizer)."""
    if id(tokenizer) not in _ORDINARY:
        special = set(tokenizer.all_special_ids)
        _ORDINARY[id(tokenizer)] = [i for i in range(len(tokenizer)) if i not in special]
    return _ORDINARY[id(tokenizer)]


class RandomPolicy:
    """Samples random ids (sometimes a <think> block first), ends with the stop id; records what it saw."""

    def __init__(self, tokenizer, rng: random.Random, stop_id: int):
        self.rng, self.stop_id = rng, stop_id
        self.think = tokenizer("<think>", add_special_tokens=False)["input_ids"]
        self.unthink = tokenizer("</think>", add_special_tokens=False)["input_ids"]
        self.vocab = ordinary_ids(tokenizer)
        self.calls: list[tuple[list[int], list[int]]] = []

    def __call__(self, prompt_ids):
        body = [self.rng.choice(self.vocab) for _ in range(self.rng.randint(0, 12))]
        if self.rng.random() < 0.4:
            body = self.think + [self.rng.choice(self.vocab) for _ in range(5)] + self.unthink + body
        ids = body + [self.stop_id]
        self.calls.append((list(prompt_ids), ids))
        return Completion(token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="stop")


def check_episode(ep: Episode, policy: RandomPolicy) -> int:
    """Mismatches between what was sampled (and from which context) and what the trainer scores."""
    trained = ep.prompt_ids + ep.ids
    full_mask = [0] * len(ep.prompt_ids) + ep.mask
    bad = 0
    sampled_at = set()
    for (context, ids), (a, b) in zip(policy.calls, ep.turns):
        bad += trained[:len(context)] != context  # the context the turn was sampled from is a prefix
        bad += trained[len(context):len(context) + len(ids)] != ids
        bad += ep.ids[a:b] != ids
        sampled_at.update(range(len(ep.prompt_ids) + a, len(ep.prompt_ids) + b))
    bad += len(policy.calls) != len(ep.turns)
    bad += any(m != (i in sampled_at) for i, m in enumerate(full_mask))
    return bad


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_thousand_episodes_are_token_exact(tokenizer, name):
    """200 episodes per template (1,000 over the five), 8-10 turns each."""
    delta = make_delta(tokenizer, name)
    stop_id = tokenizer.convert_tokens_to_ids(TEMPLATES[name][1])
    # a str seed is hashed with SHA-512 by random.Random: the same episodes in every process (hash(name) is
    # randomised per interpreter by PYTHONHASHSEED, so a failure could not be reproduced)
    rng = random.Random(f"token-exact:{name}")
    mismatches = turns = 0
    for n in range(200):
        policy = RandomPolicy(tokenizer, rng, stop_id)
        env_turns = rng.randint(8, 10)
        env = RandomEnv(rng, env_turns)
        question = rng.choice(EDGE_TEXTS) or "start"
        ep = run_episode(env, {"question": question}, policy, delta, max_turns=10, max_tokens=10_000,
                         stop_token_ids=[stop_id])
        assert ep.finish == "done" and len(ep.turns) == env_turns >= 8
        assert ep.reward == 1.0 and ep.count("tool_calls") == env_turns - 1
        mismatches += check_episode(ep, policy)
        turns += len(ep.turns)
        if n < 20 and TEMPLATES[name][2]:
            # the environment's ids are the template's own: as text, the episode is the conversation the template
            # renders (for a template that renders history as it was sampled)
            kwargs = {"chat_template": TEMPLATES[name][0]} if TEMPLATES[name][0] else {}
            rendered = tokenizer.apply_chat_template(conversation(tokenizer, question, ep, env), tokenize=False,
                                                     **kwargs)
            assert rendered.startswith(tokenizer.decode(ep.prompt_ids + ep.ids))
    assert mismatches == 0
    assert turns >= 200 * 8


def test_environment_ids_are_what_the_template_renders_between_turns(tokenizer):
    """ChatML: the ids after a sampled turn are '\\n', the tool turn and the next generation prompt, exactly."""
    delta = make_delta(tokenizer, "chatml-default-system")
    got = tokenizer.decode(delta.after_turn([{"role": "tool", "content": " 42 \n"}]))
    assert got == "\n<|im_start|>tool\n 42 \n<|im_end|>\n<|im_start|>assistant\n"
    delta = make_delta(tokenizer, "llama3-like")
    got = tokenizer.decode(delta.after_turn([{"role": "tool", "content": " 42 \n"}]))
    assert got == "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|><|start_header_id|>assistant" \
                  "<|end_header_id|>\n\n"


@pytest.mark.slow
def test_rerendering_from_text_is_not_token_exact(tokenizer):
    """The control: rebuilding the ids by rendering the conversation from the decoded turns (what a trainer
    without token bookkeeping does) mismatches the sampled ids, on every template family here."""
    for name in TEMPLATES:
        template, end_text, _ = TEMPLATES[name]
        kwargs = {"chat_template": template} if template else {}
        stop_id = tokenizer.convert_tokens_to_ids(end_text)
        rng = random.Random(0)
        differing = 0
        for _ in range(20):
            policy, env = RandomPolicy(tokenizer, rng, stop_id), RandomEnv(rng, 8)
            ep = run_episode(env, {"question": "start"}, policy, make_delta(tokenizer, name), max_turns=10,
                             stop_token_ids=[stop_id])
            text = tokenizer.apply_chat_template(conversation(tokenizer, "start", ep, env), tokenize=False, **kwargs)
            rerendered = tokenizer(text, add_special_tokens=False)["input_ids"]
            trained = ep.prompt_ids + ep.ids
            differing += rerendered[:len(trained)] != trained
        assert differing > 0, name


def test_environment_ids_get_exactly_zero_gradient(tokenizer):
    """Through the policy loss the trainers use: d loss / d log p is exactly 0 on prompt and environment ids and
    non-zero on sampled ids; changing the log-probs of environment ids leaves the loss bit-identical."""
    rng = random.Random(1)
    for name in TEMPLATES:
        delta = make_delta(tokenizer, name)
        stop_id = tokenizer.convert_tokens_to_ids(TEMPLATES[name][1])
        policy = RandomPolicy(tokenizer, rng, stop_id)
        ep = run_episode(RandomEnv(rng, 8), {"question": "q"}, policy, delta, max_turns=10, stop_token_ids=[stop_id])
        mask = torch.tensor(ep.mask, dtype=torch.float32)[None]
        logps = torch.randn(1, len(ep.ids), dtype=torch.float64, requires_grad=True)
        old = logps.detach() + 0.1 * torch.randn_like(logps)
        per_token, _ = clipped_surrogate(logps, old, torch.tensor([[1.5]], dtype=torch.float64),
                                         epsilon_low=0.2, epsilon_high=0.28)
        loss = aggregate(per_token, mask, "token")
        loss.backward()
        env = mask[0] == 0
        assert env.any() and (~env).any()
        assert torch.all(logps.grad[0][env] == 0)
        assert (logps.grad[0][~env] != 0).any()
        moved = logps.detach().clone()
        moved[0][env] += 7.0
        per_token2, _ = clipped_surrogate(moved, old, torch.tensor([[1.5]], dtype=torch.float64),
                                          epsilon_low=0.2, epsilon_high=0.28)
        assert torch.equal(aggregate(per_token2, mask, "token"), loss.detach())


def test_templates_that_rewrite_history_work_and_unclosed_turns_are_refused_up_front(tokenizer):
    # renders the last assistant turn differently (as Qwen3 does with <think>): the delta uses only what follows
    # the anchor turn, so this is fine, and the ids after a turn are the template's
    template = ("{%- for m in messages %}{%- if m.role == 'assistant' and loop.last %}{{- 'LAST:' }}{%- endif %}"
                "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
                "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    delta = TemplateDelta(tokenizer, end_text="<|im_end|>", chat_template_kwargs={"chat_template": template})
    assert tokenizer.decode(delta.after_turn([{"role": "tool", "content": "1"}])) == \
        "\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>assistant\n"
    # assistant turns closed by another token than the one sampled: refused when the delta is built
    with pytest.raises(ConfigError, match="not closed by '<|eot_id|>'"):
        TemplateDelta(tokenizer, end_text="<|eot_id|>")
    # a template that closes an assistant turn differently when a tool answers it: refused up front too
    merging = ("{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}"
               "{%- if m.role == 'assistant' and not loop.last %}{{- '\\n' }}{%- else %}{{- '<|im_end|>\\n' }}"
               "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    with pytest.raises(ConfigError, match="when \\['tool'\\] messages follow it"):
        TemplateDelta(tokenizer, end_text="<|im_end|>", chat_template_kwargs={"chat_template": merging})


def test_episode_limits(tokenizer):
    delta = make_delta(tokenizer, "chatml-default-system")
    stop_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(3)
    ep = run_episode(RandomEnv(rng, 50), {"question": "q"}, RandomPolicy(tokenizer, rng, stop_id), delta,
                     max_turns=3, stop_token_ids=[stop_id])
    assert ep.finish == "max_turns" and len(ep.turns) == 3 and ep.mask[-1] == 1  # nothing appended after the last
    ep = run_episode(RandomEnv(rng, 50), {"question": "q"}, RandomPolicy(tokenizer, rng, stop_id), delta,
                     max_turns=50, max_tokens=60, stop_token_ids=[stop_id])
    assert ep.finish == "max_tokens" and len(ep.ids) >= 60

    def cut(prompt_ids):  # a turn that hit its token limit: no end of turn, so nothing can follow it
        return Completion(token_ids=[100, 101], logprobs=[-1.0, -1.0], finish_reason="length")

    ep = run_episode(RandomEnv(rng, 50), {"question": "q"}, cut, delta, max_turns=5, stop_token_ids=[stop_id])
    assert ep.finish == "length" and ep.ids == [100, 101] and ep.mask == [1, 1]
    with pytest.raises(ConfigError, match="max_turns"):
        run_episode(RandomEnv(rng, 5), {"question": "q"}, cut, delta, max_turns=0)


@pytest.mark.slow
def test_real_model_episode_is_token_exact():
    """The embedded SmolLM2 through the transformers backend: the ids sampled in each turn are the trained ids."""
    from transformers import AutoModelForCausalLM

    from toolkit.core.generation import SamplingParams, TransformersBackend

    path = str(embedded_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    backend = TransformersBackend(model, pad_token_id=tok.pad_token_id)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(max_tokens=12, temperature=1.0, stop_token_ids=(stop,))
    seen = []

    def sample(prompt_ids):
        out = backend.generate([prompt_ids], params, n=1, seed=len(seen))[0][0]
        if out.finish_reason == "length":  # keep the episode going: the test is about the bookkeeping
            out = Completion(out.token_ids[:-1] + [stop], out.logprobs, "stop")
        seen.append((list(prompt_ids), list(out.token_ids)))
        return out

    ep = run_episode(RandomEnv(random.Random(0), 8), {"question": "What is 2 + 3?"}, sample, TemplateDelta(tok),
                     max_turns=8, stop_token_ids=[stop])
    trained = ep.prompt_ids + ep.ids
    assert len(ep.turns) == 8
    for context, ids in seen:
        assert trained[:len(context)] == context and trained[len(context):len(context) + len(ids)] == ids
    # the backend's own log-probs of the sampled ids are what the episode keeps for the importance ratio
    assert len(ep.logprobs) == len(ep.ids) and all(lp <= 0 for lp, m in zip(ep.logprobs, ep.mask) if m)


LLAMA31_LIKE = (  # closes a built-in tool call turn with <|eom_id|> and every other turn with <|eot_id|>
    "{{- '<|begin_of_text|>' }}"
    "{%- for m in messages %}{%- set role = 'ipython' if m.role == 'tool' else m.role %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' + m.content | trim }}"
    "{%- if m.role == 'assistant' and m.get('tool_call') %}{{- '<|eom_id|>' }}{%- else %}{{- '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def _scripted_episode(delta, turns, stop_token_ids):
    """One episode whose policy samples `turns` in order and whose tool answers "4"; the texts the tool read."""
    read = []

    def policy(context):
        turn = turns[len(read)]
        return Completion(token_ids=turn, logprobs=[-0.5] * len(turn), finish_reason="stop")

    class Tool:
        def reset(self, row):
            return [{"role": "user", "content": "q"}]

        def step(self, text):
            read.append(text)
            return EnvResponse(messages=[{"role": "tool", "content": "4"}], reward=0.0, done=len(read) >= len(turns))

    return run_episode(Tool(), {}, policy, delta, max_turns=len(turns) + 1, stop_token_ids=stop_token_ids), read


def test_a_turn_ended_by_another_stop_token_gets_the_template_end_of_turn_as_an_environment_id(tokenizer):
    delta = make_delta(tokenizer, "chatml-default-system")
    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    other = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert delta.end_id == end_id and not delta.closes_turn(other) and delta.closes_turn(end_id)
    between = delta.after_turn([{"role": "tool", "content": "4"}])
    ep, read = _scripted_episode(delta, [[100, 101, other], [102, end_id], [103, other]], [end_id, other])
    # turn 1 ended on <|endoftext|>: <|im_end|> is added (masked); turn 2 ended on <|im_end|>: nothing is added
    assert ep.ids == [100, 101, other, end_id] + between + [102, end_id] + between + [103, other]
    assert ep.mask == [1, 1, 1, 0] + [0] * len(between) + [1, 1] + [0] * len(between) + [1, 1]
    assert ep.logprobs[3] == 0.0 and ep.logprobs[2] == -0.5
    assert read == [tokenizer.decode([100, 101]), tokenizer.decode([102]), tokenizer.decode([103])]  # stop dropped
    assert ep.finish == "done" and len(ep.turns) == 3


def test_a_stop_token_the_template_closes_turns_with_gets_nothing_inserted():
    tok = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    tok.add_special_tokens({"additional_special_tokens": EXTRA_SPECIAL + ["<|eom_id|>"]})
    delta = TemplateDelta(tok, end_text="<|eot_id|>", chat_template_kwargs={"chat_template": LLAMA31_LIKE})
    eot, eom = tok.convert_tokens_to_ids("<|eot_id|>"), tok.convert_tokens_to_ids("<|eom_id|>")
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    assert delta.closes_turn(eom) and not delta.closes_turn(endoftext)
    between = delta.after_turn([{"role": "tool", "content": "4"}])
    ep, _ = _scripted_episode(delta, [[100, eom], [101, endoftext], [102, eot]], [eot, eom, endoftext])
    assert ep.ids == [100, eom] + between + [101, endoftext, eot] + between + [102, eot]


def test_a_stop_token_inside_a_turn_that_the_template_writes_still_gets_the_end_of_turn():
    """Qwen-style: </tool_call> is an added, non-special token the template writes inside assistant turns; a turn
    stopped on it is not closed, so <|im_end|> goes in before the tool's answer."""
    tok = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # added, not special
    template = QWEN3_LIKE.replace("+ c + '<|im_end|>", "+ c + ('<tool_call>x</tool_call>' if m.tool_calls else '') + '<|im_end|>")
    delta = TemplateDelta(tok, end_text="<|im_end|>", chat_template_kwargs={"chat_template": template})
    end_id, call_end = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("</tool_call>")
    assert "</tool_call>" in delta._template_source and not delta.closes_turn(call_end)
    between = delta.after_turn([{"role": "tool", "content": "4"}])
    ep, _ = _scripted_episode(delta, [[100, call_end], [101, end_id]], [end_id, call_end])
    assert ep.ids == [100, call_end, end_id] + between + [101, end_id]


def test_an_end_text_of_several_tokens_is_refused_when_the_delta_is_built(tokenizer):
    with pytest.raises(ConfigError, match="end_text.*not one"):
        TemplateDelta(tokenizer, end_text="<|im_end|>\n", chat_template_kwargs=None)
