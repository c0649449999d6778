"""OpenAI's Responses API: POST /v1/responses, one model turn answered as a Response object
(streamed as its typed events when `stream` is true), served through the chat path.

`input` (a string, or a list of messages, `function_call` / `function_call_output` items and
`reasoning` items, whose text goes to the assistant message after them as its
reasoning_content) and `instructions` (a system message first) become chat messages;
`max_output_tokens`, `temperature`, `top_p`, `text.format` (text, json_object, json_schema:
guided JSON), function `tools`, `tool_choice` and `parallel_tool_calls` become the chat
request's fields (`openai_api.open_chat`). The output is an assistant message of one `output_text` part, and a
`function_call` item per tool call (`slora.server.tools`). Status "incomplete" with reason
max_output_tokens where the output reached its length. With a server's `--reasoning-parser`
a thinking model's reasoning comes first, as a `reasoning` item of one `reasoning_text` part
(streamed as `response.reasoning_text.delta` events), and the message holds the content after
it; `usage.output_tokens_details.reasoning_tokens` counts the reasoning text's tokens (encoded
again).

Stateless: nothing is stored (the answer says `store: false`), so `previous_response_id` is
refused, as are `reasoning` other than its `effort` (the chat's `reasoning_effort`),
`include`, `background`, `truncation: auto`, `conversation`, `prompt`, and tools other than
functions.
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from slora.request import RequestOutput
from slora.server.errors import APIError, sse_error
from slora.server.generation import EventStream, Generation, until_disconnected
from slora.server.openai_api import open_chat
from slora.server.protocol import ChatCompletionRequest, ResponsesRequest
from slora.server.reasoning import Reasoning
from slora.server.state import ServerState
from slora.server.tools import ToolChoice

REFUSED = {"previous_response_id": lambda v: v is not None,
           "reasoning": lambda v: bool(set(v or {}) - {"effort"}),
           "include": lambda v: bool(v), "background": bool, "conversation": lambda v: bool(v),
           "prompt": lambda v: v is not None, "truncation": lambda v: v not in (None, "disabled")}


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await until_disconnected(request, _respond(state, body))


async def _respond(state: ServerState, body: ResponsesRequest):
    for field, asks in REFUSED.items():
        if asks(getattr(body, field)):
            raise APIError(400, f"{field} is not supported by slora's Responses API (it stores "
                           "nothing and serves function tools, text and JSON output)", field)
    gen, tools = await open_chat(state, _chat_body(body))
    turn = _Turn(state, body, gen, tools)
    if body.stream:
        try:
            await gen.wait_started()
        except BaseException:
            gen.close()
            raise
        return EventStream(turn.events())
    try:
        (out,) = await gen.finals()
    finally:
        gen.close()
    return JSONResponse(turn.response(out))


def _chat_body(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves a Responses request."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    thought = None  # a reasoning item's text, for the assistant message after it
    for i, item in enumerate(items):
        if isinstance(item, dict) and item.get("type") == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
                raise APIError(400, "a reasoning item's content is a list of reasoning_text "
                               "parts", f"input.{i}.content")
            thought = (thought or "") + "".join(str(p.get("text", "")) for p in parts)
            continue
        message = _message(item, f"input.{i}")
        if thought is not None and message["role"] == "assistant":
            message["reasoning_content"], thought = thought, None
        messages.append(message)
    fmt = (body.text or {}).get("format") or {"type": "text"}
    if fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise APIError(400, f"text.format type {fmt.get('type')!r}: expected text, json_object "
                       "or json_schema", "text.format")
    response_format = None if fmt["type"] == "text" else (
        {"type": "json_object"} if fmt["type"] == "json_object"
        else {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                     "schema": fmt.get("schema")}})
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise APIError(400, f"tool type {tool.get('type')!r} is not supported (function "
                           "tools only)", f"tools.{i}")
        tools.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters") if k in tool}})
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    try:
        return ChatCompletionRequest(
            model=body.model, messages=messages, max_tokens=body.max_output_tokens,
            temperature=body.temperature, top_p=body.top_p, tools=tools or None,
            tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls,
            response_format=response_format, user=body.user,
            reasoning_effort=(body.reasoning or {}).get("effort"))
    except ValidationError as e:
        raise APIError(400, f"input: {e.errors()[0]['msg']}", "input") from None


def _message(item, param: str) -> dict:
    """One input item as a chat message."""
    if not isinstance(item, dict):
        raise APIError(400, "an input item is an object (a message or a function call item)",
                       param)
    kind = item.get("type", "message")
    if kind == "function_call":
        return {"role": "assistant", "content": "", "tool_calls": [{
            "id": item.get("call_id"), "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"),
                "content": item.get("output", "")}
    if kind != "message" or item.get("role") not in ("user", "assistant", "system", "developer"):
        raise APIError(400, f"input item of type {kind!r} and role {item.get('role')!r} is not "
                       "supported (messages of user, assistant, system or developer, "
                       "function_call, function_call_output)", param)
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("input_text",
                                                                      "output_text"):
                raise APIError(400, "content parts of type input_text or output_text only "
                               "(text)", param)
            texts.append(part.get("text", ""))
        content = "".join(texts)
    role = "system" if item["role"] == "developer" else item["role"]
    return {"role": role, "content": content or ""}


class _Turn:
    """One Responses answer: its ids, its Response object, its stream of events."""

    def __init__(self, state: ServerState, body: ResponsesRequest, gen: Generation,
                 tools: ToolChoice) -> None:
        self.state, self.body, self.gen, self.tools = state, body, gen, tools
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.reasoning = Reasoning(state.settings.reasoning_parser)
        self.created = int(time.time())
        self.seq = 0

    def response(self, out: RequestOutput | None, status: str | None = None) -> dict:
        """The Response object: in progress (no output yet) or of the finished `out`."""
        b = self.body
        done = out is not None and out.finished
        incomplete = done and out.finish_reason == "length"
        output, usage = [], None
        if done:
            parts = self.reasoning.parts(out.text, True)
            thought = 0
            if parts.reasoning is not None:
                output.append(self.reasoning_item(parts.reasoning, "completed"))
                tok = self.state.tokenizer
                thought = len(tok.encode(parts.reasoning, add_special_tokens=False)) if tok \
                    else 0
            content, calls, _ = self.tools.split(parts.content)
            if content or not calls:
                output.append(self.message(content or "", "completed"))
            output += [self.call_item(c) for c in calls]
            n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
            usage = {"input_tokens": n_in, "output_tokens": n_out,
                     "total_tokens": n_in + n_out,
                     "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                     "output_tokens_details": {"reasoning_tokens": min(thought, n_out)}}
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status or ("incomplete" if incomplete else "completed"),
                "model": b.model or self.state.settings.model_name, "output": output,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "error": None, "instructions": b.instructions,
                "max_output_tokens": b.max_output_tokens, "temperature": b.temperature,
                "top_p": b.top_p, "parallel_tool_calls": b.parallel_tool_calls,
                "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
                "text": b.text or {"format": {"type": "text"}}, "store": False,
                "previous_response_id": None, "reasoning": b.reasoning,
                "truncation": "disabled",
                "metadata": b.metadata or {}, "user": b.user, "usage": usage}

    def reasoning_item(self, text: str, status: str) -> dict:
        return {"type": "reasoning", "id": self.reasoning_id, "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}

    def message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status,
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}

    @staticmethod
    def call_item(call: dict) -> dict:
        fn = call["function"]
        return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"),
                "call_id": call["id"], "name": fn["name"], "arguments": fn["arguments"],
                "status": "completed"}

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        data = {"type": kind, "sequence_number": self.seq - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    async def events(self):
        """The typed events: created, in progress, the reasoning item's text deltas (with a
        reasoning parser), the message's text deltas (none past where a tool call may begin),
        then each call's item, then completed / incomplete. Text already sent is never taken
        back."""
        gen, ev = self.gen, self.event
        part = {"type": "output_text", "text": "", "annotations": []}
        sent, opened, out = 0, False, None  # the message's text sent; whether it is open
        said, thinking = 0, None  # the reasoning's text sent; its item: None, "open", "done"

        def at() -> dict:  # the message's place: after the reasoning item, if there is one
            return {"item_id": self.message_id, "output_index": int(thinking is not None),
                    "content_index": 0}

        def think(text: str, close: bool) -> list[str]:  # the reasoning item's events
            nonlocal said, thinking
            where = {"item_id": self.reasoning_id, "output_index": 0, "content_index": 0}
            events = []
            if thinking is None:
                thinking = "open"
                events.append(ev("response.output_item.added", output_index=0,
                                 item=self.reasoning_item("", "in_progress") | {"content": []}))
            if len(text) > said:
                events.append(ev("response.reasoning_text.delta", **where, delta=text[said:]))
                said = len(text)
            if close and thinking == "open":
                thinking = "done"
                events += [ev("response.reasoning_text.done", **where, text=text),
                           ev("response.output_item.done", output_index=0,
                              item=self.reasoning_item(text, "completed"))]
            return events

        def opening() -> list[str]:  # the message item and its text part, once
            return [ev("response.output_item.added", output_index=at()["output_index"],
                       item=self.message("", "in_progress") | {"content": []}),
                    ev("response.content_part.added", **at(), part=part)]

        try:
            yield ev("response.created", response=self.response(None, "in_progress"))
            yield ev("response.in_progress", response=self.response(None, "in_progress"))
            async for _, out in gen.outputs():
                parts = self.reasoning.parts(out.text, out.finished)
                end = self.tools.sendable(parts.content)
                visible = end > sent and (opened or parts.content[:end].strip())
                if parts.reasoning is not None and not out.finished:
                    for event in think(parts.reasoning, close=bool(visible)):
                        yield event
                # (the message opens at its first visible text: blank text before a tool call
                # is no content)
                if visible and not out.finished:
                    if not opened:
                        opened = True
                        for event in opening():
                            yield event
                    yield ev("response.output_text.delta", **at(),
                             delta=parts.content[sent:end])
                    sent = end
            final = self.response(out)
            items = final["output"]
            if items and items[0]["type"] == "reasoning":
                for event in think(items[0]["content"][0]["text"], close=True):
                    yield event
            first = int(thinking is not None)
            message = items[first] if len(items) > first and items[first]["type"] == "message" \
                else None
            if message is not None:
                text = message["content"][0]["text"]
                for event in [] if opened else opening():
                    yield event
                shown = self.reasoning.parts(out.text, True).content[:sent]
                if len(text) > sent and text.startswith(shown):
                    yield ev("response.output_text.delta", **at(), delta=text[sent:])
                yield ev("response.output_text.done", **at(), text=text)
                yield ev("response.content_part.done", **at(), part=message["content"][0])
                yield ev("response.output_item.done", output_index=first, item=message)
            for k, item in enumerate(items):
                if item["type"] != "function_call":
                    continue
                yield ev("response.output_item.added", output_index=k,
                         item=item | {"arguments": "", "status": "in_progress"})
                yield ev("response.function_call_arguments.delta", item_id=item["id"],
                         output_index=k, delta=item["arguments"])
                yield ev("response.function_call_arguments.done", item_id=item["id"],
                         output_index=k, arguments=item["arguments"])
                yield ev("response.output_item.done", output_index=k, item=item)
            kind = "response.incomplete" if final["status"] == "incomplete" \
                else "response.completed"
            yield ev(kind, response=final)
        except APIError as e:
            self.state.metrics.rejected.labels(str(e.status)).inc()
            yield sse_error(e)
        finally:
            gen.close()
