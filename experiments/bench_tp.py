"""Tensor parallelism: an engine on --tp devices against one device, in one table.

Random weights of a model's shapes (EngineConfig(load_format="dummy"); every rank draws the
full model from one seed, then keeps its shard, so both degrees serve the same weights). Each
degree in turn builds its engines, measures and closes them (`Engine.close` stops the workers):
engines of two degrees never share the devices' memory.

correctness (--model, Llama-2-7B's shape): --requests prompts of --prompt-len random token ids,
    --tokens greedy tokens each, the requests cycling over the base model and synthetic
    adapters of ranks 8, 16, 32 and 64 on all seven modules, in one `generate` call. Reported:
    the requests whose tokens equal one device's, and the largest |log-prob difference| of a
    chosen token over each request's tokens up to its first difference.
decode (--big-model, Llama-2-13B's shape): `bench_scaling.decode_row` at batch --batch, without
    LoRA and with one --decode-rank adapter per request on --modules: median ms per step, and
    the byte floor over --tp devices' copy bandwidth. LoRA's share of the step is its time
    (the adapters' step minus the no-LoRA step) over the adapters' step; the communication
    estimate is LoRA's time on --tp devices minus 1/tp of its time on one (what sharding
    does not divide: the all-reduce of every module group's [tokens, rank] partial product,
    and the launches). The all-reduces run inside the step's CUDA graph, so nothing times
    them alone.
s4 (--big-model): S-LoRA's S4 setting, `bench_scaling.s2_trace` on the 13B shape: --adapters
    adapters of ranks 64/32/16/8, uniform popularity, --num-requests requests submitted at
    once, lengths uniform in [8, 511]; `bench_scaling.scaling_row` times the `generate` call
    (output tok/s, req/s, inter-token latency).

Targets (printed beside the ratios): decode step at --tp 2 <= 0.6 of one device's, S4
throughput >= 1.7x. --tp 1 runs one device alone (no ratios).

Options other than these go to bench_scaling.py's parser (--num-requests, --input-len,
--output-len, --ranks, --seed, --decode-rank, --context, --decode-tokens, --num-pages,
--max-num-seqs, --max-batch-tokens, --async-scheduling, ...), which sets up both engines;
here --num-requests defaults to 400 and --decode-rank to 32 (about S4's mean rank).

Writes bench_tp.json under --out: the harness's header (GPU, commit, command, ceilings), each
degree's rows ("degrees": {"1": ..., "2": ...}: correctness tokens, decode rows, the S4 row),
"compare" and the printed "table" (one dict a line: what, a value per degree, ratio, target,
met).

    python experiments/bench_tp.py
    python experiments/bench_tp.py --modules all
    python experiments/bench_tp.py --tp 1 --model DIR --big-model DIR --device cpu \
        --dtype float32 --requests 4 --adapters 4 --num-requests 6
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_engine import MODELS, prompts  # noqa: E402
from bench_scaling import (MODULE_SETS, add_adapters, decode_row, engine_config,  # noqa: E402
                           parse_args, remove_adapters, s2_trace, scaling_row)
from harness import add_out_arg, ceilings, free_memory, header, write_result  # noqa: E402
from slora import Engine, SamplingParams  # noqa: E402
from slora.config import LORA_MODULES  # noqa: E402

CHECK_RANKS = (8, 16, 32, 64)  # correctness: one adapter of each, on all seven modules
DECODE_TARGET, S4_TARGET = 0.6, 1.7  # TP=2 over TP=1: decode step at most, S4 tok/s at least


def greedy(eng: Engine, args) -> list[dict]:
    """Each correctness request's greedy tokens and their log-probs."""
    names = {f"check-r{r}": r for r in CHECK_RANKS}
    add_adapters(eng, names, LORA_MODULES)
    cycle = [None, *names]
    adapters = [cycle[i % len(cycle)] for i in range(args.requests)]
    ps = prompts(args.requests, args.prompt_len, eng.model_config.vocab_size, seed=1)
    sp = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, logprobs=1)
    outs = eng.generate(ps, sp, adapters=adapters)
    remove_adapters(eng, names)
    return [{"adapter": a, "tokens": o.token_ids,
             "logprobs": [lp[t] for lp, t in zip(o.logprobs, o.token_ids)]}
            for a, o in zip(adapters, outs)]


