"""Compile every Triton kernel of slora for a GPU, without one: lowering errors the interpreter
cannot see (it runs the kernels as numpy), and registers / shared memory of each variant.

    python experiments/compile_check.py [--arch 90]     # exit 1 if any variant fails

Each kernel is compiled (Triton -> PTX -> cubin with the wheel's ptxas) in the variants the
engine launches on the GPU (the default tiles, bf16), with the integer specialization a
Llama-2-7B step gives them (every pointer 16-byte aligned, the arguments in DIV16 multiples of
16, as Triton marks them at launch): registers and spills depend on it (the decode attention
kernel without it: 255 registers and a 488-byte stack; with it: 126 and none; with the KV
layout compile-time as well, `kv_layout`: 96). Registers and stack bytes come from the
wheel's cuobjdump. The decode step's kernels also compile with programmatic dependent launch
(`slora.kernels.pdl`), and their PTX must keep its order: the wait before any store, atomic,
async copy or return (`pdl_order`).
`--loads` also counts each variant's global loads and async copies by width: a tile read in
2-byte loads where 16-byte ones were meant is a lost alignment hint (one set on a jit
function's result, which Triton drops, gives exactly that).
Run it with TRITON_INTERPRET unset: under the interpreter `triton.jit` makes no compilable
kernel.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from slora.kernels import (attention, dora, experts, fp8, fused, gemm, mbgmm,  # noqa: E402
                           mbgmv)

LORA = {"x_ptr": "*bf16", "out_ptr": "*bf16", "pool_ptr": "*bf16", "xa_ptr": "*fp32",
        "pages_ptr": "*i32", "offs_ptr": "*i64", "ranks_ptr": "*i32",
        "slot_ptr": "*i32", "seg_start_ptr": "*i32", "seg_slot_ptr": "*i32", "tiles_ptr": "*i32",
        "bias_ptr": "*bf16", "rows_ptr": "*i32"}
ATTN = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
        "bt_ptr": "*i32", "ctx_ptr": "*i32", "part_ptr": "*fp32", "ml_ptr": "*fp32",
        "q_start_ptr": "*i32", "tiles_ptr": "*i32", "qk_scale": "fp32", "cap_scale": "fp32",
        "pos_ptr": "*i64",
        "inv_ptr": "*fp32", "slot_ptr": "*i64", "l_ptr": "*bf16", "sink_ptr": "*fp32",
        "qw_ptr": "*bf16", "kw_ptr": "*bf16", "norm_eps": "fp32"}
FUSED = {"x_ptr": "*bf16", "d_ptr": "*bf16", "l_ptr": "*bf16", "w_ptr": "*bf16", "sum_ptr": "*bf16",
         "out_ptr": "*bf16", "qkv_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16",
         "pos_ptr": "*i64", "inv_ptr": "*fp32", "slot_ptr": "*i64", "gu_ptr": "*bf16",
         "eps": "fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "qw_ptr": "*bf16",
         "kw_ptr": "*bf16"}
# attention without a sliding window, a softcap or sinks (every layer of a Llama)
PLAIN = dict(SLIDING=False, SOFTCAP=False, SINKS=False)
GEMM = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*bf16",
        "part_ptr": "*fp32", "count_ptr": "*i32"}
GEMM_FP8 = dict(GEMM, w_ptr="*fp8e4nv", scale_ptr="*fp32")
GEMM_W8A8 = dict(GEMM_FP8, x_ptr="*fp8e4nv", x_scale_ptr="*fp32")
EXPERTS = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "pick_ptr": "*i64", "h_ptr": "*bf16",
           "w_ptr": "*bf16", "b_ptr": "*bf16", "mid_ptr": "*bf16", "out_ptr": "*bf16"}
# integer arguments that are multiples of 16 when a 7B's step launches the kernels (hidden 4096,
# head_dim 128, 32 heads, pages of 16 tokens, LoRA rows and offsets aligned to 64 elements)
DIV16 = {"stride_x", "d_in", "stride", "P", "stride_out", "d0", "d1", "d2", "d3", "s0", "s1",
         "s2", "s3", "stride_qb", "stride_qh", "stride_qt", "stride_kp", "stride_ks",
         "stride_kh", "stride_vp", "stride_vs", "stride_vh", "block_size", "stride_ob",
         "stride_oh", "stride_ot", "D", "N", "stride_d", "stride_t", "kc_page", "kc_row",
         "kc_head", "vc_page", "vc_row", "vc_head", "stride_gu", "K", "k_split", "stride_w",
         "stride_part", "HALF", "max_out", "stride_l", "stride_lb"}


# the pool's page size of a 7B (16 tokens of K and V, 32 heads of 128): a compile-time constant
# of the LoRA kernels
PAGE = 16 * 2 * 32 * 128


def kv_layout(kv_heads: int, head_dim: int, block_size: int = 16) -> dict:
    """The attention kernels' compile-time KV layout of a model: the strides of
    `kv_views(pool_l, ...)` (K and V of a page interleaved), the page's tokens and head_dim."""
    row = kv_heads * head_dim
    strides = dict(stride_kp=2 * block_size * row, stride_ks=row, stride_kh=head_dim)
    return dict(strides, **{k.replace("k", "v", 1): v for k, v in strides.items()},
                block_size=block_size, D=head_dim)


