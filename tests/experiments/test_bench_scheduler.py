"""Micro-benchmark: one schedule() + update() with 256 running requests and 2,000 registered
adapters (pytest-benchmark; `./run test tests/experiments/test_bench_scheduler.py --benchmark-enable`)."""

from slora.config import EngineConfig
from slora.core.adapters import AdapterInfo, AdapterManager
from slora.core.pages import PageAllocator
from slora.core.scheduler import Scheduler
from slora.request import Request, SamplingParams


def _busy_scheduler():
    cfg = EngineConfig(block_size=16, num_pages=400_000, max_num_seqs=256, prefetch_window=8)
    alloc = PageAllocator(cfg.num_pages)
    adapters = AdapterManager(alloc, 1 << 40)
    for i in range(2000):
        adapters.register(AdapterInfo(f"a{i}", 4, 4 << 20, "synthetic"))
    sched = Scheduler(cfg, alloc, adapters)
    sp = SamplingParams(max_tokens=10_000, ignore_eos=True)
    for i in range(300):  # 256 run, 44 wait
        sched.add(Request(str(i), list(range(200)), sp, f"a{i * 7 % 2000}", 0.0))
    while len(sched.running) < 256:  # prefill in max_batch_tokens-sized steps
        plan = sched.schedule(0.0)
        sched.update(plan, [1] * len(plan.seqs), [None] * len(plan.seqs), 0.0)
    return sched


def test_schedule_update_256_running_2000_adapters(benchmark):
    sched = _busy_scheduler()
    assert len(sched.running) == 256

    def step():
        plan = sched.schedule(1.0)
        sched.update(plan, [1] * len(plan.seqs), [None] * len(plan.seqs), 1.0)
        return plan

    plan = benchmark(step)
    assert len(plan.decode) == 256 and not plan.prefill
    sched.allocator.check()
