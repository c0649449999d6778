"""Reasoning apart from content (slora.server.reasoning, `slora serve --reasoning-parser`):
each parser's cut of a finished output, the cut of every prefix settled (what a stream sends
is never taken back), and a chat answer through the real `openai` client, whole and streamed,
with reasoning and with tool calls after it."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from slora.server.reasoning import Reasoning
from tests.server.test_tools import CHAT, WEATHER

THOUGHT = "<think>\nThe user asks about Paris.\n</think>\n\nIt is sunny."
HARMONY = ("<|channel|>analysis<|message|>The user asks about Paris.<|end|><|start|>assistant"
           "<|channel|>final<|message|>It is sunny.<|return|>")


@pytest.mark.parametrize("parser, text, want", [
    ("qwen3", THOUGHT, ("\nThe user asks about Paris.\n", "It is sunny.")),
    ("qwen3", "It is sunny.", (None, "It is sunny.")),  # thinking off
    ("qwen3", "<think>cut short", ("cut short", "")),
    ("qwen3", "<", (None, "<")),  # finished on what might have begun a <think>: content
    ("deepseek_r1", THOUGHT, ("\nThe user asks about Paris.\n", "It is sunny.")),
    ("deepseek_r1", "No tag, thinking.</think> Answer.", ("No tag, thinking.", "Answer.")),
    ("deepseek_r1", "Still thinking", ("Still thinking", "")),
    ("gpt_oss", HARMONY, ("The user asks about Paris.", "It is sunny.")),
    ("gpt_oss", "<|channel|>final<|message|>It is sunny.", (None, "It is sunny.")),
    ("gpt_oss", "<|channel|>analysis<|message|>cut short", ("cut short", "")),
    ("gpt_oss", "<|channel|>analysis<|message|>a<|end|>", ("a", "")),  # no final message
    ("gpt_oss", "A plain answer.", (None, "A plain answer.")),
    ("gpt_oss", "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
                "<|channel|>final<|message|>Done.<|return|>", (None, "Done.")),  # a preamble
    ("gpt_oss", "<|channel|>commentary to=functions.f<|message|>{}<|call|>",
     (None, "<|channel|>commentary to=functions.f<|message|>{}<|call|>")),  # a call
])
def test_each_parser_cuts_reasoning_from_content(parser, text, want):
    parts = Reasoning(parser).parts(text, finished=True)
    assert (parts.reasoning, parts.content) == want
    # streamed: each prefix's parts extend the last's, and end where the whole's do
    last = ("", "")
    for k in range(len(text) + 1):
        p = Reasoning(parser).parts(text[:k], finished=k == len(text))
        now = (p.reasoning or "", p.content)
        assert now[0].startswith(last[0]) and now[1].startswith(last[1]), (k, now, last)
        assert "<" not in now[0] or parser == "qwen3" and k == len(text)
        last = now
    assert last == (want[0] or "", want[1])


def test_chat_answers_carry_reasoning_content(serve):
    with serve(reasoning_parser="qwen3", tool_call_parser="hermes") as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny-llama", messages=CHAT, max_tokens=240, temperature=0)
        force = r"<think>\nParis\.\n</think>\n\nSunny\."
        whole = client.chat.completions.create(**kw, extra_body={"guided_regex": force})
        chunks = list(client.chat.completions.create(**kw, stream=True,
                                                     extra_body={"guided_regex": force}))
        call = (r'<think>Look it up\.</think> <tool_call>\{"name": "get_weather", '
                r'"arguments": \{"city": "Paris"\}\}</tool_call>')
        tool = client.chat.completions.create(**kw, tools=[WEATHER],
                                              extra_body={"guided_regex": call})
        plain = client.chat.completions.create(**kw, extra_body={"guided_regex": "Sunny\\."})
    message = whole.choices[0].message
    assert message.content == "Sunny." and message.reasoning_content == "\nParis.\n"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "\nParis.\n"
    assert "".join(d.content or "" for d in deltas) == "Sunny."
    message = tool.choices[0].message
    assert message.reasoning_content == "Look it up." and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    assert tool.choices[0].finish_reason == "tool_calls"
    assert plain.choices[0].message.content == "Sunny."
    assert getattr(plain.choices[0].message, "reasoning_content", None) is None


def test_harmony_channels_through_the_chat_api(serve):
    """gpt-oss's parsers: the analysis channel's message as reasoning_content, the final
    channel's as content, whole and streamed (its markers kept in the output's text); a
    commentary message to a function after the analysis is a tool call (`openai`)."""
    force = (r"<\|channel\|>analysis<\|message\|>Paris\.<\|end\|><\|start\|>assistant"
             r"<\|channel\|>final<\|message\|>Sunny\.<\|return\|>")
    call = (r"<\|channel\|>analysis<\|message\|>Look\.<\|end\|><\|start\|>assistant"
            r"<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json"
            r'<\|message\|>\{"city": "Paris"\}<\|call\|>')
    with serve(reasoning_parser="gpt_oss", tool_call_parser="openai") as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny-llama", messages=CHAT, max_tokens=240, temperature=0)
        whole = client.chat.completions.create(**kw, extra_body={"guided_regex": force})
        chunks = list(client.chat.completions.create(**kw, stream=True,
                                                     extra_body={"guided_regex": force}))
        tool = client.chat.completions.create(**kw, tools=[WEATHER],
                                              extra_body={"guided_regex": call})
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("Paris.", "Sunny.")
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Paris."
    assert "".join(d.content or "" for d in deltas) == "Sunny."
    message = tool.choices[0].message
    assert (message.reasoning_content, message.content) == ("Look.", None)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
