"""Tokenizer: Hugging Face `tokenizer.json` through the `tokenizers` library, chat templates
from `tokenizer_config.json` rendered with jinja2 (no transformers at run time)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    """A model directory's tokenizer.json, its chat template and its end-of-sequence ids: those
    given (`eos_token_ids`: the model config's) plus the id of tokenizer_config.json's
    eos_token."""

    def __init__(self, path: str | Path, eos_token_ids: tuple[int, ...] = ()) -> None:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"model directory {path}: no tokenizer.json (slora reads "
                                    "tokenizers in the Hugging Face fast format)")
        self._tok = _HFTokenizer.from_file(str(file))
        conf_file = path / "tokenizer_config.json"
        conf = json.loads(conf_file.read_text()) if conf_file.is_file() else {}
        self.chat_template = conf.get("chat_template")
        self.bos_token = self._token_text(conf.get("bos_token"))
        self.eos_token = self._token_text(conf.get("eos_token"))
        eos = set(eos_token_ids)
        if self.eos_token and self._tok.token_to_id(self.eos_token) is not None:
            eos.add(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids = tuple(sorted(eos))

    @staticmethod
    def _token_text(tok) -> str | None:
        return tok.get("content") if isinstance(tok, dict) else tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return self._tok.decode_batch(batch, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            variables: dict | None = None) -> str:
        """Render the model's chat template (in jinja's sandbox, as HF does; `variables`: more
        it may read, such as Qwen3's enable_thinking); without one, join the
        contents line by line. `continue_final_message`: the text ends with the last
        message's content (its end-of-turn cut), for the model to continue it."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt exclude each "
                             "other: set add_generation_prompt to false")
        if not self.chat_template:
            text = "\n".join(m["content"] for m in messages)
            return text + "\n" if add_generation_prompt else text
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        # what HF's templates use: loop controls, {% generation %} blocks (rendered as they
        # are), a plain `tojson`, `strftime_now`
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols",
                                                        _generation_blocks()])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        text = env.from_string(self.chat_template).render(
            **{**(variables or {}), "messages": messages, "add_generation_prompt": add_generation_prompt,
               "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""})
        if continue_final_message:
            final = (messages[-1]["content"] or "").strip() if messages else ""
            at = text.rfind(final) if final else -1
            if at < 0:
                raise ValueError("continue_final_message: the chat template does not write "
                                 "the last message's content as it stands")
            text = text[:at + len(final)]
        return text


def _generation_blocks():
    """A jinja extension for HF's `{% generation %}...{% endgeneration %}` (which marks the
    assistant's part for training masks): the block renders as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON text as HF's chat templates expect it (jinja's own escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


class IncrementalDecoder:
    """Text of a growing token list at O(new tokens) per step (not a full decode each step).

    Decodes a window from `prefix` (a few tokens of context, so decoders that treat a leading
    token specially see the same start both times) and keeps what the last `read` tokens
    added; a trailing U+FFFD (a UTF-8 sequence cut between tokens) waits for the next token.
    Special tokens are left out of the text unless `skip_special_tokens` is False.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self.prefix = 0
        self.read = 0

    def update(self, ids: list[int]) -> str:
        decode, skip = self.tokenizer.decode, self.skip
        before = decode(ids[self.prefix:self.read], skip)
        now = decode(ids[self.prefix:], skip)
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(ids)
        return self.text
