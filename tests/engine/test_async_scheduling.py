"""EngineConfig.async_scheduling: each step is launched before the one before it is collected
(the decode rows' input ids taken on the device from its sampled tokens). The outputs must be
the sync engine's, token for token, whatever ends a request: max_tokens, a stop token, a stop
string, an abort, preemption, sampled rows and logprobs among greedy ones."""

import torch
import pytest

from slora import Engine, EngineConfig, SamplingParams

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _serve(e: Engine, jobs, abort_at=None) -> dict[int, tuple]:
    """Add one job a step (most steps mix prompts and decode rows), then run to the end;
    job -> (token ids, finish reason, logprobs, text). `abort_at`: (job, step) to abort."""
    ids, done, n = [], {}, 0
    for prompt, sp, adapter in jobs:
        ids.append(e.add_request(prompt, sp, adapter=adapter))
        done.update({o.request_id: o for o in e.step() if o.finished})
        n += 1
        if abort_at and n == abort_at[1]:
            e.abort(ids[abort_at[0]])
    while e.has_unfinished():
        done.update({o.request_id: o for o in e.step() if o.finished})
    return {i: (done[r].token_ids, done[r].finish_reason, done[r].logprobs, done[r].text)
            for i, r in enumerate(ids)}


def _engine(model_dir, paths, async_scheduling, **kw) -> Engine:
    cfg = dict(model=str(model_dir), device=DEVICE, dtype="float32", num_pages=64)
    e = Engine(EngineConfig(**{**cfg, **kw}, async_scheduling=async_scheduling))
    for name, path in paths.items():
        e.add_adapter(name, path)
    return e


def _jobs(model_dir, paths):
    """Prompts over two adapters and the base model, with stops that end some of them mid-way:
    a stop token and a stop string taken from what the sync engine generates."""
    prompts = ["The quick brown fox", "Hello", "Paris is the capital of France.", "Berlin", "I",
               "One two three four five", list(range(3, 40))]
    adapters = ["r3", None, "r16", "r3", None, "r16", "r3"]
    plain = [(p, SamplingParams(max_tokens=14, ignore_eos=True), a) for p, a in zip(prompts, adapters)]
    first = _serve(_engine(model_dir, paths, False), plain)
    stop_tok = first[0][0][5]  # job 0 stops at its 6th token
    text = first[2][3]
    jobs = [(p, SamplingParams(max_tokens=10 + i, ignore_eos=True), a)
            for i, (p, a) in enumerate(zip(prompts, adapters))]
    jobs[0] = (prompts[0], SamplingParams(max_tokens=14, ignore_eos=True, stop_token_ids=(stop_tok,)), "r3")
    jobs[2] = (prompts[2], SamplingParams(max_tokens=14, ignore_eos=True, stop=(text[len(text) // 2:][:3],)), "r16")
    jobs[3] = (prompts[3], SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=5), "r3")
    jobs[4] = (prompts[4], SamplingParams(max_tokens=8, logprobs=2, ignore_eos=True), None)
    return jobs


@pytest.fixture(scope="module")
def paths(tiny_model_dir, adapter_factory):
    return {"r3": adapter_factory(tiny_model_dir, r=3, target_modules=["q_proj", "v_proj"]),
            "r16": adapter_factory(tiny_model_dir, r=16, target_modules="all-linear", seed=1)}


def test_async_scheduling_gives_the_sync_outputs(tiny_model_dir, paths):
    jobs = _jobs(tiny_model_dir, paths)
    out = {flag: _serve(_engine(tiny_model_dir, paths, flag), jobs) for flag in (False, True)}
    assert out[True] == out[False]
    reasons = [out[False][i][1] for i in range(len(jobs))]
    assert reasons[0] == "stop" and len(out[False][0][0]) == 6  # the stop token, mid-way
    assert reasons[2] == "stop" and len(out[False][2][0]) < 14  # the stop string, mid-way
    assert out[False][4][2] and len(out[False][4][2]) == 8  # logprobs, one per token


def test_async_scheduling_with_preemption_and_abort(tiny_model_dir, paths):
    """A pool a few requests wide: requests are preempted (some while their step runs) and
    recomputed; one is aborted mid-way. Same outputs (the aborted one's up to the step it
    was aborted in); every page back at the end."""
    jobs = [(list(range(3 + i, 30 + i)), SamplingParams(max_tokens=30 + 3 * i, ignore_eos=True),
             ["r3", None][i % 2]) for i in range(7)]
    out, engines = {}, {}
    for flag in (False, True):
        e = engines[flag] = _engine(tiny_model_dir, {"r3": paths["r3"]}, flag, num_pages=14)
        out[flag] = _serve(e, jobs, abort_at=(5, 6))
    # an abort keeps the tokens collected so far: async has collected one step fewer
    a, b = out[True].pop(5), out[False].pop(5)
    assert a[1] == b[1] == "abort" and a[0] == b[0][:len(a[0])] and len(b[0]) - len(a[0]) <= 1
    assert out[True] == out[False]
    for e in engines.values():
        stats = e.stats()
        assert stats["preemptions"] > 0 and stats["pages_kv"] == 0, stats
        assert not e.has_unfinished()


def test_async_scheduling_through_the_step_graphs(tiny_model_dir, paths):
    """The graphs' static buffers (run eagerly here, capture=False, as on CPU) take the fed
    input ids too: decode and mixed steps, same outputs as the sync engine."""

    jobs = _jobs(tiny_model_dir, paths)[:4]  # (the Triton interpreter is slow on CPU)
    out = {}
    for flag in (False, True):
        e = _engine(tiny_model_dir, paths, flag, backend="triton", cuda_graphs=False)
        e.runner.graphs = e.runner.make_graphs(e.config.max_num_seqs, mixed_tokens=64, capture=False)
        out[flag] = _serve(e, jobs)
        kinds = {k[0] for k in e.runner.graphs.graphs}  # (a kind per decode rows' LoRA path)
        assert "decode" in kinds and "mixed" in kinds, kinds
    assert out[True] == out[False]
