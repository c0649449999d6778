"""S-LoRA's S2 trace in-process and through `slora serve`: what the HTTP front door costs.

One trace, two replays on the same engine options, one after the other:

in-process: `slora.replay.run_replay` (what `slora replay --model` runs): the engine built in
    this process, warmed up, the trace replayed on the wall clock.
http: `slora serve`'s app in a child process (this script again, in its child mode below) on
    127.0.0.1, with the same engine options and the pool size the in-process engine had, so
    both serve from the same number of pages; the trace sent by `slora.http_replay` (what
    `slora replay --url` runs): streamed OpenAI completions of token-id prompts, the same
    prompts as in-process (one seed), ignore_eos, max_tokens = output_len.

The trace: S-LoRA's S2 setting (`slora.workload.synthesize`, seed 42): --adapters synthetic
adapters of ranks 64/32/16/8 round-robin (q/k/v/o, random weights, one host buffer per rank),
popularity alpha 1 (uniform), Poisson arrivals (cv 1) at --rate for --duration seconds, prompt
and output lengths uniform in [8, 511]. The model: the Llama-2-7B shape with random bf16
weights (load_format "dummy"). At the default rate the arrivals outpace the engine, so both
replays run it saturated and throughput is the engine's capacity through each path.

A model directory without tokenizer.json (the shapes in experiments/models/) is served from a
copy that adds a word-level tokenizer of its vocabulary (token i reads "t<i>"), so both paths
detokenize every token, as with a real model, and the server streams one event per token: it
streams text deltas, and without a tokenizer the text stays empty until the request ends.

Prints one table (output tok/s and req/s of both, http over in-process against the 0.95
target, first-token latency p50/p90 of both, failures) and writes under --out:
bench_serve.json (the harness's header, the settings, both summaries, the ratio),
inprocess.json and http.json (each replay's result JSON: `slora plot` draws them side by side)
and serve.log (the child's output). The trace, the model copy and the child's spec live in a
temporary directory (the workload's parameters in the results reproduce the trace).

Child mode (internal; the parent starts it): `bench_serve.py --serve-child SPEC.json` builds
the engine from the spec's model and engine options, registers the trace's adapters as
synthetic ones (what `slora replay --synthetic-adapters` registers), warms up, and serves
slora.server's app on the spec's port until SIGTERM. `slora serve` has no synthetic-adapter
flag; this mode is how a benchmark serves S-LoRA's dummy adapters over HTTP.

    python experiments/bench_serve.py
    python experiments/bench_serve.py --rate 30 --duration 20 --adapters 2000
    python experiments/bench_serve.py --smoke        # CPU, a tiny model, a few requests
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import ROOT, add_out_arg, free_memory, header, write_result  # noqa: E402
from slora.workload import read_trace, synthesize, write_trace  # noqa: E402

MODELS = Path(__file__).resolve().parent / "models"
TARGET = 0.95  # http throughput over in-process, at least
# A 2-layer Llama of hidden size 64: the smoke mode's model, random weights from this alone.
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "vocab_size": 320, "bos_token_id": 0, "eos_token_id": 1}
SMOKE = {"device": "cpu", "dtype": "float32", "num_pages": 256, "max_num_seqs": 8,
         "max_batch_tokens": 512, "adapters": 4, "ranks": [8, 4], "rate": 8.0, "duration": 1.0,
         "input_len": [8, 24], "output_len": [2, 8], "startup_timeout": 120.0}


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(MODELS / "llama-2-7b"),
                    help="a model dir (config.json is enough: random weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="pool pages (default: the in-process engine sizes it from free memory, "
                    "and the server gets as many)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-batch-tokens", type=int, default=8192)
    ap.add_argument("--adapters", type=int, default=2000, help="synthetic adapters in the trace")
    ap.add_argument("--ranks", type=ints, default=[64, 32, 16, 8])
    ap.add_argument("--rate", type=float, default=30.0, help="mean requests per second")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    ap.add_argument("--cv", type=float, default=1.0, help="arrival gaps' coefficient of variation")
    ap.add_argument("--alpha", type=float, default=1.0, help="adapter popularity (1 = uniform)")
    ap.add_argument("--input-len", type=ints, default=[8, 511], help="lo,hi (inclusive)")
    ap.add_argument("--output-len", type=ints, default=[8, 511], help="lo,hi (inclusive)")
    ap.add_argument("--seed", type=int, default=42, help="the trace's seed")
    ap.add_argument("--concurrency", type=int, default=1024, help="the HTTP client's connections")
    ap.add_argument("--startup-timeout", type=float, default=600.0,
                    help="seconds the server may take to answer /health (build and warm-up)")
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, a tiny random model, a few requests: the whole path in seconds")
    ap.add_argument("--serve-child", metavar="SPEC", help=argparse.SUPPRESS)
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if args.smoke:  # the smoke mode's settings, under the flags given
        ap.set_defaults(**SMOKE)
        args = ap.parse_args(argv)
    return args


# ----------------------------------------------------------------------------- the server

def serve_child(spec_path: str) -> None:
    """Child mode: build, register, warm up, then serve until SIGTERM (see the docstring),
    as `slora serve` does (slora.server.serve.run) with synthetic adapters."""
    from slora import Engine, EngineConfig
    from slora.async_engine import AsyncEngine
    from slora.replay import register_adapters
    from slora.server.app import DrainingServer, build_app
    from slora.server.settings import ServerSettings

    spec = json.loads(Path(spec_path).read_text())
    trace = read_trace(spec["trace"])
    engine = Engine(EngineConfig(model=spec["model"], **spec["engine"]))
    register_adapters(engine, trace, synthetic=True, adapter_dir=None)
    t0 = time.perf_counter()
    engine.warmup()
    print(f"serve-child: warm-up {time.perf_counter() - t0:.1f} s, pool "
          f"{engine.stats()['pages_total']} pages", flush=True)
    async_engine = AsyncEngine(engine=engine)
    try:
        server = DrainingServer(build_app(async_engine, ServerSettings()), host="127.0.0.1",
                                port=spec["port"], log_level="warning",
                                timeout_graceful_shutdown=30)
        # uvicorn re-raises the signal that stopped it once drained: with this handler, a
        # drained SIGTERM ends the child with status 0
        signal.signal(signal.SIGTERM, lambda *_: None)
        server.run()
    finally:
        async_engine.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, child: subprocess.Popen, timeout_s: float, log: Path) -> float:
    """Seconds until GET /health answers 200; raises if the child exits or time runs out."""
    t0 = time.monotonic()
    while True:
        if child.poll() is not None:
            raise RuntimeError(f"the server exited with {child.returncode} before it was ready:\n"
                               + _tail(log))
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"the server did not answer /health within {timeout_s:.0f} s:\n"
                               + _tail(log))
        time.sleep(0.5)


def _tail(log: Path, lines: int = 30) -> str:
    text = log.read_text(errors="replace") if log.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def stop(child: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """SIGTERM (the server drains and exits), then SIGKILL after `timeout_s`; the exit status."""
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return child.returncode


def with_tokenizer(model: str, work: Path) -> str:
    """`model` if it has a tokenizer.json; else a copy of its config.json beside a word-level
    tokenizer of its vocabulary (token i reads "t<i>"), in `work`."""
    if (Path(model) / "tokenizer.json").is_file():
        return model
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from slora.config import ModelConfig

    vocab = ModelConfig.from_dir(model).vocab_size
    copy = work / "model"
    copy.mkdir()
    shutil.copy(Path(model) / "config.json", copy / "config.json")
    Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0")).save(
        str(copy / "tokenizer.json"))
    return str(copy)


def run_http(args, model: str, out: Path, work: Path, trace_path: Path,
             engine: dict) -> tuple[dict, dict]:
    """The trace through the server in a child process: (the result dict, timings)."""
    from slora.http_replay import HttpTarget, run_http_replay

    port = free_port()
    spec = work / "serve_spec.json"
    spec.write_text(json.dumps({"model": model, "engine": engine, "trace": str(trace_path),
                                "port": port}))
    log = out / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    t0 = time.monotonic()
    with open(log, "w") as fh:
        child = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-child",
                                  str(spec)], stdout=fh, stderr=subprocess.STDOUT, env=env,
                                 cwd=str(ROOT))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, child, args.startup_timeout, log)
        ready_s = time.monotonic() - t0
        print(f"http: server ready in {ready_s:.1f} s (build and warm-up)", flush=True)
        target = HttpTarget(url, concurrency=args.concurrency)
        result = run_http_replay(read_trace(trace_path), target,
                                 vocab_size=_vocab(model), seed=0, trace_path=str(trace_path),
                                 source="http", progress=sys.stderr.isatty())
    finally:
        code = stop(child)
    return result, {"ready_s": ready_s, "server_exit": code}


def _vocab(model: str) -> int:
    from slora.config import ModelConfig

    return ModelConfig.from_dir(model).vocab_size


# ----------------------------------------------------------------------------- main

def summary_row(name: str, r: dict) -> str:
    def ms(v):
        return f"{v * 1e3:>10.0f}" if v is not None else f"{'n/a':>10}"

    return (f"{name:<12}{r['throughput_tok_s']:>10.0f}{r['throughput_req_s']:>9.2f}"
            f"{ms(r['ttft_p50_s'])}{ms(r['ttft_p90_s'])}{r['duration_s']:>9.1f}"
            f"{str(r['num_completed']) + '/' + str(r['num_requests']):>12}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.serve_child:
        serve_child(args.serve_child)
        return {}
    from slora.replay import run_replay

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_serve-") as tmp:
        work = Path(tmp)
        if args.smoke:  # a model dir of config.json alone: random weights
            args.model = str(work / "tiny-model")
            Path(args.model).mkdir()
            (Path(args.model) / "config.json").write_text(json.dumps(TINY_CONFIG))
        model = with_tokenizer(args.model, work)
        trace = synthesize(num_adapters=args.adapters, rate=args.rate, cv=args.cv,
                           alpha=args.alpha, duration=args.duration,
                           input_len=tuple(args.input_len), output_len=tuple(args.output_len),
                           ranks=args.ranks, seed=args.seed)
        trace_path = work / "trace.jsonl"
        write_trace(trace, trace_path)
        print(f"S2 trace: {len(trace)} requests over {trace.duration:.1f} s, {args.adapters} "
              f"adapters ({len(trace.adapter_names())} used), ranks {args.ranks}", flush=True)
        engine = {"device": args.device, "dtype": args.dtype, "load_format": "dummy",
                  "max_num_seqs": args.max_num_seqs, "max_batch_tokens": args.max_batch_tokens}
        if args.num_pages:
            engine["num_pages"] = args.num_pages

        t0 = time.monotonic()
        inproc = run_replay(trace, model=model, engine_options=engine, synthetic_adapters=True,
                            trace_path=str(trace_path), seed=0, progress=sys.stderr.isatty())
        print(f"in-process: done in {time.monotonic() - t0:.1f} s", flush=True)
        free_memory(args.device)
        engine["num_pages"] = inproc["stats"]["pages_total"]  # the server: as many pages
        http, timing = run_http(args, model, out, work, trace_path, engine)
        # the server's EngineConfig is the in-process one with its pool size: recorded alike,
        # so `slora plot` finds no setting that differs and draws the two side by side
        http["config"]["engine"] = {**inproc["config"]["engine"], "num_pages": engine["num_pages"]}

    ratio = http["throughput_tok_s"] / inproc["throughput_tok_s"]
    result = {
        **header(__file__, args.device, {}, argv),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "serve_child")},
        "engine": engine, "requests": len(trace), "output_tokens": sum(
            r.output_len for r in trace.requests),
        "inprocess": {k: v for k, v in inproc.items() if k not in ("latencies", "config")},
        "http": {k: v for k, v in http.items() if k not in ("latencies", "config")},
        "ratio": ratio, "target": TARGET, **timing}
    write_result(out, "bench_serve.json", result)
    from slora.cli import result_json

    (out / "inprocess.json").write_text(result_json(inproc))
    (out / "http.json").write_text(result_json(http))

    print(f"\nS2 over HTTP: {len(trace)} requests at {args.rate:g} req/s (cv {args.cv:g}), "
          f"{args.adapters} adapters, ranks {args.ranks}, {Path(args.model).name}, "
          f"{engine['num_pages']} pages")
    print(f"{'':<12}{'tok/s':>10}{'req/s':>9}{'TTFT p50':>10}{'TTFT p90':>10}{'wall s':>9}"
          f"{'done':>12}")
    print(summary_row("in-process", inproc))
    print(summary_row("slora serve", http))
    print(f"throughput http / in-process: {ratio:.3f} (target >= {TARGET}); TTFT in ms; "
          f"server exit {timing['server_exit']}")
    errors = http["stats"].get("errors")
    if errors:
        print("http failures: " + "; ".join(f"{n} x {why}" for why, n in errors.items()))
    return result


if __name__ == "__main__":
    main()
