"""A chat answer's reasoning apart from its content (vLLM's `--reasoning-parser`): the text a
thinking model writes between `<think>` and `</think>` goes to the message's
`reasoning_content`, the text after `</think>` (leading whitespace dropped) to its `content`.

- `deepseek_r1` (DeepSeek-R1 and its distills, whose templates open `<think>` in the prompt):
  the output is reasoning from its start (a `<think>` there is dropped) to `</think>`.
- `qwen3` (Qwen3's thinking mode, QwQ): an output that begins with `<think>` is reasoning to
  `</think>`; one that does not (thinking off) is content alone.

An output that ends before `</think>` is reasoning alone. Streamed, each part's text goes out
as it comes, less what may still be the start of a marker.
"""

from __future__ import annotations

from dataclasses import dataclass

from slora.server.generation import holdback

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Parts:
    """An output's text cut into reasoning (None: the output has none) and content, each with
    where it begins in the text; only what is settled (no marker may still be forming)."""

    reasoning: str | None
    reasoning_at: int
    content: str
    content_at: int


@dataclass(frozen=True)
class Reasoning:
    parser: str

    def parts(self, text: str, finished: bool) -> Parts:
        body = text.lstrip()
        lead = len(text) - len(body)
        if not finished and (not body or START.startswith(body) and body != START):
            return Parts(None, 0, "", len(text))  # (a <think> may be forming)
        if body.startswith(START):
            lead += len(START)
        elif self.parser == "qwen3":  # thinking off: all content
            return Parts(None, 0, text, 0)
        else:  # (deepseek_r1: reasoning from the start)
            lead = 0
        end = text.find(END, lead)
        if end < 0:
            keep = len(text) if finished else holdback(text, [END])
            return Parts(text[lead:max(keep, lead)], lead, "", len(text))
        after = end + len(END)
        content = text[after:].lstrip()
        return Parts(text[lead:end], lead, content, len(text) - len(content))
