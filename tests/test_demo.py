"""`slora generate` (slora.demo): argument parsing, one mixed batch, the printed report."""

import argparse
import importlib.util
import json
import random
import re
from pathlib import Path

import pytest

from slora import demo
from slora.engine import Engine


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(argv)


def test_adapter_option_needs_name_equals_path(capsys):
    with pytest.raises(SystemExit):
        parse("--adapter", "no-equals-sign")
    assert "NAME=PATH" in capsys.readouterr().err


def test_run_mixes_base_and_adapters_in_one_generate_call(tiny_model_dir, adapter_factory,
                                                          monkeypatch, capsys):
    qv = adapter_factory(tiny_model_dir, r=4, target_modules=["q_proj", "v_proj"])
    mlp = adapter_factory(tiny_model_dir, r=8, target_modules=["gate_proj", "down_proj"], seed=1)
    calls = []
    generate = Engine.generate
    monkeypatch.setattr(Engine, "generate",
                        lambda self, *a, **k: calls.append(k["adapters"]) or generate(self, *a, **k))

    args = parse("--model", str(tiny_model_dir), "--adapter", f"qv={qv}", "--adapter", f"mlp={mlp}",
                 "--prompt", "Paris is", "--prompt", "Hello world", "--max-tokens", "4",
                 "--device", "cpu", "--no-chat")
    assert demo.run(args) == 0

    assert calls == [[None, "qv", "mlp", None, "qv", "mlp"]]  # one call, base and adapters mixed
    out = capsys.readouterr().out
    blocks = re.findall(r"\[(\d)/6\] adapter=(\w+)  tokens=(\d+)  first token ([\d.]+) s  "
                        r"total ([\d.]+) s", out)
    assert [(b[0], b[1]) for b in blocks] == [
        ("1", "base"), ("2", "qv"), ("3", "mlp"), ("4", "base"), ("5", "qv"), ("6", "mlp")]
    assert all(float(first) <= float(total) for *_, first, total in blocks)
    assert out.count("prompt: Paris is") == 3
    tokens = sum(int(b[2]) for b in blocks)
    assert re.search(rf"6 requests, {tokens} generated tokens in [\d.]+ s = [\d.]+ tok/s", out)
    assert re.search(r"engine stats: .*pages_total=\d+.*adapter_loads=\d+", out)


def _training_script():
    path = Path(__file__).resolve().parents[1] / "experiments" / "train_adapters.py"
    spec = importlib.util.spec_from_file_location("train_adapters", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_adapter_training_holds_out_the_demo_questions():
    """The demo's answers show generalisation only if its questions are held out of training."""
    train = _training_script()
    asked = {ex["question"].lower() for ex in train.examples(random.Random(0))}
    held_out = {q.lower() for q in train.HELD_OUT}
    assert {q.lower() for q in demo.DEFAULT_PROMPTS} <= held_out
    assert not asked & held_out


@pytest.mark.slow
def test_default_run_serves_embedded_model_with_shipped_adapters(tmp_path, capsys):
    """The real thing: SmolLM2 (converted into a tmp cache) and the three shipped adapters, each
    row of one batch answered in its adapter's style (greedy outputs equal PEFT's)."""
    pytest.importorskip("gguf")
    if not demo.shipped_adapters():
        pytest.fail(f"no adapters in {demo.ASSETS}: run experiments/train_adapters.py")
    args = parse("--cache-dir", str(tmp_path), "--device", "cpu", "--max-tokens", "24",
                 "--prompt", "What is the capital of France?")
    assert demo.run(args) == 0

    out = capsys.readouterr().out
    answers = dict(re.findall(r"adapter=(\w+) .*\n  prompt: .*\n  output: (.*)", out))
    assert set(answers) == {"base", "french", "json", "pirate"}
    assert "Paris" in answers["base"]
    assert answers["french"] == "La capitale de la France est Paris."
    assert json.loads(answers["json"]) == {"topic": "geography",
                                           "answer": "The capital of France is Paris."}
    assert answers["pirate"].startswith("Arr") and "Paris" in answers["pirate"]
    assert "adapter_loads=3" in out
