"""The sampling knobs that change the logits before a token is picked (vLLM's semantics and
order): allowed_token_ids, bad_words, min_tokens, logit_bias, repetition / frequency /
presence penalties; and min_p; and skip_special_tokens.
References: HF transformers' own generate (repetition penalty, min_new_tokens, sequence
bias), and a greedy loop over HF's forward that applies the documented rules by hand."""

import pytest
import torch

from slora import Engine, EngineConfig, SamplingParams

# On a GPU the engine and HF run on CUDA (Triton kernels), in fp32 on both sides.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = "The quick brown fox"
NEW = 24


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype="float32",
                               num_pages=64))


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="eager").to(DEVICE).eval()


def by_hand(hf, ids, new, eos, min_tokens=0, bias=(), rep=1.0, freq=0.0, pres=0.0,
            allowed=None, bad=()):
    """Greedy tokens of HF's model with the rules applied by hand, in vLLM's order: only the
    allowed ids kept, each bad word's last token masked where its other tokens end the
    output, the stop ids masked before min_tokens, the bias added, the repetition penalty
    over prompt and output, then frequency and presence over the output."""
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(new):
            x = hf(torch.tensor([seq], device=DEVICE)).logits[0, -1].clone()
            if allowed is not None:
                x[[t for t in range(x.shape[0]) if t not in allowed]] = float("-inf")
            for word in bad:
                if len(word) - 1 <= len(out) and out[len(out) - len(word) + 1:] == word[:-1]:
                    x[word[-1]] = float("-inf")
            if len(out) < min_tokens:
                x[eos] = float("-inf")
            for t, b in bias:
                x[t] += b
            for t in set(seq):
                x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
            for t in set(out):
                x[t] -= freq * out.count(t) + pres
            tok = int(x.argmax())
            seq.append(tok)
            out.append(tok)
            if tok == eos:
                break
    return out


def test_penalties_bias_and_min_tokens_follow_the_rules(engine, hf):
    ids = engine.tokenizer.encode(PROMPT)
    eos = engine.eos_token_ids[0]
    plain = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    cases = [dict(rep=1.8), dict(freq=1.5), dict(pres=2.0), dict(freq=-0.5, pres=1.0),
             dict(bias=((plain.token_ids[1], -100.0), (ids[-1], 3.0))),
             dict(bias=((eos, 9.0),), min_tokens=5),
             dict(rep=1.3, freq=0.7, pres=0.4, bias=((eos, 4.0), (ids[0], 2.5)), min_tokens=3)]
    for case in cases:
        want = by_hand(hf, ids, NEW, eos, **case)
        sp = SamplingParams(max_tokens=NEW, min_tokens=case.get("min_tokens", 0),
                            logit_bias=dict(case.get("bias", ())),
                            repetition_penalty=case.get("rep", 1.0),
                            frequency_penalty=case.get("freq", 0.0),
                            presence_penalty=case.get("pres", 0.0), logprobs=0)
        out = engine.generate(PROMPT, sp)[0]
        assert out.token_ids == want, case
        assert out.token_ids != plain.token_ids[:len(out.token_ids)], case  # it changed them
        # log-probs stay those of the raw distribution
        raw = torch.log_softmax(hf(torch.tensor([ids + out.token_ids], device=DEVICE)).logits[0]
                                .detach(), -1)
        got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        wanted = [float(raw[len(ids) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
        assert got == pytest.approx(wanted, abs=1e-3)
    # the EOS-biased cases: EOS only once min_tokens are out, then at once
    for case in cases[5:]:
        out = engine.generate(PROMPT, SamplingParams(
            max_tokens=NEW, min_tokens=case["min_tokens"], logit_bias={eos: 100.0}))[0]
        assert len(out.token_ids) == case["min_tokens"] + 1 and out.finish_reason == "stop"
        assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1]


def test_allowed_token_ids_and_bad_words_follow_the_rules(engine, hf):
    """allowed_token_ids keeps those ids alone; a bad word (as encoded alone and after a
    space) never ends the output, though its first tokens may appear."""
    ids, tok = engine.tokenizer.encode(PROMPT), engine.tokenizer
    eos = engine.eos_token_ids[0]
    plain = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    allowed = sorted({plain.token_ids[3], plain.token_ids[5], ids[1], ids[2], 7})
    out = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                 allowed_token_ids=allowed))[0]
    assert out.token_ids == by_hand(hf, ids, NEW, eos, allowed=set(allowed))
    assert set(out.token_ids) <= set(allowed) and out.token_ids != plain.token_ids
    # bad words: the first one- and two-token pieces of the plain output whose text encodes
    # (alone or after a space) to those tokens again
    def encodings(w):
        alone = tok.encode(w.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + w.lstrip(), add_special_tokens=False)
        return [alone] + ([spaced] if len(spaced) == len(alone) and spaced[0] != alone[0] else [])

    out_ids = plain.token_ids
    words = [next(w for i in range(NEW - n) if (w := tok.decode(out_ids[i:i + n])).strip()
                  and out_ids[i:i + n] in encodings(w)) for n in (1, 2)]
    bad = [e for w in words for e in encodings(w)]
    out = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                 bad_words=words))[0]
    assert out.token_ids == by_hand(hf, ids, NEW, eos, bad=bad)
    assert out.token_ids != plain.token_ids and max(map(len, bad)) == 2
    for w in bad:
        assert not any(out.token_ids[i:i + len(w)] == w for i in range(len(out.token_ids)))


