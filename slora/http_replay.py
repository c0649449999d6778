"""Trace replay over HTTP: a trace's requests sent to a running server at their arrival times.

The client of `slora replay --url`. It drives any server that speaks one of two streaming APIs,
and writes the same result JSON as the in-process replay (`slora.replay`), so `slora plot`
draws servers, and the in-process engine, side by side:

- "openai": `POST /v1/completions` with `stream: true` (slora serve, vLLM, SGLang, LoRAX's
  OpenAI route). `model` names the request's adapter, or the served base model for a request
  without one (the first entry of `GET /v1/models` without a `parent`, unless given). The
  prompt goes as a list of token ids (the completions API accepts one) or as the trace's text;
  `max_tokens` = the trace's output_len, `temperature` 0 and `ignore_eos: true` (vLLM's extra
  field, which slora and SGLang accept too), so every request generates exactly output_len
  tokens where the server honours it. `stream_options.include_usage` asks for the token counts.
- "lorax": `POST /generate_stream` (LoRAX, TGI) with `{"inputs": text, "parameters":
  {"adapter_id", "max_new_tokens", "details": true}}`. The API takes text only and has no
  ignore_eos: a request may stop early at an end-of-sequence token. A trace request given
  as a length becomes S-LoRA's dummy prompt, "hello " repeated prompt_len times.

Open loop, as S-LoRA's and vLLM's benchmark clients (aiohttp, as theirs: its C parser costs
a few times less a streamed token than httpx's): each request is sent at its arrival time
whether or not earlier ones have finished, through a pool of at most `concurrency` connections;
a request that finds the pool full waits for a connection, and its latency still counts from
its arrival time. Random prompt token ids are drawn as the in-process replay draws them (the
same seed, the same order), so both replays of one trace send the same prompts.

Timing, on the client's monotonic clock from the trace's time zero: first token = the first
stream event that carries a token; inter-token latency = the time between a request's
successive token events; finish = the end of the stream. Output tokens = the
server's `usage.completion_tokens` (openai) or `details.generated_tokens` (lorax) when given,
else the token events counted. Every request ends as a record: an HTTP error status, a
connection error, an error event, a failed finish reason ("abort", "error") or a stream that
ends before its request finished is a failed record with the reason.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from slora.metrics import DEFAULT_SLO_TTFT_S, RequestRecord, result_dict, summarize
from slora.replay import FAILED_REASONS, ReplayRun, _progress_bar, _random_ids
from slora.workload import Trace, TraceRequest

APIS = ("openai", "lorax")
DEFAULT_CONCURRENCY = 1024
ERROR_CHARS = 300  # of a failed response's body kept as the reason


@dataclass(frozen=True)
class HttpTarget:
    """Where and how requests go.

    url: the server's root, e.g. http://127.0.0.1:8000 (no trailing path).
    served_model: the OpenAI `model` of a request without an adapter; None: asked of
        `GET /v1/models` when the trace has such requests.
    adapter_source: LoRAX's `parameters.adapter_source` ("hub", "local", ...); None: not sent.
    api_key: sent as `Authorization: Bearer <key>` when set.
    """

    url: str
    api: str = "openai"
    concurrency: int = DEFAULT_CONCURRENCY
    served_model: str | None = None
    adapter_source: str | None = None
    api_key: str | None = None
    connect_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api {self.api!r}: expected one of {', '.join(APIS)}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency {self.concurrency}: must be at least 1")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url {self.url!r}: expected http://host:port")
        object.__setattr__(self, "url", self.url.rstrip("/"))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# ---------------------------------------------------------------------------------------------
# Request bodies


def dummy_text(prompt_len: int) -> str:
    """S-LoRA's dummy prompt for a length: "hello " repeated (about one token a word)."""
    return "hello " * prompt_len


def prompts_for(trace: Trace, api: str, vocab_size: int | None, seed: int) -> list[str | list[int]]:
    """Each request's prompt in trace order: its own text or ids, else `prompt_len` random ids
    in [0, vocab_size) drawn as `slora.replay.replay` draws them (openai), or `dummy_text`
    (lorax, whose API takes text only)."""
    rng = np.random.default_rng(seed)
    out: list[str | list[int]] = []
    for req in trace.requests:
        if req.prompt is not None:
            out.append(req.prompt)
        elif api == "lorax":
            out.append(dummy_text(req.prompt_len))
        else:
            if vocab_size is None:
                raise ValueError("the trace gives prompts as lengths, which become random token "
                                 "ids: give the vocabulary size (--vocab-size, or --model DIR "
                                 "whose config.json has it)")
            out.append(_random_ids(rng, req.prompt_len, vocab_size))
    return out


def openai_body(req: TraceRequest, prompt, model: str) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


def lorax_body(req: TraceRequest, prompt, adapter_source: str | None) -> dict:
    if not isinstance(prompt, str):
        raise ValueError("the lorax API takes text prompts only; this trace request gives token "
                         "ids (use --api openai)")
    params = {"max_new_tokens": req.output_len, "details": True}
    if req.adapter is not None:
        params["adapter_id"] = req.adapter
        if adapter_source is not None:
            params["adapter_source"] = adapter_source
    return {"inputs": prompt, "parameters": params}


