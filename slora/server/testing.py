"""Run a `build_app` app on a real uvicorn server in a background thread, on a free port of
127.0.0.1: for tests and for in-process clients.

    with serve_in_thread(build_app(async_engine, settings)) as live:
        httpx.get(f"{live.url}/health")          # live.url = "http://127.0.0.1:<port>"
        live.drain()                             # what SIGTERM does: drain, then stop

Leaving the block stops the server (open streams get `timeout_graceful_shutdown` seconds to
finish); the AsyncEngine stays up, owned by its maker.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from fastapi import FastAPI

from slora.server.app import DrainingServer


@dataclass
class LiveServer:
    url: str
    port: int
    server: DrainingServer
    thread: threading.Thread

    def drain(self) -> None:
        """Start the graceful shutdown SIGTERM starts: draining, then stop."""
        self.server.handle_exit(signal.SIGTERM, None)


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", startup_timeout_s: float = 30.0,
                    timeout_graceful_shutdown: float = 10.0, **config) -> Iterator[LiveServer]:
    """Serve `app` until the block ends (see the module docstring). `config`: more
    uvicorn.Config keywords."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    config.setdefault("log_level", "warning")
    server = DrainingServer(app, host=host, port=port,
                            timeout_graceful_shutdown=timeout_graceful_shutdown, **config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                              name=f"uvicorn-{port}")
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the server on {host}:{port} did not start")
        time.sleep(0.01)
    try:
        yield LiveServer(f"http://{host}:{port}", port, server, thread)
    finally:
        server.should_exit = True
        thread.join(timeout=timeout_graceful_shutdown + 10)
        sock.close()
