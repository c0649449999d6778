"""The GPU script's table: each headline figure beside the ceiling or peer measured in the same
run, and their ratio. Given several runs (gpu.sh's folders or their .tar.gz), one column group
per run, then the last run's figure over the first's.

    python3 experiments/gpu_table.py results/gpu/new
    python3 experiments/gpu_table.py results/gpu/base.tar.gz results/gpu/new.tar.gz

A run holds engine/bench_engine.json, s2/bench_scaling.json, decode/bench_scaling.json,
fp8/bench_fp8.json, chunk/bench_scaling.json (S2 at several max_prefill_chunk sizes: each
chunked row's tok/s and p99 inter-token latency beside the unchunked row's),
long/bench_scaling.json (one long prompt), shared/bench_scaling.json (S2 at other adapter
counts and popularity alphas, and the shared-adapter decode table), vllm/bench_kernels.json
(MBGMV's one-layer times beside vLLM's Triton LoRA kernels on the same adapters), pytest.log
and commit.txt, any of them missing.
Only fields that these files have always carried are read (the rows' gen_tok_s and
decode_tok_s; scaling rows' output_tok_s; decode rows' step_ms and floor_ms; ceilings;
bench_fp8's rows; chunk and long rows, which only trees with chunked prefill write), so that
a run of an older tree compares with a current one; rows with a popularity alpha, a decode
LoRA path or shared adapters (bench_scaling's) are named by them.
"""

from __future__ import annotations

import json
import re
import sys
import tarfile
from pathlib import Path

# the datasheet's HBM GB/s and dense bf16 TFLOP/s: the peers of the measured ceilings
DATASHEET = {"H200": (4800, 989), "H100": (3350, 989)}
FILES = {"engine": "engine/bench_engine.json", "s2": "s2/bench_scaling.json",
         "decode": "decode/bench_scaling.json", "fp8": "fp8/bench_fp8.json",
         "chunk": "chunk/bench_scaling.json", "long": "long/bench_scaling.json",
         "shared": "shared/bench_scaling.json", "vllm": "vllm/bench_kernels.json",
         "tests": "pytest.log", "commit": "commit.txt"}
BENCHES = ("engine", "s2", "decode", "fp8", "chunk", "long", "shared", "vllm")


def load(src: str) -> dict:
    """{"label", and each of BENCHES: parsed JSON or None, "tests": pytest's last line,
    "commit": the JSON header's, else commit.txt's}."""
    path, texts = Path(src), {}
    if path.is_dir():
        texts = {k: (path / f).read_text() for k, f in FILES.items() if (path / f).is_file()}
        label = path.name
    else:
        label = path.name.removesuffix(".tar.gz").removesuffix(".tgz")
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                for k, f in FILES.items():
                    if m.isfile() and (m.name == f or m.name.endswith("/" + f)):
                        texts[k] = tar.extractfile(m).read().decode()
    run = {"label": label, **{k: json.loads(texts[k]) if k in texts else None
                              for k in BENCHES}}
    lines = [ln for ln in texts.get("tests", "").splitlines()
             if re.search(r"\d+ (passed|failed|error)", ln)]
    run["tests"] = lines[-1].strip("= ") if lines else None
    heads = [run[k]["commit"] for k in BENCHES if run[k] and "commit" in run[k]]
    run["commit"] = heads[0] if heads else texts.get("commit", "-").strip() or "-"
    return run


