"""OpenAI-compatible routes, vLLM's conventions: POST /v1/completions, POST
/v1/chat/completions (both streamed as server-sent events ending in `data: [DONE]` when
`stream` is true), GET /v1/models and /v1/models/{model}, and vLLM's /tokenize, /detokenize
and GET /version.

`model` names the base model (the server's model name) or an adapter. Text the stream sends
never has to be taken back: while a request may still end on a stop string, the text that
could be that string's beginning is held back. Usage counts each prompt once, whatever `n`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from slora.request import RequestOutput
from slora.server.errors import APIError, sse_error
from slora.server.generation import EventStream, Generation, holdback, until_disconnected
from slora.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                   TokenizeRequest, _Sampling)
from slora.server.reasoning import SPECIAL_TEXT, Reasoning
from slora.server.state import ServerState
from slora.server.tools import SPECIAL_MARKERS, ToolChoice

DONE = "data: [DONE]\n\n"


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await until_disconnected(request, _completions(state, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await until_disconnected(request, _chat(state, body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await _tokenize(state, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await _detokenize(state, body)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": _model_cards(state)}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        card = next((c for c in _model_cards(state) if c["id"] == model), None)
        if card is None:
            raise APIError(404, f"unknown model or adapter {model!r} (GET /v1/models lists "
                           "them)", "model")
        return card

    @app.get("/version")
    async def version():
        from slora import __version__

        return {"version": __version__}


def _model_cards(state: ServerState) -> list[dict]:
    """The base model's card, then each served adapter's (its parent the base model)."""
    created, base = int(time.time()), state.settings.model_name
    card = {"object": "model", "created": created, "owned_by": "slora",
            "max_model_len": state.max_model_len}
    return ([{"id": base, "root": base, "parent": None, **card}]
            + [{"id": name, "root": name, "parent": base, **card}
               for name in state.adapters.names()])


# -- tokenize, detokenize (vLLM's)


async def _tokenize(state: ServerState, body: TokenizeRequest) -> dict:
    """A prompt's or chat's token ids with the tokenizer (and chat template) its model's
    requests use."""
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt or messages", "prompt")
    adapter = await state.acquire(body.model)
    try:
        if body.messages is not None:
            text = _render_chat(state, adapter, _messages(body.messages), body)
            ids = state.encode(text, "messages", adapter, bool(body.add_special_tokens))
        else:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = state.encode(body.prompt, "prompt", adapter, special)
    finally:
        state.release(adapter)
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
            "token_strs": None}


async def _detokenize(state: ServerState, body: DetokenizeRequest) -> dict:
    """Token ids' text (special tokens kept), with the tokenizer of the model named; ids past
    the base vocabulary only where that adapter adds them."""
    adapter = await state.acquire(body.model)
    try:
        tokenizer = state.tokenizer_of(adapter)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", "tokens")
        known = tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < known]
        if bad:
            raise APIError(400, f"token ids {bad[:5]} are outside the vocabulary [0, {known}) "
                           f"of {body.model or state.settings.model_name!r}", "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
    finally:
        state.release(adapter)


# -- completions


async def _completions(state: ServerState, body: CompletionRequest):
    state.check_accepting()
    if body.suffix:
        raise APIError(400, "suffix is not supported", "suffix")
    if body.echo and state.tokenizer is None:
        raise APIError(400, "echo needs a tokenizer to write the prompt's text", "echo")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens=0 needs echo (the prompt alone, scored with logprobs)",
                       "max_tokens")
    sampling = _sampling(body, body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None:  # the prompt's tokens' log-probs too
        sampling["prompt_logprobs"] = max(body.logprobs, body.prompt_logprobs or 0)
    if body.max_tokens == 0:  # one token is generated, and dropped (`_prompt_only`)
        sampling["max_tokens"] = 1
    gen = await Generation.open(state, body.model,
                                lambda adapter: _prompt_ids(state, body, adapter),
                                sampling, body.n, cache_salt=body.cache_salt,
                                view=_prompt_only if body.max_tokens == 0 else None,
                                priority=state.priority(body.priority))
    reply = _Reply(state, body, "cmpl", "text_completion")
    if body.echo:  # each choice's text begins with its prompt: as sent, or its ids' text
        sent = [body.prompt] if isinstance(body.prompt, str) or all(
            isinstance(t, int) for t in body.prompt) else body.prompt
        tokenizer = state.tokenizer_of(gen.adapter)
        cut = body.truncate_prompt_tokens is not None  # (a cut prompt: its tokens' text)
        reply.echo = [p if isinstance(p, str) and not cut
                      else tokenizer.decode(ids, skip_special_tokens=False)
                      for p, ids in zip(sent, gen.prompts[::body.n]) for _ in range(body.n)]
    return await reply.respond(gen, _completion_chunk, lambda out: {
        "text": out.text, "logprobs": _completion_logprobs(state, body, out, 0),
        **_prompt_logprobs_field(state, body, out)})


def _prompt_ids(state: ServerState, body: CompletionRequest,
                adapter: str | None) -> list[list[int]]:
    """A completion's prompts as token ids (strings with `adapter`'s tokenizer, with its
    special tokens unless add_special_tokens is false): a string, a list of strings, a
    token-id list or a list of them; each cut to its last truncate_prompt_tokens."""
    prompt, special = body.prompt, body.add_special_tokens
    if isinstance(prompt, str):
        prompts = [state.encode(prompt, "prompt", adapter, special)]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [list(prompt)]
    else:
        prompts = [state.encode(p, "prompt", adapter, special) if isinstance(p, str)
                   else list(p) for p in prompt]
    if not prompts:
        raise APIError(400, "the prompt list is empty", "prompt")
    return [_truncated(state, body, ids, "prompt") for ids in prompts]


def _truncated(state: ServerState, body: _Sampling, ids: list[int], field: str) -> list[int]:
    """A prompt's ids cut to their last `truncate_prompt_tokens` (if set), checked against
    the model's length."""
    if body.truncate_prompt_tokens is not None:
        ids = ids[-body.truncate_prompt_tokens:]
    state.check_length(ids, field)
    return ids


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """A max_tokens=0 completion's output: the token generated to run the prompt dropped."""
    return dataclasses.replace(out, text="", token_ids=[],
                               logprobs=None if out.logprobs is None else [])


