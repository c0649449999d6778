"""`slora serve` as a command: its help lists every EngineConfig knob, and a real server
process drains on SIGTERM (the running stream finishes, then the process exits 0)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import fields

import httpx
import pytest

from slora.cli import main
from slora.config import EngineConfig


def test_help_lists_the_server_flags_and_every_engine_knob(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    for flag in ("--adapter NAME=PATH", "--adapter-dir", "--api-key", "--host", "--port",
                 "--allow-any-adapter-path", "--max-waiting", "--max-body-bytes"):
        assert flag in text
    for f in fields(EngineConfig):
        assert f"--{f.name.replace('_', '-')}" in text, f.name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_running_requests_and_exits_0(tiny_model_dir, adapter_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "slora.cli", "serve", "--model", str(tiny_model_dir),
         "--adapter", f"a0={adapter_dir / 'a0'}", "--port", str(port), "--device", "cpu",
         "--dtype", "float32", "--num-pages", "256", "--log-level", "warning",
         "--no-progress"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.2)

        events, first = [], threading.Event()

        def stream():
            body = {"model": "a0", "prompt": "Hello", "max_tokens": 100, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as res:
                for line in res.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        first.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]  # the stream ran to its end
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 100
    with pytest.raises(httpx.TransportError):  # gone: nothing listens any more
        httpx.get(f"{url}/health", timeout=1)
