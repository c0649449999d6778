"""JSON output for guided decoding: a JSON Schema, or any JSON object, as a regular expression
for `slora.guided` (vLLM's `guided_json`, OpenAI's and LoRAX's `response_format`).

The text is compact JSON: no whitespace but one optional space after each `:` and `,`.
Objects list their properties in the schema's order, each required one always, each other
one where the model writes it. The keywords read (anything else is a ValueError naming it):

- `type` (a name or a list of them): object, array, string, integer, number, boolean, null;
- object: `properties`, `required`, `additionalProperties` false or absent (no other keys;
  an object without `properties` is any object unless it is false), `title` and
  `description` (notes for people);
- a map: an object of `additionalProperties` (a schema) without `properties`;
- array: `items`, `prefixItems` (a tuple), `minItems`, `maxItems`;
- string: `minLength`, `maxLength`, `pattern` (a regex of `slora.guided`'s syntax, its
  characters written as they are: one that can match `"` or `\\` can give invalid JSON),
  `format` date, time, date-time, uuid, email, uri or ipv4;
- integer and number: `minimum`, `maximum`, `exclusiveMinimum`, `exclusiveMaximum` (a
  number's bounds integers; a bounded number's text has no exponent);
- `enum`, `const`, `anyOf`/`oneOf` (any of the schemas; a `discriminator` beside them is a
  note), `allOf` of one schema, `$ref` to `#/$defs/...` or `#/definitions/...`, OpenAPI's
  `nullable`, and the empty schema: any JSON value.

A regular expression cannot count brackets without a bound, so the nesting is bounded: any
JSON value nests objects and arrays at most ANY_DEPTH deep, and a recursive `$ref` (a tree, a
linked list) expands at most REF_DEPTH times inside itself; past that its value cannot be
written, so the text takes the schema's other ways out there (an empty array, null, leaving
an optional property out). A schema every text of which recurses deeper is refused.
"""

from __future__ import annotations

import json
import math
import re

ANY_DEPTH = 3
REF_DEPTH = 3
# a class no character is in: a value past REF_DEPTH (guided's NFA drops the branch)
NEVER = f"[^\x00-{chr(0x10FFFF)}]"
WS = "[ ]?"
STRING_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})'
STRING = f'"{STRING_CHAR}*"'
INTEGER = r"-?(?:0|[1-9][0-9]*)"
NUMBER = INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
SCALARS = {"string": STRING, "integer": INTEGER, "number": NUMBER,
           "boolean": "(?:true|false)", "null": "null"}
FORMATS = {"date": r'"\d{4}-\d{2}-\d{2}"', "time": r'"\d{2}:\d{2}:\d{2}(?:\.\d+)?"',
           "date-time": r'"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:\d{2})?"',
           "uuid": r'"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"',
           "email": r'"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"',
           "uri": r'"[A-Za-z][A-Za-z0-9+.-]*:[^"\\\x00-\x20]+"',
           "ipv4": r'"(?:(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])\.){3}'
                   r'(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"'}
_NOTES = {"title", "description", "$schema", "$id", "examples", "default", "$comment",
          "readOnly", "writeOnly", "deprecated", "discriminator"}
_READ = {"type", "properties", "required", "additionalProperties", "items", "minItems",
         "maxItems", "minLength", "maxLength", "pattern", "format", "enum", "const", "anyOf",
         "oneOf", "allOf", "$ref", "$defs", "definitions", "minimum", "maximum",
         "exclusiveMinimum", "exclusiveMaximum", "prefixItems", "nullable"} | _NOTES
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _digits_range(x: str, y: str) -> str:
    """The digit strings of one length from x to y (x <= y, same length), as a regex."""
    if x == y:
        return x
    if len(x) == 1:
        return f"[{x}-{y}]"
    if x[0] == y[0]:
        return x[0] + _digits_range(x[1:], y[1:])
    rest = len(x) - 1
    parts, lo, hi = [], int(x[0]), int(y[0])
    if x[1:] != "0" * rest:  # x's first digit with the rest from x's up
        parts.append(x[0] + _digits_range(x[1:], "9" * rest))
        lo += 1
    tail = y[1:] != "9" * rest
    if tail:
        hi -= 1
    if lo <= hi:
        parts.append((str(lo) if lo == hi else f"[{lo}-{hi}]") + f"[0-9]{{{rest}}}")
    if tail:  # y's first digit with the rest up to y's
        parts.append(y[0] + _digits_range("0" * rest, y[1:]))
    return "(?:" + "|".join(parts) + ")"