def _completion_logprobs(state, body, out: RequestOutput, start: int) -> dict | None:
    """OpenAI's completion logprobs of the output tokens `start`.., led by the prompt's when
    echoed from the first (its first token's log-prob null: it has no context). Text
    offsets count from the first token these logprobs hold."""
    if out.logprobs is None:
        return None
    name = _token_name(state, body, out.adapter)
    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    tokens = list(zip(out.token_ids[start:], out.logprobs[start:]))
    if body.echo and not start:
        tokens = list(zip(out.prompt_token_ids, out.prompt_logprobs)) + tokens
    offset = 0
    for tid, probs in tokens:
        lp["tokens"].append(name(tid))
        lp["token_logprobs"].append(None if probs is None else probs.get(tid))
        lp["top_logprobs"].append(None if probs is None else
                                  {name(t): v for t, v in _top(probs, body.logprobs)})
        lp["text_offset"].append(offset)
        offset += len(state.token_text(tid, out.adapter))
    return lp


def _completion_chunk(state, body, out: RequestOutput, text: str, start: int) -> dict:
    return {"text": text, "logprobs": _completion_logprobs(state, body, out, start),
            **(_prompt_logprobs_field(state, body, out) if not start else {})}


def _prompt_logprobs_field(state, body, out: RequestOutput) -> dict:
    """vLLM's `prompt_logprobs` (asked for by the request's field of that name): per prompt
    token, null for the first, else {token id: {"logprob", "decoded_token"}} holding that
    token and the top `prompt_logprobs`. Empty unless asked for."""
    if body.prompt_logprobs is None:
        return {}
    name = _token_name(state, body, out.adapter)
    return {"prompt_logprobs": [
        None if probs is None else
        {str(t): {"logprob": v, "decoded_token": name(t)}
         for t, v in {**dict(_top(probs, body.prompt_logprobs)), tid: probs[tid]}.items()}
        for tid, probs in zip(out.prompt_token_ids, out.prompt_logprobs)]}


# -- chat


async def _chat(state: ServerState, body: ChatCompletionRequest):
    gen, tools = await open_chat(state, body)
    reply = _Reply(state, body, "chatcmpl", "chat.completion")
    reply.tools = tools if tools.parses else None
    reply.reasoning = Reasoning(state.settings.reasoning_parser)

    def choice(out: RequestOutput) -> dict:
        parts = reply.reasoning.parts(out.text, True)
        content, calls, reason = tools.split(parts.content)
        message = {"role": "assistant", "content": content}
        if parts.reasoning is not None:  # (vLLM's field; content None when the answer is empty)
            message.update(content=content or None, reasoning_content=parts.reasoning)
        if calls:
            message["tool_calls"] = calls
        return {"message": message, "logprobs": _chat_logprobs(state, body, out, 0),
                **({"finish_reason": reason} if reason else {})}

    return await reply.respond(gen, _chat_chunk, choice)


