"""End-to-end GPU benchmark: slora beside HF transformers (and HF PEFT) on the same GPU run.

Models are config.json files under experiments/models/ (or any model directory) with random
weights (EngineConfig(load_format="dummy"); bf16 on CUDA), so nothing is downloaded: throughput depends on shapes,
not on weight values. For each model and batch size: B prompts of --prompt-len random token
ids, --gen-len new tokens each (ignore_eos), greedy.

Reported: generate tok/s = B * gen_len / wall time of the whole call (prefill included, the
way HF's generate is timed), and slora's decode tok/s (tokens after the first / time after
the last first token). --race adds the PEFT race: Llama-2-7B at batch 32, 32 distinct
rank-16 q/k/v/o adapters in one batch, slora beside HF PEFT (mixed-batch adapter_names;
--skip-hf leaves PEFT out: the slora rows with and without adapters remain).
--quantization fp8 builds slora's engines with FP8 base weights (EngineConfig.quantization;
the HF baselines stay in --dtype); the rows keep their system names and carry the setting, so
gpu_table.py sets an FP8 run beside a bf16 one row by row. --moe-experts grouped,dense runs
each slora row once per mixture-of-experts path (EngineConfig.moe_experts), its system named
"slora[grouped]" and "slora[dense]", with its mean time to first token.

Writes bench_engine.json under --out: the harness's header (GPU, commit, command, ceilings)
and one row per system, model and batch (gen_tok_s; decode_tok_s for slora).

    python experiments/bench_engine.py --models smollm2-135m,llama-2-7b --batches 1,32
    python experiments/bench_engine.py --models llama-2-7b --batches 32 --race --skip-hf
    python experiments/bench_engine.py --models llama-2-7b --batches 32 --race --skip-hf \
        --quantization fp8
    python experiments/bench_engine.py --models qwen3-30b-a3b --batches 32,1 --skip-hf \
        --moe-experts grouped,dense
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import add_out_arg, ceilings, free_memory, header, sync, write_result  # noqa: E402
from slora import Engine, EngineConfig, SamplingParams  # noqa: E402

MODELS = Path(__file__).resolve().parent / "models"


def prompts(n, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def slora_run(model, batch, prompt_len, gen_len, adapters=None, rank=16, device="cuda",
              dtype="bfloat16", **cfg):
    """tok/s of one engine.generate over `batch` prompts (after a warm-up call)."""
    eng = Engine(EngineConfig(model=str(MODELS / model), load_format="dummy", device=device,
                              dtype=dtype, max_num_seqs=max(batch, 8), **cfg))
    names = [None] * batch
    if adapters:
        for i in range(adapters):
            eng.add_synthetic_adapter(f"a{i}", rank, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=i)
        names = [f"a{i % adapters}" for i in range(batch)]
    ps = prompts(batch, prompt_len, eng.model_config.vocab_size)
    sp = SamplingParams(max_tokens=gen_len, ignore_eos=True)
    eng.generate(ps, SamplingParams(max_tokens=4, ignore_eos=True), adapters=names)  # warm-up
    # the timed call computes every prompt again, in the steps the warm-up call ran
    eng.reset_prefix_cache()
    sync(device)
    t0 = time.perf_counter()
    outs = eng.generate(ps, sp, adapters=names)
    sync(device)
    wall = time.perf_counter() - t0
    last_first = max(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finish_time for o in outs)
    decode_toks = sum(len(o.token_ids) - 1 for o in outs)
    system = "slora" + (f"[{cfg['moe_experts']}]" if cfg.get("moe_experts") else "") + (
        f"+{adapters}x r{rank}" if adapters else "")
    ttft = sum(o.metrics.first_token_time - o.metrics.arrival_time for o in outs) / len(outs)
    res = {"system": system + ("" if eng.config.async_scheduling else " sync"), "model": model,
           "batch": batch, "gen_tok_s": batch * gen_len / wall,
           "decode_tok_s": decode_toks / max(end - last_first, 1e-9), "wall_s": wall,
           "ttft_s": ttft,
           "quantization": eng.config.quantization, "stats": eng.stats()}
    eng.close()
    del eng
    free_memory(device)
    return res


def hf_model(model, device="cuda", dtype="bfloat16"):
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(MODELS / model)
    with torch.device(device):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    return m.eval()


def hf_run(m, model, batch, prompt_len, gen_len, label="hf", **gen_kwargs):
    device = m.device
    ps = torch.tensor(prompts(batch, prompt_len, m.config.vocab_size), device=device)
    kw = dict(attention_mask=torch.ones_like(ps), do_sample=False, eos_token_id=None,
              pad_token_id=0, **gen_kwargs)
    with torch.inference_mode():
        m.generate(ps, max_new_tokens=4, min_new_tokens=4, **kw)
        sync(device)
        t0 = time.perf_counter()
        out = m.generate(ps, max_new_tokens=gen_len, min_new_tokens=gen_len, **kw)
        sync(device)
    wall = time.perf_counter() - t0
    assert out.shape[1] == prompt_len + gen_len
    return {"system": label, "model": model, "batch": batch, "gen_tok_s": batch * gen_len / wall,
            "wall_s": wall}


def peft_race(model, batch, prompt_len, gen_len, n_adapters=32, rank=16, device="cuda",
              dtype="bfloat16"):
    """HF PEFT with `n_adapters` distinct adapters in one batch (mixed-batch adapter_names)."""
    import peft

    m = hf_model(model, device, dtype)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    pm = peft.get_peft_model(m, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                init_lora_weights=False), adapter_name="a0")
    for i in range(1, n_adapters):
        pm.add_adapter(f"a{i}", peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                target_modules=targets, init_lora_weights=False))
    pm = pm.to(getattr(torch, dtype)).eval()
    names = [f"a{i % n_adapters}" for i in range(batch)]
    res = hf_run(pm, model, batch, prompt_len, gen_len, label=f"hf-peft+{n_adapters}x r{rank}",
                 adapter_names=names)
    del pm, m
    free_memory(device)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,llama-2-7b",
                    help="names under experiments/models/, or model directories")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--race", action="store_true",
                    help="the PEFT race: llama-2-7b, batch 32, 32 rank-16 q/k/v/o adapters")
    ap.add_argument("--race-peft-gen", type=int, default=16,
                    help="HF PEFT output tokens in the race (it is slow; tok/s is what counts)")
    ap.add_argument("--num-pages", type=int, default=2048)
    ap.add_argument("--skip-hf", action="store_true", help="slora rows only (no HF baselines)")
    ap.add_argument("--sync-too", action="store_true",
                    help="each slora row again without async scheduling (EngineConfig."
                         "async_scheduling=False; the default on CUDA is with it)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", choices=("fp8",),
                    help="slora's base weights: fp8 = FP8 E4M3 linear layers (default: --dtype)")
    ap.add_argument("--moe-experts", type=lambda v: v.split(","), default=[None],
                    help="EngineConfig.moe_experts values, each slora row once per value "
                         "(e.g. grouped,dense; default: the engine's own)")
    add_out_arg(ap)
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    on = dict(device=args.device, dtype=args.dtype)
    quant = dict(quantization=args.quantization)  # slora's engines only
    rows = []
    ceil = ceilings(dev)
    print("ceilings:", ceil, flush=True)
    modes = [None, False] if args.sync_too else [None]  # None: the engine's default
    for model in args.models.split(","):
        for b in map(int, args.batches.split(",")):
            for mode in modes:
                for experts in args.moe_experts:
                    moe = {"moe_experts": experts} if experts else {}
                    rows.append(slora_run(model, b, args.prompt_len, args.gen_len, **on, **quant,
                                          **moe, num_pages=args.num_pages,
                                          async_scheduling=mode))
                    print(rows[-1], flush=True)
        if args.skip_hf:
            continue
        m = hf_model(model, **on)
        for b in map(int, args.batches.split(",")):
            rows.append(hf_run(m, model, b, args.prompt_len, args.gen_len))
            print(rows[-1], flush=True)
        del m
        free_memory(dev)
    if args.race:
        for mode in modes:
            rows.append(slora_run("llama-2-7b", 32, 128, 128, adapters=32, **on, **quant,
                                  num_pages=args.num_pages, async_scheduling=mode))
            print(rows[-1], flush=True)
        if not args.skip_hf:
            rows.append(peft_race("llama-2-7b", 32, 128, args.race_peft_gen, **on))
            print(rows[-1], flush=True)
    result = {**header(__file__, dev, ceil, argv), "quantization": args.quantization,
              "rows": rows}
    write_result(args.out, "bench_engine.json", result)
    if args.quantization:
        print(f"\nslora's base weights: {args.quantization}", end="")
    print(f"\n{'system':<28}{'model':<14}{'batch':>6}{'gen tok/s':>12}{'decode tok/s':>14}"
          f"{'TTFT ms':>10}")
    for r in rows:
        dec = f"{r['decode_tok_s']:14.0f}" if "decode_tok_s" in r else f"{'':>14}"
        ttft = f"{1e3 * r['ttft_s']:10.1f}" if "ttft_s" in r else ""
        print(f"{r['system']:<28}{r['model']:<14}{r['batch']:>6}{r['gen_tok_s']:12.0f}{dec}{ttft}")
    return result


if __name__ == "__main__":
    main()