# a 7B's layout (32 KV heads of 128), the 256-wide heads of the sliding-window variants, and
# gpt-oss's (8 KV heads of 64, groups of 8 query heads) of the sinks' variants
KV7B, KV256, KV64 = kv_layout(32, 128), kv_layout(8, 256), kv_layout(8, 64)


def variants():
    """(name, kernel, argument types, constexprs, options) of each variant to compile."""
    opts = dict(num_warps=4)
    # MBGMM over the prompts' tiles of 64 tokens, and over the decode rows grouped by adapter
    # (slora.kernels.segments, `rows`) in tiles of 16 rows
    mbgmm_variants = [
        (f"mbgmm {kind}{what}", kernel, LORA,
         dict(constexprs, BLOCK_M=rows, ROWS=indirect, P=PAGE),
         options)
        for what, rows, indirect in (("", 64, False), (", decode rows", 16, True))
        for kind, kernel, constexprs, options in (
            ("shrink", mbgmm._mbgmm_shrink_kernel,
             dict(BLOCK_R=16, BLOCK_K=64, EVEN_K=True, DOT_F32=False),
             dict(opts, num_warps=8, num_stages=3)),
            ("expand", mbgmm._mbgmm_expand_kernel,
             dict(BLOCK_R=64, BLOCK_N=64, EVEN_N=True, DOT_F32=False, TWO_PAGES=True),
             dict(opts, num_stages=2, maxnreg=128)))]
    base = [
        ("mbgmv shrink [4 x 32]", mbgmv._mbgmv_shrink_kernel, LORA,
         dict(BLOCK_R=4, CH=32, EVEN_K=True, PRE=False, P=PAGE), opts),
        ("mbgmv shrink [1 x 32], first tile early", mbgmv._mbgmv_shrink_kernel, LORA,
         dict(BLOCK_R=1, CH=32, EVEN_K=True, PRE=True, P=PAGE), dict(opts, num_warps=8)),
        ("mbgmv expand [2 x 8]", mbgmv._mbgmv_expand_kernel, LORA,
         dict(BLOCK_R=2, CHN=8, EVEN_N=True, PRE=False, P=PAGE), opts),
        ("mbgmv expand [4 x 4], first tile early", mbgmv._mbgmv_expand_kernel, LORA,
         dict(BLOCK_R=4, CHN=4, EVEN_N=True, PRE=True, P=PAGE), opts),
        ("dora rescale", dora._dora_scale_kernel, LORA,
         dict(HAS_BIAS=True, CHN=dora.CHN, EVEN_N=True), dict(opts, num_warps=dora.NUM_WARPS)),
        *mbgmm_variants,
        ("decode attention", attention._decode_kernel, ATTN,
         dict(QH=1, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, SPLIT=False, DOT_F32=False,
              ROPE=False, **PLAIN, **KV7B), dict(opts, num_stages=2)),
        *[(f"decode attention, rotary + K/V store{what}", attention._decode_kernel, ATTN,
           dict(QH=1, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, SPLIT=False, DOT_F32=False,
                ROPE=True, LORA=lora, NORM=False, **PLAIN, **KV7B), dict(opts, num_stages=2))
          for what, lora in (("", False), (", LoRA rows added", True))],
        # a table rule's PREFETCH: the first keys' K and V asked of L2 before the PDL wait
        ("decode attention, rotary + K/V store, first keys prefetched", attention._decode_kernel,
         ATTN, dict(QH=1, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, SPLIT=False, DOT_F32=False,
                    ROPE=True, PREFETCH=64, **PLAIN, **KV7B), dict(opts, num_stages=2)),
        # Qwen3-8B's layer (32 heads, 8 KV heads of 128): q and k normed first
        ("decode attention, q/k norms + rotary, LoRA", attention._decode_kernel, ATTN,
         dict(QH=4, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, SPLIT=False, DOT_F32=False,
              ROPE=True, LORA=True, NORM=True, **PLAIN, **kv_layout(8, 128)),
         dict(opts, num_stages=2)),
        ("decode attention, split", attention._decode_kernel, ATTN,
         dict(QH=4, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, SPLIT=True, DOT_F32=False,
              ROPE=False, **PLAIN, **kv_layout(8, 128)), dict(opts, num_stages=2)),
        ("decode attention, rotary, sliding window + softcap", attention._decode_kernel, ATTN,
         dict(QH=2, BLOCK_H=16, BLOCK_D=256, BLOCK_N=64, SPLIT=False, DOT_F32=False,
              ROPE=True, SLIDING=True, SOFTCAP=True, SINKS=False, **KV256),
         dict(opts, num_stages=2)),
        # gpt-oss's layers: sinks on every one, a sliding window on every other
        ("decode attention, rotary + sinks", attention._decode_kernel, ATTN,
         dict(QH=8, BLOCK_H=16, BLOCK_D=64, BLOCK_N=64, SPLIT=False, DOT_F32=False,
              ROPE=True, SLIDING=False, SOFTCAP=False, SINKS=True, **KV64),
         dict(opts, num_stages=2)),
        ("decode attention, split, sliding window + sinks", attention._decode_kernel, ATTN,
         dict(QH=8, BLOCK_H=16, BLOCK_D=64, BLOCK_N=64, SPLIT=True, DOT_F32=False,
              ROPE=False, SLIDING=True, SOFTCAP=False, SINKS=True, **KV64),
         dict(opts, num_stages=2)),
        ("merge", attention._merge_kernel, ATTN, dict(BLOCK_S=8, BLOCK_D=128), opts),
        ("prefill attention", attention._prefill_kernel, ATTN,
         dict(QH=1, BLOCK_M=64, BLOCK_D=128, BLOCK_N=64, DOT_F32=False, **PLAIN, **KV7B),
         dict(opts, num_stages=2)),
        ("prefill attention, sliding window + softcap", attention._prefill_kernel, ATTN,
         dict(QH=2, BLOCK_M=64, BLOCK_D=256, BLOCK_N=32, DOT_F32=False, SLIDING=True,
              SOFTCAP=True, SINKS=False, **KV256), dict(opts, num_stages=2)),
        ("prefill attention, sliding window + sinks", attention._prefill_kernel, ATTN,
         dict(QH=8, BLOCK_M=64, BLOCK_D=64, BLOCK_N=64, DOT_F32=False, SLIDING=True,
              SOFTCAP=False, SINKS=True, **KV64), dict(opts, num_stages=2)),
        # the norm and SiLU alone, and writing their output's E4M3 rounding too (`feeds`)
        # (and adding their input's LoRA rows: `backend.Pending`)
        *[(f"add_rms_norm{what}", fused._rms_norm_kernel, FUSED,
           dict(HAS_DELTA=True, HAS_LORA=lora, QUANT=quant, BLOCK=4096, **fp8.ROUNDING), opts)
          for what, quant, lora in (("", False, False), (", FP8 rounding", True, False),
                                    (", LoRA rows added", False, True))],
        *[(f"rope_write_kv{what}", fused._rope_kv_kernel, FUSED,
           dict(BLOCK=64, TB=1, LORA=lora), dict(opts, num_warps=1))
          for what, lora in (("", False), (", LoRA rows added", True))],
        ("rope_write_kv, 16 tokens a program", fused._rope_kv_kernel, FUSED,
         dict(BLOCK=64, TB=16, LORA=False), opts),
        # q's and k's norms: a head of 128 a program under one weight (Qwen3's), and a
        # token's whole q or k of 4,096 under its own (OLMo 2's)
        *[(f"qk_norm, per head{what}", fused._qk_norm_kernel, FUSED,
           dict(OWN=False, CENTER=False, LORA=lora, BLOCK=128), dict(opts, num_warps=1))
          for what, lora in (("", False), (", LoRA rows added", True))],
        ("qk_norm, whole q and k", fused._qk_norm_kernel, FUSED,
         dict(OWN=True, CENTER=False, LORA=False, BLOCK=4096), dict(opts, num_warps=8)),
        *[(f"{name}{what}", fused._act_mul_kernel, FUSED,
           dict(BLOCK=16384 if quant else 1024, GELU=gelu, HAS_LORA=lora, QUANT=quant,
                **fp8.ROUNDING), dict(opts, num_warps=16) if quant else opts)
          for name, gelu in (("silu_mul", False), ("gelu_tanh_mul", True))
          for what, quant, lora in (("", False, False), (", FP8 rounding", True, False))
          + ((", LoRA rows added", False, True),) * (not gelu)],
        ("quantize rows, 1,024-column blocks", fp8._quantize_rows_kernel, FUSED,
         dict(BLOCK_K=1024, WHOLE=False, **fp8.ROUNDING), opts),
        ("quantize rows, 16,384 columns at once", fp8._quantize_rows_kernel, FUSED,
         dict(BLOCK_K=16384, WHOLE=True, **fp8.ROUNDING), dict(opts, num_warps=16)),
        # a few rows' layer of experts (Qwen3-30B-A3B's: 128 experts, 8 picked), at the tiles
        # experts._tiles gives one token
        ("experts route", experts._route_kernel, EXPERTS,
         dict(K=8, KP=8, RENORM=True, BLOCK_E=128), dict(opts, num_warps=1)),
        ("experts gate|up", experts._gate_up_kernel, EXPERTS,
         dict(K=8, ACT="silu", LIMIT=7.0, ALPHA=1.702, BIAS=False, BLOCK_N=8, BLOCK_K=256),
         dict(opts, num_warps=8)),
        ("experts down", experts._down_kernel, EXPERTS,
         dict(K=8, BIAS=False, BLOCK_N=8, BLOCK_K=512), opts),
        # gpt-oss's (4 picked): biases, the clamped SwiGLU
        ("experts gate|up, biases, clamped SwiGLU", experts._gate_up_kernel, EXPERTS,
         dict(K=4, ACT="swiglu_oai", LIMIT=7.0, ALPHA=1.702, BIAS=True, BLOCK_N=8,
              BLOCK_K=256), dict(opts, num_warps=8)),
        ("experts down, biases", experts._down_kernel, EXPERTS,
         dict(K=4, BIAS=True, BLOCK_N=8, BLOCK_K=512), opts),
        ("few-rows gemm, K split", gemm._skinny_kernel, GEMM,
         dict(SPLIT_K=True, HAS_BIAS=True, EVEN_K=True, DOT_F32=False, UNPACK=False,
              BLOCK_M=32, BLOCK_N=64, BLOCK_K=128), dict(opts, num_stages=4)),
        # a table rule's PREFETCH: each W row's first bytes asked of L2 before the PDL wait
        ("few-rows gemm, W rows prefetched", gemm._skinny_kernel, GEMM,
         dict(SPLIT_K=False, HAS_BIAS=False, EVEN_K=True, DOT_F32=False, UNPACK=False,
              BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, PREFETCH=1024), dict(opts, num_stages=3)),
        # FP8 W (configs' w_bytes 1 rule): read as words and unpacked, and converted (UNPACK off)
        ("fp8 gemm, words unpacked, K split", gemm._skinny_kernel, GEMM_FP8,
         dict(SPLIT_K=True, HAS_BIAS=True, EVEN_K=True, DOT_F32=False, UNPACK=True,
              BLOCK_M=32, BLOCK_N=64, BLOCK_K=256), dict(opts, num_stages=3)),
        ("fp8 gemm, tiles converted, K split", gemm._skinny_kernel, GEMM_FP8,
         dict(SPLIT_K=True, HAS_BIAS=True, EVEN_K=True, DOT_F32=False, UNPACK=False,
              BLOCK_M=32, BLOCK_N=64, BLOCK_K=128), dict(opts, num_stages=4)),
        ("fp8 gemm, W8A8, K split", gemm._skinny_kernel, GEMM_W8A8,
         dict(SPLIT_K=True, HAS_BIAS=True, EVEN_K=True, DOT_F32=False, UNPACK=False,
              BLOCK_M=32, BLOCK_N=64, BLOCK_K=256), dict(opts, num_stages=3)),
    ]
    # a decode step's kernels take a PDL constexpr (slora.kernels.pdl): each compiles without
    # it and, as a Hopper launches them, with it
    out = []
    for name, kernel, types, constexprs, options in base:
        if "PDL" not in inspect.signature(kernel.fn).parameters:
            out.append((name, kernel, types, constexprs, options))
            continue
        out += [(name, kernel, types, dict(constexprs, PDL=False), options),
                (name + ", PDL", kernel, types, dict(constexprs, PDL=True),
                 dict(options, launch_pdl=True))]
    return out


