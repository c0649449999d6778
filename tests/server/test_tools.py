"""Tool calls in chat completions through the real `openai` client: a named call and
"required" guided by the tools' schemas, "auto" parsed from the model's text (hermes), streamed
and not; and the requests that cannot be answered so are a 400 naming the field."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from slora import SamplingParams
from slora.server.errors import APIError
from slora.server.tools import ToolChoice

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
# what a Hermes-style model writes when it calls a tool, forced here with guided_regex
CALL = (r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}'
        r'</tool_call>')


def test_hermes_text_splits_into_content_and_calls():
    auto = ToolChoice("auto")
    text = ('Let me check. <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>'
            '<tool_call>{"name": "b", "parameters": {}}</tool_call>')
    content, calls, reason = auto.split(text)
    assert content == "Let me check." and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("a", {"x": 1}), ("b", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert ToolChoice("auto", single=True).split(text)[1][0]["function"]["name"] == "a"
    assert auto.split("<tool_call>{not json</tool_call>") == (
        "<tool_call>{not json</tool_call>", [], None)
    assert auto.split("no call") == ("no call", [], None)
    assert [auto.sendable(t) for t in ("abc <tool", "abc <tool_call>{", "abc <")] == [4, 4, 4]


def test_llama3_json_output_is_calls_when_it_is_json():
    llama = ToolChoice("auto", parser="llama3_json")
    content, calls, reason = llama.split(' {"name": "a", "parameters": {"x": 1}}; '
                                         '{"name": "b", "arguments": {}}')
    assert content is None and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("a", {"x": 1}), ("b", {})]
    assert llama.split("The weather is fine.") == ("The weather is fine.", [], None)
    assert llama.split('{"no": "name"}') == ('{"no": "name"}', [], None)
    assert [llama.sendable(t) for t in ("  ", ' {"na', "Hello {")] == [0, 0, 7]


def test_mistral_calls_follow_the_tool_calls_token():
    """Both of Mistral's forms: a JSON list after [TOOL_CALLS], and NAME[ARGS]{...} after
    each [TOOL_CALLS]; the text before the first is the content."""
    mistral = ToolChoice("auto", parser="mistral")
    listed = 'Checking. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b"}]'
    named = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    for text, content in ((listed, "Checking."), (named, None)):
        got, calls, reason = mistral.split(text)
        assert got == content and reason == "tool_calls"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert mistral.split("[TOOL_CALLS] [{broken") == ("[TOOL_CALLS] [{broken", [], None)
    assert mistral.split("plain") == ("plain", [], None)
    assert [mistral.sendable(t) for t in ("ab [TOOL", "ab [TOOL_CALLS][", "ab")] == [3, 3, 2]


def test_granite_calls_follow_its_tool_call_token():
    granite = ToolChoice("auto", parser="granite")
    content, calls, reason = granite.split(
        'Sure.<|tool_call|>[{"name": "a", "arguments": {"x": 1}}, {"name": "b"}]')
    assert content == "Sure." and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("a", {"x": 1}), ("b", {})]
    assert granite.split("<|tool_call|>[{") == ("<|tool_call|>[{", [], None)
    assert [granite.sendable(t) for t in ("ok <|tool", "ok")] == [3, 2]


def test_pythonic_output_is_calls_when_it_is_a_list_of_calls():
    py = ToolChoice("auto", parser="pythonic")
    content, calls, reason = py.split('[get_weather(city="Paris", days=[1, 2]), now()]')
    assert content is None and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}), ("now", {})]
    for text in ("It is sunny.", "[1, 2]", "[f(x)]", "[f(a=g())]", "[f(a=1"):
        assert py.split(text) == (text, [], None), text
    assert [py.sendable(t) for t in (" ", " [get", "Hi [")] == [0, 0, 4]


def test_openai_calls_are_harmony_commentary_messages_to_functions():
    """gpt-oss's calls: commentary messages to functions.NAME, the recipient after the channel
    (with <|constrain|>) or before it; a commentary message to no function (a preamble) is
    not a call; the text before the first call is the content."""
    oai = ToolChoice("auto", parser="openai")
    text = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
            '{"city": "Paris"}<|call|>'
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>'
            '{"zone": "UTC"}<|call|>')
    content, calls, reason = oai.split("Checking." + text)
    assert content == "Checking." and reason == "tool_calls"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]
    preamble = "<|channel|>commentary<|message|>Let me look.<|end|>"
    assert oai.split(preamble) == (preamble, [], None)
    broken = "<|channel|>commentary to=functions.f<|message|>{oops"
    assert oai.split(broken) == (broken, [], None)
    assert [oai.sendable(t) for t in ("ok <|channel|>comm", "ok to=functions.f", "ok")] == [
        3, 3, 2]


def test_requests_that_cannot_be_answered_are_400():
    def error(*args):
        with pytest.raises(APIError) as e:
            ToolChoice.of(*args)
        return e.value.status, e.value.param, str(e.value)

    assert error([WEATHER], "auto", True, None, False)[:2] == (400, "tool_choice")
    assert "--tool-call-parser" in error([WEATHER], "auto", True, None, False)[2]
    assert error([WEATHER], {"type": "function", "function": {"name": "nope"}}, True, "hermes",
                 False)[1] == "tool_choice"
    assert error([{"type": "function", "function": {}}], None, True, None, False)[1] == "tools.0"
    assert error([WEATHER], "required", True, None, True)[1] == "tool_choice"
    assert error(None, "required", True, None, False)[1] == "tool_choice"
    assert ToolChoice.of([WEATHER], None, True, None, False).mode == "none"
    assert ToolChoice.of([WEATHER], None, True, "hermes", False).mode == "auto"


def test_named_required_and_auto_calls_over_openai(serve, reference):
    params = WEATHER["function"]["parameters"]
    named_want = reference.generate(_prompt(reference), SamplingParams(
        max_tokens=32, temperature=0, guided_json=params))[0]
    with serve(tool_call_parser="hermes") as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny-llama", messages=CHAT, tools=[WEATHER, TIME], max_tokens=96,
                  temperature=0)
        named = client.chat.completions.create(**kw, tool_choice={
            "type": "function", "function": {"name": "get_weather"}}).choices[0]
        required = client.chat.completions.create(**kw, tool_choice="required",
                                                  parallel_tool_calls=False).choices[0]
        auto = client.chat.completions.create(**kw, extra_body={"guided_regex": CALL}).choices[0]
        none = client.chat.completions.create(**kw, tool_choice="none",
                                              extra_body={"guided_regex": CALL}).choices[0]
        chunks = list(client.chat.completions.create(**kw, stream=True,
                                                     extra_body={"guided_regex": CALL}))
        refused = httpx.post(f"{live.url}/v1/chat/completions", json={
            **{k: v for k, v in kw.items() if k != "model"}, "tool_choice": "required",
            "guided_regex": "a"})
    call = named.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.function.arguments == named_want.text
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert named.finish_reason == "stop" and named.message.content is None
    assert required.finish_reason == "tool_calls" and len(required.message.tool_calls) == 1
    assert required.message.tool_calls[0].function.name in ("get_weather", "get_time")
    assert auto.finish_reason == "tool_calls" and auto.message.content == "Sure."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in auto.message.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert none.message.tool_calls is None and none.message.content.startswith("Sure. <tool_call>")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    streamed = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert text == "Sure. " and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        ("get_weather", '{"city": "Paris"}')]
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"


def _prompt(reference) -> list[int]:
    tok = reference.tokenizer
    return [tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)]
