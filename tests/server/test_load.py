"""A bounded local load test: 200 concurrent streaming requests over 20 adapters, with a
runtime load and an unload in the middle. Every request completes or gets a clear error,
none is lost, the pool's pages come back, and /metrics agrees with what was sent."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import wait_idle

REQUESTS, MAX_TOKENS = 200, 8
JIT = [f"load{i}" for i in range(18)]  # found in the adapter directory on first use
NAMES = JIT + ["early", "late"]  # early: loaded before, unloaded in the middle; late: loaded then


def metric_values(text: str) -> dict:
    """(sample name, sorted labels) -> value, from the Prometheus text format."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def one(client, i: int, started: set[int]) -> dict:
    """Request i, streamed: its outcome (status, text, usage, error message). `started` gets
    i once the request has its answer's status."""
    body = {"model": NAMES[i % len(NAMES)], "prompt": f"Hello world {i}", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/completions", json=body) as res:
        started.add(i)
        if res.status_code != 200:
            return {"i": i, "status": res.status_code,
                    "error": json.loads(await res.aread())["error"]["message"]}
        text, usage, finish = "", None, None
        async for line in res.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            usage = event.get("usage") or usage
        return {"i": i, "status": 200, "text": text, "usage": usage, "finish": finish}


def test_200_streams_over_20_adapters_with_a_load_and_an_unload(serve, adapter_dir,
                                                                async_engine):
    for k, name in enumerate(JIT):
        shutil.copytree(adapter_dir / f"a{k % 2}", adapter_dir / name)
    for name in ("early", "late"):  # under x/: no name the resolver would find
        shutil.copytree(adapter_dir / "a1", adapter_dir / "x" / name)
    start = wait_idle(async_engine)
    try:
        with serve() as live:
            async def main():
                # (no idle connection reused: one the server's keep-alive timeout closes as
                # the client picks it up, on a loaded machine, fails that request before the
                # server sees it)
                limits = httpx.Limits(max_connections=REQUESTS + 10,
                                      max_keepalive_connections=0)
                async with httpx.AsyncClient(base_url=live.url, timeout=120,
                                             limits=limits) as client:
                    async def post(path, name, **body):
                        return await client.post(path, json={"lora_name": name, **body})

                    assert (await post("/v1/load_lora_adapter", "early",
                                       lora_path="x/early")).status_code == 200
                    started: set[int] = set()
                    half = REQUESTS // 2
                    first = [asyncio.create_task(one(client, i, started)) for i in range(half)]
                    while len(started) < half:  # the middle: the first half is answering
                        await asyncio.sleep(0.005)
                    load = await post("/v1/load_lora_adapter", "late", lora_path="x/late")
                    unload = asyncio.create_task(post("/v1/unload_lora_adapter", "early"))
                    while "early" not in live.state.adapters.unloading and not unload.done():
                        await asyncio.sleep(0.005)
                    second = [asyncio.create_task(one(client, i, started))
                              for i in range(half, REQUESTS)]
                    results = await asyncio.gather(*first, *second)
                    metrics = (await client.get("/metrics")).text
                    for name in JIT + ["late"]:  # the adapters of this test leave the pool
                        assert (await post("/v1/unload_lora_adapter", name)).status_code == 200
                    return results, load, await unload, metrics

            results, load, unload, metrics = asyncio.run(main())
    finally:
        for name in JIT + ["x"]:
            shutil.rmtree(adapter_dir / name)
    assert load.status_code == 200 and unload.status_code == 200

    # every request is accounted for: done in full, or a 404 for an adapter not served then
    assert sorted(r["i"] for r in results) == list(range(REQUESTS))
    done = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] != 200]
    for r in refused:
        name = NAMES[r["i"] % len(NAMES)]
        assert r["status"] == 404 and name in r["error"], r
        assert (name, r["i"] < REQUESTS // 2) in {("late", True), ("early", False)}, r
    assert len(refused) == 10 and len(done) == REQUESTS - 10
    for r in done:
        assert r["finish"] == "length" and r["usage"]["completion_tokens"] == MAX_TOKENS, r

    # the pool: no KV left, and without this test's adapters, the free pages of the start
    end = wait_idle(async_engine)
    assert end["pages_kv"] == 0
    assert end["pages_free"] + end["pages_cached"] == start["pages_free"] + start["pages_cached"]

    # /metrics parses and agrees with what was sent
    m = metric_values(metrics)
    served = {k[1][0][1]: v for k, v in m.items()
              if k[0] == "slora_requests_total" and dict(k[1])["finish_reason"] == "length"}
    assert sum(served.values()) == len(done)
    for name in NAMES:
        sent = sum(1 for r in done if NAMES[r["i"] % len(NAMES)] == name)
        assert served.get(name, 0) == sent
    assert m[("slora_generation_tokens_total", ())] == len(done) * MAX_TOKENS
    assert m[("slora_prompt_tokens_total", ())] == sum(r["usage"]["prompt_tokens"] for r in done)
    assert m[("slora_http_errors_total", (("status", "404"),))] == len(refused)
    assert m[("slora_time_to_first_token_seconds_count", ())] == len(done)
    assert m[("slora_e2e_request_latency_seconds_count", ())] == len(done)
    assert m[("slora_inter_token_latency_seconds_count", ())] == len(done) * (MAX_TOKENS - 1)
    assert m[("slora_num_requests_running", ())] == 0
    pages = {dict(k[1])["use"]: v for k, v in m.items() if k[0] == "slora_pool_pages"}
    assert pages["free"] + pages["kv"] + pages["adapter"] + pages["cached"] == pages["total"]
    residency = {dict(k[1])["adapter"]: v for k, v in m.items()
                 if k[0] == "slora_adapter_residency"}
    assert set(JIT + ["late"]) <= set(residency) and "early" not in residency
    assert set(residency.values()) <= {0.0, 1.0, 2.0} and residency["late"] == 2.0

