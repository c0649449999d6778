"""Guided decoding's regex engine (slora.guided): its states accept exactly what
`re.fullmatch` accepts, and a non-empty state always leads on to a match; patterns it does not
take are refused by name; a guide allows exactly the tokens that keep the output on a match."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slora.guided import Grammar, Guide, Regex, TokenPieces, choice_pattern

PATTERNS = [r"(yes|no|maybe)", r"-?\d{1,3}(\.\d+)?", r"[A-Z][a-z]*( [A-Z][a-z]*){0,2}",
            r"a*b+c?", r"(ab|a)(bc|c)*", r"\w+@\w+\.(com|org)", r"[^ab\n]{2,4}x", r"^(a|)b$",
            r"\(\d\)\[[-+*/]\]", r"(?P<n>\s\S){2}", r".{0,3}z", r"x{3}|y{2,}"]
ALPHABET = "abcxyzAZ019 .-+*/()[]@_\n\t"


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(PATTERNS), st.text(alphabet=ALPHABET, max_size=10))
def test_states_accept_what_re_fullmatch_accepts(pattern, text):
    rx = Regex(pattern)
    state = rx.step(rx.start, text)
    assert rx.accepts(state) == bool(re.fullmatch(pattern.lstrip("^").rstrip("$"), text))
    # a prefix of a match never has an empty state
    for k in range(len(text) + 1):
        if re.fullmatch(pattern.lstrip("^").rstrip("$"), text):
            assert rx.step(rx.start, text[:k])


def test_a_class_of_no_character_is_a_dead_branch():
    """A class no character is in (json_regex's bound on a recursive $ref) leads nowhere: no
    state holds the nodes before it, so a non-empty state still always leads on to a match."""
    never = f"[^\x00-{chr(0x10FFFF)}]"
    assert Regex(f"a{never}").start == frozenset()
    rx = Regex(f"a{never}c|ab")
    assert rx.step(rx.start, "a") and not rx.step(rx.start, "ac")
    assert rx.accepts(rx.step(rx.start, "ab"))


@pytest.mark.parametrize("pattern,why", [
    (r"(a)\1", r"\\1 is not supported"), (r"(?=a)b", "lookaround"), (r"a{3,2}", "bad repeat"),
    (r"(ab", "missing \\)"), (r"*a", "nothing to repeat"), (r"[a-", "missing ]"),
    (r"a{1001}", "at most 1000"), (r"[\W]", "negated classes")])
def test_unsupported_patterns_are_refused_by_name(pattern, why):
    with pytest.raises(ValueError, match=why):
        Regex(pattern)


def test_guide_allows_exactly_the_tokens_that_stay_on_a_match(tiny_model_dir):
    from slora.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model_dir)
    pieces = TokenPieces(tok, tok.vocab_size)
    choices = ["quick brown", "quiet", "fox"]
    grammar = Grammar(choice_pattern(choices), pieces, eos=(1,))
    guide, ids = Guide(grammar), []
    for target in ("quiet", "quick brown"):
        ids = []
        while True:
            allowed = guide.allowed(ids)
            text = tok.decode(ids)
            want = {t for t in range(tok.vocab_size)
                    if (p := (pieces.first if not ids else pieces.mid)[t])
                    and any(c.startswith(text + p) for c in choices)}
            assert set(allowed) - {1} == want
            assert (1 in allowed) == (text in choices)
            if text == target:
                break
            nxt = next(t for t in allowed if target.startswith(text + (
                pieces.first if not ids else pieces.mid)[t]) and t != 1)
            ids.append(nxt)
        assert tok.decode(ids) == target
