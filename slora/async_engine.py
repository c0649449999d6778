"""AsyncEngine: requests added while the engine steps, outputs streamed token by token.

One background thread owns the Engine and runs its step loop; every other thread (or an
asyncio event loop) talks to it through a command queue, so the Engine itself never needs
locks. What a server needs:

    engine = AsyncEngine(EngineConfig(model=...))
    async for out in engine.stream("prompt", SamplingParams(max_tokens=64), adapter="sql"):
        print(out.text)                      # cumulative text after each new token
    engine.shutdown()

The rules that keep it from hanging or dying:
- A consumer that stops early (breaks out of `stream`, is cancelled, or its event loop
  closes) aborts its request: its pages are freed at the next step. A sink that fails to
  deliver (a closed event loop) is dropped and its request aborted; the engine thread never
  sees the consumer's error.
- `Engine.step` fails the requests a fault belongs to and keeps serving (see `Engine.step`).
  Should anything escape the loop anyway, the thread ends, and every waiting and later call
  raises `EngineDeadError` at once, naming the cause.
- After `shutdown()` every call raises `RuntimeError`; requests still running get that error.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from typing import AsyncIterator, Callable

from slora.config import EngineConfig
from slora.engine import Engine
from slora.request import RequestOutput, SamplingParams

_DONE = object()


class EngineDeadError(RuntimeError):
    """The engine thread has ended on an error; nothing more will run."""


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None) -> None:
        self.engine = engine or Engine(config)
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, Callable] = {}  # request id -> where its outputs go
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._error: BaseException | None = None  # why the engine thread ended, if it failed
        self._thread = threading.Thread(target=self._loop, name="slora-engine", daemon=True)
        self._thread.start()

    # -- the background loop
    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - every waiter learns why, none hangs
            self._error = e
        finally:
            self._close()

    def _serve(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            block = not eng.has_unfinished()
            try:  # idle: wait for work; busy: take what has arrived and step
                while True:
                    self._run(self._commands.get(block=block, timeout=0.1 if block else None))
                    block = False
            except queue.Empty:
                pass
            if eng.has_unfinished() and not self._stop.is_set():
                for out in eng.step():
                    self._deliver(out.request_id, out)

    def _deliver(self, rid: str, item) -> None:
        """Hand an output (or an error) to its request's sink; the sink is dropped once the
        request ends. A sink that raises (its consumer's loop closed) is dropped and its
        request aborted."""
        sink = self._sinks.get(rid)
        if sink is None:
            return
        final = not isinstance(item, RequestOutput) or item.finished
        if final:
            del self._sinks[rid]
        try:
            sink(item)
        except Exception:  # noqa: BLE001 - the consumer is gone; the engine is not
            self._sinks.pop(rid, None)
            if not final:
                self._abort(rid)

    def _abort(self, rid: str) -> None:
        req = self.engine.requests.get(rid)
        if req is not None and not req.finished:
            self.engine.abort(rid)

    def _run(self, command) -> None:
        kind, args, reply = command
        try:
            if kind == "add":
                rid, prompt, sampling, adapter, options, sink = args
                self.engine.add_request(prompt, sampling, adapter, request_id=rid, **options)
                self._sinks[rid] = sink
                reply(rid)
            elif kind == "abort":
                self._abort(args)
            elif kind == "call":
                fn, fargs = args
                reply(fn(*fargs))
        except Exception as e:  # noqa: BLE001 - the caller gets the error, the loop goes on
            reply(e)

    def _close(self) -> None:
        """The thread is ending: every request still open and every queued command gets the
        reason, so no caller waits for an answer that will not come."""
        error = self._closed_error()
        for rid in list(self._sinks):
            self._deliver(rid, error)
        while True:
            try:
                _, _, reply = self._commands.get_nowait()
            except queue.Empty:
                break
            if reply is not None:
                reply(error)

    def _closed_error(self) -> Exception:
        if self._error is not None:
            return EngineDeadError(f"the engine thread ended on {type(self._error).__name__}: "
                                   f"{self._error}; restart the engine")
        return RuntimeError("the AsyncEngine is shut down; make a new one to serve again")

    def _check_open(self) -> None:
        if not self._thread.is_alive() or self._stop.is_set():
            raise self._closed_error()

    def _submit(self, kind, args):
        """Run a command on the engine thread and wait for its answer; raises at once if the
        thread has ended (or ends meanwhile) rather than waiting for ever."""
        self._check_open()
        done = threading.Event()
        box = []

        def reply(value):
            box.append(value)
            done.set()

        self._commands.put((kind, args, reply))
        while not done.wait(timeout=0.1):
            if not self._thread.is_alive() and not done.is_set():
                raise self._closed_error()
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def _new_id(self, request_id: str | None) -> str:
        return request_id if request_id is not None else f"async-{next(self._ids)}"

    # -- the API
    @property
    def alive(self) -> bool:
        """Whether the engine thread runs and takes requests."""
        return self._thread.is_alive() and not self._stop.is_set()

    def call(self, fn, *args):
        """Run fn(*args) on the engine thread (add_adapter, stats, ...) and return its value."""
        return self._submit("call", (fn, args))

    def add_adapter(self, name: str, path) -> None:
        self.call(self.engine.add_adapter, name, path)

    def add_merged_adapter(self, name: str, spec) -> None:
        """See `Engine.add_merged_adapter`."""
        self.call(self.engine.add_merged_adapter, name, spec)

    def remove_adapter(self, name: str) -> None:
        """Unregister an adapter; its queued and running requests end with an error (see
        `Engine.remove_adapter`)."""
        self.call(self.engine.remove_adapter, name)

    def stats(self) -> dict:
        return self.call(self.engine.stats)

    def abort(self, request_id: str) -> None:
        """Stop a request from any thread, without waiting; its pages are freed at the next
        step and its stream ends with finish_reason "abort". Unknown or finished ids are
        ignored (the request may have ended meanwhile)."""
        if self.alive:
            self._commands.put(("abort", request_id, None))

    def submit(self, prompt, sampling: SamplingParams | None = None,
               adapter: str | None = None, request_id: str | None = None,
               cache_salt: str | None = None, priority: int = 0
               ) -> "queue.Queue[RequestOutput]":
        """Queue a request from any thread; its outputs arrive on the returned queue.
        `cache_salt`, `priority`: as `Engine.add_request`'s."""
        q: queue.Queue = queue.Queue()

        def sink(item):
            q.put(item)
            if isinstance(item, Exception) or item.finished:
                q.put(_DONE)

        self._submit("add", (self._new_id(request_id), prompt, sampling, adapter,
                             {"cache_salt": cache_salt, "priority": priority}, sink))
        return q

    def generate(self, prompt, sampling: SamplingParams | None = None,
                 adapter: str | None = None, cache_salt: str | None = None,
                 priority: int = 0) -> RequestOutput:
        """Blocking: the finished output of one request (other threads may add more)."""
        last = None
        for last in _drain(self.submit(prompt, sampling, adapter, cache_salt=cache_salt,
                                       priority=priority)):
            pass
        return last

    async def stream(self, prompt, sampling: SamplingParams | None = None,
                     adapter: str | None = None, request_id: str | None = None,
                     cache_salt: str | None = None, priority: int = 0
                     ) -> AsyncIterator[RequestOutput]:
        """Async: yield the request's output after each step in which it progressed. Bad
        input raises here (KeyError: unknown adapter; ValueError: bad prompt or sampling).
        If the consumer stops before the request finished, the request is aborted."""
        self._check_open()
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()
        added = loop.create_future()
        rid = self._new_id(request_id)

        def settle(value):
            if not added.done():
                (added.set_exception if isinstance(value, Exception) else added.set_result)(value)

        def reply(value):  # on the engine thread; raises if this loop has closed
            loop.call_soon_threadsafe(settle, value)

        def sink(item):
            loop.call_soon_threadsafe(aq.put_nowait, item)

        finished = False
        options = {"cache_salt": cache_salt, "priority": priority}
        self._commands.put(("add", (rid, prompt, sampling, adapter, options, sink), reply))
        try:
            while not added.done():  # the answer, or the thread's end
                await asyncio.wait([added], timeout=0.1)
                if not added.done() and not self._thread.is_alive():
                    raise self._closed_error()
            added.result()
            while True:
                item = await aq.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(rid)

    def shutdown(self) -> None:
        """Stop the engine thread; requests still running end with an error."""
        self._stop.set()
        self._commands.put(("call", (lambda: None, ()), lambda _: None))
        self._thread.join(timeout=10)


def _drain(q: queue.Queue):
    while True:
        item = q.get()
        if item is _DONE:
            return
        if isinstance(item, Exception):
            raise item
        yield item
