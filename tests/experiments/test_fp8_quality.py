"""experiments/fp8_quality.py: its perplexities are HF transformers' on the same windows (the
engine's forward scores every position as HF's does), and its smoke run reports every
configuration over ShareGPT text."""

from __future__ import annotations

import json
import math

import pytest
import torch

from slora.model import quant
from tests.conftest import CORPUS


def hf_nll(model_dir, windows, fp8: bool) -> float:
    """Mean -log p(token | before) over the windows by HF transformers in fp32, its linear
    weights replaced by their FP8 round trip when `fp8`."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    if fp8:
        with torch.no_grad():
            for name, mod in model.named_modules():
                if isinstance(mod, torch.nn.Linear) and name.split(".")[-1].endswith("_proj"):
                    mod.weight.copy_(quant.round_trip(mod.weight))
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in windows:
            logits = model(torch.tensor([ids])).logits[0, :-1].double()
            logp = torch.log_softmax(logits, -1)
            total -= float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum())
            count += len(ids) - 1
    return total / count


def test_perplexity_equals_transformers(experiment, tiny_models):
    fq = experiment("fp8_quality")
    model = tiny_models("llama")
    from slora.tokenizer import Tokenizer

    tok = Tokenizer(str(model), (1,))
    windows = [tok.encode(text, add_special_tokens=False)[:40] for text in CORPUS[:4]]
    res = fq.measure(str(model), windows, tokens=0, window=40,
                     configs=("float32", "fp8-float32"), log=lambda *_: None)
    assert res["float32"]["nll"] == pytest.approx(hf_nll(model, windows, fp8=False), rel=1e-5)
    assert res["fp8-float32"]["nll"] == pytest.approx(hf_nll(model, windows, fp8=True), rel=1e-5)
    # the round trip changes the weights, so the perplexity too
    assert res["fp8-float32"]["nll"] != res["float32"]["nll"]


def test_smoke_run_reports_every_configuration(experiment, tiny_models, tmp_path, capsys):
    fq = experiment("fp8_quality")
    out = tmp_path / "fp8_quality.json"
    res = fq.main(["--smoke", "--model", str(tiny_models("llama")), "--out", str(out)])
    for name in fq.CONFIGS:
        assert res[name]["tokens"] == 128
        assert math.isfinite(res[name]["ppl"]) and res[name]["ppl"] > 1
    assert res["fp8_vs_bf16"] == pytest.approx(res["fp8"]["ppl"] / res["bfloat16"]["ppl"])
    assert res["w8a8_vs_bf16"] == pytest.approx(res["fp8-w8a8"]["ppl"] / res["bfloat16"]["ppl"])
    assert res["fp8_vs_fp32"] == pytest.approx(res["fp8"]["ppl"] / res["float32"]["ppl"])
    assert res["block_vs_bf16"] == pytest.approx(res["fp8-block"]["ppl"]
                                                 / res["bfloat16"]["ppl"])
    # the block-wise checkpoint's weights are not the model's: it was written and loaded
    assert res["fp8-block"]["nll"] not in (res["bfloat16"]["nll"], res["fp8"]["nll"])
    # quantized activations change the logits: the emulated GPU path really ran
    assert res["fp8-w8a8"]["nll"] != res["fp8"]["nll"]
    assert json.loads(out.read_text()) == res
    assert f"fp8 / bf16 {res['fp8_vs_bf16']:.4f}" in capsys.readouterr().out
