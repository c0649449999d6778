"""JSON Schema -> regex for guided decoding: the texts it allows are JSON that the schema
accepts (written compactly, an optional space after `:` and `,`), and it refuses what it does
not read by name."""

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slora.guided import Regex
from slora.json_regex import REF_DEPTH, json_object_regex, schema_regex

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer"},
    "email": {"type": "string", "format": "uuid"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 2},
    "kind": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/kind"}]}},
    "required": ["name", "age"], "$defs": {"kind": {"const": "x"}}}


def accepts(pattern: str, text: str) -> bool:
    rx = Regex(pattern)
    return rx.accepts(rx.step(rx.start, text))


@pytest.mark.parametrize("value,ok", [
    ({"name": "Al", "age": 3}, True),
    ({"name": "Al", "age": -30, "tags": ["a", 3], "kind": None}, True),
    ({"name": "Al", "age": 3, "kind": "x"}, True),
    ({"name": "Al", "age": 3, "email": "123e4567-e89b-12d3-a456-426614174000"}, True),
    ({"age": 3, "name": "Al"}, False),  # the schema's order
    ({"name": "Al"}, False),  # a required one missing
    ({"name": "Al", "age": 3.5}, False),
    ({"name": "Alexander the Great", "age": 3}, False),  # maxLength
    ({"name": "Al", "age": 3, "tags": ["a", "b", "a"]}, False),  # maxItems
    ({"name": "Al", "age": 3, "kind": "y"}, False),
    ({"name": "Al", "age": 3, "other": 1}, False),  # no other keys
])
def test_schema_texts(value, ok):
    pattern = schema_regex(PERSON)
    for seps in ((",", ":"), (", ", ": ")):
        assert accepts(pattern, json.dumps(value, separators=seps)) == ok, (value, seps)


def test_optional_properties_and_any_json():
    schema = {"properties": {"a": {"type": "boolean"}, "b": {"type": "number"},
                             "c": {"type": "string", "pattern": "[a-z]{2}"}}}
    pattern = schema_regex(json.dumps(schema))
    for text in ('{}', '{"b":1e5}', '{"a":true,"c":"xy"}', '{"c":"ab"}', '{"a":false, "b":-0.5}'):
        assert accepts(pattern, text), text
    for text in ('{,}', '{"a":true,}', '{"c":"abc"}', '{"b":01}'):
        assert not accepts(pattern, text), text
    anything = json_object_regex()
    for value in ({}, {"k": [1, {"x": None}], "s": "q\"\\u00e9"}, {"n": -1.5e-3}):
        assert accepts(anything, json.dumps(value)), value
    assert not accepts(anything, "[1]") and not accepts(anything, '{"a":{"b":{"c":{}}}}')
    assert accepts(schema_regex({"type": "object"}), '{"a": [1, 2]}')


@pytest.mark.parametrize("schema,good,bad", [
    # a map (pydantic's dict[str, int])
    ({"type": "object", "additionalProperties": {"type": "integer"}},
     ['{}', '{"a": 1, "b": -2}'], ['{"a": "x"}', '{"a": 1,}']),
    # a tuple (pydantic's tuple[int, str])
    ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
      "minItems": 2, "maxItems": 2}, ['[1, "a"]'], ['[1]', '[1, "a", 2]', '["a", 1]']),
    # a prefix, then items of their own kind; or none past it
    ({"prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}},
     ['[]', '[1]', '[1, true, false]'], ['[true]', '[1, 2]']),
    ({"prefixItems": [{"type": "integer"}, {"type": "null"}], "items": False},
     ['[]', '[1]', '[1, null]'], ['[1, null, 2]', '[null]']),
    ({"type": "string", "format": "email"}, ['"a.b+c@x-y.example.org"'], ['"a@b"', '"a b@c.de"']),
    ({"type": "string", "format": "uri"}, ['"https://x.org/a?b=1#c"', '"urn:isbn:1"'],
     ['"no scheme"', '"http://a b"']),
    ({"type": "string", "format": "ipv4"}, ['"192.168.0.255"', '"0.0.0.0"'],
     ['"256.1.1.1"', '"1.2.3"', '"01.2.3.4"']),
    # OpenAPI's nullable; a discriminated union (pydantic's), its discriminator a note
    ({"type": "integer", "nullable": True, "readOnly": True}, ['3', 'null'], ['"3"']),
    ({"oneOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
      "discriminator": {"propertyName": "k"}, "$defs": {
          "a": {"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
          "b": {"type": "object", "properties": {"k": {"const": "b"}, "n": {"type": "integer"}},
                "required": ["k", "n"]}}},
     ['{"k": "a"}', '{"k": "b", "n": 1}'], ['{"k": "b"}', '{"k": "c"}']),
])
def test_maps_tuples_and_formats(schema, good, bad):
    pattern = schema_regex(schema)
    for text in good:
        assert accepts(pattern, text) and re.fullmatch(pattern, text), text
    for text in bad:
        assert not accepts(pattern, text), text