def compile_variant(kernel, types, constexprs, options, arch: int):
    if not hasattr(kernel, "fn"):
        raise RuntimeError("the kernel is not compilable here: unset TRITON_INTERPRET")
    params = list(inspect.signature(kernel.fn).parameters)
    # a constexpr the variant leaves out takes its default, as a launch does
    constexprs = {**{p.name: p.default for p in kernel.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty},
                  **constexprs}
    sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
    div16 = [i for i, p in enumerate(params) if sig[p] != "constexpr"
             and (sig[p].startswith("*") or p in DIV16)
             and p not in kernel.do_not_specialize]
    attrs = {(i,): [["tt.divisibility", 16]] for i in div16}
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs),
                          target=GPUTarget("cuda", arch, 32), options=options)


def resources(compiled) -> str:
    """'REG n STACK b' of a compiled kernel, from the wheel's cuobjdump ('' without it)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True,
                             text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"{found[1]:>5}{found[2]:>7}" if found else ""


def pdl_order(ptx: str, prefetch: bool = False) -> str:
    """'' if a PDL variant's PTX keeps `slora.kernels.pdl`'s rule in program order, else why
    not: a `griddepcontrol.wait` before any store, atomic or async copy (what the kernel
    before may still read or write) and before every `ret`, and a `launch_dependents`; with
    `prefetch` (a PREFETCH variant), L2 prefetches before the wait.
    (Loads before the wait are allowed: the step's metadata, and in small MBGMV launches the
    first adapter tile; which pointer a load reads is not visible here.)"""
    lines = ptx.splitlines()
    waits = [i for i, l in enumerate(lines) if "griddepcontrol.wait" in l]
    if not waits:
        return "no griddepcontrol.wait"
    if not any("griddepcontrol.launch_dependents" in l for l in lines):
        return "no griddepcontrol.launch_dependents"
    early = [l.strip() for l in lines[:waits[0]]
             if re.search(r"\b(st\.global|atom\.|red\.|cp\.async)", l)]
    if early:
        return f"before the wait: {early[0]}"
    if any(re.search(r"\bret;", l) for l in lines[:waits[0]]):
        return "a ret before the wait"
    if prefetch and not any("prefetch.global.L2" in l for l in lines[:waits[0]]):
        return "no prefetch.global.L2 before the wait"
    return ""


def load_widths(ptx: str) -> str:
    """'ld.global.b16 x32, ...': a kernel's global loads and async copies in its PTX, by kind
    and width (per thread, as written; a loop's body counts once)."""
    kinds = Counter(re.findall(r"\b(ld\.global[\w.]*|cp\.async\.c[ag]\.shared\.global)\s", ptx))
    return ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--loads", action="store_true",
                    help="also count each variant's global loads and async copies by width (a "
                         "tile of 2-byte loads where 16-byte ones were meant is a lost hint)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: TRITON_INTERPRET=1 makes no compilable kernels; unset it")
        return 2
    failed = 0
    print(f"{'variant':<42}{'shared B':>10}{'regs':>5}{'stack':>7}  sm_{args.arch}")
    for name, kernel, types, constexprs, options in variants():
        try:
            k = compile_variant(kernel, types, constexprs, options, args.arch)
            bad = pdl_order(k.asm["ptx"], constexprs.get("PREFETCH", 0) > 0) \
                if constexprs.get("PDL") else ""
            if bad:
                raise RuntimeError(f"PDL order: {bad}")
            print(f"{name:<42}{k.metadata.shared:>10}{resources(k) or ' ' * 12}  ok"
                  + (f"  {load_widths(k.asm['ptx'])}" if args.loads else ""))
        except Exception as e:  # report every failing variant, then fail
            failed += 1
            print(f"{name:<42}{'':>10}  FAILED: {type(e).__name__}: {str(e)[:300]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