# ---------------------------------------------------------------------------------------------
# Server-sent events


class SseParser:
    """Bytes of a `text/event-stream` in, each event's data (str) out.

    An event is its `data:` lines joined by newlines, dispatched at a blank line (or at the
    end of the stream); other fields (`event:`, `id:`, comments) are skipped. Chunks may split
    lines anywhere; lines end in LF or CRLF.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        events = []
        for line in lines:
            line = line.removesuffix(b"\r")
            if not line:
                if self._data:
                    events.append(b"\n".join(self._data).decode())
                    self._data = []
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
        return events

    def close(self) -> list[str]:
        events = self.feed(b"\n\n") if self._buf else []
        if self._data:
            events.append(b"\n".join(self._data).decode())
            self._data = []
        return events


class StreamState:
    """What a request's events said so far: when its first token came, how many token events,
    the time since the event before each token event after the first (`gaps`, seconds ->
    events), the server's token counts, its finish reason, an error, and whether it is done."""

    def __init__(self, api: str) -> None:
        self.api = api
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.gaps: Counter[float] = Counter()
        self.token_events = 0
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.done = False

    def on_event(self, data: str, now: float) -> None:
        if self.api == "openai" and data.strip() == "[DONE]":
            self.done = True
            return
        try:
            ev = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"an event that is not JSON: {data[:ERROR_CHARS]!r}"
            return
        if not isinstance(ev, dict):
            self.error = f"an event that is not a JSON object: {data[:ERROR_CHARS]!r}"
        elif "error" in ev:
            self.error = _error_message(ev)
        elif self.api == "openai":
            self._openai(ev, now)
        else:
            self._lorax(ev, now)

    def _token(self, now: float) -> None:
        self.token_events += 1
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.gaps[now - self.last_token_time] += 1
        self.last_token_time = now

    def _openai(self, ev: dict, now: float) -> None:
        choices = ev.get("choices") or []
        if choices:
            self._token(now)
            reason = choices[0].get("finish_reason")
            if reason:
                self.finish_reason = reason
        usage = ev.get("usage")
        if usage:
            self.completion_tokens = usage.get("completion_tokens", self.completion_tokens)
            self.prompt_tokens = usage.get("prompt_tokens", self.prompt_tokens)

    def _lorax(self, ev: dict, now: float) -> None:
        if ev.get("token") is not None:
            self._token(now)
        details = ev.get("details") or {}
        if details:
            self.finish_reason = details.get("finish_reason", self.finish_reason)
            self.completion_tokens = details.get("generated_tokens", self.completion_tokens)
            self.prompt_tokens = details.get("prompt_tokens", self.prompt_tokens)
        if ev.get("generated_text") is not None:
            self.done = True

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.token_events

    def failure(self) -> str | None:
        """Why the request failed, or None when it completed."""
        if self.error is not None:
            return self.error
        if self.finish_reason in FAILED_REASONS:
            return f"the server finished it with finish_reason {self.finish_reason!r}"
        if not self.done:
            return "the stream ended before the request finished"
        if self.first_token_time is None:
            return "the stream finished without a token"
        return None


