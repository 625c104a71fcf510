"""Tool calls: parsing the common formats, running tools with errors returned to the model, a tool episode."""

from __future__ import annotations

import time

import pytest
from transformers import AutoTokenizer

from toolkit import embedded_model_path
from toolkit.core.environments import (
    Episode,
    TemplateDelta,
    ToolBox,
    ToolCall,
    ToolEnvironment,
    calc,
    parse_tool_calls,
    run_episode,
)
from toolkit.core.errors import ConfigError
from toolkit.core.generation import Completion


def test_hermes_calls_one_or_several_and_broken_ones():
    text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "17 + 5"}}\n</tool_call>\n'
            '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>')
    calls = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calc", {"expression": "17 + 5"}, None), ("calc", {"expression": "2*3"}, None)]
    assert parse_tool_calls("The answer is 22.", "hermes") == []
    broken = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {"expression": </tool_call>', "hermes")
    assert len(broken) == 1 and "not valid JSON" in broken[0].error
    unclosed = parse_tool_calls('<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}', "hermes")
    assert unclosed[0].name == "calc" and unclosed[0].error is None
    nameless = parse_tool_calls('<tool_call>{"arguments": {}}</tool_call>', "hermes")
    assert "\"name\" string" in nameless[0].error


def test_llama3_and_mistral_calls():
    calls = parse_tool_calls('<|python_tag|>{"name": "calc", "parameters": {"expression": "3-1"}}; '
                             '{"name": "calc", "parameters": {"expression": "4"}}', "llama3")
    assert [c.arguments for c in calls] == [{"expression": "3-1"}, {"expression": "4"}]
    bare = parse_tool_calls(' {"name": "calc", "parameters": {"expression": "9"}} ', "llama3")
    assert bare == [ToolCall("calc", {"expression": "9"})]
    assert parse_tool_calls("It is 9.", "llama3") == []
    calls = parse_tool_calls('[TOOL_CALLS] [{"name": "calc", "arguments": {"expression": "1"}}, '
                             '{"name": "calc", "arguments": {"expression": "2"}}]', "mistral")
    assert [c.arguments["expression"] for c in calls] == ["1", "2"]
    with pytest.raises(ConfigError, match="tool_call_format: 'xml'"):
        parse_tool_calls("x", "xml")


def test_tool_failures_become_messages_to_the_model():
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "woke"

    def shout(text: str) -> str:
        """Repeat loudly.

        Args:
            text: What to repeat.
        """
        return text.upper() * 1000

    box = ToolBox([calc, slow, shout], timeout=0.5, max_chars=50)
    assert box.run(ToolCall("calc", {"expression": "17 + 5 * (3 - 1)"})) == ("27", False)
    assert box.run(ToolCall("calc", {"expression": "7 / 2"})) == ("3.5", False)
    text, failed = box.run(ToolCall("calc", {"expression": "1 / 0"}))
    assert failed and text.startswith("error: ZeroDivisionError")
    text, failed = box.run(ToolCall("calc", {"expression": "__import__('os').system('true')"}))
    assert failed and "only numbers" in text
    text, failed = box.run(ToolCall("calc", {"expr": "1"}))
    assert failed and "wrong arguments for calc" in text
    text, failed = box.run(ToolCall("search", {}))
    assert failed and "no tool named 'search'" in text and "'calc'" in text
    started = time.monotonic()
    text, failed = box.run(ToolCall("slow", {"seconds": 5}))
    assert failed and "no result within 0.5 s" in text and time.monotonic() - started < 2
    text, failed = box.run(ToolCall("shout", {"text": "ab"}))
    assert not failed and text.endswith("[cut at 50 characters]") and text.startswith("AB" * 25)
    assert box.run(ToolCall("", {}, "the tool call is not valid JSON"))[1]


def test_tool_schemas_reach_the_chat_template():
    tok = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    template = ("{%- if tools %}{{- '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
                "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    delta = TemplateDelta(tok, tools=[calc], chat_template_kwargs={"chat_template": template})
    prompt = tok.decode(delta.prompt_ids([{"role": "user", "content": "What is 2 + 3?"}]))
    assert '"name": "calc"' in prompt and '"expression"' in prompt and "17 + 5 * (3 - 1)" in prompt


def scripted(tok, turns: list[str]):
    """A policy that says the given turns (ids from the tokenizer), each ending with <|im_end|>."""
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    said = iter(turns)

    def sample(prompt_ids):
        ids = tok(next(said), add_special_tokens=False)["input_ids"] + [stop]
        return Completion(ids, [-0.5] * len(ids), "stop")

    return sample, stop


def test_calculator_episode_end_to_end():
    tok = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    env = ToolEnvironment(ToolBox([calc]), lambda text, row: float(text.strip().endswith(str(row["answer"]))),
                          max_tool_turns=3)
    turns = ['<tool_call>{"name": "calc", "arguments": {"expression": "17 + 5"}}</tool_call>',
             '<tool_call>{"name": "calc", "arguments": {"expression": "22 *"}}</tool_call>',
             "The answer is 22"]
    sample, stop = scripted(tok, turns)
    ep: Episode = run_episode(env, {"prompt": "What is 17 + 5?", "answer": 22}, sample, TemplateDelta(tok),
                              max_turns=6, stop_token_ids=[stop])
    assert ep.finish == "done" and len(ep.turns) == 3 and ep.reward == 1.0
    assert ep.count("tool_calls") == 2 and ep.count("tool_errors") == 1
    context = tok.decode(ep.prompt_ids + ep.ids)
    assert "<|im_start|>tool\n22<|im_end|>" in context and "error: SyntaxError" in context
    # the tool messages are context only
    tool_ids = tok("22", add_special_tokens=False)["input_ids"]
    first_tool = ep.turns[0][1]
    assert ep.mask[first_tool:ep.turns[1][0]] == [0] * (ep.turns[1][0] - first_tool)
    assert tool_ids[0] in ep.ids[first_tool:ep.turns[1][0]]


def test_tool_turn_budget_scores_the_last_turn():
    tok = AutoTokenizer.from_pretrained(str(embedded_model_path()))
    env = ToolEnvironment(ToolBox([calc]), lambda text, row: 0.5, max_tool_turns=1)
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call>'
    sample, stop = scripted(tok, [call, call, call])
    ep = run_episode(env, {"prompt": [{"role": "user", "content": "hi"}]}, sample, TemplateDelta(tok), max_turns=5,
                     stop_token_ids=[stop])
    assert len(ep.turns) == 2 and ep.finish == "done" and ep.reward == 0.5 and ep.count("tool_calls") == 1
