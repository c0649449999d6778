"""`slora replay --url`: a trace sent over HTTP, measured as the in-process replay measures it.

A stub server (Starlette on 127.0.0.1, the SSE shapes of OpenAI's and LoRAX's streaming APIs)
pins down what the client sends and how it reads every way a request can end; the real
`slora serve` app on a tiny CPU model checks the whole path end to end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import pytest

from slora.cli import main
from slora.http_replay import HttpTarget, SseParser, StreamState, replay_http, served_base_model
from slora.workload import Trace, TraceRequest, read_trace

starlette = pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")


# ---------------------------------------------------------------------------------------------
# A stub server


def stub_app(seen: list[dict]):
    """OpenAI completions and LoRAX generate_stream, streaming max tokens one event each.
    The adapter name picks a failure: "missing" -> 404, "cut" -> the stream stops after two
    tokens, "broken" -> an error event, "aborted" -> finish_reason "abort"."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def sse(obj) -> bytes:
        return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": "lora-0", "parent": "base"}, {"id": "base", "parent": None}]})

    async def health(request):
        return JSONResponse({})

    async def completions(request):
        body = await request.json()
        seen.append(body)
        model, n = body["model"], body["max_tokens"]
        if model == "missing":
            return JSONResponse({"error": {"message": "adapter 'missing' is not registered",
                                           "type": "NotFoundError", "code": 404}}, 404)

        async def events():
            for i in range(n):
                await asyncio.sleep(0.001)
                if model == "cut" and i == 2:
                    return
                if model == "broken" and i == 1:
                    yield sse({"error": {"message": "engine step failed", "code": 500}})
                    return
                reason = ("abort" if model == "aborted" else "length") if i == n - 1 else None
                yield sse({"object": "text_completion", "model": model, "choices": [
                    {"index": 0, "text": "x", "finish_reason": reason}]})
            yield sse({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                                "completion_tokens": n}})
            yield sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def generate_stream(request):
        body = await request.json()
        seen.append(body)
        n = body["parameters"]["max_new_tokens"]

        async def events():
            for i in range(n):
                last = i == n - 1
                yield sse({"token": {"id": 5, "text": "y", "logprob": 0.0, "special": False},
                           "generated_text": "y" * n if last else None,
                           "details": {"finish_reason": "length", "generated_tokens": n}
                           if last else None})

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/health", health),
                             Route("/v1/completions", completions, methods=["POST"]),
                             Route("/generate_stream", generate_stream, methods=["POST"])])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app):
    """`app` under uvicorn on 127.0.0.1 in a thread; its URL. Stops on exit."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the stub server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def stub():
    seen: list[dict] = []
    with running(stub_app(seen)) as url:
        yield url, seen


def small_trace(adapters, output_len=4, gap=0.01) -> Trace:
    return Trace([TraceRequest(arrival_time=i * gap, adapter=a, prompt_len=3 + i,
                               output_len=output_len) for i, a in enumerate(adapters)])


# ---------------------------------------------------------------------------------------------
# The stream readers


def test_sse_parser_joins_split_chunks_and_multiline_data():
    p = SseParser()
    events = p.feed(b"data: {\"a\"") + p.feed(b": 1}\r\n\r\n: a comment\nevent: x\ndata:two\n")
    events += p.feed(b"data: lines\n\ndata: [DONE]")
    assert events == ['{"a": 1}', "two\nlines"]
    assert p.close() == ["[DONE]"]


def test_stream_state_reads_openai_and_lorax_events():
    s = StreamState("openai")
    s.on_event('{"choices": [{"text": "a", "finish_reason": null}]}', 0.5)
    s.on_event('{"choices": [{"text": "b", "finish_reason": "length"}]}', 0.7)
    assert s.failure() == "the stream ended before the request finished"
    s.on_event('{"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}', 0.8)
    s.on_event("[DONE]", 0.8)
    assert (s.first_token_time, s.token_events, s.output_tokens, s.prompt_tokens) == (0.5, 2, 3, 9)
    assert s.failure() is None
    assert s.gaps == {0.7 - 0.5: 1}  # one gap: the second token event's

    s = StreamState("lorax")
    s.on_event('{"token": {"id": 1, "text": "a"}, "generated_text": null, "details": null}', 0.1)
    s.on_event('{"token": {"id": 2, "text": "b"}, "generated_text": "ab", '
               '"details": {"finish_reason": "length", "generated_tokens": 2}}', 0.2)
    assert (s.first_token_time, s.output_tokens, s.failure()) == (0.1, 2, None)

    s = StreamState("lorax")
    s.on_event('{"error": "Request failed during generation", "error_type": "generation"}', 0.1)
    assert s.failure() == "Request failed during generation"


def test_served_base_model_is_the_entry_without_a_parent():
    models = {"data": [{"id": "a", "parent": "m"}, {"id": "m", "parent": None}]}
    assert served_base_model(models) == "m"
    with pytest.raises(ValueError, match="no base model"):
        served_base_model({"data": [{"id": "a", "parent": "m"}]})


# ---------------------------------------------------------------------------------------------
# Against the stub


def test_openai_requests_carry_ids_lengths_and_adapters(stub):
    url, seen = stub
    seen.clear()
    trace = small_trace(["lora-0", None, "lora-1"], output_len=5)
    run, base = replay_http(trace, HttpTarget(url, concurrency=2), vocab_size=50, seed=3)
    assert base == "base"
    assert [r.failed for r in run.records] == [False] * 3
    assert [r.output_tokens for r in run.records] == [5, 5, 5]
    assert [r.prompt_tokens for r in run.records] == [3, 4, 5]
    assert all(r.arrival_time <= r.first_token_time <= r.finish_time <= run.duration_s
               for r in run.records)
    bodies = sorted(seen, key=lambda b: len(b["prompt"]))
    assert [b["model"] for b in bodies] == ["lora-0", "base", "lora-1"]
    assert all(b["max_tokens"] == 5 and b["ignore_eos"] is True and b["temperature"] == 0
               and b["stream"] is True for b in bodies)
    # the in-process replay's prompts: the same seed, the same draws, in arrival order
    from slora.replay import _random_ids
    import numpy as np

    rng = np.random.default_rng(3)
    assert [b["prompt"] for b in bodies] == [_random_ids(rng, n, 50) for n in (3, 4, 5)]


def test_every_failure_is_a_record_with_its_reason(stub):
    url, _ = stub
    trace = small_trace(["missing", "cut", "broken", "aborted", "lora-0"])
    run, _ = replay_http(trace, HttpTarget(url), vocab_size=50)
    by = {r.adapter: r for r in run.records}
    assert len(run.records) == 5 and not by["lora-0"].failed
    assert by["missing"].error == "HTTP 404: adapter 'missing' is not registered"
    assert by["missing"].first_token_time is None and by["missing"].output_tokens == 0
    assert by["cut"].error == "the stream ended before the request finished"
    assert by["cut"].output_tokens == 2 and by["cut"].first_token_time is not None
    assert by["broken"].error == "engine step failed"
    assert by["aborted"].error == "the server finished it with finish_reason 'abort'"


def test_lorax_api_sends_text_and_adapter_ids(stub):
    url, seen = stub
    seen.clear()
    run, _ = replay_http(small_trace(["lora-0", None], output_len=3),
                         HttpTarget(url, api="lorax", adapter_source="local"))
    assert [(r.failed, r.output_tokens) for r in run.records] == [(False, 3), (False, 3)]
    bodies = sorted(seen, key=lambda b: len(b["inputs"]))
    assert bodies[0] == {"inputs": "hello " * 3, "parameters": {
        "max_new_tokens": 3, "details": True, "adapter_id": "lora-0", "adapter_source": "local"}}
    assert "adapter_id" not in bodies[1]["parameters"]


def test_unreachable_server_is_a_clear_error(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_time": 0, "adapter": null, "prompt_len": 3, "output_len": 2}\n')
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["replay", str(trace), "--url", url, "--vocab-size", "50", "-o",
                 str(tmp_path / "r.json")]) == 1
    assert f"cannot reach {url}" in capsys.readouterr().err


def test_cli_refuses_in_process_options_with_url(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"arrival_time": 0, "adapter": null, "prompt_len": 3, "output_len": 2}\n')
    out = str(tmp_path / "r.json")
    assert main(["replay", str(trace), "--url", "http://127.0.0.1:1", "--num-pages", "64",
                 "-o", out]) == 1
    assert "--num-pages" in capsys.readouterr().err
    assert main(["replay", str(trace), "-o", out]) == 1
    assert "--model DIR or --url URL" in capsys.readouterr().err


def test_cli_writes_the_replay_result_json(stub, tmp_path, capsys):
    url, _ = stub
    path, out = tmp_path / "t.jsonl", tmp_path / "http.json"
    path.write_text("".join(json.dumps(r.to_json()) + "\n"
                            for r in small_trace(["lora-0", None, "missing"]).requests))
    assert main(["replay", str(path), "--url", url, "--vocab-size", "50", "--label", "stub",
                 "--no-progress", "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert (result["num_requests"], result["num_completed"], result["num_failed"]) == (3, 2, 1)
    assert result["source"] == "stub" and result["config"]["url"] == url
    assert result["stats"]["errors"] == {"HTTP 404: adapter 'missing' is not registered": 1}
    lat = result["latencies"]
    assert (len(lat["ttft_s"]), len(lat["e2e_s"])) == (2, 2)
    assert sum(n for _, n in lat["itl_s"]) == 2 * 3  # two streams of four token events
    assert "first-token latency" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Against slora serve


@pytest.fixture(scope="module")
def slora_server(tiny_model_dir):
    """`slora serve`'s app on 127.0.0.1 over a tiny CPU engine with the synthetic adapters of
    `served_trace()`; (its URL, that trace)."""
    pytest.importorskip("fastapi")
    from slora import Engine, EngineConfig
    from slora.async_engine import AsyncEngine
    from slora.replay import register_adapters
    from slora.server.app import build_app
    from slora.server.settings import ServerSettings
    from slora.server.testing import serve_in_thread

    trace = served_trace()
    engine = Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                 num_pages=256, max_num_seqs=8))
    register_adapters(engine, trace, synthetic=True, adapter_dir=None)
    served = AsyncEngine(engine=engine)
    try:
        with serve_in_thread(build_app(served, ServerSettings(model_name="tiny"))) as live:
            yield live.url, trace
    finally:
        served.shutdown()


def served_trace() -> Trace:
    """16 requests over 3 synthetic adapters at 20 req/s, every fourth on the base model."""
    from slora.workload import synthesize

    t = synthesize(num_adapters=3, rate=20, cv=1, alpha=1, duration=0.8, input_len=(3, 12),
                   output_len=(2, 8), ranks=(4, 8), seed=1)
    reqs = [TraceRequest(r.arrival_time, None if i % 4 == 3 else r.adapter, r.output_len,
                         prompt_len=r.prompt_len) for i, r in enumerate(t.requests)]
    return Trace(reqs, t.adapters, t.params)


def test_replay_against_slora_serve(slora_server, tiny_model_dir):
    """Every request completes with exactly its output_len tokens, the base model's requests
    named by the server's own listing."""
    url, trace = slora_server
    run, base = replay_http(trace, HttpTarget(url, concurrency=4), vocab_size=256, seed=5)
    assert base == "tiny" and len(run.records) == len(trace) == 16
    assert [r.error for r in run.records] == [None] * 16
    assert [r.output_tokens for r in run.records] == [r.output_len for r in trace.requests]
    assert [r.prompt_tokens for r in run.records] == [r.prompt_len for r in trace.requests]
    assert [r.adapter for r in run.records] == [r.adapter for r in trace.requests]
    assert all(r.arrival_time <= r.first_token_time <= r.finish_time for r in run.records)
    # a gap for each streamed token after a request's first (one token an event)
    assert sum(run.token_gaps.values()) == sum(r.output_len - 1 for r in trace.requests)