def test_skip_special_tokens_false_keeps_them_in_the_text(engine):
    eos = engine.eos_token_ids[0]
    sp = dict(max_tokens=3, min_tokens=2, logit_bias={eos: 100.0})
    kept = engine.generate(PROMPT, SamplingParams(**sp, skip_special_tokens=False))[0]
    dropped = engine.generate(PROMPT, SamplingParams(**sp))[0]
    assert kept.token_ids == dropped.token_ids and kept.token_ids[-1] == eos
    name = engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert name and kept.text == dropped.text + name


def test_repetition_penalty_min_new_tokens_and_bias_equal_hf_generate(engine, hf):
    ids = engine.tokenizer.encode(PROMPT)
    eos = engine.eos_token_ids[0]
    for ours, theirs in (
            (dict(repetition_penalty=1.6), dict(repetition_penalty=1.6)),
            (dict(min_tokens=4, logit_bias={eos: 50.0}),
             dict(min_new_tokens=4, sequence_bias={(eos,): 50.0}))):
        out = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, **ours))[0]
        ref = hf.generate(torch.tensor([ids], device=DEVICE),
                          attention_mask=torch.ones(1, len(ids), device=DEVICE),
                          max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                          pad_token_id=0, **theirs)[0, len(ids):].tolist()
        assert out.token_ids == ref, ours


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_batch_mixes_processed_and_plain_rows(tiny_model_dir, engine, async_scheduling):
    """Rows with penalties beside plain greedy and sampled rows: each equals its own run
    alone, with async scheduling too (a processed row's step is collected at once)."""
    e = Engine(EngineConfig(model=str(tiny_model_dir), device=DEVICE, dtype="float32",
                            num_pages=64, async_scheduling=async_scheduling))
    prompts = ["Hello", PROMPT, "Paris is the capital of", "Serving many"]
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True),
              SamplingParams(max_tokens=NEW, ignore_eos=True, frequency_penalty=1.2,
                             repetition_penalty=1.2),
              SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, seed=3,
                             presence_penalty=1.5),
              SamplingParams(max_tokens=NEW, ignore_eos=True, logit_bias={5: 2.0})]
    together = e.generate(prompts, params)
    for p, sp, out in zip(prompts, params, together):
        assert out.token_ids == engine.generate(p, sp)[0].token_ids, sp


def test_min_p_one_keeps_only_the_likeliest_token(engine):
    greedy = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    for seed in (1, 2):
        out = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                     temperature=2.0, min_p=1.0, seed=seed))[0]
        assert out.token_ids == greedy.token_ids
    # a min_p that drops nothing leaves the seeded draws as they were
    sp = dict(max_tokens=NEW, ignore_eos=True, temperature=1.0, seed=4)
    assert engine.generate(PROMPT, SamplingParams(**sp, min_p=1e-12))[0].token_ids == \
        engine.generate(PROMPT, SamplingParams(**sp))[0].token_ids


def test_stop_strings_wait_for_min_tokens_and_may_stay(engine):
    full = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True))[0]
    stop = next(full.text[i:i + 2] for i in range(len(full.text)) if full.text[i:i + 2].strip()
                and len(full.text[i:i + 2]) == 2)
    early = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True,
                                                   stop=stop))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < NEW
    late = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True, stop=stop,
                                                  min_tokens=len(early.token_ids)))[0]
    assert len(late.token_ids) > len(early.token_ids)
    assert late.token_ids == full.token_ids[:len(late.token_ids)]
    assert full.text.startswith(late.text) and len(late.text) > len(early.text)
    # include_stop_str_in_output keeps the stop string and cuts only what follows it
    kept = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True, stop=stop,
                                                  include_stop_str_in_output=True))[0]
    assert kept.token_ids == early.token_ids and kept.text == early.text + stop


