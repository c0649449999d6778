"""Fault injection: each stage of a step fails on demand, over random workloads, and the fault
stays with the requests it belongs to.

The `faults` fixture arms one stage's fault on an engine by monkeypatching its entry point,
for the length of a `with` block:

    read_error  AdapterInfo.pack of one adapter raises: its weights cannot be read
    read_nan    AdapterInfo.pack of one PEFT adapter returns NaN weights
    copy        HostAdapterTier.load (host -> pool copy) raises on its Nth call
    forward     LlamaModel.layers (or a CUDA graph's replay) raises on its Nth call
    sample      Sampler._sample_row raises for one request, at its Nth sampled token
    nonfinite   one request's row of logits holds NaN or inf, at its Nth step
    detok       IncrementalDecoder.update raises for one request, at its Nth call

Hypothesis draws a small workload (prompts of random token ids arriving over the first steps,
on PEFT and synthetic adapters of random ranks and targets and on the base model, greedy and
seeded sampled rows, some with logprobs) and when the fault fires. Each example serves the
workload clean (counting the stage's calls, from which N is drawn), then with the fault, then
clean again on the same engine, and checks:

- no exception leaves `step`, no request ends twice, the workload ends in a bounded number of
  steps;
- when the fault fired, at least one request ended with finish_reason "error" and an error
  naming the cause (a row's fault: exactly its request; an adapter read: exactly that
  adapter's requests); when it did not fire, none did; a failed request's tokens are a prefix
  of its clean tokens;
- every other request's tokens, finish reason, text and chosen tokens' log-probs are the
  clean run's;
- no request holds a page or per-request state any more: every page is free or a resident
  adapter's (an adapter whose read failed is not resident), and once the workload's adapters
  are removed every page is free, as at the start;
- the next batch, on the same engine and the adapters as the fault left them, gives the clean
  run's outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import slora.runner.model_runner as model_runner
from slora import Engine, EngineConfig, SamplingParams
from slora.config import LORA_MODULES
from slora.tokenizer import IncrementalDecoder

CUDA = torch.cuda.is_available()

STAGES = ("read_error", "read_nan", "copy", "forward", "sample", "nonfinite", "detok")
ROW_STAGES = ("sample", "nonfinite", "detok")  # the fault belongs to one request
READ_STAGES = ("read_error", "read_nan")  # the fault belongs to one adapter's requests
# what the error of a request a stage fails says
CAUSES = {
    "read_error": r"adapter '\w+' could not be loaded: .*injected read fault",
    "read_nan": r"not finite|non-finite|NaN",
    "copy": r"injected copy fault",
    "forward": r"injected forward fault",
    "sample": r"sampling failed: .*injected sampling fault",
    "nonfinite": r"not finite",
    "detok": r"detokenising failed: .*injected detokenising fault",
}

# A pool of 14 pages of 8 tokens holds a few requests and adapters at once (a rank-4 adapter
# on every module takes 8 pages): adapters are evicted and requests preempted now and then.
# Three sequences at most run at once, so later ones wait and their adapters are prefetched.
BASE = dict(dtype="float32", num_pages=14, block_size=8, max_num_seqs=3, prefetch_reserve=1)
CONFIGS = {
    "cpu": dict(device="cpu", backend="torch", async_scheduling=False),
    "cpu-async": dict(device="cpu", backend="torch", async_scheduling=True),
    # graphs replayed for decode and small mixed steps, larger steps eager
    "cuda": dict(device="cuda", cuda_graphs=True, async_scheduling=True, mixed_graph_tokens=64),
    "triton": dict(device="cpu", backend="triton", cuda_graphs=False, async_scheduling=False),
}
DEVICES = ["cpu", "cpu-async",
           pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs a GPU"))]
# workload bounds: the Triton interpreter takes about a second a step
SIZES = {"full": dict(min_jobs=2, max_jobs=5, max_prompt=30, max_tokens=10, max_arrive=2),
         "tiny": dict(min_jobs=2, max_jobs=2, max_prompt=6, max_tokens=2, max_arrive=1)}
_runs = itertools.count()  # request ids stay unique across runs on one engine


# -- the fault
class Fault:
    """One stage's fault, armed on `engine` while its `with` block runs (pytest's
    MonkeyPatch, undone at the end). `calls` counts the stage's calls that concern the
    target: the packs of `adapter` (read stages), every host -> pool copy (copy), every
    `LlamaModel.layers` call outside a graph's capture and every graph replay (forward), the
    sampled tokens, steps or detokenisations of request `rid` (row stages). With `nth`, the
    nth of those fails (a read fails at every call: the file is gone) and `fired` says
    whether one did; without, it only counts."""

    def __init__(self, engine: Engine, stage: str, rid: str | None = None,
                 adapter: str | None = None, nth: int | None = None,
                 poison: float = float("nan")) -> None:
        assert stage in STAGES
        self.engine, self.stage, self.rid, self.adapter = engine, stage, rid, adapter
        self.nth, self.poison = nth, poison
        self.calls, self.fired = 0, False
        self.moving: list[int] = []  # forward: the calls in steps that copy adapters
        self._mp: pytest.MonkeyPatch | None = None

    def __enter__(self) -> "Fault":
        self._mp = pytest.MonkeyPatch()
        getattr(self, "_arm_" + self.stage.split("_")[0])()
        return self

    def __exit__(self, *exc) -> None:
        self._mp.undo()

    def _hit(self) -> bool:
        """Count a call of the stage; True when this one fails."""
        self.calls += 1
        fire = self.nth is not None and (self.calls == self.nth or self.stage in READ_STAGES)
        self.fired |= fire
        return fire

    def _arm_read(self) -> None:
        info = self.engine.adapters.get(self.adapter)
        pack, nan = info.pack, self.stage == "read_nan"

        def bad_pack(page_size, dtype):
            if self._hit():
                if nan:  # (a new tensor: synthetic adapters share their host buffer)
                    return torch.full_like(pack(page_size, dtype), float("nan"))
                raise OSError(f"injected read fault: the weights of {self.adapter!r} are gone")
            return pack(page_size, dtype)

        self._mp.setattr(info, "pack", bad_pack)

    def _arm_copy(self) -> None:
        tier = self.engine.runner.host_tier
        load = tier.load

        def bad_load(loads, adapters, on_piece=None):
            if self._hit():
                raise RuntimeError("injected copy fault: host -> pool copy failed")
            return load(loads, adapters, on_piece)

        self._mp.setattr(tier, "load", bad_load)

    def _arm_forward(self) -> None:
        model, graphs = self.engine.runner.model, self.engine.runner.graphs
        layers = model.layers

        def bad_layers(*args, **kwargs):
            if CUDA and torch.cuda.is_current_stream_capturing():  # a graph's capture
                return layers(*args, **kwargs)
            self._note_moves()
            if self._hit():
                raise RuntimeError("injected forward fault: a layer failed")
            return layers(*args, **kwargs)

        self._mp.setattr(model, "layers", bad_layers)
        if graphs is not None:  # a replayed step calls no layers
            replay = graphs.replay

            def bad_replay(*args, **kwargs):
                self._note_moves()
                if self._hit():
                    raise RuntimeError("injected forward fault: a graph replay failed")
                return replay(*args, **kwargs)

            self._mp.setattr(graphs, "replay", bad_replay)

    def _note_moves(self) -> None:
        """Note whether the call about to be counted is in a step that loads or prefetches
        adapters: a step failing there must leave no adapter resident without its weights."""
        plan = self.engine._plan
        if plan is not None and (plan.adapter_loads or plan.prefetch):
            self.moving.append(self.calls + 1)

    def _arm_sample(self) -> None:
        sampler = self.engine.runner.sampler
        sample_row = sampler._sample_row

        def bad_sample_row(logits, sp, request_id):
            if request_id == self.rid and self._hit():
                raise RuntimeError("injected sampling fault")
            return sample_row(logits, sp, request_id)

        self._mp.setattr(sampler, "_sample_row", bad_sample_row)

    def _arm_nonfinite(self) -> None:
        fault, flight = self, model_runner.Flight

        class PoisonedFlight(flight):
            """A launched step whose logits row of the target request, once, holds poison."""

            def __init__(self, plan, logits, *args):
                rows = [i for i, r in enumerate(plan.seqs) if r.request_id == fault.rid]
                if rows and fault._hit():
                    logits = logits.clone()
                    logits[rows[0], ::3] = fault.poison
                super().__init__(plan, logits, *args)

        self._mp.setattr(model_runner, "Flight", PoisonedFlight)

    def _arm_detok(self) -> None:
        update, decoders = IncrementalDecoder.update, self.engine._decoders

        def bad_update(decoder, ids):
            if decoders.get(self.rid) is decoder and self._hit():
                raise RuntimeError("injected detokenising fault")
            return update(decoder, ids)

        self._mp.setattr(IncrementalDecoder, "update", bad_update)


@pytest.fixture(scope="session")
def faults():
    """`with faults(engine, stage, rid=..., adapter=..., nth=...) as fault:` arms one stage's
    fault (see `Fault`) on the engine for the block."""
    return Fault


# -- engines, adapters, workloads
@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """kind -> its engine (CONFIGS), made on first use and reused by every example."""
    made = {}

    def get(kind: str) -> Engine:
        if kind not in made:
            made[kind] = Engine(EngineConfig(model=str(tiny_model_dir), **BASE, **CONFIGS[kind]))
        return made[kind]

    return get


@pytest.fixture(scope="module")
def peft_paths(tiny_model_dir, adapter_factory):
    """Two PEFT adapters whose weights change the tiny model's tokens clearly."""
    return {"qv4": adapter_factory(tiny_model_dir, r=4, target_modules=["q_proj", "v_proj"],
                                   seed=11),
            "all4": adapter_factory(tiny_model_dir, r=4, target_modules="all-linear", seed=12)}


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    sampling: SamplingParams
    adapter: str | None
    arrive: int  # added before this step of the run