def _natural_range(lo: int, hi: int | None) -> str:
    """The decimal texts of the integers lo..hi (0 <= lo; hi None: no bound), without leading
    zeros, as a regex."""
    parts, length = [], len(str(lo))
    while hi is None or length <= len(str(hi)):
        first = max(lo, 10 ** (length - 1) if length > 1 else 0)
        if hi is None and first == 10 ** (length - 1) and length > 1:
            parts.append(f"[1-9][0-9]{{{length - 1},}}")  # every longer text too
            break
        last = 10 ** length - 1 if hi is None else min(hi, 10 ** length - 1)
        if first <= last:
            parts.append(_digits_range(str(first), str(last)))
        length += 1
    return "(?:" + "|".join(parts) + ")"


def _magnitudes(a: int, a_open: bool, b: int | None, b_open: bool, fraction: bool):
    """The texts of the non-negative integers (`fraction` False) or decimals (True) from a to
    b (None: no bound), each end included unless open, as a list of alternatives. A decimal's
    integer part ranges over the integers strictly inside with any fraction; an open low end a
    takes a with a fraction not all zeros, a closed high end b takes b with zeros."""
    if not fraction:
        lo, hi = a + a_open, None if b is None else b - b_open
        return [_natural_range(lo, hi)] if hi is None or lo <= hi else []
    frac = r"(?:\.[0-9]+)?"
    inner_hi = None if b is None else b - 1
    out = []
    if inner_hi is None or a + a_open <= inner_hi:
        out.append(_natural_range(a + a_open, inner_hi) + frac)
    if a_open and (b is None or b > a):
        out.append(rf"{a}\.[0-9]*[1-9][0-9]*")
    if b is not None and not b_open and (b > a or not a_open):
        out.append(rf"{b}(?:\.0+)?")
    return out


def _bounded(lo, lo_open: bool, hi, hi_open: bool, fraction: bool) -> str | None:
    """The texts of the integers (`fraction` False) or decimals (True) between lo and hi
    (integers, or None: no bound; an open end excluded), as a regex; None where there are
    none. Non-negative values, then negative ones as "-" and their magnitudes (a "-0" may or
    may not be among them: it equals 0)."""
    parts = []
    if hi is None or hi > 0 or hi == 0 and not hi_open:
        low_ok = lo is not None and lo >= 0
        parts += _magnitudes(lo if low_ok else 0, lo_open and low_ok, hi, hi_open, fraction)
    if lo is None or lo < 0:
        top = None if lo is None else -lo
        if hi is not None and (hi < 0 or hi == 0 and hi_open):
            parts += ["-" + m for m in _magnitudes(-hi, hi_open, top, lo_open, fraction)]
        else:  # every negative value down to lo
            parts += ["-" + m for m in _magnitudes(0 if fraction else 1, False, top, lo_open,
                                                   fraction)]
    return "(?:" + "|".join(parts) + ")" if parts else None


def any_json(depth: int = ANY_DEPTH) -> str:
    """Any JSON value with objects and arrays nested at most `depth` deep."""
    value = "(?:" + "|".join(SCALARS.values()) + ")"
    for _ in range(depth):
        inner = value
        obj = rf"\{{(?:{STRING}:{WS}{inner}(?:,{WS}{STRING}:{WS}{inner})*)?\}}"
        arr = rf"\[(?:{inner}(?:,{WS}{inner})*)?\]"
        value = f"(?:{value}|{obj}|{arr})"
    return value


def json_object_regex() -> str:
    """Any JSON object (OpenAI's response_format json_object)."""
    inner = any_json(ANY_DEPTH - 1)
    return rf"\{{(?:{STRING}:{WS}{inner}(?:,{WS}{STRING}:{WS}{inner})*)?\}}"


