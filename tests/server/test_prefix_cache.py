"""The server takes a prefix-cache salt per request on the OpenAI and LoRAX routes, and /metrics
reports the prefix cache."""

from __future__ import annotations

import httpx

from .conftest import wait_idle
from .test_load import metric_values

TEXT = "The quick brown fox jumps over the lazy dog. " * 5


def test_cache_salt_per_request_and_prefix_metrics(serve, async_engine):
    engine = async_engine.engine
    async_engine.call(engine.reset_prefix_cache)
    n = len(engine.tokenizer.encode(TEXT))
    found = (n - 1) // engine.config.block_size * engine.config.block_size
    assert found >= 32
    with serve() as live:
        def hits() -> int:
            wait_idle(async_engine)
            return async_engine.stats()["prefix_hit_tokens"]

        def complete(salt, route="openai"):
            if route == "openai":
                body = {"prompt": TEXT, "max_tokens": 2, "temperature": 0}
                if salt:
                    body["cache_salt"] = salt
                res = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
            else:
                params = {"max_new_tokens": 2, **({"cache_salt": salt} if salt else {})}
                res = httpx.post(f"{live.url}/generate", timeout=60,
                                 json={"inputs": TEXT, "parameters": params})
            assert res.status_code == 200, res.text
            return hits()

        start = hits()
        assert complete("tenant-1") == start
        assert complete("tenant-2", "lorax") == start  # another tenant: nothing shared
        assert complete(None) == start
        assert complete("tenant-1", "lorax") == start + found  # the same tenant, either route
        assert complete("tenant-2") == start + 2 * found
        res = httpx.post(f"{live.url}/v1/completions", json={"prompt": TEXT, "cache_salt": ""})
        assert res.status_code == 400 and res.json()["error"]["param"] == "cache_salt"
        m = metric_values(httpx.get(f"{live.url}/metrics").text)
    stats = async_engine.stats()
    assert m[("slora_prefix_cache_hits_total", ())] == stats["prefix_hit_tokens"]
    assert m[("slora_prefix_cache_queries_total", ())] == stats["prefix_query_tokens"]
    assert m[("slora_pool_pages", (("use", "cached"),))] == stats["pages_cached"] > 0
    assert 0 < m[("slora_prefix_cache_hit_rate", ())] <= 1
