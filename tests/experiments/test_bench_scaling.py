"""experiments/bench_scaling.py end to end on CPU with a tiny random model: both parts, tiny
sizes. Checks the rows and that rates are positive, never timings."""

import gzip
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench(experiment):
    return experiment("bench_scaling")


def run_tiny(bench, model_dir, out, *args) -> dict:
    """bench_scaling.py's result for `args` on the tiny model, on the CPU in float32."""
    bench.main(["--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                "--num-pages", "1024", "--max-num-seqs", "8", *args, "--out", str(out)])
    return json.loads((out / "bench_scaling.json").read_text())


def test_bench_scaling_cpu(bench, tiny_model_dir, tmp_path):
    bench.main(["--part", "all", "--model", str(tiny_model_dir), "--device", "cpu",
                "--dtype", "float32", "--num-pages", "1024", "--max-num-seqs", "8",
                "--adapters", "1,5", "--num-requests", "12", "--input-len", "8,40",
                "--output-len", "2,12", "--batches", "1,4", "--context", "24",
                "--decode-tokens", "16", "--breakdown", "4", "--mixed-prompts", "2",
                "--mixed-prompt-len", "20", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "bench_scaling.json").read_text())

    rows = res["scaling"]
    assert [(r["adapters"], r["modules"]) for r in rows] == [
        (0, "none"), (1, "qkvo"), (5, "qkvo"), (1, "all"), (5, "all")]
    for r in rows:
        assert r["requests"] == 12 and r["not_length"] == 0
        assert r["output_tokens"] == rows[0]["output_tokens"]  # the same lengths in every row
        assert r["output_tok_s"] > 0 and r["req_s"] > 0 and r["ratio"] > 0
        # every step logged: 12 requests with prompts of 8-40 tokens in an 8-sequence batch
        # need at least two steps with prompts, and their time is part of the row's
        assert r["steps"] > r["mixed_steps"] >= 2 and 0 < r["mixed_s"] < r["wall_s"]
        # eager steps (past the mixed graphs) are some of those; the allocators' growth is
        # read on CUDA only
        assert r["eager_steps"] <= r["mixed_steps"] and 0 <= r["eager_s"] <= r["mixed_s"]
        assert r["longest"] and all(s["allocs"] is None for s in r["longest"])
    assert rows[0]["ratio"] == 1.0 and rows[0]["adapter_loads"] == 0
    assert all(r["adapter_loads"] >= r["adapters_used"] >= 1 for r in rows[1:])

    rows = res["decode"]
    assert [(r["batch"], r["modules"]) for r in rows] == [
        (b, m) for b in (1, 4) for m in ("none", "qkvo", "all")]
    for r in rows:
        assert r["steps_timed"] >= 1 and r["step_ms"] > 0 and r["floor_ms"] > 0 and r["ratio"] > 0
        assert 24 <= r["ctx_mean"] <= 40
        assert (r["adapter_bytes"] > 0) == (r["modules"] != "none")
    # (with LoRA, one adapter a request: --breakdown-adapters 0)
    assert [(b["batch"], b["modules"], b["adapters"]) for b in res["breakdown"]] == [
        (4, "none", 0), (4, "qkvo", 4)]
    assert all(b[k]["wall_ms_per_step"] > 0 for b in res["breakdown"] for k in ("decode", "mixed"))
    # the GPU's idle gaps (none on CPU: no device activity to part)
    assert all(b[k]["short_gaps_ms_per_step"] == b[k]["long_gaps_ms_per_step"] == 0
               for b in res["breakdown"] for k in ("decode", "mixed"))
    by = {(r["batch"], r["modules"]): r for r in rows}
    # KV grows with the batch; adapter bytes with the batch (one adapter each) and the modules
    assert by[4, "none"]["kv_bytes"] > by[1, "none"]["kv_bytes"]
    assert by[4, "qkvo"]["adapter_bytes"] == 4 * by[1, "qkvo"]["adapter_bytes"]
    assert by[1, "all"]["adapter_bytes"] > by[1, "qkvo"]["adapter_bytes"]
    assert res["ceilings"]["copy_GBps"] > 0
    # the harness's header: what reproduces the run
    assert res["command"].startswith("python3 experiments/bench_scaling.py --part all --model ")
    assert res["commit"] and res["gpu"] is None


def test_byte_counts(bench):
    from slora.config import LORA_MODULES, ModelConfig

    cfg = ModelConfig.from_dir(ROOT / "experiments" / "models" / "llama-2-7b")
    # rank 16 on q/k/v/o of Llama-2-7B: 16 x 4 x (4096 + 4096) x 32 layers x 2 bytes
    assert bench.adapter_bytes(cfg, 16, bench.MODULE_SETS["qkvo"], 2) == 16 * 4 * 8192 * 32 * 2
    seven, four = (bench.adapter_bytes(cfg, 8, m, 2) for m in (LORA_MODULES, LORA_MODULES[:4]))
    assert seven > four
    # DoRA: one more row of d_out elements a module and layer
    assert (bench.adapter_bytes(cfg, 16, LORA_MODULES[:4], 2, dora=True)
            - bench.adapter_bytes(cfg, 16, LORA_MODULES[:4], 2)) == 4 * 4096 * 32 * 2
    # embed_tokens and lm_head once, beside q/k/v/o: the head's rows whole, one column of the
    # embedding's A and its B
    vocab = bench.adapter_bytes(cfg, 16, bench.MODULE_SETS["vocab"], 2)
    assert vocab - bench.adapter_bytes(cfg, 16, bench.MODULE_SETS["qkvo"], 2) == \
        16 * ((4096 + 32000) + (1 + 4096)) * 2
    # the 7B's weights minus its (untied) embedding table: ~13.2 GB in bf16
    assert bench.weight_read_bytes(cfg, 2) == cfg.weight_bytes(2) - 32000 * 4096 * 2
    assert 13.0e9 < bench.weight_read_bytes(cfg, 2) < 13.3e9
    assert bench.weight_read_bytes(cfg, 2, tokens=1) == bench.weight_read_bytes(cfg, 2)
    # a mixture of experts: one row reads its k experts of each layer, many rows nearly all
    moe = ModelConfig.from_dir(ROOT / "experiments" / "models" / "qwen3-30b-a3b")
    expert = 3 * moe.hidden_size * moe.expert_intermediate_size * 2
    idle = moe.num_layers * (moe.num_experts - moe.experts_per_token) * expert
    assert bench.weight_read_bytes(moe, 2, tokens=1) == bench.weight_read_bytes(moe, 2) - idle
    assert bench.weight_read_bytes(moe, 2) - bench.weight_read_bytes(moe, 2, tokens=512) < expert


@pytest.mark.parametrize("flag", ["--async-scheduling", "--dora"])
def test_bench_scaling_decode_options(bench, tiny_model_dir, tmp_path, flag):
    """--async-scheduling: the decode table's steps are timed without synchronising each.
    --dora: rows of DoRA adapters beside the plain ones of the same rank and modules."""
    bench.main(["--part", "decode", "--model", str(tiny_model_dir), "--device", "cpu",
                "--dtype", "float32", "--num-pages", "1024", "--max-num-seqs", "8",
                "--batches", "4", "--context", "24", "--decode-tokens", "16", "--breakdown", "",
                flag, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_scaling.json").read_text())["decode"]
    by = {r["modules"]: r for r in rows}
    assert all(r["batch"] == 4 and r["steps_timed"] > 0 and r["step_ms"] > 0 for r in rows)
    if flag == "--async-scheduling":
        assert list(by) == ["none", "qkvo", "all"]
        assert all(r["execute_ms"] is None for r in rows)
    else:
        assert list(by) == ["none", "qkvo", "all", "qkvo-dora", "all-dora"]
        for m in ("qkvo", "all"):  # a DoRA adapter reads one more row a module and layer
            assert by[m + "-dora"]["adapter_bytes"] > by[m]["adapter_bytes"]


def test_decode_rows_time_a_batch_whose_prompts_take_more_steps_than_its_tokens(
        bench, tiny_model_dir, tmp_path):
    """Eight 24-token prompts under a 48-token step budget take four steps to prefill, more
    than the 3 tokens a row times: every request still decodes in the timed steps (each runs
    until they are done, then is aborted), and exactly --decode-tokens steps are timed."""
    rows = run_tiny(bench, tiny_model_dir, tmp_path, "--part", "decode",
                    "--max-batch-tokens", "48", "--batches", "8", "--decode-modules",
                    "none,qkvo", "--context", "24", "--decode-tokens", "3",
                    "--breakdown", "")["decode"]
    assert [(r["batch"], r["modules"], r["steps_timed"]) for r in rows] == [
        (8, "none", 3), (8, "qkvo", 3)]
    assert all(r["ctx_mean"] > 24 + 3 for r in rows)  # (the fill steps' tokens came first)


def test_breakdown_puts_the_rows_on_the_adapters_asked_for(bench, tiny_model_dir, tmp_path):
    """--breakdown-adapters 1: the profiled batch's requests all take one adapter, and the
    result says how many it ran on (one each by default: test_bench_scaling_cpu)."""
    res = run_tiny(bench, tiny_model_dir, tmp_path, "--part", "decode", "--batches", "4",
                   "--decode-modules", "none", "--context", "16", "--decode-tokens", "2",
                   "--breakdown", "4", "--breakdown-modules", "qkvo", "--mixed-prompt-len", "8",
                   "--breakdown-adapters", "1")
    (b,) = res["breakdown"]
    assert (b["batch"], b["modules"], b["adapters"]) == (4, "qkvo", 1)
    with pytest.raises(SystemExit):
        bench.main(["--breakdown-adapters", "-1"])


def test_stall_note_names_the_allocator_growth(bench):
    step = {"ms": 356.2, "prefill_tokens": 7987, "decode_seqs": 162, "allocs": None}
    assert bench._stall(step) == "356 ms (7987 prompt tokens, 162 decode rows)"
    step["allocs"] = {"device": 2, "host": 3, "host_ms": 41.25}
    assert bench._stall(step) == ("356 ms (7987 prompt tokens, 162 decode rows, cudaMalloc x2, "
                                  "pinned blocks x3 (41.2 ms))")
    step.update(allocs=None, **bench._copies({"load_bytes": [2e6, 3e6], "prefetch_bytes": []}))
    assert bench._stall(step) == "356 ms (7987 prompt tokens, 162 decode rows, 2 loads (5 MB))"


def test_tail_counts_the_steps_past_the_p99(bench):
    def step(ms, prompt=0, loads=(), prefetch=()):
        return {"seconds": ms / 1e3, "features": {"prefill_tokens": prompt},
                "load_bytes": list(loads), "prefetch_bytes": list(prefetch)}
    steps = [step(20), step(20), step(40, prompt=256), step(50, loads=[1]), step(60, prefetch=[1]),
             step(45)]
    assert bench._tail(steps, 40.0) == {"steps": 4, "mean_ms": 48.75, "with_prompts": 1,
                                        "with_loads": 1, "with_prefetch": 1,
                                        "decode_only_no_copies": 1, "host_bound": None}
    assert bench._tail(steps, 0.0)["steps"] == 0
    # with host phases: the slow steps whose collect found the device done
    for s, wait in zip(steps, [12.0, 11.0, 9.0, 0.1, 0.0, 8.0]):
        s["host_ms"] = {"wait": wait, "launch": 3.0}
    assert bench._tail(steps, 40.0)["host_bound"] == 2


def test_trace_steps_prints_where_the_first_steps_went(bench, tiny_model_dir, tmp_path, capsys):
    """--trace-steps N (--trace-skip K): each S2 row's steps K to K + N - 1 under
    torch.profiler, a table of their ops printed, their timeline and the row's step log
    written; the engine's own step method is back afterwards."""
    bench.main(["--part", "scaling", "--model", str(tiny_model_dir), "--device", "cpu",
                "--dtype", "float32", "--num-pages", "1024", "--max-num-seqs", "8",
                "--adapters", "1", "--num-requests", "6", "--input-len", "8,20",
                "--output-len", "2,6", "--modules", "qkvo", "--batches", "4", "--trace-steps", "2",
                "--trace-skip", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "trace of steps 1-2, modules none, 0 adapters (step ms: " in out
    assert "trace of steps 1-2, modules qkvo, 1 adapters (step ms: " in out
    assert out.count("Self CPU time total") == 2  # one table a row
    for tag in ("chunk2048-0-none", "chunk2048-1-qkvo"):
        with gzip.open(tmp_path / f"timeline-{tag}.json.gz", "rt") as fh:
            assert any(e.get("cat") == "cpu_op" for e in json.load(fh)["traceEvents"])
        steps = json.loads((tmp_path / f"steps-{tag}.json").read_text())
        assert steps and all(s["seconds"] > 0 for s in steps)
    rows = json.loads((tmp_path / "bench_scaling.json").read_text())["scaling"]
    assert [r["not_length"] for r in rows] == [0, 0]


def test_timeline_summary_splits_the_compute_streams_idle_time(experiment):
    """experiments/timeline.py: the compute stream (most kernel time) idles 200 us between
    its kernels, 150 of them while a host-to-device copy ran on another stream, 20 beside
    another stream's kernel, 30 with nothing on the GPU, listed by the kernels around the
    gap; host ops are not GPU work."""
    timeline = experiment("timeline")

    def ev(cat, name, ts, dur, stream):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}

    text = timeline.summarize([
        ev("kernel", "gemm", 0, 100, 7), ev("kernel", "norm", 300, 100, 7),
        ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 200, 13),
        ev("kernel", "shrink", 260, 20, 21), ev("cpu_op", "aten::mm", 0, 500, 0)], gaps=1)
    assert "span 0.4 ms, 4 GPU events on 3 streams" in text
    assert ("compute stream 7: idle 0.20 ms of the span: 0.15 ms while a host-to-device copy ran "
            "on another stream, 0.02 ms while only other work ran, 0.03 ms with the GPU idle") in text
    assert "host-to-device copies on other streams: busy 0.20 ms, 0.05 ms of it beside compute" in text
    assert ("gap    0.20 ms at      0.1 ms (copying 0.15 ms, GPU idle 0.03 ms): after gemm / before "
            "norm") in text
    assert "     0.03 ms in     1 gaps (mean   30.0 us): after gemm / before norm" in text
    assert "       0.10 ms       1 x   100.0 us  gemm" in text  # kernels by GPU time
    assert timeline.summarize([ev("cpu_op", "aten::mm", 0, 5, 0)]).startswith("no GPU events")


def test_s2_rows_at_each_prefill_chunk_with_inter_token_latency(bench, tiny_model_dir, tmp_path):
    """--max-prefill-chunk 0,16: the S2 rows at each chunk size on one engine, each with its
    inter-token latency percentiles; the same tokens whatever the chunk, and the engine's own
    step method back afterwards."""
    bench.main(["--part", "scaling", "--model", str(tiny_model_dir), "--device", "cpu",
                "--dtype", "float32", "--num-pages", "1024", "--max-num-seqs", "8",
                "--adapters", "2", "--num-requests", "6", "--input-len", "20,60",
                "--output-len", "2,6", "--modules", "qkvo", "--max-prefill-chunk", "0,16",
                "--batches", "4", "--step-logs",
                "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_scaling.json").read_text())["scaling"]
    assert [(r["max_prefill_chunk"], r["modules"]) for r in rows] == [
        (0, "none"), (0, "qkvo"), (16, "none"), (16, "qkvo")]
    for r in rows:
        assert r["not_length"] == 0 and r["output_tokens"] == rows[0]["output_tokens"]
        # every token after a request's first has a gap
        assert r["itl_tokens"] == r["output_tokens"] - r["requests"]
        assert 0 < r["itl_p50_ms"] <= r["itl_p99_ms"] <= r["itl_max_ms"]
    assert rows[2]["steps"] > rows[0]["steps"]  # prompts of up to 60 tokens in chunks of 16
    # --step-logs: each row's steps, every one with its host phases (the scheduler's, the
    # launch's and the collect's at least), in the row's step count
    for r in rows:
        tag = f"chunk{r['max_prefill_chunk']}-{r['adapters']}-{r['modules']}"
        steps = [json.loads(line) for line in (tmp_path / f"steps-{tag}.jsonl").open()]
        assert len(steps) == r["steps"]
        assert all({"schedule", "launch", "collect"} <= set(s["host_ms"]) for s in steps)
        assert all(v >= 0 for s in steps for v in s["host_ms"].values())


def test_host_phases_go_to_the_step_they_timed_under_async_scheduling(bench, tiny_model_dir,
                                                                      tmp_path):
    """--step-logs with async scheduling (a call launches a step, then collects the one before
    it): each step's entry holds its own scheduling and launch, and its own collect. On a CPU
    the launch computes the step, so the step with every prompt (the first: prompts of 200-240
    tokens, where the others decode one token a request) has the longest launch (read on the
    base model's row, whose decode steps launch fewest kernels)."""
    rows = run_tiny(bench, tiny_model_dir, tmp_path, "--part", "scaling", "--adapters", "2",
                    "--num-requests", "8", "--input-len", "200,240", "--output-len", "4,6",
                    "--modules", "qkvo", "--max-prefill-chunk", "0", "--async-scheduling",
                    "--step-logs")["scaling"]
    for r in rows:
        tag = f"chunk0-{r['adapters']}-{r['modules']}"
        steps = [json.loads(line) for line in (tmp_path / f"steps-{tag}.jsonl").open()]
        assert len(steps) == r["steps"] and steps[0]["features"]["prefill_tokens"] > 0
        assert not any(s["features"]["prefill_tokens"] for s in steps[1:])
        assert all({"schedule", "launch", "collect", "resolve"} <= set(s["host_ms"])
                   for s in steps)
        launch = [s["host_ms"]["launch"] for s in steps]
        if r["modules"] == "none":
            assert launch[0] == max(launch) > 2 * sorted(launch)[len(launch) // 2]


def test_long_prompt_part(bench, tiny_model_dir, tmp_path):
    """--part long: one prompt of many chunks completes; its first-token time and steps."""
    bench.main(["--part", "long", "--model", str(tiny_model_dir), "--device", "cpu",
                "--dtype", "float32", "--num-pages", "64", "--long-prompt", "200",
                "--long-output", "3", "--max-prefill-chunk", "32", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "bench_scaling.json").read_text())["long"]
    assert row["output_tokens"] == 3 and row["finish"] == "length"
    assert row["steps"] >= 200 // 32 + 2 and row["max_prefill_chunk"] == 32
    assert 0 < row["ttft_s"] <= row["wall_s"] and row["prefill_tok_s"] > 0


def test_bench_scaling_decode_with_vocab_lora(bench, tiny_model_dir, tmp_path):
    """--decode-modules vocab: q/k/v/o with embed_tokens and lm_head, beside q/k/v/o alone."""
    bench.main(["--part", "decode", "--model", str(tiny_model_dir), "--device", "cpu",
                "--dtype", "float32", "--num-pages", "256", "--max-num-seqs", "4",
                "--batches", "2", "--context", "8", "--decode-tokens", "4", "--breakdown", "",
                "--decode-modules", "qkvo,vocab", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bench_scaling.json").read_text())["decode"]
    assert [r["modules"] for r in rows] == ["qkvo", "vocab"]
    assert all(r["steps_timed"] >= 1 and r["step_ms"] > 0 for r in rows)
    assert rows[1]["adapter_bytes"] > rows[0]["adapter_bytes"]


def test_bench_scaling_popularity_and_shared_adapters(bench, tiny_model_dir, tmp_path):
    """S2 at several popularity alphas, and the shared-adapter decode table (a batch on one
    adapter, on two, each request on its own, half of it on one adapter and the rest each on
    its own) beside the no-LoRA row of the same batch, each LoRA row under each --decode-lora
    path (the torch backend on CPU has one: the rows are made and recorded all the same)."""
    bench.main(["--part", "scaling,shared", "--model", str(tiny_model_dir), "--device", "cpu",
                "--dtype", "float32", "--num-pages", "1024", "--max-num-seqs", "8",
                "--adapters", "1,6", "--alpha", "0.1,1", "--num-requests", "10",
                "--input-len", "8,20", "--output-len", "2,6", "--modules", "qkvo",
                "--shared-batches", "4", "--shared-adapters", "1,2,0", "--shared-hot", "0.5",
                "--context", "24",
                "--decode-tokens", "8", "--decode-lora", "mbgmv,segments", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "bench_scaling.json").read_text())
    assert "decode" not in res
    rows = res["scaling"]
    # (one adapter takes every draw: its trace runs at the first alpha alone)
    assert [(r["adapters"], r["alpha"], r["decode_lora"]) for r in rows] == [
        (0, 1.0, None)] + [(n, a, m) for m in ("mbgmv", "segments")
                           for n, a in ((1, 0.1), (6, 0.1), (6, 1.0))]
    assert all(r["requests"] == 10 and r["not_length"] == 0 and r["ratio"] > 0 for r in rows)
    used = {(r["alpha"], r["decode_lora"]): r["adapters_used"] for r in rows if r["adapters"] == 6}
    # skewed popularity draws fewer adapters (the same draws under both paths)
    assert used[0.1, "mbgmv"] == used[0.1, "segments"] < used[1.0, "mbgmv"]

    rows = res["shared"]
    assert [(r["modules"], r["adapters"], r["hot"], r["decode_lora"]) for r in rows] == [
        ("none", 0, 0, None)] + [("qkvo", n, h, m) for m in ("mbgmv", "segments")
                                   for n, h in ((1, 0), (2, 0), (4, 0), (3, 0.5))]
    assert all(r["batch"] == 4 and r["steps_timed"] >= 1 and r["vs_none"] > 0 for r in rows)
    assert rows[0]["vs_none"] == 1.0 and rows[0]["adapter_bytes"] == 0
    # the byte floor counts each distinct adapter once
    assert rows[2]["adapter_bytes"] == 2 * rows[1]["adapter_bytes"]
    assert rows[3]["adapter_bytes"] == 4 * rows[1]["adapter_bytes"]
    assert rows[4]["adapter_bytes"] == 3 * rows[1]["adapter_bytes"]  # one for two rows, two alone


def test_repeats_interleave_the_rows_and_keep_each_median_run(bench, tiny_model_dir, tmp_path):
    """--repeats 3: each S2 row's trace three times, the rows interleaved; a row is its median
    run by tok/s, with every run's tok/s beside it, and its ratio over the no-LoRA median.
    Every run repeats the same prompts on a cold prefix cache: none finds an earlier run's
    KV (prompts of 20-40 tokens fill a cached page). With --step-logs each run writes its
    own step log."""
    rows = run_tiny(bench, tiny_model_dir, tmp_path, "--part", "scaling", "--adapters", "2",
                    "--num-requests", "4", "--input-len", "20,40", "--output-len", "2,4",
                    "--modules", "qkvo", "--repeats", "3", "--step-logs")["scaling"]
    assert [(r["adapters"], r["modules"]) for r in rows] == [(0, "none"), (2, "qkvo")]
    for r in rows:
        assert len(r["runs"]) == 3 and r["output_tok_s"] == sorted(r["runs"])[1]
        assert r["prefix_hit_tokens"] == 0
        # where each run's time went, in run order
        assert [p["output_tok_s"] for p in r["run_parts"]] == r["runs"]
        assert all(0 < p["mixed_s"] <= p["wall_s"] and p["compiles"] >= 0
                   for p in r["run_parts"])
    assert rows[0]["ratio"] == 1.0
    assert rows[1]["ratio"] == rows[1]["output_tok_s"] / rows[0]["output_tok_s"]
    logs = sorted(p.name for p in tmp_path.glob("steps-*.jsonl"))
    assert logs == sorted(f"steps-chunk{rows[0]['max_prefill_chunk']}-{n}-{m}-run{k}.jsonl"
                          for n, m in ((0, "none"), (2, "qkvo")) for k in (1, 2, 3))
    # an even count: the lower middle run
    runs = [{"output_tok_s": t, "n": i, "compiles": []} for i, t in enumerate((7.0, 5.0))]
    row = bench.median_run(runs)
    assert (row["output_tok_s"], row["n"], row["runs"]) == (5.0, 1, [7.0, 5.0])
