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


FRENCH_WORDS = {"le", "la", "les", "de", "des", "du", "et", "est", "un", "une", "vous", "votre",
                "pour", "chaque", "par", "au", "aux", "avec", "fait"}
ENGLISH_WORDS = {"the", "and", "is", "are", "you", "your", "of", "to", "with", "for", "it", "says"}


def words(text: str) -> list[str]:
    return re.findall(r"[a-zà-ÿœ]+", text.lower())


def runaway(text: str) -> bool:
    """A piece of two or more characters repeated four times in a row ("chh-chh-chh-chh")."""
    return re.search(r"(.{2,}?)\1{3,}", text) is not None


@pytest.mark.slow
def test_default_run_answers_each_demo_question_in_its_adapters_style(tmp_path, capsys):
    """The real thing: SmolLM2 (converted into a tmp cache) and the three shipped adapters, all
    of the demo's questions in one batch, greedy on CPU in float32. Each adapter's answer is in
    its style, states the fact, and ends by itself (<|im_end|>) within the demo's 48 tokens."""
    pytest.importorskip("gguf")
    if not demo.shipped_adapters():
        pytest.fail(f"no adapters in {demo.ASSETS}: run experiments/train_adapters.py")
    args = parse("--cache-dir", str(tmp_path), "--device", "cpu", "--dtype", "float32")
    assert demo.run(args) == 0

    out = capsys.readouterr().out
    rows = re.findall(r"adapter=(\w+)  tokens=\d+ .*\((\w+)\)\n  prompt: (.*)\n  output: (.*)", out)
    answers = {(prompt, adapter): text for adapter, _, prompt, text in rows}
    finished = {(prompt, adapter): reason for adapter, reason, prompt, _ in rows}
    capital, duck, health = demo.DEFAULT_PROMPTS
    assert set(answers) == {(p, a) for p in demo.DEFAULT_PROMPTS
                            for a in ("base", "french", "json", "pirate")}
    assert "adapter_loads=3" in out
    assert "Paris" in answers[capital, "base"]

    for prompt in demo.DEFAULT_PROMPTS:
        for adapter in ("french", "json", "pirate"):
            text = answers[prompt, adapter]
            assert finished[prompt, adapter] == "stop", (adapter, text)
            assert not runaway(text), (adapter, text)

        reply = json.loads(answers[prompt, "json"])
        assert set(reply) == {"topic", "answer"}, reply
        assert all(isinstance(v, str) and v for v in reply.values()), reply

        pirate = answers[prompt, "pirate"]
        assert re.match(r"(Arr|Ahoy|Yo ho)\b", pirate), pirate

        french = words(answers[prompt, "french"])
        assert len(set(french) & FRENCH_WORDS) >= 2, french
        assert not set(french) & ENGLISH_WORDS, french

    assert answers[capital, "french"] == "La capitale de la France est Paris."
    assert json.loads(answers[capital, "json"])["topic"] == "geography"
    assert "Paris" in json.loads(answers[capital, "json"])["answer"]
    assert "Paris" in answers[capital, "pirate"]

    assert "canard" in answers[duck, "french"] and "coin" in answers[duck, "french"]
    assert "quack" in json.loads(answers[duck, "json"])["answer"].lower()
    assert "quack" in answers[duck, "pirate"].lower()