async def open_chat(state: ServerState, body: ChatCompletionRequest
                    ) -> tuple[Generation, ToolChoice]:
    """A chat request checked and started: its Generation (close it) and what its output's
    tool calls are (`ToolChoice`). APIError for what cannot be served."""
    state.check_accepting()
    if body.echo:
        raise APIError(400, "echo is not supported in chat completions", "echo")
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(400, "continue_final_message needs add_generation_prompt false (the "
                       "text ends in the last message, not in a new turn)",
                       "continue_final_message")
    messages = _messages(body.messages)

    def prompts(adapter: str | None) -> list[list[int]]:
        text = _render_chat(state, adapter, messages, body)
        ids = state.encode(text, "messages", adapter, body.add_special_tokens)
        return [_truncated(state, body, ids, "messages")]

    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs is not streamed in chat completions; ask "
                       "without stream", "prompt_logprobs")
    top = (body.top_logprobs or 0) if body.logprobs else None
    sampling = _sampling(body, body.max_completion_tokens or body.max_tokens, top)
    tools = ToolChoice.of(body.tools, body.tool_choice, body.parallel_tool_calls,
                          state.settings.tool_call_parser,
                          guided=any(sampling[k] is not None for k in GUIDED))
    if tools.schema is not None:
        sampling["guided_json"] = tools.schema
    if (tools.mode == "auto" and tools.parser in SPECIAL_MARKERS
            or state.settings.reasoning_parser in SPECIAL_TEXT):  # (kept in the text)
        sampling["skip_special_tokens"] = False
    gen = await Generation.open(state, body.model, prompts, sampling, body.n,
                                names={"logprobs": "top_logprobs"}, cache_salt=body.cache_salt,
                                priority=state.priority(body.priority))
    return gen, tools


GUIDED = ("guided_choice", "guided_regex", "guided_json")


def _messages(messages) -> list[dict]:
    """A request's chat messages as the chat template takes them: text content, and an
    assistant's tool calls (arguments as JSON text, as OpenAI sends them) or the call a tool
    message answers, where given; an assistant's reasoning_content under that name (Qwen3's
    templates read it) and as `thinking` (gpt-oss's)."""
    out = []
    for i, m in enumerate(messages):
        message = {"role": m.role, "content": _content(m.content, i)}
        for key in ("tool_calls", "tool_call_id", "name", "reasoning_content"):
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        if m.reasoning_content is not None:
            message["thinking"] = m.reasoning_content
        out.append(message)
    return out


