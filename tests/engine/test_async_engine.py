"""AsyncEngine: requests join while the engine steps, and stream token by token."""

import asyncio
import threading

import pytest

from slora import Engine, EngineConfig, SamplingParams
from slora.async_engine import AsyncEngine


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    cfg = EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", num_pages=64)
    ae = AsyncEngine(cfg)
    yield Engine(cfg), ae
    ae.shutdown()


def test_stream_token_by_token_with_requests_joining(engines):
    sync, ae = engines
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    want = {p: o.token_ids for p, o in zip(["Hello", "The quick", "Berlin"],
                                           sync.generate(["Hello", "The quick", "Berlin"], sp))}

    async def main():
        got, lengths = {}, []
        late = []

        async def one(prompt):
            async for out in ae.stream(prompt, sp):
                if prompt == "Hello":
                    lengths.append(len(out.token_ids))
                    if len(out.token_ids) == 3 and not late:  # join while "Hello" decodes
                        late.append(asyncio.create_task(one("Berlin")))
                got[prompt] = out.token_ids

        await asyncio.gather(one("Hello"), one("The quick"))
        await asyncio.gather(*late)
        return got, lengths

    got, lengths = asyncio.run(main())
    assert got == want
    assert lengths == list(range(1, 13))  # one output per generated token


def test_threads_submit_concurrently_and_errors_reach_the_caller(engines):
    _, ae = engines
    sp = SamplingParams(max_tokens=5, ignore_eos=True)
    results = {}

    def worker(i):
        results[i] = ae.generate(f"Hello {i}", sp).token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0, 1, 2, 3] and all(len(v) == 5 for v in results.values())
    with pytest.raises(KeyError, match="unknown adapter"):
        ae.generate("Hello", sp, adapter="missing")
    assert ae.stats()["num_running"] == 0
