"""Simulated replicas behind routers: one replica is the single-engine simulation exactly;
taking quiet steps at once and spreading replicas over processes leave every result unchanged;
the routers choose as documented (adapter affinity keeps an adapter on few replicas, its
bounded load never passes the bound); `slora plan` finds the count an exhaustive sweep finds;
`slora simulate --replicas`, `slora plan` and `slora plot --kind load` end to end; and a
scaled-down run of the shape of the million-request benchmark (64 replicas, gzipped trace)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from slora.cli import main
from slora.sim import Profile, simulate
from slora.sim.cluster import simulate_cluster
from slora.sim.plan import fewest_replicas, plan_capacity
from slora.sim.router import AdapterAffinityRouter, ReplicaMetrics, make_router
from slora.sim.simulator import SimEngine
from slora.workload import Trace, TraceRequest, synthesize, write_trace

H200 = Path(__file__).resolve().parents[2] / "experiments" / "profiles" / "h200-llama2-7b.json"


@pytest.fixture(scope="module")
def h200() -> Profile:
    return Profile.load(H200)


def _trace(rate=40.0, duration=15.0, adapters=200, alpha=0.5, cv=2.0, seed=1):
    # S-LoRA's S2 ranks; bursty, skewed traffic into a small pool (num_pages below): queueing,
    # adapter loads, evictions and preemptions all happen
    return synthesize(num_adapters=adapters, rate=rate, cv=cv, alpha=alpha, duration=duration,
                      ranks=(64, 32, 16, 8), seed=seed)


def _same(a: dict, b: dict) -> None:
    """Two result dicts with the same metrics, latencies and engine counters."""
    keys = [k for k in a if k not in ("config", "stats", "per_replica")]
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}
    stats = [k for k in a["stats"] if k not in ("sim_wall_s", "adapters_registered")]
    assert {k: a["stats"][k] for k in stats} == {k: b["stats"][k] for k in stats}


@pytest.mark.filterwarnings("ignore::slora.sim.simulator.ProfileOrderWarning")
@pytest.mark.parametrize("options", [{}, {"async_scheduling": False}, {"policy": "fair"},
                                     {"policy": "abort", "slo_ttft_s": 0.5}])
def test_one_replica_equals_the_single_engine_simulation(h200, options):
    """`simulate` (the replay loop, every step through the scheduler, random prompt ids) and
    one replica behind a router (the scrape-split loop, quiet steps at once, fake prompt ids)
    give the same metrics, per-request latencies and counters. The replica registers the
    adapters its requests use (`adapters_registered`), the single engine all of the header's.
    Requests too long for the model fail, reported at the next step, in both."""
    trace = _trace()
    too_long = [TraceRequest(t, None, 5, prompt_len=4096) for t in (3.01, 7.5, 7.5)]
    trace = Trace(trace.requests + too_long, trace.adapters, trace.params)
    single = simulate(trace, h200, engine_options=options, num_pages=1200).result
    fleet = simulate_cluster(trace, h200, replicas=1, router="adapter-affinity",
                             engine_options=options, num_pages=1200).result
    _same(single, fleet)
    assert single["num_failed"] >= 3
    assert fleet["stats"]["adapters_registered"] == len(trace.adapter_names())
    assert single["stats"]["adapter_evictions"] > 0 and single["stats"]["preemptions"] > 0
    assert fleet["per_replica"][0]["requests"] == len(trace)


@pytest.mark.filterwarnings("ignore::slora.sim.simulator.ProfileOrderWarning")
@pytest.mark.parametrize("router,options", [
    ("adapter-affinity", {}), ("least-loaded", {"async_scheduling": False}),
    ("power-of-two", {"policy": "fair"}), ("random", {"policy": "cluster"})])
def test_fast_forward_and_workers_leave_the_result_unchanged(h200, monkeypatch, router, options):
    taken = []
    fast_forward = SimEngine.fast_forward

    def counted(self, limit):
        before = self.steps
        outputs = fast_forward(self, limit)
        taken.append(self.steps - before)
        return outputs

    monkeypatch.setattr(SimEngine, "fast_forward", counted)
    trace = _trace(rate=60.0, duration=10.0)
    kwargs = dict(replicas=3, router=router, engine_options=options, num_pages=1200)
    stepped_run = simulate_cluster(trace, h200, fast_forward=False, **kwargs)
    stepped = stepped_run.result
    assert not taken
    forwarded_run = simulate_cluster(trace, h200, **kwargs)
    forwarded = forwarded_run.result
    assert sum(taken) > 500, "quiet steps were taken at once"
    _same(stepped, forwarded)
    # every inter-token gap, counted step by step and in runs of quiet steps alike
    assert stepped_run.token_gaps == forwarded_run.token_gaps
    assert stepped["itl_p99_s"] > stepped["itl_p50_s"] > 0
    assert stepped["per_replica"] == forwarded["per_replica"]
    if router == "adapter-affinity":  # replicas in two processes, meeting at each scrape
        _same(stepped, simulate_cluster(trace, h200, workers=2, **kwargs).result)


def test_routers_choose_as_documented():
    rr = make_router("round-robin", 3)
    assert [rr.route("a") for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]

    least = make_router("least-loaded", 4)
    least.observe([ReplicaMetrics(2, 3, ()), ReplicaMetrics(0, 1, ()), ReplicaMetrics(0, 4, ()),
                   ReplicaMetrics(1, 0, ())])
    # loads 5 1 4 1: the lowest index among the least, then its own dispatches count
    assert [least.route(None) for _ in range(5)] == [1, 3, 1, 3, 1]
    assert least.load == [5, 4, 4, 3] and least.routed == [0, 3, 0, 2]

    two = make_router("power-of-two", 4, seed=7)
    chosen = []
    for _ in range(2000):
        two.observe([ReplicaMetrics(5, 0, ()), ReplicaMetrics(0, 0, ()), ReplicaMetrics(9, 0, ()),
                     ReplicaMetrics(3, 0, ())])
        chosen.append(two.route(None))
    assert 2 not in chosen  # the most loaded loses to whichever it is drawn with
    assert chosen.count(1) == pytest.approx(1000, rel=0.1)  # the least: whenever drawn (1/2)

    draws = [make_router("random", 5, seed=3).route("a") for _ in range(3)]
    assert draws == [make_router("random", 5, seed=3).route("a") for _ in range(3)]
    rand = make_router("random", 5, seed=3)
    assert set(rand.route(None) for _ in range(200)) == set(range(5))
    with pytest.raises(ValueError, match="adapter-affinity"):
        make_router("hash", 2)


def test_affinity_load_never_passes_its_bound():
    """Consistent hashing with bounded loads: after every routing decision the chosen replica's
    load is within ceil(c * total / N), c the load factor, under skewed adapters and scrapes
    that report arbitrary queues."""
    rng = random.Random(0)
    for replicas, factor in ((2, 1.0), (8, 1.25), (13, 1.5)):
        router = AdapterAffinityRouter(replicas, load_factor=factor)
        spilled = 0
        for step in range(4000):
            if step % 50 == 0:
                router.observe([ReplicaMetrics(rng.randrange(20), rng.randrange(10), ())
                                for _ in range(replicas)])
            adapter = f"lora-{int(rng.paretovariate(1.0)) % 40}"  # a few adapters take most
            bound = router.bound()
            i = router.route(adapter)
            assert router.load[i] <= bound == math.ceil(factor * router.total / replicas)
            spilled += i != router._owners[router._start[adapter]]  # not its home replica
        assert spilled > 0, "some requests spilled past a full home replica"


def test_affinity_prefers_a_replica_holding_the_adapter():
    router = AdapterAffinityRouter(6, probes=2)
    home = router.route("x")
    ring = router._owners
    start = router._start["x"]
    second = next(ring[(start + k) % len(ring)] for k in range(len(ring))
                  if ring[(start + k) % len(ring)] != home)
    router.observe([ReplicaMetrics(0, 0, {"x"} if i == second else set()) for i in range(6)])
    assert router.route("x") == second  # within the first two probes and holding it
    router.observe([ReplicaMetrics(0, 0, set()) for _ in range(6)])
    assert router.route("x") == home
    router.observe([ReplicaMetrics(3, 0, ()), ReplicaMetrics(1, 0, ()), ReplicaMetrics(0, 2, ()),
                    ReplicaMetrics(1, 1, ()), ReplicaMetrics(5, 0, ()), ReplicaMetrics(4, 4, ())])
    assert router.route(None) == 1  # the base model: the least loaded


def test_affinity_keeps_an_adapter_on_few_replicas(h200):
    trace = _trace(rate=100.0, duration=8.0, adapters=300, alpha=1.0, cv=1.0)
    used = len(trace.adapter_names())
    spread, loads = {}, {}
    for router in ("random", "round-robin", "adapter-affinity"):
        result = simulate_cluster(trace, h200, replicas=8, router=router).result
        # replicas each adapter's requests went to, on average
        spread[router] = sum(r["adapters_routed"] for r in result["per_replica"]) / used
        loads[router] = result["stats"]["adapter_loads"]
    # ~2.9 requests an adapter: spread out, each request lands on a new replica half the time
    assert spread["adapter-affinity"] < 1.4 < 2.2 < min(spread["random"], spread["round-robin"])
    assert loads["adapter-affinity"] < 0.7 * min(loads["random"], loads["round-robin"])


def test_fewest_replicas_doubles_then_bisects():
    for answer in range(1, 40):
        for top in (1, 7, 32, 40, 64):
            calls = []

            def meets(n):
                calls.append(n)
                return n >= answer

            assert fewest_replicas(meets, top) == (answer if answer <= top else None)
            assert len(calls) == len(set(calls)) <= 2 * math.ceil(math.log2(top + 1)) + 1


def test_plan_finds_the_count_of_an_exhaustive_sweep(h200):
    trace = _trace(rate=70.0, duration=6.0, adapters=300, alpha=0.8, cv=1.5, seed=5)
    routers = ("round-robin", "adapter-affinity")
    kwargs = dict(slo_ttft_s=0.5, target=0.95, routers=routers, max_replicas=5)
    searched = plan_capacity(trace, h200, **kwargs)
    swept = plan_capacity(trace, h200, exhaustive=True, **kwargs)
    assert searched.fewest == swept.fewest
    assert all(n is not None and n > 1 for n in swept.fewest.values())
    assert len(searched.candidates) < len(swept.candidates)
    # a candidate stopped early reports at least the attainment its full run reaches
    full = {(c.router, c.replicas): c.attainment for c in swept.candidates}
    stopped = [c for c in searched.candidates if c.stopped]
    assert stopped and all(full[c.router, c.replicas] <= c.attainment < c.target for c in stopped)
    answer = searched.answer
    assert answer.replicas == min(swept.fewest.values()) and answer.meets
    table = searched.table()
    assert "<- answer" in table and f"answer: {answer.replicas} replicas" in table


def test_cli_simulate_replicas_plan_and_plot(tmp_path, h200):
    trace_path = tmp_path / "t.jsonl.gz"
    write_trace(_trace(rate=50.0, duration=4.0, adapters=100), trace_path)
    prof = str(H200)
    out = tmp_path / "fleet.json"
    assert main(["simulate", str(trace_path), "--profile", prof, "--replicas", "3", "--router",
                 "adapter-affinity", "--num-pages", "1200", "--no-progress", "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["replicas"] == 3 and result["config"]["router"] == "adapter-affinity"
    assert sum(r["requests"] for r in result["per_replica"]) == result["num_requests"] == 200
    sweep = tmp_path / "sweep"
    assert main(["simulate", str(trace_path), "--profile", prof, "--sweep", "replicas=1,2",
                 "--sweep", "router=random,adapter-affinity", "-o", str(sweep)]) == 0
    files = sorted(sweep.glob("*.json"))
    assert len(files) == 4
    assert main(["plot", *map(str, files), "-o", str(tmp_path / "sweep.png")]) == 0
    assert main(["plot", str(out), "--kind", "load", "-o", str(tmp_path / "load.png")]) == 0
    plan = tmp_path / "plan.json"
    assert main(["plan", "--trace", str(trace_path), "--profile", prof, "--slo-ttft", "0.5",
                 "--slo-attainment", "0.99", "--routers", "round-robin,adapter-affinity",
                 "--max-replicas", "4", "--no-progress", "-o", str(plan)]) == 0
    answer = json.loads(plan.read_text())["answer"]
    assert answer["meets"] and answer["margin"] >= 0 and answer["replicas"] <= 4
    with pytest.raises(SystemExit):  # argparse: an unknown router name
        main(["plan", "--trace", str(trace_path), "--profile", prof, "--slo-ttft", "1",
              "--slo-attainment", "0.9", "--routers", "hash"])


def test_a_fleet_of_64_replicas_over_thousands_of_adapters(tmp_path, h200):
    """The path of the million-request benchmark, scaled down: a gzipped trace over 4,000
    adapters on 64 replicas behind adapter affinity, through the command line."""
    trace_path = tmp_path / "big.jsonl.gz"
    assert main(["trace", "synth", "--num-adapters", "4000", "--rate", "900", "--duration", "5",
                 "--ranks", "64,32,16,8", "--no-progress", "-o", str(trace_path)]) == 0
    out = tmp_path / "fleet.json"
    assert main(["simulate", str(trace_path), "--profile", str(H200), "--replicas", "64",
                 "--router", "adapter-affinity", "--no-progress", "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_completed"] == result["num_requests"] == 4500
    assert len(result["per_replica"]) == 64 and result["slo_attainment"] == 1.0
    assert result["stats"]["sim_wall_s"] < 60
