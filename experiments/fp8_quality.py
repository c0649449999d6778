"""FP8 quality: perplexity of a model with its linear weights in FP8 against the same model
with 16-bit (and 32-bit) weights, over real text from the shipped ShareGPT data.

    .venv/bin/python experiments/fp8_quality.py                  # SmolLM2-135M, 4,096 tokens
    .venv/bin/python experiments/fp8_quality.py --smoke          # a quick run (the tests')

Method. Each configuration is an `Engine` on the CPU (`EngineConfig(device="cpu", dtype=...,
quantization=...)`), and the text is scored by that engine's own model forward (embed, every
layer, head) over each window of tokens as one prompt, with the logits of every position
instead of the last one only: the kernels, weights and arithmetic the engine serves with. The
perplexity is exp of the mean negative log-likelihood of every token of every window given
the tokens before it (the window's first token is context only).

Configurations, all of one model:
  float32        the checkpoint's weights in fp32, fp32 arithmetic (the reference)
  bfloat16       weights and activations in bf16 (what a GPU serves without FP8)
  fp8            FP8 E4M3 linear weights, per-channel scales, quantized at load; bf16
                 arithmetic on the dequantized weights (the FP8 engine's specification, the
                 twin every GPU kernel keeps)
  fp8-w8a8       the same FP8 weights, and each linear layer's input quantized to E4M3 per
                 token: the GPU's FP8 tensor-core path (prefill and decode batches past
                 `gemm_max_rows` rows), emulated on the CPU (`w8a8_linear`)
  fp8-float32    the same FP8 weights in fp32 arithmetic: the weights' own error alone
  fp8-block      a block-wise FP8 checkpoint of the model (128 x 128 blocks, a scale each, as
                 DeepSeek-V3's and Qwen3-FP8's), written to a temporary folder and loaded:
                 each weight's values quantized again per row; bf16 arithmetic
The headline is fp8 / bfloat16 (target: within 2%); fp8-w8a8 / bfloat16 bounds the GPU's
prefill path; fp8-block / bfloat16 is what a block-wise checkpoint costs on top.

Text: each ShareGPT conversation's first human turn and its reply, rendered with the model's
chat template, cut to `--window` tokens; conversations in file order until `--tokens` tokens
are scored. Results print as a table and go to `--out` (JSON) when given.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from slora import Engine, EngineConfig  # noqa: E402
from slora.model.llama import Batch  # noqa: E402

CONFIGS = {  # name -> (dtype, quantization, activations quantized per token)
    "float32": ("float32", None, False),
    "bfloat16": ("bfloat16", None, False),
    "fp8": ("bfloat16", "fp8", False),
    "fp8-w8a8": ("bfloat16", "fp8", True),
    "fp8-float32": ("float32", "fp8", False),
    "fp8-block": ("bfloat16", None, False),
}
BLOCK = (128, 128)  # fp8-block's scale blocks (rows, columns)


def write_block_fp8(src: Path, dst: Path, block=BLOCK) -> Path:
    """The model directory `src` as a block-wise FP8 checkpoint in `dst`: every linear weight
    of the layers in E4M3 with one `weight_scale_inv` per block (its largest magnitude ->
    448), quant_method "fp8" with `weight_block_size`; everything else as it is."""
    import shutil

    from safetensors.torch import load_file, save_file

    from slora.model.loader import LINEAR_PATH
    from slora.model.quant import FP8_DTYPE, FP8_MAX

    r, c = block
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(f))
    for key in [k for k in state if k.endswith(".weight") and LINEAR_PATH.match(k[:-7])]:
        w = state[key].float()
        n, k = w.shape
        pad = torch.zeros(-(-n // r) * r, -(-k // c) * c)
        pad[:n, :k] = w
        blocks = pad.view(pad.shape[0] // r, r, pad.shape[1] // c, c)
        amax = blocks.abs().amax(dim=(1, 3))
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        state[key] = q.view(pad.shape)[:n, :k].contiguous()
        state[key[:-7] + ".weight_scale_inv"] = scale
    save_file(state, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def w8a8_linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The GPU's FP8 tensor-core linear (`kernels.fp8.scaled_mm_linear`) on the CPU: x
    quantized to E4M3 per row (`quantize_rows_ref`), both operands' exact values multiplied
    with fp32 accumulation, the product rounded to x's dtype, then the bias added. A weight
    that is not FP8 (lm_head) runs the plain linear."""
    from slora.kernels.fp8 import quantize_rows_ref
    from slora.model.quant import Fp8Weight, linear

    if not isinstance(w, Fp8Weight):
        return linear(x, w, bias)
    xq, xs = quantize_rows_ref(x)
    out = ((xq.float() * xs) @ w.dequantize(torch.float32).t()).to(x.dtype)
    return out if bias is None else out + bias