def _content(content, index: int) -> str:
    """A message's text: a string, or the text parts of a list of content parts."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"content part of type {part.get('type')!r} is not supported "
                           "(text only)", f"messages.{index}.content")
        parts.append(part["text"])
    return "".join(parts)


def _render_chat(state: ServerState, adapter: str | None, messages: list[dict],
                 body: ChatCompletionRequest | TokenizeRequest) -> str:
    """The chat prompt: the adapter's own template if its directory has one, else the
    server's --chat-template, else the model's, with the body's add_generation_prompt, continue_final_message,
    chat_template_kwargs and tools."""
    tokenizer = state.tokenizer_of(adapter)
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so no chat template", "messages")
    own = state.adapters.templates.get(adapter) if adapter is not None else None
    own = own or state.settings.chat_template
    if own:
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = own
    variables = dict(body.chat_template_kwargs or {})
    if getattr(body, "reasoning_effort", None):
        variables.setdefault("reasoning_effort", body.reasoning_effort)
    if getattr(body, "tools", None):
        variables["tools"] = body.tools
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, variables=variables)
    except Exception as e:  # noqa: BLE001 - a template that rejects these messages
        raise APIError(400, f"the chat template cannot render these messages: {e}",
                       "messages") from None


def _chat_logprobs(state, body, out: RequestOutput, start: int) -> dict | None:
    if out.logprobs is None:
        return None
    name = _token_name(state, body, out.adapter)

    def entry(tid, value):
        text = name(tid)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return {"content": [{**entry(tid, probs.get(tid)),
                         "top_logprobs": [entry(t, v) for t, v in _top(probs, body.top_logprobs)]}
                        for tid, probs in zip(out.token_ids[start:], out.logprobs[start:])]}


def _chat_chunk(state, body, out: RequestOutput, text: str, start: int) -> dict:
    return {"delta": {"content": text}, "logprobs": _chat_logprobs(state, body, out, start)}


# -- shared


# Fields slora does not implement -> whether a request's value asks for them (their neutral
# values pass: a text response format, no tools, one candidate)
_SET = lambda v: v is not None  # noqa: E731 - a field asks for something when given
UNSUPPORTED = {
    "response_format": lambda v: v is not None and v.get("type") not in (
        "text", "json_object", "json_schema"),
    "best_of": lambda v: v not in (None, 1), "use_beam_search": bool,
    "length_penalty": lambda v: v != 1.0,
    "guided_grammar": _SET,
    "structured_outputs": lambda v: bool(set(v or {}) - {"choice", "regex", "json",
                                                         "json_object"}),
    "logits_processors": _SET,
    "spaces_between_special_tokens": lambda v: not v,
    # completions' and chat's own
    "prompt_embeds": _SET, "chat_template": _SET, "documents": _SET,
}


def _sampling(body: _Sampling, max_tokens: int | None, logprobs: int | None) -> dict:
    """SamplingParams' keywords of an OpenAI request (temperature defaults to 1, as OpenAI's;
    top_k -1 disables, as vLLM's; logit_bias keys are token ids written as strings). A field
    of UNSUPPORTED that asks for something is a 400 naming it."""
    for field, asks in UNSUPPORTED.items():
        if field in type(body).model_fields and asks(getattr(body, field)):
            raise APIError(400, f"{field} is not supported by slora (grammars, tools, beam "
                           "search, logits processors, prompt embeddings and request chat "
                           "templates are not implemented; choice, regex and JSON output are)",
                           field)
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            raise APIError(400, f"logit_bias key {key!r} is not a token id (an integer)",
                           "logit_bias") from None
    return dict(max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=0 if body.top_k in (None, -1) else body.top_k,
                seed=body.seed, stop=[body.stop] if isinstance(body.stop, str) else body.stop or [],
                stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
                logprobs=logprobs, prompt_logprobs=body.prompt_logprobs,
                min_tokens=body.min_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words or [],
                **_guided(body),
                min_p=body.min_p or 0.0, presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None
                else body.repetition_penalty, logit_bias=bias)


def _guided(body: _Sampling) -> dict:
    """SamplingParams' guided decoding keywords from vLLM's guided_* fields, its
    structured_outputs, or OpenAI's response_format (json_object: any JSON object;
    json_schema: its schema)."""
    so = body.structured_outputs or {}
    schema = body.guided_json if body.guided_json is not None else so.get("json")
    if so.get("json_object") or (body.response_format or {}).get("type") == "json_object":
        schema = {"type": "object"} if schema is None else schema
    if (body.response_format or {}).get("type") == "json_schema":
        spec = body.response_format.get("json_schema") or {}
        if not isinstance(spec, dict) or "schema" not in spec:
            raise APIError(400, "response_format json_schema needs json_schema.schema",
                           "response_format")
        schema = spec["schema"]
    return dict(guided_choice=body.guided_choice or so.get("choice"),
                guided_regex=body.guided_regex or so.get("regex"), guided_json=schema)


def _top(probs: dict[int, float], k: int | None) -> list[tuple[int, float]]:
    return sorted(probs.items(), key=lambda kv: -kv[1])[:k or 0]


def _token_name(state: ServerState, body: _Sampling, adapter: str | None):
    if body.return_tokens_as_token_ids:
        return lambda tid: f"token_id:{tid}"
    return lambda tid: state.token_text(tid, adapter)




class _Reply:
    """The envelope of a completion or chat answer: id, object, created, model, usage."""

    def __init__(self, state: ServerState, body: _Sampling, prefix: str, obj: str) -> None:
        self.state, self.body, self.obj = state, body, obj
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = body.model or state.settings.model_name
        self.echo: list[str] | None = None  # completions' echo: each choice's prompt text
        self.tools: ToolChoice | None = None  # chat's tool calls, when its output may hold them
        self.reasoning = Reasoning(None)  # chat's: the server's reasoning parser

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage(self, outs: list[RequestOutput], gen: Generation) -> dict:
        prompt = sum(len(ids) for ids in gen.prompts[::self.body.n])
        completion = sum(len(out.token_ids) for out in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def answer(self, choices: list[dict], outs: list[RequestOutput], gen: Generation) -> dict:
        answer = {**self.envelope(self.obj, choices), "usage": self.usage(outs, gen)}
        if self.obj == "chat.completion" and self.body.prompt_logprobs is not None:
            # (vLLM's place in a chat answer: one prompt, whatever n)
            answer.update(_prompt_logprobs_field(self.state, self.body, outs[0]))
        return answer

    async def respond(self, gen: Generation, chunk, choice):
        """The answer: streamed when the body asks (`chunk`, see `stream`), else whole once
        every choice finished, `choice(out)` making a finished choice's own fields."""
        if self.body.stream:
            return await self.stream(gen, chunk)
        try:
            outs = await gen.finals()
        finally:
            gen.close()
        choices = []
        for i, out in enumerate(outs):
            fields = choice(out)
            reason = fields.pop("finish_reason", out.finish_reason)
            choices.append({"index": i, **fields, "finish_reason": reason, "stop_reason": None})
        for i, c in enumerate(choices if self.echo else ()):
            c["text"] = self.echo[i] + c["text"]
        return JSONResponse(self.answer(choices, outs, gen))

    async def stream(self, gen: Generation, chunk) -> EventStream:
        """Wait for every choice's first output (an error until then is an error status),
        then stream; `chunk(state, body, out, text, first_token)` makes a choice's fields."""
        try:
            await gen.wait_started()
        except BaseException:
            gen.close()
            raise
        return EventStream(self._events(gen, chunk))

    async def _events(self, gen: Generation, chunk):
        state, body = self.state, self.body
        obj = self.obj + ".chunk" if self.obj == "chat.completion" else self.obj
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        # per choice: the characters of its content and of its reasoning sent, and its tokens
        sent_text, sent_reason, sent_tokens = [0] * gen.count, [0] * gen.count, [0] * gen.count
        try:
            if obj == "chat.completion.chunk":  # the role first, as OpenAI's streams do
                role = [{"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None} for i in range(gen.count)]
                yield _event(self.envelope(obj, role))
            async for i, out in gen.outputs():
                limit = len(out.text) if out.finished else holdback(out.text, stops)
                parts = self.reasoning.parts(out.text, out.finished)
                end = max(0, limit - parts.content_at)  # (in the content)
                if self.tools is not None:  # (no content past where a call begins)
                    end = min(end, self.tools.sendable(parts.content))
                text = parts.content[sent_text[i]:end]
                thought = "" if parts.reasoning is None else parts.reasoning[
                    sent_reason[i]:max(0, limit - parts.reasoning_at)]
                # one event per new token, its text delta empty while the detokeniser holds
                # it back (a partial character, a possible stop string), as vLLM streams
                if not (text or thought) and not out.finished \
                        and len(out.token_ids) == sent_tokens[i]:
                    continue
                if self.echo and not sent_tokens[i]:  # a choice's first event
                    text = self.echo[i] + text
                fields = chunk(state, body, out, text, sent_tokens[i])
                if thought:
                    fields["delta"]["reasoning_content"] = thought
                sent_text[i], sent_tokens[i] = max(end, sent_text[i]), len(out.token_ids)
                sent_reason[i] += len(thought)
                reason = out.finish_reason if out.finished else None
                if out.finished and self.tools is not None:  # the calls, whole, at the end
                    content, calls, why = self.tools.split(parts.content)
                    if calls:
                        fields["delta"]["tool_calls"] = [{"index": k, **c}
                                                         for k, c in enumerate(calls)]
                    elif content and sent_text[i] < len(content):  # (held back: no call)
                        fields["delta"]["content"] += content[sent_text[i]:]
                    reason = why or reason
                choice = {"index": i, **fields, "finish_reason": reason}
                event = self.envelope(obj, [choice])
                if body.stream_options is not None and body.stream_options.continuous_usage_stats:
                    prompt, done = len(out.prompt_token_ids), len(out.token_ids)
                    event["usage"] = {"prompt_tokens": prompt, "completion_tokens": done,
                                      "total_tokens": prompt + done}
                yield _event(event)
            if body.stream_options is not None and body.stream_options.include_usage:
                outs = [gen.last[i] for i in range(gen.count)]
                yield _event({**self.envelope(obj, []), "usage": self.usage(outs, gen)})
            yield DONE
        except APIError as e:
            state.metrics.rejected.labels(str(e.status)).inc()
            yield sse_error(e)
            yield DONE
        finally:
            gen.close()


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