def rows(run: dict) -> list[tuple[str, float, float, str]]:
    """(what, figure, ceiling or peer, the peer's name) for each figure the run holds."""
    out = []
    eng = run["engine"]
    if eng:
        by = {r["system"]: r for r in eng["rows"] if r["model"] == "llama-2-7b" and r["batch"] == 32}
        race = next((r for s, r in by.items() if s.startswith("slora+")), None)
        if race and "slora" in by:
            for key, unit in (("gen_tok_s", "gen tok/s"), ("decode_tok_s", "decode tok/s")):
                out.append((f"PEFT race, {race['system'][6:]}: {unit}", race[key],
                            by["slora"][key], "no LoRA"))
        peft = next((r for s, r in by.items() if s.startswith("hf-peft")), None)
        if race and peft:
            out.append(("PEFT race: gen tok/s", race["gen_tok_s"], peft["gen_tok_s"], "HF PEFT"))
    named = set()
    for d in (run["s2"], run["shared"]):  # (a row both hold: the s2 run's)
        s2 = (d or {}).get("scaling") or []
        base = next((r for r in s2 if r["adapters"] == 0), None)
        for r in s2:
            what = f"S2 {r['modules']}, {r['adapters']} adapters{_variant(r)}: tok/s"
            if base and r["adapters"] and what not in named:
                named.add(what)
                out.append((what, r["output_tok_s"], base["output_tok_s"], "no LoRA"))
    chunk = (run["chunk"] or {}).get("scaling") or []
    whole = {(r["adapters"], r["modules"]): r for r in chunk if r["max_prefill_chunk"] == 0}
    for r in chunk:
        w = whole.get((r["adapters"], r["modules"]))
        if w is not None and r is not w:
            what = f"S2 {r['modules']}, {r['adapters']} ad., chunk {r['max_prefill_chunk']}"
            out.append((f"{what}: tok/s", r["output_tok_s"], w["output_tok_s"], "unchunked"))
            out.append((f"{what}: ITL p99 ms", r["itl_p99_ms"], w["itl_p99_ms"], "unchunked"))
    if run["long"] and run["long"].get("long"):
        r = run["long"]["long"]
        out.append((f"{r['prompt_tokens']}-token prompt: prompt tok/s", r["prefill_tok_s"],
                    float("nan"), "-"))
    for d in (run["s2"], run["decode"], run["shared"]):  # the shared-adapter decode table
        none = {}
        for r in (d or {}).get("shared") or []:
            if r["modules"] == "none":
                none[r["batch"]] = r
            elif r["batch"] in none:
                out.append((f"decode batch {r['batch']}, {r['adapters']} adapters{_variant(r)}: "
                            "ms/step", r["step_ms"], none[r["batch"]]["step_ms"], "no LoRA"))
    for r in (run["decode"] or {}).get("decode") or []:
        out.append((f"decode batch {r['batch']}, {r['modules']}: ms/step", r["step_ms"],
                    r["floor_ms"], "byte floor"))
    # the FP8 few-rows GEMM reading words against the converting one, weight GB/s
    fp8 = {(r["module"], r["M"], r["path"]): r for r in (run.get("fp8") or {}).get("rows", [])}
    for (module, M, path), r in fp8.items():
        old = fp8.get((module, M, "fp8 converted"))
        if path == "fp8 unpacked" and old:
            out.append((f"FP8 GEMM {module} x{M}: GB/s", r["weight_GBps"], old["weight_GBps"],
                        "converted"))
    # one LoRA layer (MBGMV) beside vLLM's Triton LoRA kernels on the same adapters, in us
    for w in (run.get("vllm") or {}).get("mbgmv") or []:
        if "us_vllm" in w:
            out.append((f"LoRA layer, {w['T']} tokens, rank {w['rank']}: us", w["us_ours"],
                        w["us_vllm"], "vLLM"))
    src = next((d for d in (run["decode"], eng, run.get("fp8"), run.get("vllm"))
                if d and d.get("ceilings")), None)
    if src:
        c = src["ceilings"]
        sheet = next((v for k, v in DATASHEET.items() if k in (src.get("gpu") or "")), None)
        out.append(("device copy GB/s (read + write)", c["copy_GBps"],
                    sheet[0] if sheet else float("nan"), "datasheet"))
        out.append(("bf16 GEMM TFLOP/s (8192^3)", c["gemm_bf16_TFLOPs"],
                    sheet[1] if sheet else float("nan"), "datasheet"))
    return out


def _variant(row: dict) -> str:
    """A LoRA row's popularity alpha (when not uniform), its share of rows on one adapter
    (when skewed) and decode LoRA path (when set)."""
    alpha, hot = row.get("alpha", 1.0), row.get("hot")
    path = row.get("decode_lora")
    return ((f", alpha {alpha:g}" if alpha != 1.0 else "") + (f", {hot:.0%} on one" if hot else "")
            + (f", {path}" if path else ""))


def num(x: float) -> str:
    return "-" if x != x else f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}"


def table(runs: list[dict]) -> str:
    lines = []
    for run in runs:
        d = next((run[k] for k in BENCHES if run[k]), {})
        quant = next((run[k]["quantization"] for k in ("engine", "s2", "decode")
                      if run[k] and run[k].get("quantization")), None)
        lines.append(f"{run['label']}: {d.get('gpu') or '-'}, commit {run['commit'][:12]}; "
                     f"{quant + ' base weights; ' if quant else ''}"
                     f"tests: {run['tests'] or 'not run'}")
    per = [{what: (fig, peer, name) for what, fig, peer, name in rows(run)} for run in runs]
    names = {what: name for p in per for what, (_, _, name) in p.items()}
    # the first two columns as wide as their longest entry, two spaces apart
    w1 = max([len("benchmark")] + [len(what) for what in names]) + 2
    w2 = max([len("peer (same run)")] + [len(name) for name in names.values()]) + 2
    head = f"{'benchmark':<{w1}}{'peer (same run)':<{w2}}" + "".join(
        f"{run['label'][:9]:>10}{'peer':>8}{'ratio':>7}" for run in runs)
    if len(runs) > 1:
        head += f"{runs[-1]['label'][:6] + '/' + runs[0]['label'][:6]:>15}"
    lines += ["", head]
    for what, name in names.items():
        line, figs = f"{what:<{w1}}{name:<{w2}}", []
        for p in per:
            fig, peer, _ = p.get(what, (float("nan"), float("nan"), ""))
            figs.append(fig)
            line += f"{num(fig):>10}{num(peer):>8}{fig / peer if peer else float('nan'):>7.3f}"
        if len(runs) > 1:
            line += f"{figs[-1] / figs[0]:>15.3f}" if figs[0] == figs[0] and figs[0] else f"{'-':>15}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args else 2
    print(table([load(a) for a in args]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
