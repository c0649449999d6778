"""Trace-replay simulator: the real scheduler on a virtual clock with a calibrated cost model.

    profile = Profile.load("experiments/profiles/h200-llama2-7b.json")
    run = simulate(read_trace("trace.jsonl"), profile, engine_options={"policy": "cluster"})
    run.result["throughput_req_s"]

`slora.sim.cost`: the cost model, its fit and the profile file; `slora.sim.simulator`: the
engine-shaped simulator and sweeps; `slora.sim.steplog`: the log of a real engine's steps as
the cost model sees them; `slora.sim.profile`: calibration on a real engine (imports torch
when it runs). Nothing imported here needs torch.
"""

from slora.sim.cost import FEATURES, CostModel, Profile, fit, fit_max, plan_features
from slora.sim.simulator import (SimEngine, SimRun, SimRunner, VirtualClock, adapter_pages,
                                 parse_sweep, rescale_rate, simulate, simulate_point)

__all__ = ["FEATURES", "CostModel", "Profile", "fit", "fit_max", "plan_features", "SimEngine",
           "SimRun", "SimRunner", "VirtualClock", "adapter_pages", "parse_sweep", "rescale_rate",
           "simulate", "simulate_point"]
