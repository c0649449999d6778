"""OpenAI's Responses API through the real `openai` client: text, instructions and a
conversation with a function call and its output, JSON output, a forced tool call, streamed
and not, each equal to the chat path's answer for the same turn; what it does not serve is a
400 naming the field."""

from __future__ import annotations

import json

import httpx
from openai import OpenAI

from slora import SamplingParams

from .conftest import BASE

TOOL = {"type": "function", "name": "get_weather", "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                       "required": ["city"]}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def chat_ids(reference, messages, adapter=None) -> list[int]:
    tok = reference.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


def test_responses_equal_the_chat_path(serve, reference):
    turn = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    want = reference.generate([chat_ids(reference, turn)],
                              SamplingParams(max_tokens=8), adapters="a0")[0]
    want_json = reference.generate([chat_ids(reference, turn[1:])], SamplingParams(
        max_tokens=32, guided_json=SCHEMA))[0]
    with serve() as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        res = client.responses.create(model="a0", instructions="Be brief.", input="Hi there",
                                      max_output_tokens=8, temperature=0)
        events = list(client.responses.create(model="a0", instructions="Be brief.",
                                              input=[{"role": "user", "content": "Hi there"}],
                                              max_output_tokens=8, temperature=0, stream=True))
        as_json = client.responses.create(model=BASE, input="Hi there", temperature=0,
                                          max_output_tokens=32, text={"format": {
                                              "type": "json_schema", "name": "x",
                                              "schema": SCHEMA}})
        called = client.responses.create(
            model=BASE, temperature=0, max_output_tokens=48, tools=[TOOL],
            tool_choice={"type": "function", "name": "get_weather"},
            input=[{"role": "user", "content": "Weather?"},
                   {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                    "arguments": '{"city": "Rome"}'},
                   {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
                   {"role": "user", "content": [{"type": "input_text", "text": "And Paris?"}]}])
        refused = httpx.post(f"{live.url}/v1/responses", json={
            "input": "Hi", "previous_response_id": "resp_1"})
        bad_tool = httpx.post(f"{live.url}/v1/responses", json={
            "input": "Hi", "tools": [{"type": "web_search"}]})
    assert res.output_text == want.text and res.usage.output_tokens == len(want.token_ids)
    assert res.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert res.usage.input_tokens == len(want.prompt_token_ids)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == res.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert as_json.output_text == want_json.text and json.loads(as_json.output_text)
    call = called.output[-1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "previous_response_id"
    assert bad_tool.status_code == 400 and bad_tool.json()["error"]["param"] == "tools.0"


def test_reasoning_comes_first_as_a_reasoning_item():
    """With a reasoning parser the reasoning is an item of its own before the message, whole
    and streamed (its deltas, then the message's at output index 1); tool calls are found in
    the content after it."""
    import asyncio
    from types import SimpleNamespace

    from slora.request import RequestOutput
    from slora.server.protocol import ResponsesRequest
    from slora.server.responses_api import _Turn
    from slora.server.tools import ToolChoice

    class Gen:  # the outputs of one request, a token of text at a time
        def __init__(self, pieces):
            self.pieces = pieces

        async def outputs(self):
            for k in range(1, len(self.pieces) + 1):
                done = k == len(self.pieces)
                yield 0, RequestOutput("r", None, [1, 2], "".join(self.pieces[:k]),
                                       list(range(k)), None, "stop" if done else None, done,
                                       None)

        def close(self):
            pass

    def run(pieces, tools=ToolChoice("none")):
        state = SimpleNamespace(settings=SimpleNamespace(reasoning_parser="qwen3",
                                                         model_name="m"),
                                tokenizer=None)
        turn = _Turn(state, ResponsesRequest(input="Hi"), Gen(pieces), tools)
        events = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(_collect(turn))]
        return turn.response(RequestOutput("r", None, [1, 2], "".join(pieces), [0], None,
                                           "stop", True, None)), events

    async def _collect(turn):
        return [e async for e in turn.events()]

    final, events = run(["<think>", "Pa", "ris", ".</think>", "\n\nSun", "ny."])
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "Paris."}]
    assert final["output"][1]["content"][0]["text"] == "Sunny."

    def deltas(kind):
        return [e for e in events if e["type"] == kind]
    assert "".join(e["delta"] for e in deltas("response.reasoning_text.delta")) == "Paris."
    assert all(e["output_index"] == 0 for e in deltas("response.reasoning_text.delta"))
    text = deltas("response.output_text.delta")
    assert "".join(e["delta"] for e in text) == "Sunny." and {e["output_index"] for e in text} \
        == {1}
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    assert kinds[-1] == "response.completed" and [e["sequence_number"] for e in events] == \
        list(range(len(events)))
    final, events = run(["<think>Look.</think> ", '<tool_call>{"name": "get_weather", ',
                         '"arguments": {"city": "Paris"}}</tool_call>'], ToolChoice("auto"))
    assert [i["type"] for i in final["output"]] == ["reasoning", "function_call"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1]


def test_reasoning_items_in_the_input_go_to_the_next_assistant_message():
    """A reasoning item's text is the reasoning_content of the assistant message (or function
    call) after it; a reasoning item whose content is not a list of parts is a 400."""
    import pytest

    from slora.server.errors import APIError
    from slora.server.protocol import ResponsesRequest
    from slora.server.responses_api import _chat_body

    body = ResponsesRequest(input=[
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Look it up."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])
    messages = _chat_body(body).messages
    assert [m.role for m in messages] == ["user", "assistant", "tool"]
    assert messages[1].reasoning_content == "Look it up." and messages[1].tool_calls
    assert messages[0].reasoning_content is None
    with pytest.raises(APIError) as e:
        _chat_body(ResponsesRequest(input=[{"type": "reasoning", "content": "text"}]))
    assert e.value.param == "input.0.content"