def sharegpt_windows(tokenizer, tokens: int, window: int, min_len: int = 16) -> list[list[int]]:
    """Token windows of ShareGPT conversations (chat-templated prompt + reply, at most `window`
    tokens each, at least `min_len`) until `tokens` tokens are scored (a window of n tokens
    scores n - 1)."""
    from slora.workload import sharegpt_conversations

    out, scored = [], 0
    for prompt, reply in sharegpt_conversations():
        chat = [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]
        ids = tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=False),
                               add_special_tokens=False)[:window]
        if len(ids) < min_len:
            continue
        ids = ids[:tokens - scored + 1]
        out.append(ids)
        scored += len(ids) - 1
        if scored >= tokens:
            return out
    raise ValueError(f"ShareGPT holds fewer than {tokens} tokens in windows of {window}")


def window_batch(ids: list[int], block_size: int) -> Batch:
    """One prompt over pool pages 0, 1, ... with the logits of every position: the batch the
    runner builds for a lone prompt, but `logits_index` covering every token."""
    n = len(ids)
    pages = -(-n // block_size)
    q_start = torch.tensor([0, n], dtype=torch.int32)
    return Batch(input_ids=torch.tensor(ids), positions=torch.arange(n),
                 slot_mapping=torch.arange(n), block_tables=torch.arange(pages,
                                                                         dtype=torch.int32)[None],
                 ctx_lens=torch.tensor([n], dtype=torch.int32), ctx_lens_list=[n],
                 q_start_list=[0, n], q_start_tensor=q_start, num_decode=0,
                 logits_index=torch.arange(n), lora=None)


def nll(engine: Engine, windows: list[list[int]]) -> tuple[float, int]:
    """Sum of -log p(token | tokens before it) over every window's tokens after its first, in
    float64, and how many tokens that is. Runs on an idle engine: the pool's pages are free."""
    runner = engine.runner
    total, count = 0.0, 0
    for ids in windows:
        assert -(-len(ids) // runner.block_size) <= runner.num_pages, "window past the pool"
        logits = runner.model.forward(window_batch(ids, runner.block_size), runner.pool)
        logp = torch.log_softmax(logits[:-1].double(), dim=-1)
        target = torch.tensor(ids[1:])
        total -= float(logp.gather(1, target[:, None]).sum())
        count += len(ids) - 1
    return total, count


def measure(model: str | None, windows: list[list[int]] | None, tokens: int, window: int,
            configs=tuple(CONFIGS), log=print) -> dict:
    """{name: {"ppl", "nll", "tokens", "seconds"}} for each configuration, the perplexity
    ratios "fp8_vs_bf16", "block_vs_bf16", "w8a8_vs_bf16" and "fp8_vs_fp32", and how many
    windows."""
    import tempfile

    from slora.model.smollm import default_model_dir

    results: dict = {"model": model or "SmolLM2-135M-Instruct (embedded)", "window": window}
    with tempfile.TemporaryDirectory() as tmp:  # fp8-block's checkpoint
        for name in configs:
            dtype, quantization, w8a8 = CONFIGS[name]
            t0 = time.perf_counter()
            path = model
            if name == "fp8-block":
                path = str(write_block_fp8(Path(model or default_model_dir()), Path(tmp)))
            engine = Engine(EngineConfig(model=path, device="cpu", dtype=dtype,
                                         quantization=quantization))
            if w8a8:
                engine.runner.backend.linear = w8a8_linear
            if windows is None:
                windows = sharegpt_windows(engine.tokenizer, tokens, window)
            total, count = nll(engine, windows)
            engine.close()
            results[name] = {"ppl": math.exp(total / count), "nll": total / count,
                             "tokens": count, "seconds": round(time.perf_counter() - t0, 1)}
            log(f"{name:12s} ppl {results[name]['ppl']:.4f} over {count} tokens "
                f"({results[name]['seconds']} s)")
    results["windows"] = len(windows)
    for key, name, base in (("fp8_vs_bf16", "fp8", "bfloat16"),
                            ("block_vs_bf16", "fp8-block", "bfloat16"),
                            ("w8a8_vs_bf16", "fp8-w8a8", "bfloat16"),
                            ("fp8_vs_fp32", "fp8", "float32")):
        if name in results and base in results:
            results[key] = results[name]["ppl"] / results[base]["ppl"]
    return results


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="HF model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens scored")
    ap.add_argument("--window", type=int, default=512, help="most tokens of one window")
    ap.add_argument("--smoke", action="store_true", help="a quick run: 128 tokens, windows of 64")
    ap.add_argument("--out", type=Path, default=None, help="write the results here (JSON)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.tokens, args.window = 128, 64
    torch.manual_seed(0)
    results = measure(args.model, None, args.tokens, args.window)
    print("perplexity ratios: " + "; ".join(
        f"{key.replace('_vs_', ' / ')} {results[key]:.4f} ({(results[key] - 1) * 100:+.2f}%)"
        for key in ("fp8_vs_bf16", "w8a8_vs_bf16", "block_vs_bf16", "fp8_vs_fp32")))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