def compare(ref: list[dict], got: list[dict]) -> dict:
    """Requests with equal tokens; the largest |log-prob difference| over each request's
    tokens up to its first difference (its first differing position, None when equal)."""
    diff, first = 0.0, []
    for r, g in zip(ref, got):
        at = next((j for j, (a, b) in enumerate(zip(r["tokens"], g["tokens"])) if a != b), None)
        first.append(at)
        n = len(r["tokens"]) if at is None else at
        diff = max([diff] + [abs(a - b) for a, b in zip(r["logprobs"][:n], g["logprobs"][:n])])
    return {"identical": sum(at is None for at in first), "requests": len(ref),
            "max_logprob_diff": diff, "first_difference": first}


def throughput(eng: Engine, args, sargs, copy_GBps: float) -> dict:
    """The decode rows (no LoRA, then --modules) and the S4 row, after a warm-up."""
    warm = eng.warmup(ranks=sargs.ranks, modules=[MODULE_SETS[args.modules]])
    print(f"warm-up {warm:.1f} s", flush=True)
    decode = [decode_row(eng, sargs, args.batch, key, copy_GBps)
              for key in ("none", args.modules)]
    trace = s2_trace(sargs, args.adapters)
    lens = [(r.prompt_len, r.output_len) for r in trace.requests]
    return {"decode": decode, "s4": scaling_row(eng, sargs, trace, args.modules, lens)}


