"""`slora serve`: build the engine, register the adapters, warm up, then serve until SIGTERM
(or Ctrl-C), draining first; exits 0 after a drain."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from slora.server.settings import ServerSettings, engine_config_from_args


def run(args) -> int:
    from slora.async_engine import AsyncEngine
    from slora.engine import Engine
    from slora.server.app import DrainingServer, build_app

    config = engine_config_from_args(args)
    for line in unapplied_vllm_flags(args):
        print(f"slora serve: warning: {line}", file=sys.stderr)
    adapters = [_adapter_spec(spec) for spec in args.adapter]
    settings = ServerSettings(
        model_name=args.served_model_name or args.model or "SmolLM2-135M-Instruct",
        adapter_dir=args.adapter_dir, allow_any_adapter_path=args.allow_any_adapter_path,
        api_key=args.api_key, max_waiting=args.max_waiting, max_body_bytes=args.max_body_bytes,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        chat_template=_template(args.chat_template))
    engine = Engine(config)
    for name, path in adapters:
        engine.add_adapter(name, path)
    if args.warmup:
        seconds = engine.warmup(progress=args.progress)
        print(f"slora serve: warmed up in {seconds:.1f} s", file=sys.stderr)
    async_engine = AsyncEngine(engine=engine)
    try:
        server = DrainingServer(build_app(async_engine, settings), host=args.host,
                                port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.drain_timeout)
        # uvicorn re-raises the signal that stopped it once it has drained; with this
        # handler in place, a drained SIGTERM ends the process with status 0
        signal.signal(signal.SIGTERM, lambda *_: None)
        server.run()
    finally:
        async_engine.shutdown()
    return 0


def unapplied_vllm_flags(args) -> list[str]:
    """A line for each vLLM flag given whose vLLM meaning slora does not apply, and why."""
    return [f"{flag} {value} is not applied: adapters share the paged pool with the KV cache, "
            "loaded and evicted as requests need them (no count of adapters a batch), and "
            "the host tier holds --host-cache-gb of them"
            for flag, value in (("--max-loras", args.max_loras),
                                ("--max-cpu-loras", args.max_cpu_loras)) if value is not None]


def _adapter_spec(spec: str) -> tuple[str, str]:
    """NAME=PATH, or vLLM's {"name": NAME, "path": PATH} (its other keys unused)."""
    if spec.lstrip().startswith("{"):
        try:
            d = json.loads(spec)
            return str(d["name"]), str(d["path"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"--adapter {spec!r}: expected {{\"name\": ..., \"path\": ...}}"
                             ) from None
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--adapter {spec!r}: expected NAME=PATH")
    return name, path


def _template(value: str | None) -> str | None:
    """--chat-template: a file's text, else the value itself (vLLM's rule)."""
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if path.is_file() else value
