"""AsyncEngine: requests added while the engine steps, outputs streamed token by token.

One background thread owns the Engine and runs its step loop; every other thread (or an
asyncio event loop) talks to it through a command queue, so the Engine itself never needs
locks. What a server needs:

    engine = AsyncEngine(EngineConfig(model=...))
    async for out in engine.stream("prompt", SamplingParams(max_tokens=64), adapter="sql"):
        print(out.text)                      # cumulative text after each new token
    engine.shutdown()
"""

from __future__ import annotations

import asyncio
import queue
import threading
from typing import AsyncIterator

from slora.config import EngineConfig
from slora.engine import Engine
from slora.request import RequestOutput, SamplingParams

_DONE = object()


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None) -> None:
        self.engine = engine or Engine(config)
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, callable] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="slora-engine", daemon=True)
        self._thread.start()

    # -- the background loop
    def _loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            block = not eng.has_unfinished()
            try:  # idle: wait for work; busy: take what has arrived and step
                while True:
                    self._run(self._commands.get(block=block, timeout=0.1 if block else None))
                    block = False
            except queue.Empty:
                pass
            if eng.has_unfinished():
                try:
                    outputs = eng.step()
                except Exception as e:  # noqa: BLE001 - report to every waiter, keep serving
                    for sink in self._sinks.values():
                        sink(e)
                    self._sinks.clear()
                    continue
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is not None:
                        sink(out)
                        if out.finished:
                            del self._sinks[out.request_id]

    def _run(self, command) -> None:
        kind, args, reply = command
        try:
            if kind == "add":
                prompt, sampling, adapter, sink = args
                rid = self.engine.add_request(prompt, sampling, adapter)
                self._sinks[rid] = sink
                reply(rid)
            elif kind == "call":
                fn, fargs = args
                reply(fn(*fargs))
        except Exception as e:  # noqa: BLE001 - the caller gets the error, the loop goes on
            reply(e)

    def _submit(self, kind, args):
        done = threading.Event()
        box = []

        def reply(value):
            box.append(value)
            done.set()

        self._commands.put((kind, args, reply))
        done.wait()
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    # -- the API
    def call(self, fn, *args):
        """Run fn(*args) on the engine thread (add_adapter, stats, ...) and return its value."""
        return self._submit("call", (fn, args))

    def add_adapter(self, name: str, path) -> None:
        self.call(self.engine.add_adapter, name, path)

    def stats(self) -> dict:
        return self.call(self.engine.stats)

    def submit(self, prompt, sampling: SamplingParams | None = None,
               adapter: str | None = None) -> "queue.Queue[RequestOutput]":
        """Queue a request from any thread; its outputs arrive on the returned queue."""
        q: queue.Queue = queue.Queue()

        def sink(item):
            q.put(item)
            if isinstance(item, Exception) or item.finished:
                q.put(_DONE)

        self._submit("add", (prompt, sampling, adapter, sink))
        return q

    def generate(self, prompt, sampling: SamplingParams | None = None,
                 adapter: str | None = None) -> RequestOutput:
        """Blocking: the finished output of one request (other threads may add more)."""
        last = None
        for last in _drain(self.submit(prompt, sampling, adapter)):
            pass
        return last

    async def stream(self, prompt, sampling: SamplingParams | None = None,
                     adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """Async: yield the request's output after each step in which it progressed."""
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()

        def sink(item):
            loop.call_soon_threadsafe(aq.put_nowait, item)

        await loop.run_in_executor(None, self._submit, "add", (prompt, sampling, adapter, sink))
        while True:
            item = await aq.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return

    def shutdown(self) -> None:
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
