"""Fault isolation: a bad request, adapter or client fails alone; the engine serves on.

Each case is an input that passes (or used to pass) validation and then breaks something:
the affected requests end with finish_reason "error" and a message naming the cause, the
other requests' tokens are those of a clean run, and every KV page comes back.
"""

import asyncio
import math
import threading

import pytest
import torch

from slora import Engine, EngineConfig, SamplingParams
from slora.async_engine import AsyncEngine, EngineDeadError
from slora.config import ConfigError

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir):
    return Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                               num_pages=64))


def kv_back(engine) -> bool:
    """No request holds pages: every page is free, cached or an adapter's."""
    s = engine.stats()
    return (s["pages_kv"] == 0
            and s["pages_free"] + s["pages_cached"] + s["pages_adapter"] == s["pages_total"])


# -- validation at the door
@pytest.mark.parametrize("kwargs, field", [
    (dict(seed=2 ** 64), "seed"), (dict(seed="abc"), "seed"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"), (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"), (dict(top_p=math.nan), "top_p"),
    (dict(top_k=1.5), "top_k"), (dict(logprobs=-1), "logprobs"), (dict(logprobs=2.0), "logprobs"),
    (dict(stop=[1]), "stop"), (dict(stop_token_ids=[-3]), "stop_token_ids"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_sampling_params_check_types_and_ranges(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**kwargs)


def test_seeds_that_fit_64_bits_sample(engine):
    for seed in (2 ** 64 - 1, -(2 ** 63)):
        out = engine.generate("Hello", SamplingParams(max_tokens=3, temperature=1.0, seed=seed))
        assert out[0].finish_reason in ("length", "stop") and out[0].error is None


def test_logprobs_beyond_max_logprobs_are_refused(engine):
    with pytest.raises(ValueError, match="max_logprobs=20"):
        engine.add_request("Hello", SamplingParams(logprobs=10 ** 6))
    assert not engine.has_unfinished()
    out = engine.generate("Hello", SamplingParams(max_tokens=2, logprobs=20))[0]
    assert len(out.logprobs[0]) >= 20


@pytest.mark.parametrize("prompt, why", [
    ([1.0, 2.0], "must be ints"), ([1, "2"], "must be ints"), ([1, True], "must be ints"),
    (b"Hello", "expected a string"),
    ([], "empty prompt"), ([10 ** 9], "outside the vocabulary"),
])
def test_bad_prompts_are_refused(engine, prompt, why):
    with pytest.raises(ValueError, match=why):
        engine.add_request(prompt)
    assert not engine.has_unfinished()


def test_generate_validates_every_item_before_queueing_any(engine):
    with pytest.raises(ValueError, match="prompt 2: empty prompt"):
        engine.generate(["Hello", "World", ""], GREEDY)
    with pytest.raises(KeyError, match="prompt 1: unknown adapter 'nope'"):
        engine.generate(["Hello", "World"], GREEDY, adapters=[None, "nope"])
    assert not engine.has_unfinished() and engine.stats()["num_waiting"] == 0
    assert engine.generate("Hello", GREEDY)[0].finish_reason == "length"


def test_abort_of_an_unknown_id_says_so(engine):
    with pytest.raises(KeyError, match="unknown request id '2'"):
        engine.abort("2")


@pytest.mark.parametrize("change, field", [
    (dict(num_pages=2.5), "num_pages"), (dict(block_size="16"), "block_size"),
    (dict(cuda_graphs="yes"), "cuda_graphs"), (dict(host_cache_gb=math.nan), "host_cache_gb"),
    (dict(max_num_seqs=None), "max_num_seqs"), (dict(max_logprobs=-1), "max_logprobs"),
])
def test_engine_config_checks_types(change, field):
    with pytest.raises(ConfigError, match=f"EngineConfig.{field}="):
        EngineConfig(**change)


def test_triton_backend_without_a_gpu_or_the_interpreter_says_what_to_do(tiny_model_dir,
                                                                         monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need a CUDA device .*use backend='torch'"):
        Engine(EngineConfig(model=str(tiny_model_dir), device="cpu", backend="triton",
                            num_pages=16))


# -- faults inside a step
def _poison(engine, name: str) -> None:
    """Fill a resident adapter's pool pages with NaN: its rows' logits are not finite."""
    info = engine.adapters.get(name)
    assert info.resident
    engine.runner.pool[:, info.pages] = math.nan


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_with_non_finite_logits_fail_alone_naming_the_adapter(engine, temperature):
    engine.add_synthetic_adapter("bad", 8)
    engine.add_synthetic_adapter("good", 8, seed=1)
    prompts = ["Hello", "The quick", "Berlin"]
    clean = engine.generate(prompts, GREEDY, adapters=[None, "good", "bad"])
    _poison(engine, "bad")
    sp = [GREEDY, GREEDY, SamplingParams(max_tokens=6, temperature=temperature, seed=1)]
    outs = engine.generate(prompts, sp, adapters=[None, "good", "bad"])
    assert outs[2].finish_reason == "error" and "'bad'" in outs[2].error
    assert "not finite" in outs[2].error
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in clean[:2]]
    assert kv_back(engine)


def test_an_error_in_one_row_sampling_fails_that_row(engine, monkeypatch):
    sampler = engine.runner.sampler
    real = sampler._sample_row

    def sample_row(logits, sp, request_id):
        if sp.seed == 13:
            raise RuntimeError("injected")
        return real(logits, sp, request_id)

    monkeypatch.setattr(sampler, "_sample_row", sample_row)
    sps = [SamplingParams(max_tokens=5, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 13)]
    outs = engine.generate(["Hello", "Hello"], sps)
    assert outs[1].finish_reason == "error" and "sampling failed: RuntimeError: injected" in outs[1].error
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 5
    assert kv_back(engine)


def test_a_failing_forward_fails_its_step_and_the_next_step_runs(engine, monkeypatch):
    clean = engine.generate(["Hello", "World"], GREEDY)
    model, calls = engine.runner.model, []
    real = model.forward

    def forward(batch, pool):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected forward fault")
        return real(batch, pool)

    monkeypatch.setattr(model, "forward", forward)
    outs = engine.generate(["Hello", "World"], GREEDY)
    assert all(o.finish_reason == "error" and "injected forward fault" in o.error for o in outs)
    assert kv_back(engine)
    monkeypatch.setattr(model, "forward", real)
    assert [o.token_ids for o in engine.generate(["Hello", "World"], GREEDY)] == \
        [o.token_ids for o in clean]


def test_a_failing_detokeniser_fails_that_request(engine, monkeypatch):
    from slora import engine as engine_module

    real = engine_module.IncrementalDecoder.update

    def update(self, ids):
        if len(ids) == 3 and self.tokenizer is engine.tokenizer and ids == target[:3]:
            raise UnicodeError("injected")
        return real(self, ids)

    target = engine.generate("Berlin", GREEDY)[0].token_ids
    monkeypatch.setattr(engine_module.IncrementalDecoder, "update", update)
    outs = engine.generate(["Berlin", "Hello"], GREEDY)
    assert outs[0].finish_reason == "error" and "detokenising failed" in outs[0].error
    assert outs[1].finish_reason == "length"
    assert kv_back(engine)


def test_an_adapter_read_that_fails_at_first_use_fails_its_requests_only(engine):
    engine.add_synthetic_adapter("flaky", 8, seed=3)
    engine.add_synthetic_adapter("other", 8, seed=4)
    clean = engine.generate(["Hello", "World"], GREEDY, adapters=[None, "other"])
    engine.remove_adapter("other")
    engine.add_synthetic_adapter("other", 8, seed=4)
    info = engine.adapters.get("flaky")
    real, fail = info.pack, [True]

    def pack(page_size, dtype):
        if fail[0]:
            raise OSError("injected: the adapter's file is gone")
        return real(page_size, dtype)

    info.pack = pack
    engine.reset_prefix_cache()
    free = engine.stats()["pages_free"]
    outs = engine.generate(["Hello", "World", "Berlin"], GREEDY, adapters=[None, "other", "flaky"])
    assert outs[2].finish_reason == "error" and "'flaky' could not be loaded" in outs[2].error
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in clean]
    assert not info.resident and kv_back(engine)
    s = engine.stats()
    assert s["pages_free"] + s["pages_cached"] == free - engine.adapters.get("other").num_pages
    fail[0] = False  # the file is back: the next use reads it again
    assert engine.generate("Berlin", GREEDY, adapters="flaky")[0].finish_reason == "length"


def test_removing_an_adapter_fails_its_queued_and_running_requests(engine):
    engine.add_synthetic_adapter("gone", 8)
    a = engine.add_request("Hello", GREEDY, adapter="gone")
    engine.step()  # a runs
    b = engine.add_request("World", GREEDY, adapter="gone")  # b is queued
    c = engine.add_request("Berlin", GREEDY)
    engine.remove_adapter("gone")
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    for rid in (a, b):
        assert outs[rid].finish_reason == "error" and "'gone' was removed" in outs[rid].error
    assert outs[c].finish_reason == "length"
    assert "gone" not in engine.list_adapters() and kv_back(engine)


def test_breaking_out_of_engine_stream_aborts_its_request(engine):
    for out in engine.stream("Hello", SamplingParams(max_tokens=50, ignore_eos=True)):
        if len(out.token_ids) == 2:
            break
    assert engine.stats()["num_running"] == 0 and kv_back(engine)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.finish_reason for o in outs] == ["abort"]


# -- AsyncEngine never hangs
@pytest.fixture
def async_engine(tiny_model_dir):
    ae = AsyncEngine(EngineConfig(model=str(tiny_model_dir), device="cpu", dtype="float32",
                                  num_pages=64))
    yield ae
    ae.shutdown()


def _idle(ae) -> bool:
    s = ae.stats()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["pages_kv"] == 0


def _wait_idle(ae, timeout=30.0) -> bool:
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if _idle(ae):
            return True
        time.sleep(0.02)
    return False


def test_a_cancelled_stream_aborts_its_request(async_engine):
    sp = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        first = asyncio.Event()

        async def consume():  # reads one output, then waits (a slow client) until cancelled
            async for _ in async_engine.stream("Hello", sp):
                first.set()
                await asyncio.Event().wait()

        task = asyncio.create_task(consume())
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert _wait_idle(async_engine)


def test_a_closed_client_loop_never_reaches_the_engine_thread(async_engine):
    sp = SamplingParams(max_tokens=200, ignore_eos=True)
    loop = asyncio.new_event_loop()
    gen = async_engine.stream("Hello", sp)
    first = loop.run_until_complete(gen.__anext__())
    assert not first.finished
    loop.close()  # the client goes away without closing its stream
    assert _wait_idle(async_engine)
    assert async_engine.generate("Hello", GREEDY).finish_reason == "length"


def test_abort_ends_a_stream_with_abort(async_engine):
    sp = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main():
        reasons = []
        async for out in async_engine.stream("Hello", sp, request_id="r1"):
            if len(out.token_ids) == 2:
                async_engine.abort("r1")
            reasons.append(out.finish_reason)
        return reasons

    assert asyncio.run(main())[-1] == "abort"
    async_engine.abort("no-such-id")  # ignored
    assert _wait_idle(async_engine)


def test_calls_after_shutdown_raise(async_engine):
    async_engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        async_engine.stats()
    with pytest.raises(RuntimeError, match="shut down"):
        async_engine.generate("Hello", GREEDY)

    async def main():
        async for _ in async_engine.stream("Hello", GREEDY):
            pass

    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(main())


def test_a_dead_engine_thread_fails_every_waiting_and_later_call(async_engine):
    started = threading.Event()

    def broken_step():
        started.set()
        raise SystemError("injected: the loop itself broke")

    async_engine.engine.step = broken_step
    q = async_engine.submit("Hello", SamplingParams(max_tokens=50, ignore_eos=True))
    assert started.wait(10)
    item = q.get(timeout=10)
    assert isinstance(item, EngineDeadError) and "injected" in str(item)
    with pytest.raises(EngineDeadError, match="SystemError"):
        async_engine.stats()
    with pytest.raises(EngineDeadError):
        async_engine.generate("Hello", GREEDY)


def test_nan_weights_through_async_engine_fail_one_request(async_engine):
    eng = async_engine.engine
    async_engine.call(eng.add_synthetic_adapter, "bad", 8)
    async_engine.generate("Hello", GREEDY, adapter="bad")  # resident now

    def poison():
        eng.runner.pool[:, eng.adapters.get("bad").pages] = torch.nan

    async_engine.call(poison)
    sp = SamplingParams(max_tokens=6, temperature=0.8, seed=2, ignore_eos=True)
    bad = async_engine.generate("Hello", sp, adapter="bad")
    assert bad.finish_reason == "error" and "'bad'" in bad.error
    assert async_engine.generate("Hello", GREEDY).finish_reason == "length"
    assert _wait_idle(async_engine)


def test_integral_token_ids_of_other_types_are_served_as_ints(engine):
    """A prompt of numpy integers is the prompt of the same plain ints."""
    np = pytest.importorskip("numpy")
    ids = [1, 2, 3]
    want = engine.generate(ids, GREEDY)[0].token_ids
    assert engine.generate([np.int64(i) for i in ids], GREEDY)[0].token_ids == want
    assert engine.generate(tuple(ids), GREEDY)[0].token_ids == want