@st.composite
def workloads(draw, min_jobs, max_jobs, max_prompt, max_tokens, max_arrive):
    """(adapters, jobs): adapters name -> ("peft", key) or ("synthetic", rank, targets, seed),
    the synthetic ones of distinct seeds; jobs on them and on the base model."""
    synthetic = st.tuples(st.just("synthetic"), st.sampled_from([2, 4]),
                          st.lists(st.sampled_from(LORA_MODULES), min_size=1, max_size=3,
                                   unique=True).map(tuple))
    peft = st.tuples(st.just("peft"), st.sampled_from(["qv4", "all4"]))
    kinds = draw(st.lists(st.one_of(synthetic, peft), min_size=1, max_size=3))
    adapters = {f"a{i}": kind + (i + 1,) if kind[0] == "synthetic" else kind
                for i, kind in enumerate(kinds)}
    jobs = []
    for _ in range(draw(st.integers(min_jobs, max_jobs))):
        prompt = draw(st.lists(st.integers(2, 299), min_size=1, max_size=max_prompt))
        common = dict(max_tokens=draw(st.integers(1, max_tokens)), ignore_eos=draw(st.booleans()),
                      logprobs=draw(st.sampled_from([None, None, 0, 2])))
        if draw(st.booleans()):
            sp = SamplingParams(**common)
        else:
            sp = SamplingParams(**common, temperature=draw(st.sampled_from([0.7, 1.0, 1.5])),
                                top_p=draw(st.sampled_from([1.0, 0.9])),
                                top_k=draw(st.sampled_from([0, 20])),
                                seed=draw(st.integers(0, 2 ** 32)))
        jobs.append(Job(prompt, sp, draw(st.sampled_from([None, *adapters])),
                        draw(st.integers(0, max_arrive))))
    return adapters, jobs