TREE = {"$ref": "#/$defs/node", "$defs": {"node": {"type": "object", "properties": {
    "name": {"type": "string"},
    "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["name"]}}}
LIST = {"$ref": "#/$defs/cell", "$defs": {"cell": {"type": "object", "properties": {
    "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/cell"}, {"type": "null"}]}},
    "required": ["v", "next"]}}}


def nested(depth: int, leaf: str, make) -> str:
    return leaf if depth == 0 else make(nested(depth - 1, leaf, make))


@pytest.mark.parametrize("schema,leaf,bad,make", [
    (TREE, '{"name": "x"}', '{"name": 3}',
     lambda inner: f'{{"name": "x", "children": [{inner}, {inner}]}}'),
    (LIST, '{"v": 0, "next": null}', '{"v": "0", "next": null}',
     lambda inner: f'{{"v": 1, "next": {inner}}}')])
def test_recursive_refs_expand_to_their_depth(schema, leaf, bad, make):
    """A recursive $ref (a tree, a linked list) expands REF_DEPTH times inside itself: texts
    nested up to that depth are allowed and deeper ones are not."""
    pattern = schema_regex(schema)
    assert re.fullmatch(pattern, nested(2, leaf, make))
    for depth in range(REF_DEPTH + 1):
        assert accepts(pattern, nested(depth, leaf, make)), depth
    assert not accepts(pattern, nested(REF_DEPTH + 1, leaf, make))
    assert not accepts(pattern, nested(1, bad, make))


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.none(), st.integers(-2000, 2000)),
       st.one_of(st.none(), st.integers(-2000, 2000)),
       st.integers(-3000, 3000), st.sampled_from(["", ".0", ".5", ".25", ".000"]))
def test_numeric_bounds_allow_exactly_the_values_between(lo, hi, n, frac):
    """minimum / maximum, inclusive or exclusive: an integer's or a number's text is allowed
    exactly where its value lies between the bounds (a number's "-0" may go either way: it
    equals 0, and its text need not be allowed)."""
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    bounds = {k: v for k, v in (("minimum", lo), ("maximum", hi)) if v is not None}
    ints = schema_regex({"type": "integer", **bounds})
    assert bool(re.fullmatch(ints, str(n))) == ((lo is None or n >= lo)
                                                and (hi is None or n <= hi))
    exclusive = {"exclusive" + k[0].upper() + k[1:]: v for k, v in bounds.items()}
    if lo is not None and hi is not None and hi - lo < 2:  # no integer strictly between
        with pytest.raises(ValueError, match="no integer lies between its bounds"):
            schema_regex({"type": "integer", **exclusive})
    else:
        ex = schema_regex({"type": "integer", **exclusive})
        assert bool(re.fullmatch(ex, str(n))) == ((lo is None or n > lo)
                                                  and (hi is None or n < hi))
    text = ("-" if n < 0 else "") + str(abs(n)) + frac
    value = float(text)
    for given, inside in ((bounds, (lo is None or value >= lo) and (hi is None or value <= hi)),
                          (exclusive, (lo is None or value > lo) and (hi is None or value < hi))):
        if lo is not None and hi is not None and lo == hi and given is exclusive:
            continue  # (no number between)
        matched = bool(re.fullmatch(schema_regex({"type": "number", **given}), text))
        assert matched == inside or (not matched and value == 0 and text.startswith("-"))


@pytest.mark.parametrize("schema,why", [
    ({"type": "integer", "multipleOf": 3}, "multipleOf not supported"),
    ({"type": "number", "maximum": 2.5}, "maximum 2.5 on a number"),
    ({"type": "number", "exclusiveMinimum": 2, "maximum": 2}, "no number lies between"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "no integer lies between its bounds"),
    ({"type": "integer", "minimum": "1"}, "minimum '1': expected a number"),
    ({"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}},
     "nests a recursive $ref more than 3 levels deep"),
    ({"$ref": "#/$defs/x", "$defs": {"x": {"type": "object", "properties": {
        "a": {"$ref": "#/$defs/x"}}, "required": ["a"]}}}, "give the recursion a way to end"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True},
     "additionalProperties beside properties"),
    ({"type": "object", "properties": {}, "required": ["a"]}, "required names"),
    ({"type": "string", "format": "hostname"}, "format 'hostname' is not supported"),
    ({"type": "array", "prefixItems": [{}], "items": False, "minItems": 2},
     "minItems 2 exceeds the 1 prefixItems"),
    ("{not json", "not valid JSON"),
])
def test_what_it_does_not_read_is_refused_by_name(schema, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        schema_regex(schema)
