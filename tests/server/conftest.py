"""Fixtures of the server tests: one AsyncEngine on the tiny Llama (CPU) for the test run,
PEFT adapters in an adapter directory, and apps over that engine served by a real uvicorn on
127.0.0.1 (`serve`). Apps do not own the engine, so each test builds the app its settings
need; every server stops when its test ends."""

from __future__ import annotations

import importlib.util
import shutil
import time
from contextlib import contextmanager

import pytest

from slora import Engine, EngineConfig
from slora.async_engine import AsyncEngine

# The server's packages and the clients the tests drive (./run installs them all); without
# them, this directory's tests are not collected.
NEEDS = ("fastapi", "uvicorn", "prometheus_client", "httpx", "openai", "lorax", "requests")
if any(importlib.util.find_spec(name) is None for name in NEEDS):
    collect_ignore_glob = ["test_*.py"]

BASE = "tiny-llama"
# an adapter with its own chat template (chat_template.jinja in its directory)
OWN_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="session")
def engine_config(tiny_model_dir) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                        num_pages=1024)


@pytest.fixture(scope="session")
def adapter_dir(tiny_model_dir, adapter_factory, tmp_path_factory):
    """DIR/a0, DIR/a1: distinct adapters; DIR/chatty: a0's weights with its own chat template."""
    root = tmp_path_factory.mktemp("adapter_dir")
    for i in range(2):
        shutil.copytree(adapter_factory(tiny_model_dir, seed=i), root / f"a{i}")
    shutil.copytree(root / "a0", root / "chatty")
    (root / "chatty" / "chat_template.jinja").write_text(OWN_TEMPLATE)
    return root


@pytest.fixture(scope="session")
def async_engine(engine_config, adapter_dir):
    """The served engine, with a0, a1 and chatty registered."""
    engine = AsyncEngine(engine_config)
    for name in ("a0", "a1", "chatty"):
        engine.add_adapter(name, adapter_dir / name)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def reference(engine_config, adapter_dir) -> Engine:
    """An in-process engine with the same adapters: what each response must equal."""
    engine = Engine(engine_config)
    for name in ("a0", "a1", "chatty"):
        engine.add_adapter(name, adapter_dir / name)
    return engine


@pytest.fixture
def serve(async_engine, adapter_dir):
    """serve(**settings) -> a LiveServer over `async_engine` (settings: ServerSettings'
    fields; model_name and adapter_dir default to BASE and the adapter directory). After the
    test, the engine must be idle again with every KV page back."""

    from slora.server.app import build_app
    from slora.server.settings import ServerSettings
    from slora.server.testing import serve_in_thread

    @contextmanager
    def start(**settings):
        settings.setdefault("model_name", BASE)
        settings.setdefault("adapter_dir", str(adapter_dir))
        app = build_app(async_engine, ServerSettings(**settings))
        with serve_in_thread(app) as live:
            live.state = app.state.slora
            yield live

    yield start
    assert wait_idle(async_engine)["pages_kv"] == 0


def wait_idle(engine: AsyncEngine, timeout: float = 20.0) -> dict:
    """The engine's stats once nothing runs or waits (aborted requests end at the next
    step)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if (stats["num_running"] == stats["num_waiting"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)