def register(engine: Engine, adapters: dict, peft_paths: dict) -> None:
    for name, spec in adapters.items():
        if spec[0] == "peft":
            engine.add_adapter(name, peft_paths[spec[1]])
        else:
            engine.add_synthetic_adapter(name, spec[1], spec[2], seed=spec[3])


def serve(engine: Engine, jobs: list[Job], tag: str) -> list:
    """Each job's final output: job i added (as request `tag`i) before step `arrive`, steps
    until nothing is left. A request that ends in two steps, or steps past a generous bound
    (a hang), fail the test."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i].arrive)
    limit = 50 + 10 * sum(len(j.prompt) // 16 + j.sampling.max_tokens for j in jobs)
    final, step = {}, 0
    while order or engine.has_unfinished():
        while order and jobs[order[0]].arrive <= step:
            i = order.pop(0)
            engine.add_request(jobs[i].prompt, jobs[i].sampling, jobs[i].adapter,
                               request_id=f"{tag}{i}")
        ended = {}  # (a request may be listed twice in one step, with one output)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, f"request {out.request_id} ended twice"
                assert_same(out, ended.setdefault(out.request_id, out), out.request_id)
        final.update(ended)
        step += 1
        assert step <= limit, f"{len(final)} of {len(jobs)} requests ended after {step} steps"
    return [final[f"{tag}{i}"] for i in range(len(jobs))]


def assert_same(out, clean, what: str) -> None:
    """`out` repeats `clean`: tokens, finish reason, text and the chosen tokens' log-probs
    (to 1e-4: another batch may round differently)."""
    assert (out.token_ids, out.finish_reason, out.text) == \
        (clean.token_ids, clean.finish_reason, clean.text), what
    lps = [None if o.logprobs is None else [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]
           for o in (out, clean)]
    assert lps[0] == (None if lps[1] is None else pytest.approx(lps[1], abs=1e-4)), what


def assert_nothing_held(engine: Engine, adapters) -> None:
    """No request holds a page or per-request state: every page is free or held by a
    resident adapter."""
    s = engine.stats()
    assert not engine.has_unfinished() and not engine.requests
    assert not engine.runner.sampler.generators and not engine._decoders
    assert s["pages_kv"] == 0 and s["num_running"] == s["num_waiting"] == 0, s
    held = sum(engine.adapters.get(n).num_pages for n in adapters
               if engine.adapters.get(n).resident)
    assert s["pages_adapter"] == held, s
    assert s["pages_free"] + s["pages_cached"] == s["pages_total"] - held, s


# -- the check
def check_fault(engine: Engine, reference: Engine, faults, peft_paths, stage: str, data,
                size: str) -> None:
    """`_check_fault`, then the engines emptied of requests and adapters, whatever the
    outcome, so that one failing example leaves the next one a clean engine."""
    try:
        _check_fault(engine, reference, faults, peft_paths, stage, data, size)
    finally:
        for e in {id(engine): engine, id(reference): reference}.values():
            for rid in [r for r, req in e.requests.items() if not req.finished]:
                e.abort(rid)
            for _ in range(100):
                if not e.has_unfinished():
                    break
                e.step()
            for name in e.list_adapters():
                e.remove_adapter(name)


def _check_fault(engine: Engine, reference: Engine, faults, peft_paths, stage: str, data,
                 size: str) -> None:
    """One example: a workload served clean on `reference` (counting the stage's calls),
    then with the fault on `engine`, then clean again on `engine`; see the module docstring
    for what is checked. `reference` may be `engine` or one of the same scheduling on
    another backend (the torch twins, whose float32 tokens the Triton backend's equal)."""
    adapters, jobs = data.draw(workloads(**SIZES[size]), label="workload")
    target = data.draw(st.integers(0, len(jobs) - 1), label="target job")
    job = jobs[target]
    if stage == "sample" and job.sampling.greedy:  # the target samples
        job = dataclasses.replace(job, sampling=dataclasses.replace(
            job.sampling, temperature=1.0, seed=data.draw(st.integers(0, 2 ** 32))))
    if stage in READ_STAGES + ("copy",) and job.adapter is None:  # an adapter is loaded
        job = dataclasses.replace(job, adapter=next(iter(adapters)))
    if stage == "read_nan" and adapters[job.adapter][0] != "peft":
        # NaN comes from a file: a synthetic adapter's buffer is drawn by slora, finite, and
        # not scanned per read (see HostAdapterTier.host_copy)
        adapters["a9"] = ("peft", "qv4")
        job = dataclasses.replace(job, adapter="a9")
    jobs[target] = job
    poison = data.draw(st.sampled_from([float("nan"), float("inf")]), label="poison")
    start = engine.stats()
    assert start["pages_free"] + start["pages_cached"] == start["pages_total"], start

    tag = f"clean{next(_runs)}-"
    register(reference, adapters, peft_paths)
    with faults(reference, stage, rid=f"{tag}{target}", adapter=job.adapter) as count:
        clean = serve(reference, jobs, tag)
    for name in adapters:
        reference.remove_adapter(name)
    assert [o.error for o in clean] == [None] * len(jobs)
    assert count.calls >= 1, "the stage ran in the clean run"
    if stage in READ_STAGES:
        nth = 1
    elif count.moving and data.draw(st.booleans(), label="in a step that copies adapters"):
        nth = data.draw(st.sampled_from(count.moving), label="nth")
    else:
        nth = data.draw(st.integers(1, count.calls), label="nth")

    tag = f"fault{next(_runs)}-"
    register(engine, adapters, peft_paths)
    with faults(engine, stage, rid=f"{tag}{target}", adapter=job.adapter, nth=nth,
                poison=poison) as fault:
        outs = serve(engine, jobs, tag)
    failed = [i for i, o in enumerate(outs) if o.finish_reason == "error"]
    assert bool(failed) == fault.fired, \
        f"the fault fired: {fault.fired}; the requests' errors: {[o.error for o in outs]}"
    if fault.fired and stage in ROW_STAGES:
        assert failed == [target], [o.error for o in outs]
    if fault.fired and stage in READ_STAGES:
        assert failed == [i for i, j in enumerate(jobs) if j.adapter == job.adapter]
    for i in failed:
        err = outs[i].error
        assert err and re.search(CAUSES[stage], err), err
        if stage == "read_nan" or (stage == "nonfinite" and jobs[i].adapter):
            assert repr(jobs[i].adapter) in err, err
        assert outs[i].token_ids == clean[i].token_ids[:len(outs[i].token_ids)]
    for i in set(range(len(jobs))) - set(failed):
        assert_same(outs[i], clean[i], f"job {i}: {jobs[i]}")
    assert_nothing_held(engine, adapters)
    if fault.fired and stage == "read_error":  # the next use reads it again
        assert not engine.adapters.get(job.adapter).resident

    again = serve(engine, jobs, f"next{next(_runs)}-")  # the adapters as the fault left them
    for i, (o, c) in enumerate(zip(again, clean)):
        assert_same(o, c, f"next batch, job {i}: {jobs[i]}")
    assert_nothing_held(engine, adapters)
    for name in adapters:
        engine.remove_adapter(name)
    end = engine.stats()
    assert end["pages_free"] + end["pages_cached"] == start["pages_total"], end
    assert end["pages_adapter"] == 0, end


EXAMPLES = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("device", DEVICES)
@EXAMPLES
@given(data=st.data())
def test_a_fault_fails_only_its_requests(engines, faults, peft_paths, device, stage, data):
    """Each stage's fault, at a random point of a random workload, fails the requests it
    belongs to with an error naming the cause; every other request gets the clean run's
    outputs, every page comes back and the next batch is served as if nothing had happened.
    device: the torch backend on CPU, synchronous and with async scheduling, and on a GPU
    the Triton backend with CUDA graphs and async scheduling."""
    engine = engines(device)
    check_fault(engine, engine, faults, peft_paths, stage, data, "full")


@pytest.mark.skipif(CUDA, reason="the interpreter runs on CPU; on a GPU the cuda case runs "
                    "the Triton backend")
@pytest.mark.parametrize("stage", ["read_nan", "forward"])
@settings(EXAMPLES, max_examples=3,  # (no shrinking: each try costs seconds)
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_a_fault_on_the_triton_backend(engines, faults, peft_paths, stage, data):
    """The Triton backend under the interpreter: an adapter whose read returns NaN weights
    fails its own requests only, and a layer that raises mid-step fails that step's
    requests; the other requests and the next batch get the torch twins' tokens, and every
    page comes back."""
    check_fault(engines("triton"), engines("cpu"), faults, peft_paths, stage, data, "tiny")