def _error_message(body) -> str:
    """The message of an error body: OpenAI's {"error": {"message"}}, vLLM's {"message"},
    TGI's {"error": "..."}; else the body itself, shortened."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:ERROR_CHARS]
        if isinstance(err, str) and err:
            return err[:ERROR_CHARS]
        if body.get("message"):
            return str(body["message"])[:ERROR_CHARS]
    return json.dumps(body)[:ERROR_CHARS]


# ---------------------------------------------------------------------------------------------
# The client


def served_base_model(models: dict) -> str:
    """The base model's id in a `GET /v1/models` answer: the first entry without a `parent`
    (vLLM's and slora's listing gives adapters `parent` = the base)."""
    data = models.get("data") or []
    for entry in data:
        if not entry.get("parent"):
            return entry["id"]
    raise ValueError(f"/v1/models lists no base model (every entry has a parent: "
                     f"{[e.get('id') for e in data][:5]}): give the served model's name")


async def _preflight(session, target: HttpTarget, need_base: bool) -> str | None:
    """Checks that the server answers; returns the base model's name for openai requests
    without an adapter (None when none is needed)."""
    import aiohttp

    path = "/v1/models" if target.api == "openai" else "/health"
    try:
        async with session.get(target.url + path, headers=target.headers) as resp:
            status, text = resp.status, await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise OSError(f"cannot reach {target.url} ({type(e).__name__}: {e})") from None
    if status != 200:
        raise OSError(f"{target.url}{path} answered HTTP {status}: {text[:ERROR_CHARS]}")
    if target.api == "openai" and need_base:
        return target.served_model or served_base_model(json.loads(text))
    return target.served_model


async def _send(session, target: HttpTarget, req: TraceRequest, body: dict, start: float,
                gate: asyncio.Semaphore) -> tuple[RequestRecord, Counter]:
    """One request, streamed; its record (times relative to `start`) and its token gaps."""
    import aiohttp

    path = "/v1/completions" if target.api == "openai" else "/generate_stream"
    state = StreamState(target.api)
    prompt = body.get("prompt", body.get("inputs"))
    prompt_tokens = req.input_len if req.input_len is not None else (
        len(prompt) if isinstance(prompt, list) else 0)
    failure = None
    async with gate:
        try:
            async with session.post(target.url + path, json=body,
                                    headers=target.headers) as resp:
                if resp.status != 200:
                    text = (await resp.read()).decode(errors="replace")
                    try:
                        why = _error_message(json.loads(text))
                    except json.JSONDecodeError:
                        why = text[:ERROR_CHARS]
                    failure = f"HTTP {resp.status}: {why}"
                else:
                    parser = SseParser()
                    async for chunk in resp.content.iter_any():
                        now = time.monotonic() - start
                        for data in parser.feed(chunk):
                            state.on_event(data, now)
                    for data in parser.close():
                        state.on_event(data, time.monotonic() - start)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            failure = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        except Exception as e:  # noqa: BLE001 - the request is recorded, the replay goes on
            failure = f"{type(e).__name__}: {e}"
    finish = time.monotonic() - start
    failure = failure or state.failure()
    first = state.first_token_time
    return RequestRecord(
        arrival_time=req.arrival_time, first_token_time=first,
        finish_time=finish if first is not None or failure is None else None,
        prompt_tokens=state.prompt_tokens if state.prompt_tokens is not None else prompt_tokens,
        output_tokens=state.output_tokens, failed=failure is not None, adapter=req.adapter,
        error=failure), state.gaps


async def replay_http_async(trace: Trace, target: HttpTarget, prompts: list, *,
                            progress: bool = False,
                            label: str = "replay") -> tuple[ReplayRun, str | None]:
    """Send every request of `trace` at its arrival time; (the run, the base model's name used)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=target.concurrency)
    # No read timeout: a request may wait in the server's queue for long before its first byte.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=target.connect_timeout_s)
    need_base = any(r.adapter is None for r in trace.requests)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        base = await _preflight(session, target, need_base)
        bodies = [openai_body(r, p, r.adapter if r.adapter is not None else base)
                  if target.api == "openai" else lorax_body(r, p, target.adapter_source)
                  for r, p in zip(trace.requests, prompts)]
        gate = asyncio.Semaphore(target.concurrency)
        bar = _progress_bar(len(trace), progress, label)
        tasks: list[asyncio.Task] = []

        def tick(_task) -> None:
            bar.update(1)

        start = time.monotonic()
        try:
            for req, body in zip(trace.requests, bodies):
                delay = start + req.arrival_time - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                task = asyncio.create_task(_send(session, target, req, body, start, gate))
                task.add_done_callback(tick)
                tasks.append(task)
            sent = await asyncio.gather(*tasks)
            end = time.monotonic()
        finally:
            for task in tasks:
                task.cancel()
            bar.close()
    gaps: Counter[float] = Counter()
    for _, g in sent:
        gaps.update(g)
    return ReplayRun([record for record, _ in sent], end - start, dict(gaps)), base


def _event_loop_factory():
    """uvloop's event loop where it is installed (less client overhead a token), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def replay_http(trace: Trace, target: HttpTarget, *, vocab_size: int | None = None, seed: int = 0,
                progress: bool = False, label: str = "replay") -> tuple[ReplayRun, str | None]:
    """`replay_http_async` on an event loop of its own (uvloop's when installed)."""
    if not trace.requests:
        raise ValueError("the trace has no requests")
    prompts = prompts_for(trace, target.api, vocab_size, seed)
    loop = (_event_loop_factory() or asyncio.new_event_loop)()
    try:
        return loop.run_until_complete(
            replay_http_async(trace, target, prompts, progress=progress, label=label))
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def run_http_replay(trace: Trace, target: HttpTarget, *, vocab_size: int | None = None,
                    seed: int = 0, trace_path: str | None = None,
                    slo_ttft_s: float = DEFAULT_SLO_TTFT_S, source: str = "http",
                    progress: bool = False) -> dict:
    """Replay `trace` against the server and return the result dict (`slora.metrics.result_dict`).

    source: the result's series name in `slora plot` ("http"; or the server's name, to tell
        servers apart). The duration runs from the trace's time zero to the last request's end.
    """
    run, base = replay_http(trace, target, vocab_size=vocab_size, seed=seed, progress=progress)
    summary = summarize(run.records, slo_ttft_s=slo_ttft_s, duration_s=run.duration_s,
                        token_gaps=run.token_gaps)
    errors: dict[str, int] = {}
    for r in run.records:
        if r.failed:
            errors[r.error] = errors.get(r.error, 0) + 1
    config = {"trace": trace_path, "workload": trace.params, "url": target.url, "api": target.api,
              "model": base, "concurrency": target.concurrency, "seed": seed}
    return result_dict(summary, source=source, records=run.records, stats={"errors": errors},
                       token_gaps=run.token_gaps, config=config)
