"""One HTTP request's engine requests, and the plumbing that ends them with the client:

- `Generation`: each prompt times `n` choices as engine requests run at once, their outputs
  merged into one stream of (choice index, cumulative RequestOutput) in arrival order. It
  holds the adapter's use and the waiting bound, records each request in the metrics as it
  ends, and at `close()` aborts whatever has not finished (its pages are freed at the next
  step).
- `until_disconnected`: runs a handler unless the client goes away first, in which case the
  handler is cancelled (and with it its Generation).
- `EventStream`: server-sent events whose generator is closed when the client goes away.
- `holdback`: how much of a streamed text may go out while a stop string may still begin.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from slora.config import is_seed
from slora.request import RequestOutput, SamplingParams
from slora.server.errors import APIError
from slora.server.state import ServerState, engine_error, sampling_error


def _choice(sampling: dict, j: int) -> dict:
    """SamplingParams' keywords of choice j of a prompt: its seed moved on by j (wrapping
    within 64 bits)."""
    seed = sampling.get("seed")
    if not j or not is_seed(seed):
        return sampling
    return {**sampling, "seed": (seed + j) % (1 << 64) if seed >= 0 else seed + j}


class Generation:
    """See the module docstring. Open with `await Generation.open(...)`; always `close()`."""

    def __init__(self, state: ServerState, adapter: str | None, label: str) -> None:
        self.state = state
        self.adapter = adapter
        self.label = label  # the metrics' adapter label
        self.prompts: list[list[int]] = []
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.last: dict[int, RequestOutput] = {}  # each choice's latest output
        self.ended: set[int] = set()
        self._seen_at: dict[int, float] = {}
        self._counted: set[int] = set()  # choices no longer counted in state.pending
        self._buffer: list[tuple[int, RequestOutput]] = []
        self._closed = False
        self.cache_salt: str | None = None
        self.view: Callable[[RequestOutput], RequestOutput] | None = None
        self.priority = 0

    @classmethod
    async def open(cls, state: ServerState, model: str | None,
                   prompts: Callable[[str | None], list[list[int]]], sampling: dict,
                   n: int = 1, names: dict[str, str] | None = None,
                   cache_salt: str | None = None,
                   view: Callable[[RequestOutput], RequestOutput] | None = None,
                   priority: int = 0) -> "Generation":
        """Check everything, then start the engine requests.

        `model`: the base model's name or an adapter's (loaded on first use). `prompts`: the
        prompts' token ids for the adapter (its chat template may differ). `sampling`:
        SamplingParams' keywords; max_tokens None means up to the model's length.
        `names`: SamplingParams field -> the request's name for it, for error messages.
        `cache_salt`, `priority`: the requests' (`Engine.add_request`). `view`: what the
        consumer sees of each output (default: the output as it is).
        Raises APIError: 404 unknown adapter, 400 bad prompt or sampling, 503 when the
        waiting requests would pass `max_waiting`."""
        adapter = await state.acquire(model)
        gen = cls(state, adapter, adapter or state.settings.model_name)
        gen.cache_salt = cache_salt
        gen.view = view
        gen.priority = priority
        try:
            gen.prompts = [ids for ids in prompts(adapter) for _ in range(n)]
            # the n choices of a prompt are n draws: with a seed, choice j samples with
            # seed + j (as vLLM's parallel sampling), so they differ and each is reproducible
            params = [gen._sampling(ids, _choice(sampling, j % n), names or {})
                      for j, ids in enumerate(gen.prompts)]
            count = len(gen.prompts)
            if state.pending + count > state.settings.max_waiting:
                raise APIError(503, f"too many requests waiting ({state.pending} of at most "
                               f"{state.settings.max_waiting}); retry later",
                               headers=state.retry_after)
            state.pending += count
            base = f"{state.id_prefix}-{next(state.ids)}"
            gen.tasks = [asyncio.create_task(gen._pump(i, f"{base}-{i}", ids, sp))
                         for i, (ids, sp) in enumerate(zip(gen.prompts, params))]
        except BaseException:
            gen.close()
            raise
        return gen

    def _sampling(self, ids: list[int], kw: dict, names: dict[str, str]) -> SamplingParams:
        kw = dict(kw)
        if kw.get("max_tokens") is None:
            kw["max_tokens"] = self.state.max_model_len - len(ids)
        try:
            sp = SamplingParams(**kw)
            for name in ("logprobs", "prompt_logprobs"):
                k = getattr(sp, name)
                if k is not None and k > self.state.max_logprobs:
                    raise ValueError(f"SamplingParams.{name}={k}: at most "
                                     f"{self.state.max_logprobs} (--max-logprobs)")
        except ValueError as e:
            raise sampling_error(e, names) from None
        return sp

    async def _pump(self, i: int, rid: str, ids: list[int], sp: SamplingParams) -> None:
        try:
            async for out in self.state.engine.stream(ids, sp, self.adapter, request_id=rid,
                                                      cache_salt=self.cache_salt,
                                                      priority=self.priority):
                self.queue.put_nowait((i, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer as its answer
            self.queue.put_nowait((i, e))

    @property
    def count(self) -> int:
        return len(self.prompts)

    async def _next(self) -> tuple[int, RequestOutput]:
        """The next output of any choice; raises APIError for a choice that failed."""
        i, item = await self.queue.get()
        now = time.monotonic()
        if i not in self._counted:
            self._counted.add(i)
            self.state.pending -= 1
        if isinstance(item, Exception):
            if i in self.last:  # it ran: an engine request that ended on an error
                self._end(i, "error")
            else:  # refused at submission (an adapter unloaded meanwhile): it never ran
                self.ended.add(i)
            raise engine_error(item)
        if self.view is not None:
            item = self.view(item)
        self._observe(i, item, now)
        if item.finished:
            self._end(i, item.finish_reason)
            if item.finish_reason == "error":
                raise APIError(500, f"the engine failed the request: {item.error}")
            if item.finish_reason == "abort":
                raise APIError(503, "the engine aborted the request (its scheduling policy "
                               "drops requests past their first-token deadline)",
                               headers=self.state.retry_after)
        return i, item

    async def wait_started(self) -> None:
        """Wait for every choice's first output (kept for `outputs`), so that a request that
        fails at once gets an error status instead of a stream that carries the error."""
        started: set[int] = set()
        while len(started) < self.count:
            i, out = await self._next()
            started.add(i)
            self._buffer.append((i, out))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) until every choice has finished."""
        while self._buffer:
            yield self._buffer.pop(0)
        while len(self.ended) < self.count:
            yield await self._next()

    async def finals(self) -> list[RequestOutput]:
        """Every choice's finished output, in choice order."""
        async for _ in self.outputs():
            pass
        return [self.last[i] for i in range(self.count)]

    def _observe(self, i: int, out: RequestOutput, now: float) -> None:
        m, before = self.state.metrics, self.last.get(i)
        new = len(out.token_ids) - (len(before.token_ids) if before else 0)
        if before is None or not before.token_ids:
            if out.token_ids and out.metrics.first_token_time is not None:
                m.ttft.observe(out.metrics.first_token_time - out.metrics.arrival_time)
        elif new > 0:
            gap = (now - self._seen_at[i]) / new
            for _ in range(new):
                m.itl.observe(gap)
        self._seen_at[i] = now
        self.last[i] = out

    def _end(self, i: int, reason: str) -> None:
        if i in self.ended:
            return
        self.ended.add(i)
        m, out = self.state.metrics, self.last.get(i)
        m.requests.labels(self.label, reason).inc()
        m.prompt_tokens.inc(len(self.prompts[i]))
        if out is not None:
            m.generation_tokens.inc(len(out.token_ids))
            if out.finished and out.metrics.finish_time is not None:
                m.e2e.observe(out.metrics.finish_time - out.metrics.arrival_time)

    def close(self) -> None:
        """Abort the choices still running, settle the counts, release the adapter.
        Idempotent. Synchronous, so it completes inside a cancelled task or scope too: a
        cancelled pump task aborts its engine request as it unwinds."""
        if self._closed:
            return
        self._closed = True
        for task in self.tasks:
            task.cancel()
        for i in range(len(self.tasks)):  # the started choices the consumer left
            if i not in self._counted:
                self._counted.add(i)
                self.state.pending -= 1
            self._end(i, "abort")
        self.state.release(self.adapter)


async def until_disconnected(request: Request, handler: Awaitable[Response]) -> Response:
    """Run `handler` to its answer, unless the client disconnects first: then cancel it (its
    `finally` closes its Generation, which aborts the engine requests)."""
    work = asyncio.ensure_future(handler)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
    if work.cancelled():
        return Response(status_code=499)  # nobody reads it: the client has gone
    return work.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events. When the client disconnects, starlette cancels the stream; the
    body generator is then closed here too, whatever it was waiting on, so its `finally`
    (closing its Generation) runs at once."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def holdback(text: str, stops) -> int:
    """How much of `text` may be sent while the request may still end on a stop string: all
    but the longest tail that begins one of `stops`."""
    keep = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), keep, -1):
            if text.endswith(stop[:k]):
                keep = k
                break
    return len(text) - keep