def test_cli_replays_slora_serve_over_both_apis_and_plots(slora_server, tiny_model_dir, tmp_path,
                                                          capsys):
    """`slora replay --url` over the OpenAI and the LoRAX API, then `slora plot` of both."""
    url, trace = slora_server
    path = tmp_path / "t.jsonl"
    from slora.workload import write_trace

    write_trace(trace, path)
    paths = []
    for api in ("openai", "lorax"):
        paths.append(tmp_path / f"{api}.json")
        assert main(["replay", str(path), "--url", url, "--api", api, "--label", api,
                     "--model", str(tiny_model_dir), "--no-progress", "-o", str(paths[-1])]) == 0
        result = json.loads(paths[-1].read_text())
        assert (result["num_requests"], result["num_completed"]) == (16, 16), result["stats"]
        assert result["source"] == api and result["config"]["api"] == api
        tokens = round(result["throughput_tok_s"] * result["duration_s"])
        want = sum(r.output_len for r in trace.requests)
        # lorax has no ignore_eos: a request may end early at the end-of-sequence token
        assert tokens == want if api == "openai" else 16 <= tokens <= want
    assert read_trace(path).requests == trace.requests
    assert main(["plot", *map(str, paths), "-o", str(tmp_path / "servers.png")]) == 0
    assert (tmp_path / "servers.png").stat().st_size > 0
