"""Trace-replay simulator: the real scheduler on a virtual clock with a calibrated cost model.

    profile = Profile.load("experiments/profiles/h200-llama2-7b.json")
    run = simulate(read_trace("trace.jsonl"), profile, engine_options={"policy": "cluster"})
    run.result["throughput_req_s"]
    fleet = simulate_cluster(trace, profile, replicas=64, router="adapter-affinity")

`slora.sim.cost`: the cost model, its fit and the profile file; `slora.sim.simulator`: the
engine-shaped simulator and sweeps; `slora.sim.cluster`: replicas of it behind a router
(`slora.sim.router`); `slora.sim.plan`: the fewest replicas meeting an SLO;
`slora.sim.steplog`: the log of a real engine's steps as the cost model sees them;
`slora.sim.profile`: calibration on a real engine (imports torch when it runs). Nothing
imported here needs torch, and the names below load with their module on first use, so
`import slora.sim.router` stays light (the command line's parser reads its names).
"""

from importlib import import_module

_EXPORTS = {
    "slora.sim.cost": ("FEATURES", "CostModel", "Profile", "fit", "fit_max", "plan_features"),
    "slora.sim.simulator": ("SimEngine", "SimRun", "SimRunner", "VirtualClock", "adapter_pages",
                            "parse_sweep", "rescale_rate", "simulate", "simulate_point"),
    "slora.sim.cluster": ("ClusterRun", "simulate_cluster"),
    "slora.sim.plan": ("Plan", "plan_capacity"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'slora.sim' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