def measure(args, sargs, tp: int, copy_GBps: float) -> dict:
    """One degree's rows: correctness on --model, decode and S4 on --big-model (one engine
    when they are one model). Each engine is closed before the next is built."""
    res, t0 = {}, time.perf_counter()
    for model in dict.fromkeys([args.model, args.big_model]):
        eng = Engine(engine_config(sargs).replace(model=model, tensor_parallel_size=tp))
        try:
            print(f"TP={tp}: {Path(model).name}, {eng.runner.num_pages} pages "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
            if model == args.model:
                res["correctness"] = greedy(eng, args)
            if model == args.big_model:
                # the byte floor over the group's bandwidth: each device reads 1/tp
                res.update(throughput(eng, args, sargs, copy_GBps * tp))
                print(f"TP={tp}: decode {res['decode'][0]['step_ms']:.2f} / "
                      f"{res['decode'][1]['step_ms']:.2f} ms, S4 "
                      f"{res['s4']['output_tok_s']:.0f} tok/s "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
        finally:
            eng.close()
            del eng
            free_memory(sargs.device)
    return res


def lora_cost(res: dict) -> tuple[float, float]:
    """(LoRA's ms in the decode step: adapters' step minus no-LoRA step, the adapters' step)."""
    none, lora = (r["step_ms"] for r in res["decode"])
    return lora - none, lora


def table(args, degrees: dict[int, dict]) -> list[dict]:
    """The printed table's lines: what, a value per degree ("tp1", "tp2": absent where it has
    none), and with two degrees the ratio (the larger degree's over one device's) and its
    target."""
    tps = sorted(degrees)
    top, lines = tps[-1], []

    def add(what, vals: dict, fmt="{:.2f}", target=None, ratio=True):
        r = vals[top] / vals[1] if ratio and top > 1 and vals[1] else None
        target = target if r is not None else None
        lines.append({"what": what, **{f"tp{tp}": v for tp, v in vals.items()}, "ratio": r,
                      "target": target and f"{target[0]} {target[1]}",
                      "met": target and (r <= target[1] if target[0] == "<=" else r >= target[1]),
                      "fmt": fmt})

    def each(value) -> dict:
        return {tp: value(degrees[tp]) for tp in tps}

    if top > 1:
        cmp = compare(degrees[1]["correctness"], degrees[top]["correctness"])
        add(f"greedy requests equal to TP=1 ({args.tokens} tokens)",
            {top: f"{cmp['identical']}/{cmp['requests']}"}, "{}", ratio=False)
        add("max |logprob diff| before a token differs", {top: cmp["max_logprob_diff"]},
            "{:.2e}", ratio=False)
    for i, key in enumerate(("none", args.modules)):
        label = "no LoRA" if key == "none" else f"{key} r{degrees[1]['decode'][i]['rank']}"
        add(f"decode b{args.batch} {label}, ms/step", each(lambda d: d["decode"][i]["step_ms"]),
            target=("<=", DECODE_TARGET))
        add(f"decode b{args.batch} {label}, byte floor ms",
            each(lambda d: d["decode"][i]["floor_ms"]))
    add("decode LoRA ms (adapters - none)", each(lambda d: lora_cost(d)[0]))
    add("decode LoRA share of the step", each(lambda d: lora_cost(d)[0] / lora_cost(d)[1]),
        "{:.1%}", ratio=False)
    if top > 1:
        comm = lora_cost(degrees[top])[0] - lora_cost(degrees[1])[0] / top
        add(f"LoRA comm. estimate ms (TP={top} - TP=1 / {top})", {top: comm}, ratio=False)
        add("  its share of the step", {top: comm / lora_cost(degrees[top])[1]}, "{:.1%}",
            ratio=False)
    s4 = f"S4 {args.adapters} adapters {args.modules}"
    add(f"{s4}, output tok/s", each(lambda d: d["s4"]["output_tok_s"]), "{:.0f}",
        target=(">=", S4_TARGET))
    add(f"{s4}, req/s", each(lambda d: d["s4"]["req_s"]))
    add(f"{s4}, ITL p99 ms", each(lambda d: d["s4"]["itl_p99_ms"]), "{:.1f}")
    return lines


def print_table(args, tps: list[int], lines: list[dict]) -> None:
    two = len(tps) > 1
    print(f"\ntensor parallelism, TP={tps[-1]} against TP=1, {args.device} {args.dtype}: "
          f"correctness {Path(args.model).name}, decode and S4 {Path(args.big_model).name}")
    print(f"{'':<48}" + "".join(f"{f'TP={tp}':>11}" for tp in tps)
          + (f"{'ratio':>8}{'target':>9}{'met':>5}" if two else ""))
    for ln in lines:
        cells = [ln["fmt"].format(ln[f"tp{tp}"]) if f"tp{tp}" in ln else "-" for tp in tps]
        ratio = "-" if ln["ratio"] is None else f"{ln['ratio']:.3f}"
        met = "" if ln["met"] is None else "yes" if ln["met"] else "no"
        print(f"{ln['what']:<48}" + "".join(f"{c:>11}" for c in cells)
              + (f"{ratio:>8}{ln['target'] or '':>9}{met:>5}" if two else ""))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                 epilog="other options: bench_scaling.py's (see the docstring)")
    ap.add_argument("--tp", type=int, default=2, help="the degree set against one device")
    ap.add_argument("--model", default=str(MODELS / "llama-2-7b"), help="correctness' model")
    ap.add_argument("--big-model", default=str(MODELS / "llama-2-13b"),
                    help="decode's and S4's model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=32, help="correctness: requests")
    ap.add_argument("--tokens", type=int, default=16, help="correctness: greedy tokens each")
    ap.add_argument("--prompt-len", type=int, default=64, help="correctness: prompt tokens")
    ap.add_argument("--batch", type=int, default=32, help="decode: batch size")
    ap.add_argument("--adapters", type=int, default=1000, help="S4: adapters")
    ap.add_argument("--modules", choices=("qkvo", "all"), default="qkvo",
                    help="S4's and decode's adapter modules (S-LoRA's: qkvo)")
    add_out_arg(ap)
    args, rest = ap.parse_known_args(argv)
    if args.tp < 1:
        ap.error(f"--tp {args.tp}: expected 1 or more")
    # bench_scaling's parser sets up the engines; its defaults here first, the caller's last
    sargs = parse_args(["--num-requests", "400", "--decode-rank", "32", *rest,
                        "--model", args.big_model, "--device", args.device, "--dtype", args.dtype,
                        "--part", "scaling,decode", "--batches", str(args.batch),
                        "--adapters", str(args.adapters), "--modules", args.modules,
                        "--breakdown", "", "--out", args.out])
    t0 = time.perf_counter()
    device = torch.device(args.device)
    ceil = ceilings(device)
    print("ceilings:", ceil, flush=True)
    tps = sorted({1, args.tp})
    degrees = {tp: measure(args, sargs, tp, ceil["copy_GBps"]) for tp in tps}
    lines = table(args, degrees)
    result = {**header(__file__, device, ceil, argv), "model": args.model,
              "big_model": args.big_model, "device": args.device, "dtype": args.dtype,
              "tp": args.tp, "args": {**vars(sargs), **vars(args)},
              "degrees": {str(tp): d for tp, d in degrees.items()},
              "compare": (compare(degrees[1]["correctness"], degrees[tps[-1]]["correctness"])
                          if len(tps) > 1 else None),
              "table": [{k: v for k, v in ln.items() if k != "fmt"} for ln in lines],
              "wall_s": time.perf_counter() - t0}
    print_table(args, tps, lines)
    path = write_result(args.out, "bench_tp.json", result)
    print(f"\nwrote {path} ({result['wall_s']:.0f} s in all)")
    return result


if __name__ == "__main__":
    main()