def test_bad_values_are_clear_errors(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=r"logit_bias token ids \[%d\] are outside the "
                                         r"vocabulary \[0, %d\)" % (vocab, vocab)):
        engine.add_request(PROMPT, SamplingParams(logit_bias={vocab: 1.0}))
    with pytest.raises(ValueError, match=r"allowed_token_ids \[%d\] are outside" % vocab):
        engine.add_request(PROMPT, SamplingParams(allowed_token_ids=[1, vocab]))
    for kw, why in ((dict(min_tokens=20), "min_tokens=20: must be at most max_tokens=16"),
                    (dict(presence_penalty=2.5), r"presence_penalty=2.5: must be a number in "
                                                 r"\[-2, 2\]"),
                    (dict(repetition_penalty=0.0), "repetition_penalty=0.0: must be a number > 0"),
                    (dict(min_p=-0.1), r"min_p=-0.1: must be a number in \[0, 1\]"),
                    (dict(logit_bias={3: 101}), r"logit_bias=\(\(3, 101\),\): must map token "
                                                r"ids \(integers >= 0\) to biases in \[-100, 100\]"),
                    (dict(logit_bias=[1, 2]), "logit_bias=.*expected a dict"),
                    (dict(allowed_token_ids=[]), "allowed_token_ids=.*non-empty list"),
                    (dict(allowed_token_ids=[-1]), "allowed_token_ids=.*token ids"),
                    (dict(bad_words=[" "]), "bad_words=.*non-empty strings"),
                    (dict(skip_special_tokens=1), "skip_special_tokens=1: must be True")):
        with pytest.raises(ValueError, match=why):
            SamplingParams(**kw)
    assert engine.generate("Hello", SamplingParams(max_tokens=2))[0].finish_reason is not None


def test_guided_choice_and_regex_hold_the_output(engine):
    """guided_choice ends on one of the strings and stops there; guided_regex's output is a
    full match; beside unguided rows in one batch, with sampling too."""
    import re

    choices = ["quick brown dog", "lazy", "Paris"]
    pattern = r"-?\d{1,3}(\.\d)? [a-z]+"
    params = [SamplingParams(max_tokens=NEW, guided_choice=choices),
              SamplingParams(max_tokens=NEW, guided_regex=pattern),
              SamplingParams(max_tokens=NEW, guided_regex=pattern, temperature=1.0, seed=5),
              SamplingParams(max_tokens=NEW, ignore_eos=True)]
    outs = engine.generate([PROMPT] * 4, params)
    assert outs[0].text in choices and outs[0].finish_reason == "stop"
    for out in outs[1:3]:
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason in ("stop", "length")
    assert outs[3].token_ids == engine.generate(PROMPT, params[3])[0].token_ids
    # a sure pattern: the output is the pattern's one string
    out = engine.generate(PROMPT, SamplingParams(max_tokens=NEW, guided_regex="abc( def)?!"))[0]
    assert out.text in ("abc!", "abc def!") and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="lookaround"):
        engine.add_request(PROMPT, SamplingParams(guided_regex="(?=a)b"))
    with pytest.raises(ValueError, match="exclude each other"):
        SamplingParams(guided_regex="a", guided_choice=["a"])


def test_guided_json_gives_json_the_schema_accepts(engine):
    import json

    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "tag": {"enum": ["x", "y", None]},
        "s": {"type": "string", "maxLength": 3}, "n": {"type": "integer", "minimum": -3,
                                                       "maximum": 12},
        "more": {"type": "array", "maxItems": 2, "items": {"type": "boolean"}}},
        "required": ["ok", "tag", "s", "n"]}
    outs = engine.generate([PROMPT] * 3, [
        SamplingParams(max_tokens=64, guided_json=schema),
        SamplingParams(max_tokens=64, guided_json=json.dumps(schema), temperature=1.0, seed=2),
        SamplingParams(max_tokens=64, temperature=1.0, seed=9, guided_json=schema)])
    for out in outs:
        value = json.loads(out.text)
        assert out.finish_reason == "stop", out.text
        assert list(value)[:4] == ["ok", "tag", "s", "n"]
        assert set(value) <= set(schema["properties"])
        assert isinstance(value["ok"], bool) and value["tag"] in ("x", "y", None)
        assert isinstance(value["s"], str) and len(value["s"]) <= 3
        assert isinstance(value["n"], int) and -3 <= value["n"] <= 12
    with pytest.raises(ValueError, match="guided_json: JSON schema at #: multipleOf not "):
        engine.add_request(PROMPT, SamplingParams(guided_json={"type": "integer",
                                                               "multipleOf": 2}))


def test_rules_that_leave_no_token_fail_that_request_alone(engine):
    """A guide that allows only EOS while min_tokens masks it, or allowed_token_ids that are
    all stop ids under min_tokens: the request fails with the reason, its neighbour runs."""
    eos = engine.eos_token_ids[0]
    outs = engine.generate([PROMPT] * 3, [
        SamplingParams(max_tokens=8, guided_choice=["a"], min_tokens=4),
        SamplingParams(max_tokens=8, allowed_token_ids=[eos], min_tokens=2),
        SamplingParams(max_tokens=4, ignore_eos=True)])
    assert outs[0].finish_reason == "error" and "guided decoding's pattern" in outs[0].error
    assert "no token is left to pick after 1 tokens" in outs[0].error
    assert outs[1].finish_reason == "error" and "allowed_token_ids" in outs[1].error
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == 4
