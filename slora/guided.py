"""Guided decoding: outputs held to a regular expression (vLLM's `guided_regex`) or to one of
a list of strings (`guided_choice`, the regex of their alternation). No torch: the sampler
asks `Guide.allowed` for the token ids that may come next and masks the rest.

The pattern compiles to a Thompson NFA over characters, with the nodes that cannot reach the
end removed, so a non-empty set of nodes always has a way to a full match. A state is such a
set (closed under empty moves); steps are made on demand and remembered. A token may come
next when the text it adds (`TokenPieces`) leads to a non-empty state; an end-of-sequence id
when the state holds a full match. The output is the whole of a match (as `re.fullmatch`);
a token whose text is not whole characters (a UTF-8 sequence cut between tokens) or is empty
(a special token) is never allowed.

Regex syntax: literals, `.` (any character but a newline), classes `[a-z_]`, `[^...]`, the
escapes `\\d \\w \\s` (ASCII, their capitals negated), `\\n \\t \\r \\f \\v \\xhh \\uhhhh` and escaped
metacharacters, groups `(...)`, `(?:...)`, `(?P<name>...)`, alternation `|`, and the
quantifiers `* + ? {n} {n,} {n,m}` (lazy `?` after them means the same here). A leading `^`
and a trailing `$` are accepted. Anything else (backreferences, lookaround, flags) is a
ValueError naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ANY_BUT_NEWLINE = (True, (("\n", "\n"),))  # (negated, ranges)
_CLASSES = {"d": (False, (("0", "9"),)),
            "w": (False, (("0", "9"), ("A", "Z"), ("_", "_"), ("a", "z"))),
            "s": (False, ((" ", " "), ("\t", "\r")))}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
_MAX_REPEAT = 1000


def _matches(cls, ch: str) -> bool:
    negated, ranges = cls
    return any(lo <= ch <= hi for lo, hi in ranges) != negated


def _empty(cls) -> bool:
    """Whether a class matches no character: no ranges, or negated ranges covering them all."""
    negated, ranges = cls
    if not negated:
        return not ranges
    covered = 0  # code points 0 .. covered - 1 lie in some range
    for lo, hi in sorted(ranges):
        if ord(lo) > covered:
            return False
        covered = max(covered, ord(hi) + 1)
    return covered > 0x10FFFF


class _Parser:
    """A pattern -> an AST of tuples: ("chars", cls), ("cat", [..]), ("alt", [..]),
    ("repeat", node, lo, hi or None)."""

    def __init__(self, pattern: str) -> None:
        self.p, self.i = pattern, 0

    def fail(self, why: str):
        raise ValueError(f"guided_regex {self.p!r}: {why} at position {self.i}")

    def parse(self):
        if self.p.startswith("^"):
            self.i = 1
        node = self.alt()
        if self.i < len(self.p):
            self.fail(f"unexpected {self.p[self.i]!r}")
        return node

    def peek(self) -> str | None:
        return self.p[self.i] if self.i < len(self.p) else None

    def alt(self):
        options = [self.cat()]
        while self.peek() == "|":
            self.i += 1
            options.append(self.cat())
        return options[0] if len(options) == 1 else ("alt", options)

    def cat(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            if self.p[self.i] == "$" and self.i == len(self.p) - 1:
                self.i += 1
                break
            items.append(self.quantified(self.atom()))
        return ("cat", items)

    def quantified(self, node):
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                node = ("repeat", node, 1 if c == "+" else 0, 1 if c == "?" else None)
            elif c == "{" and (m := re.match(r"\{(\d+)(,(\d*))?\}", self.p[self.i:])):
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if (hi is not None and hi < lo) or max(lo, hi or 0) > _MAX_REPEAT:
                    self.fail(f"bad repeat {m.group(0)} (at most {_MAX_REPEAT})")
                self.i += len(m.group(0))
                node = ("repeat", node, lo, hi)
            else:
                return node
            if self.peek() == "?":  # lazy: the same set of matches
                self.i += 1

    def atom(self):
        c = self.p[self.i]
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i):
                end = self.p.find(">", self.i)
                if end < 0:
                    self.fail("unterminated group name")
                self.i = end + 1
            elif self.peek() == "?":
                self.fail("lookaround, flags and other (?...) groups are not supported")
            node = self.alt()
            if self.peek() != ")":
                self.fail("missing )")
            self.i += 1
            return node
        if c == "[":
            return ("chars", self.char_class())
        if c == ".":
            return ("chars", _ANY_BUT_NEWLINE)
        if c == "\\":
            return ("chars", self.escape(in_class=False))
        if c in "*+?{":
            self.fail(f"nothing to repeat before {c!r}")
        if c == ")":
            self.fail("unbalanced )")
        return ("chars", (False, ((c, c),)))

    def escape(self, in_class: bool):
        if self.i >= len(self.p):
            self.fail("trailing backslash")
        c = self.p[self.i]
        self.i += 1
        if c.lower() in _CLASSES:
            negated, ranges = _CLASSES[c.lower()]
            return (negated != c.isupper(), ranges)
        if c in _ESCAPES:
            ch = _ESCAPES[c]
        elif c in "xu":
            n = 2 if c == "x" else 4
            digits = self.p[self.i:self.i + n]
            if not re.fullmatch(r"[0-9a-fA-F]{%d}" % n, digits):
                self.fail(f"bad \\{c} escape")
            self.i += n
            ch = chr(int(digits, 16))
        elif c.isalnum():
            self.fail(f"\\{c} is not supported (backreferences, \\b and other escapes)")
        else:
            ch = c
        return (False, ((ch, ch),))

    def char_class(self):
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges, first = [], True
        while True:
            c = self.peek()
            if c is None:
                self.fail("missing ]")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            if c == "\\":
                self.i += 1
                sub_negated, sub = self.escape(in_class=True)
                if sub_negated:
                    self.fail("negated classes (\\D, \\W, \\S) inside [...] are not supported")
                if len(sub) > 1 or sub[0][0] != sub[0][1]:
                    ranges += sub
                    continue
                lo = sub[0][0]
            else:
                self.i += 1
                lo = c
            if self.peek() == "-" and self.i + 1 < len(self.p) and self.p[self.i + 1] != "]":
                self.i += 1
                hi = self.p[self.i]
                self.i += 1
                if hi == "\\":
                    sub_negated, sub = self.escape(in_class=True)
                    hi = sub[0][0]
                if hi < lo:
                    self.fail(f"bad range {lo}-{hi}")
                ranges.append((lo, hi))
            else:
                ranges.append((lo, lo))
        return (negated, tuple(ranges))


class Regex:
    """A compiled pattern: its NFA and the states reached so far (see the module
    docstring). `start` is the state before any text; `step(state, text)` the state after
    `text` (an empty frozenset: no match can follow)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.eps: list[list[int]] = []
        self.edges: list[list[tuple[tuple, int]]] = []
        start, end = self._build(_Parser(pattern).parse())
        self.accept = end
        live = self._co_reachable(end)
        self._live = live
        self.start = self._closure({start} & live)
        self._steps: dict[tuple[frozenset, str], frozenset] = {}

    def _node(self) -> int:
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def _build(self, node) -> tuple[int, int]:
        kind = node[0]
        if kind == "chars":
            a, b = self._node(), self._node()
            if not _empty(node[1]):  # (a class of no character: no edge, a dead branch)
                self.edges[a].append((node[1], b))
            return a, b
        if kind == "cat":
            a = b = self._node()
            for item in node[1]:
                s, e = self._build(item)
                self.eps[b].append(s)
                b = e
            return a, b
        if kind == "alt":
            a, b = self._node(), self._node()
            for option in node[1]:
                s, e = self._build(option)
                self.eps[a].append(s)
                self.eps[e].append(b)
            return a, b
        _, sub, lo, hi = node  # repeat: lo copies, then hi - lo optional ones (or a loop)
        a = b = self._node()
        for _ in range(lo):
            s, e = self._build(sub)
            self.eps[b].append(s)
            b = e
        if hi is None:
            s, e = self._build(sub)
            self.eps[b].append(s)
            self.eps[e].append(s)
            end = self._node()
            self.eps[b].append(end)
            self.eps[e].append(end)
            return a, end
        end = self._node()
        for _ in range(hi - lo):
            s, e = self._build(sub)
            self.eps[b].append(s)
            self.eps[b].append(end)
            b = e
        self.eps[b].append(end)
        return a, end

    def _co_reachable(self, end: int) -> set[int]:
        """The nodes from which `end` can be reached (every edge's class matches some
        character)."""
        back: list[list[int]] = [[] for _ in self.eps]
        for n in range(len(self.eps)):
            for m in self.eps[n]:
                back[m].append(n)
            for _, m in self.edges[n]:
                back[m].append(n)
        seen, todo = {end}, [end]
        while todo:
            for n in back[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    def _closure(self, nodes: set[int]) -> frozenset:
        seen, todo = set(nodes), list(nodes)
        while todo:
            for m in self.eps[todo.pop()]:
                if m not in seen and m in self._live:
                    seen.add(m)
                    todo.append(m)
        return frozenset(seen)

    def step(self, state: frozenset, text: str) -> frozenset:
        for ch in text:
            if not state:
                return state
            key = (state, ch)
            nxt = self._steps.get(key)
            if nxt is None:
                nxt = self._closure({m for n in state for cls, m in self.edges[n]
                                     if m in self._live and _matches(cls, ch)})
                self._steps[key] = nxt
            state = nxt
        return state

    def accepts(self, state: frozenset) -> bool:
        return self.accept in state


def choice_pattern(choices) -> str:
    """The regex matching exactly one of `choices`."""
    return "(?:" + "|".join(re.escape(c) for c in choices) + ")"


class TokenPieces:
    """The text each token adds to an output: `first[t]` as its first token, `mid[t]` after
    others (read by decoding it after an anchor token: a tokenizer may write a token's
    leading space only mid-text). None where the text is not whole characters or is empty.
    `by_char`: the tokens grouped by the first character of their text, mid-text and first,
    so a state rules out a whole group with one step."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        anchor = tokenizer.encode("a", add_special_tokens=False)[-1:]
        base = tokenizer.decode(anchor)
        ids = list(range(vocab_size))
        first = tokenizer.decode_batch([[t] for t in ids])
        mid = [text[len(base):] if text.startswith(base) else None
               for text in tokenizer.decode_batch([anchor + [t] for t in ids])]
        whole = lambda s: s if s and "\ufffd" not in s else None  # noqa: E731
        self.first = [whole(s) for s in first]
        self.mid = [whole(s) for s in mid]
        self.by_char = {}
        for which, pieces in (("first", self.first), ("mid", self.mid)):
            groups: dict[str, list[int]] = {}
            for t, s in enumerate(pieces):
                if s is not None:
                    groups.setdefault(s[0], []).append(t)
            self.by_char[which] = groups


class Grammar:
    """A pattern compiled for one tokenizer: its Regex, the tokenizer's pieces, the
    end-of-sequence ids, and the allowed ids of each state met (shared by its guides)."""

    def __init__(self, pattern: str, pieces: TokenPieces, eos: tuple[int, ...]) -> None:
        self.regex = Regex(pattern)
        self.pieces = pieces
        self.eos = tuple(eos)
        self.masks: dict[tuple[frozenset, bool], list[int]] = {}


@dataclass
class Guide:
    """One request's progress through `grammar`: `allowed(ids)` gives the token ids that may
    follow the output `ids` (each a token it allowed), the end-of-sequence ids included once
    the output is a full match."""

    grammar: Grammar
    _state: frozenset | None = None
    _done: int = 0  # output tokens folded into _state

    def __post_init__(self) -> None:
        self._state = self.grammar.regex.start

    def allowed(self, ids: list[int]) -> list[int]:
        g = self.grammar
        if len(ids) < self._done:  # (a shorter output: start over)
            self._state, self._done = g.regex.start, 0
        for t in ids[self._done:]:
            piece = (g.pieces.first if self._done == 0 else g.pieces.mid)[t]
            self._state = g.regex.step(self._state, piece) if piece else frozenset()
            self._done += 1
        key = (self._state, self._done == 0)
        mask = g.masks.get(key)
        if mask is None:
            mask = g.masks[key] = self._mask(*key)
        return mask

    def _mask(self, state: frozenset, first: bool) -> list[int]:
        g, which = self.grammar, "first" if first else "mid"
        pieces, step = getattr(g.pieces, which), g.regex.step
        out = [t for ch, group in g.pieces.by_char[which].items() if step(state, ch)
               for t in group if step(state, pieces[t])]
        if g.regex.accepts(state):
            out += [t for t in g.eos if t not in out]
        return sorted(out)

    @property
    def pattern(self) -> str:
        return self.grammar.regex.pattern