def schema_regex(schema) -> str:
    """The regex of the JSON texts `schema` allows (see the module docstring)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"JSON schema: not valid JSON ({e})") from None
    reader = _Schema(schema)
    out = reader.regex(schema, "#", ())
    if reader.recursive:
        from slora.guided import Regex

        if not Regex(out).start:
            reader.fail("#", f"every text it allows nests a recursive $ref more than "
                        f"{REF_DEPTH} levels deep (give the recursion a way to end: an "
                        "optional property, an array that may be empty, or a null)")
    return out


class _Schema:
    def __init__(self, root) -> None:
        self.root = root
        self.recursive = False  # a $ref met inside itself

    def fail(self, where: str, why: str):
        raise ValueError(f"JSON schema at {where}: {why}")

    def regex(self, s, where: str, refs: tuple[str, ...]) -> str:
        if s is True or s == {}:
            return any_json()
        if not isinstance(s, dict):
            self.fail(where, f"expected an object, got {s!r}")
        unknown = sorted(set(s) - _READ)
        if unknown:
            self.fail(where, f"{', '.join(unknown)} not supported (slora reads: type, "
                      "properties, required, items, enum, const, anyOf, oneOf, $ref, "
                      "minimum, maximum, and the "
                      "string, array and object bounds listed in slora/json_regex.py)")
        if s.get("nullable") is True:  # (OpenAPI's: the schema, or null)
            rest = {k: v for k, v in s.items() if k != "nullable"}
            return f"(?:{self.regex(rest, where, refs)}|null)"
        if "$ref" in s:
            return self.ref(s["$ref"], where, refs)
        if "const" in s:
            return re.escape(json.dumps(s["const"]))
        if "enum" in s:
            if not isinstance(s["enum"], list) or not s["enum"]:
                self.fail(where, "enum must be a non-empty list")
            return "(?:" + "|".join(re.escape(json.dumps(v)) for v in s["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in s:
                if not isinstance(s[key], list) or not s[key]:
                    self.fail(where, f"{key} must be a non-empty list")
                return "(?:" + "|".join(self.regex(x, f"{where}/{key}/{i}", refs)
                                        for i, x in enumerate(s[key])) + ")"
        if "allOf" in s:
            if not isinstance(s["allOf"], list) or len(s["allOf"]) != 1:
                self.fail(where, "allOf is supported with one schema only")
            return self.regex(s["allOf"][0], f"{where}/allOf/0", refs)
        kind = s.get("type")
        if kind is None:
            kind = ("object" if {"properties", "additionalProperties"} & set(s)
                    else "array" if {"items", "prefixItems"} & set(s)
                    else "string" if {"pattern", "format", "minLength", "maxLength"} & set(s)
                    else None)
            if kind is None:
                return any_json()
        if isinstance(kind, list):
            return "(?:" + "|".join(self.regex({**s, "type": k}, where, refs) for k in kind) + ")"
        if kind == "object":
            return self.object(s, where, refs)
        if kind == "array":
            return self.array(s, where, refs)
        if kind == "string":
            return self.string(s, where)
        if kind not in SCALARS:
            self.fail(where, f"type {kind!r} is not a JSON Schema type")
        if kind in ("integer", "number") and set(_BOUNDS) & set(s):
            return self.bounded(s, kind, where)
        return SCALARS[kind]

    def bounded(self, s: dict, kind: str, where: str) -> str:
        """An integer or a number between its schema's bounds (`_bounded`): an integer's
        bounds rounded inward to integers, a number's integers as they are."""
        for key in set(_BOUNDS) & set(s):
            if not isinstance(s[key], (int, float)) or isinstance(s[key], bool):
                self.fail(where, f"{key} {s[key]!r}: expected a number")
        if kind == "integer":
            lows = [math.ceil(s["minimum"])] if "minimum" in s else []
            lows += [math.floor(s["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in s else []
            highs = [math.floor(s["maximum"])] if "maximum" in s else []
            highs += [math.ceil(s["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in s else []
            out = _bounded(max(lows, default=None), False, min(highs, default=None), False,
                           fraction=False)
        else:
            odd = [f"{k} {s[k]!r}" for k in _BOUNDS if k in s and s[k] != int(s[k])]
            if odd:
                self.fail(where, f"{', '.join(odd)} on a number: slora bounds numbers by "
                          "integers only (round it, or use type integer)")
            lo, hi, lo_open, hi_open = None, None, False, False
            for key, open_ in (("minimum", False), ("exclusiveMinimum", True)):
                if key in s and (lo is None or s[key] > lo or s[key] == lo and open_):
                    lo, lo_open = int(s[key]), open_
            for key, open_ in (("maximum", False), ("exclusiveMaximum", True)):
                if key in s and (hi is None or s[key] < hi or s[key] == hi and open_):
                    hi, hi_open = int(s[key]), open_
            out = _bounded(lo, lo_open, hi, hi_open, fraction=True)
        if out is None:
            self.fail(where, f"no {kind} lies between its bounds")
        return out

    def ref(self, ref, where: str, refs: tuple[str, ...]) -> str:
        m = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", ref) if isinstance(ref, str) else None
        if m is None or m.group(2) not in self.root.get(m.group(1), {}):
            self.fail(where, f"$ref {ref!r}: only #/$defs/NAME and #/definitions/NAME that "
                      "exist are supported")
        if ref in refs:
            self.recursive = True
            if refs.count(ref) > REF_DEPTH:
                return NEVER
        return self.regex(self.root[m.group(1)][m.group(2)], ref, refs + (ref,))

    def object(self, s: dict, where: str, refs: tuple[str, ...]) -> str:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            self.fail(where, "properties must be an object")
        required = s.get("required", [])
        missing = [r for r in required if r not in props]
        if missing:
            self.fail(where, f"required names {missing}, which are not in properties")
        extra = s.get("additionalProperties")
        if not props:  # {"type": "object"}: any object, unless no key may be added
            if isinstance(extra, dict) and extra:  # a map: any keys, each value `extra`
                value = self.regex(extra, f"{where}/additionalProperties", refs)
                return rf"\{{(?:{STRING}:{WS}{value}(?:,{WS}{STRING}:{WS}{value})*)?\}}"
            return r"\{\}" if extra is False else json_object_regex()
        if extra not in (False, None):
            self.fail(where, "additionalProperties beside properties is not supported (set "
                      "it false or leave it out)")
        items = [(f"{re.escape(json.dumps(k))}:{WS}"
                  f"{self.regex(v, f'{where}/properties/{k}', refs)}", k in required)
                 for k, v in props.items()]
        if not items:
            return r"\{\}"
        # the first property written is k: every required one before k would be missing
        firsts = []
        for k, (item, _) in enumerate(items):
            if any(req for _, req in items[:k]):
                break
            rest = "".join(f",{WS}{it}" if req else f"(?:,{WS}{it})?"
                           for it, req in items[k + 1:])
            firsts.append(item + rest)
        body = "(?:" + "|".join(firsts) + ")"
        if not any(req for _, req in items):
            body += "?"
        return rf"\{{{body}\}}"

    def array(self, s: dict, where: str, refs: tuple[str, ...]) -> str:
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if not isinstance(lo, int) or lo < 0 or (hi is not None and (not isinstance(hi, int)
                                                                     or hi < lo)):
            self.fail(where, f"minItems {lo!r} / maxItems {hi!r}: expected 0 <= minItems <= "
                      "maxItems")
        if s.get("prefixItems"):
            return self.tuple(s, lo, hi, where, refs)
        item = self.regex(s.get("items", {}), f"{where}/items", refs)
        if hi == 0:
            return r"\[\]"
        more_lo = max(lo - 1, 0)
        more = f"{{{more_lo},{'' if hi is None else hi - 1}}}"
        items = f"{item}(?:,{WS}{item}){more}"
        return rf"\[{items}\]" if lo else rf"\[(?:{items})?\]"

    def tuple(self, s: dict, lo: int, hi: int | None, where: str, refs) -> str:
        """An array whose first items follow `prefixItems` in order and the rest `items`
        (false: none; absent: any value), minItems to maxItems of them."""
        if not isinstance(s["prefixItems"], list):
            self.fail(where, "prefixItems must be a list")
        first = [self.regex(x, f"{where}/prefixItems/{i}", refs)
                 for i, x in enumerate(s["prefixItems"])]
        n, more = len(first), s.get("items", {})
        if more is False and lo > n:
            self.fail(where, f"minItems {lo} exceeds the {n} prefixItems with items false")
        rest = None if more is False else self.regex(more, f"{where}/items", refs)

        def tail(i: int) -> str:  # items i.. after item i - 1
            sep = f",{WS}" if i else ""
            if hi is not None and i >= hi:
                return ""
            if i < n:
                body = sep + first[i] + tail(i + 1)
                return body if i < lo else f"(?:{body})?"
            if rest is None:
                return ""
            return f"(?:,{WS}{rest}){{{max(lo - i, 0)},{'' if hi is None else hi - i}}}"
        return rf"\[{tail(0)}\]"

    def string(self, s: dict, where: str) -> str:
        if "format" in s:
            if s["format"] not in FORMATS:
                self.fail(where, f"format {s['format']!r} is not supported (supported: "
                          f"{', '.join(FORMATS)})")
            return FORMATS[s["format"]]
        if "pattern" in s:
            return '"' + s["pattern"].removeprefix("^").removesuffix("$") + '"'
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        if lo or hi is not None:
            return f'"{STRING_CHAR}{{{lo},{"" if hi is None else hi}}}"'
        return STRING
