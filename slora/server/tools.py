"""Tool calls in chat completions (OpenAI's `tools` and `tool_choice`, vLLM's rules).

The request's tools go to the chat template (its `tools` variable). What the answer does with
the output follows `tool_choice`:

- "none": the output is the message's content, as without tools.
- "auto" (the default when tools are given and the server has a `--tool-call-parser`): the
  model decides; the parser finds its calls in the text, and text that does not parse as
  calls stays content. Without a parser, "auto" is refused (vLLM's rule).
  - `hermes` (Hermes, Qwen 2.5 and 3, and most templates that write `<tool_call>`): each
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` is a call, the text before the
    first one the content.
  - `llama3_json` (Llama 3.1 to 3.3's JSON tool calls): an output that is a JSON object
    `{"name": ..., "parameters": {...}}` (or several, joined by `;`) is calls, with no content.
  - `mistral` (Mistral's `[TOOL_CALLS]` token, which the output then keeps: special tokens are
    not skipped in such a request): `[TOOL_CALLS]` followed by a JSON list of
    `{"name": ..., "arguments": {...}}`, or by `NAME[ARGS]{...}` (newer tokenizers; each
    further call after another `[TOOL_CALLS]`), the text before the first the content.
  - `granite` (Granite 3's `<|tool_call|>`, a special token kept as Mistral's is) followed by
    a JSON list of `{"name": ..., "arguments": {...}}`, the text before it the content.
  - `pythonic` (Llama 3.2 and 4's, and others'): an output that is a Python list of calls
    with literal keyword arguments, `[get_weather(city="Paris"), get_time(zone="UTC")]`, is
    calls, with no content.
  - `openai` (gpt-oss's harmony format; its markers are special tokens, kept as Mistral's
    are): each `commentary` message to `functions.NAME` (the recipient before or after the
    channel, `<|constrain|>json` or not) is a call of NAME, its message the arguments, the
    text before the first the content. With `--reasoning-parser gpt_oss` the analysis
    message is the reasoning.
- "required": guided decoding holds the output to a JSON array of one or more
  `{"name": <a tool's name>, "parameters": <its parameters schema>}`; each item is a call.
- {"type": "function", "function": {"name": N}}: the output is N's arguments, guided by its
  parameters schema; the answer is that one call (finish_reason "stop", as OpenAI answers a
  forced call).

Calls get ids "call_" + 24 hex digits; their arguments are JSON text. With calls made by the
model ("auto", "required") the finish_reason is "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from slora.server.errors import APIError
from slora.server.generation import holdback
from slora.server.settings import PARSERS

_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
HERMES_START = "<tool_call>"
MISTRAL_START = "[TOOL_CALLS]"
GRANITE_START = "<|tool_call|>"
# a harmony commentary message to a function: (recipient before the channel, recipient after
# it, the message)
_HARMONY = re.compile(r"(?:to=functions\.([^\s<]+)\s*)?<\|channel\|>commentary\s*"
                      r"(?:to=functions\.([^\s<]+))?[^<]*(?:<\|constrain\|>[^<]*)?"
                      r"<\|message\|>(.*?)(?:<\|call\|>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolChoice:
    """What a chat request does with its output (see the module docstring). `mode`: none,
    auto, required or named; `name`: the named tool; `schema`: the guided JSON schema of
    "required" and named calls (None otherwise); `single`: at most one call
    (parallel_tool_calls false)."""

    mode: str
    name: str | None = None
    schema: dict | None = None
    single: bool = False
    parser: str = "hermes"  # (auto's)

    @classmethod
    def of(cls, tools: list | None, tool_choice, parallel: bool, parser: str | None,
           guided: bool) -> "ToolChoice":
        """The request's choice; APIError 400 naming the field for a malformed tool, an
        unknown named tool, "auto" without a parser, or guided decoding beside a call the
        server guides itself."""
        functions = {}
        for i, tool in enumerate(tools or []):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if (tool.get("type", "function") != "function" or not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str) or not fn["name"]
                    or not isinstance(fn.get("parameters", {}), dict)):
                raise APIError(400, 'a tool is {"type": "function", "function": {"name": ..., '
                               '"parameters": {JSON Schema}}}', f"tools.{i}")
            functions[fn["name"]] = fn.get("parameters") or {"type": "object"}
        if tool_choice is None:
            tool_choice = "auto" if functions and parser else "none"
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            if tool_choice.get("type") != "function" or name not in functions:
                raise APIError(400, f"tool_choice names function {name!r}, which is not among "
                               f"the tools {sorted(functions)}", "tool_choice")
            mode, schema = "named", functions[name]
        elif tool_choice in ("none", "auto", "required"):
            mode, name, schema = tool_choice, None, None
        else:
            raise APIError(400, f"tool_choice {tool_choice!r}: expected none, auto, required "
                           "or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           "tool_choice")
        if mode != "none" and not functions:
            raise APIError(400, f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        if mode == "auto" and parser is None:
            raise APIError(400, "tool_choice auto needs the server started with "
                           f"--tool-call-parser (one of {', '.join(PARSERS)})", "tool_choice")
        if mode == "required":
            items = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                      "required": ["name", "parameters"]} for n, p in functions.items()]
            schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1,
                      **({"maxItems": 1} if not parallel else {})}
        if schema is not None and guided:
            raise APIError(400, f"tool_choice {tool_choice!r} guides the output itself: leave "
                           "out guided_* and response_format", "tool_choice")
        return cls(mode, name, schema, not parallel, parser or "hermes")

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def sendable(self, text: str) -> int:
        """How much of a streamed output may go out as content: all of it without calls to
        find; before the first call (and before what may begin one) with "auto"; none of
        it when the whole output is a call."""
        if self.mode == "none":
            return len(text)
        if self.mode != "auto":
            return 0
        if self.parser in WHOLE:  # a call is the whole output: wait for its start
            start = WHOLE[self.parser]
            return 0 if not text.strip() or text.lstrip().startswith(start) else len(text)
        markers = MARKERS[self.parser]
        at = min((text.find(m) for m in markers if m in text), default=-1)
        return at if at >= 0 else holdback(text, markers)

    def split(self, text: str) -> tuple[str | None, list[dict], str | None]:
        """(content, calls, finish_reason or None to keep the output's) of a finished
        output."""
        if self.mode == "none":
            return text, [], None
        if self.mode == "named":
            return None, [_call(self.name, text)], None
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:  # (cut by max_tokens)
                return text, [], None
            return None, [_call(c["name"], json.dumps(c["parameters"])) for c in items], \
                "tool_calls"
        try:
            at, found = _PARSE[self.parser](text)
        except (ValueError, SyntaxError, KeyError, TypeError, AttributeError):
            return text, [], None  # not calls after all: the text is the content
        if not found:
            return text, [], None
        calls = [_call(name, args if isinstance(args, str) else json.dumps(args))
                 for name, args in found]
        content = text[:at].strip() or None
        return content, calls[:1] if self.single else calls, "tool_calls"


def _json_call(body: str) -> tuple[str, object]:
    call = json.loads(body.strip())
    return call["name"], call.get("arguments", call.get("parameters", {}))


def _json_list(text: str) -> list[tuple[str, object]]:
    """The calls of a JSON list of {"name": ..., "arguments": {...}}."""
    return [(c["name"], c.get("arguments", {})) for c in json.loads(text)]


def _hermes(text: str):
    at = text.find(HERMES_START)
    return at, [_json_call(b) for b in (_HERMES.findall(text[at:]) if at >= 0 else [])]


def _llama3_json(text: str):
    bodies = text.strip().split(";") if text.lstrip().startswith("{") else []
    return 0, [_json_call(b) for b in bodies]


def _mistral(text: str):
    at = text.find(MISTRAL_START)
    if at < 0:
        return at, []
    found = []
    for part in text[at:].split(MISTRAL_START)[1:]:
        part = part.strip()
        if part.startswith("["):  # a JSON list of calls
            found += _json_list(part)
        else:  # NAME[ARGS]{...}
            name, args = part.split("[ARGS]", 1)
            found.append((name.strip(), json.loads(args)))
    return at, found


def _granite(text: str):
    at = text.find(GRANITE_START)
    if at < 0:
        return at, []
    return at, _json_list(text[at + len(GRANITE_START):])


def _openai(text: str):
    """Harmony's calls: each commentary message with a `functions.` recipient (a commentary
    message to no function, a preamble, is not one)."""
    found = [(m.start(), m.group(1) or m.group(2), m.group(3)) for m in _HARMONY.finditer(text)
             if m.group(1) or m.group(2)]
    if not found:
        return -1, []
    return found[0][0], [(name, json.loads(args)) for _, name, args in found]


def _pythonic(text: str):
    """A Python list of calls with literal keyword arguments (ValueError or SyntaxError when
    the output is not one)."""
    import ast

    if not text.lstrip().startswith("["):
        return 0, []
    tree = ast.parse(text.strip(), mode="eval").body
    if not isinstance(tree, ast.List) or not all(
            isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and not c.args
            for c in tree.elts):
        raise ValueError("not a list of calls with keyword arguments")
    return 0, [(c.func.id, {k.arg: ast.literal_eval(k.value) for k in c.keywords})
               for c in tree.elts]


# parser -> text -> (where the calls begin, [(name, arguments)]): the calls found, if any
_PARSE = {"hermes": _hermes, "llama3_json": _llama3_json, "mistral": _mistral,
          "granite": _granite, "pythonic": _pythonic, "openai": _openai}
# the other parsers: the markers their calls may begin with, after any content
MARKERS = {"hermes": (HERMES_START,), "mistral": (MISTRAL_START,), "granite": (GRANITE_START,),
           "openai": ("to=functions.", "<|channel|>commentary")}
# the parsers whose markers are special tokens of its model: a request they parse keeps special
# tokens in its text
SPECIAL_MARKERS = ("mistral", "granite", "openai")
# the parsers whose calls are the whole output, and how such an output begins
WHOLE = {"llama3_json": "{", "pythonic": "["}


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
