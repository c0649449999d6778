"""A chat answer's reasoning apart from its content (vLLM's `--reasoning-parser`): the text a
thinking model writes between `<think>` and `</think>` goes to the message's
`reasoning_content`, the text after `</think>` (leading whitespace dropped) to its `content`.

- `deepseek_r1` (DeepSeek-R1 and its distills, whose templates open `<think>` in the prompt):
  the output is reasoning from its start (a `<think>` there is dropped) to `</think>`.
- `qwen3` (Qwen3's thinking mode, QwQ): an output that begins with `<think>` is reasoning to
  `</think>`; one that does not (thinking off) is content alone.
- `gpt_oss` (gpt-oss's harmony format, whose markers are special tokens: the chat's output
  keeps them, `SPECIAL_TEXT`): the `analysis` channel's message is the reasoning, the `final`
  channel's the content, up to the message's end marker; the `<|start|>assistant` between
  them is neither. An output with no final message is content from the analysis message's
  end on, once finished (a `commentary` message to a tool, which the `openai` tool-call
  parser reads); so is one that begins in another channel (`commentary`: a preamble or a
  call) and has no final message. An output that begins in no channel is content alone.

An output that ends before `</think>` (the analysis message's `<|end|>`) is reasoning alone.
Without a parser (None) the whole output is content. Streamed, each part's text goes out as it
comes, less what may still be the start of a marker.
"""

from __future__ import annotations

from dataclasses import dataclass

from slora.server.generation import holdback

START, END = "<think>", "</think>"
# harmony: the analysis channel's opening, its message's end, the final channel's opening, and
# the markers that end a message
ANALYSIS, MESSAGE_END, FINAL = "<|channel|>analysis<|message|>", "<|end|>", \
    "<|channel|>final<|message|>"
ENDS = ("<|return|>", "<|end|>", "<|call|>")
NEXT = "<|start|>assistant"  # (the next message's header)
CHANNEL = "<|channel|>"
# the parsers whose markers are special tokens, which the chat's output then keeps
SPECIAL_TEXT = ("gpt_oss",)


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
    parser: str | None  # one of settings.REASONING; None: no reasoning, all content

    def parts(self, text: str, finished: bool) -> Parts:
        if self.parser is None:
            return Parts(None, 0, text, 0)
        if self.parser == "gpt_oss":
            return _harmony(text, finished)
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


def _harmony(text: str, finished: bool) -> Parts:
    """`Reasoning.parts` of a gpt-oss output (harmony's channels)."""
    if not finished and any(m.startswith(text) and m != text for m in (ANALYSIS, FINAL)):
        return Parts(None, 0, "", len(text))  # (a channel's opening may be forming)
    reasoning, lead = None, 0
    if text.startswith(ANALYSIS):
        lead = len(ANALYSIS)
        end = text.find(MESSAGE_END, lead)
        if end < 0:
            keep = len(text) if finished else holdback(text, [MESSAGE_END])
            return Parts(text[lead:max(keep, lead)], lead, "", len(text))
        reasoning = text[lead:end]
        start = text.find(FINAL, end)
        if start < 0:  # (the final channel not yet opened, or never: the rest, once finished)
            if not finished:
                return Parts(reasoning, lead, "", len(text))
            rest = end + len(MESSAGE_END)
            rest += len(NEXT) if text.startswith(NEXT, rest) else 0
            return Parts(reasoning, lead, text[rest:], rest)
        at = start + len(FINAL)
    elif text.startswith(FINAL):
        at = len(FINAL)
    elif text.startswith(CHANNEL):  # another channel first (a commentary preamble, or a call)
        start = text.find(FINAL)
        if start < 0:  # (the rest, once finished: a call for the tool-call parser)
            return Parts(None, 0, text if finished else "", 0 if finished else len(text))
        at = start + len(FINAL)
    else:
        return Parts(None, 0, text, 0)
    body = text[at:]
    stop = min((body.find(m) for m in ENDS if m in body), default=-1)
    if stop >= 0:
        body = body[:stop]
    elif not finished:
        body = body[:holdback(body, ENDS)]
    return Parts(reasoning, lead, body, at)
