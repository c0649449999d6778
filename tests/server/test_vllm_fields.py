"""vLLM's request fields beyond OpenAI's, over HTTP: allowed_token_ids, bad_words,
skip_special_tokens, truncate_prompt_tokens, add_special_tokens, and chat's
continue_final_message and chat_template_kwargs, each answer equal to the in-process
engine's for the same request; the fields slora does not implement are a 400 naming them."""

from __future__ import annotations

import httpx

from slora import SamplingParams

from .conftest import BASE

PROMPT = "The quick brown fox"


def post(live, path, body):
    return httpx.post(f"{live.url}{path}", json=body, timeout=30)


def tokens_of(res) -> list[int]:
    assert res.status_code == 200, res.text
    lp = res.json()["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]]


def test_logits_fields_and_special_tokens_equal_the_engine(serve, reference):
    ids = reference.tokenizer.encode(PROMPT)
    eos = reference.eos_token_ids[0]
    plain = reference.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True),
                               adapters="a0")[0]
    allowed = sorted({plain.token_ids[2], plain.token_ids[4], ids[1], 7})
    word = reference.tokenizer.decode(plain.token_ids[:1])
    cases = [dict(allowed_token_ids=allowed), dict(bad_words=[word])]
    base = dict(model="a0", prompt=PROMPT, max_tokens=8, temperature=0, ignore_eos=True,
                logprobs=0, return_tokens_as_token_ids=True)
    with serve() as live:
        got = [tokens_of(post(live, "/v1/completions", {**base, **case})) for case in cases]
        special = post(live, "/v1/completions", {
            "prompt": PROMPT, "max_tokens": 3, "min_tokens": 2, "temperature": 0,
            "logit_bias": {str(eos): 100}, "skip_special_tokens": False}).json()
    for case, tokens in zip(cases, got):
        want = reference.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True, **case),
                                  adapters="a0")[0]
        assert tokens == want.token_ids and tokens != plain.token_ids, case
    assert special["choices"][0]["text"].endswith("</s>")


def test_guided_decoding_equals_the_engine(serve, reference):
    """guided_choice and guided_regex (and structured_outputs' choice and regex) over HTTP give
    the engine's answer for the same request; a pattern slora does not take is a 400."""
    import re

    choices, pattern = ["quick brown dog", "lazy", "Paris"], r"\d{1,3}( [a-z]+)?"
    want_choice = reference.generate(PROMPT, SamplingParams(max_tokens=8, guided_choice=choices),
                                     adapters="a0")[0]
    want_regex = reference.generate(PROMPT, SamplingParams(max_tokens=8, guided_regex=pattern),
                                    adapters="a0")[0]
    base = dict(model="a0", prompt=PROMPT, max_tokens=8, temperature=0)
    with serve() as live:
        texts = [post(live, "/v1/completions", {**base, **kw}).json()["choices"][0]["text"]
                 for kw in (dict(guided_choice=choices), dict(guided_regex=pattern),
                            dict(structured_outputs={"choice": choices}),
                            dict(structured_outputs={"regex": pattern}))]
        chat = post(live, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "guided_choice": ["yes", "no"]}).json()
        bad = post(live, "/v1/completions", {**base, "guided_regex": "(?=a)b"})
    assert texts == [want_choice.text, want_regex.text] * 2
    assert want_choice.text in choices and re.fullmatch(pattern, want_regex.text)
    assert chat["choices"][0]["message"]["content"] in ("yes", "no")
    assert bad.status_code == 400 and "lookaround" in bad.text


def test_json_output_over_openai_and_lorax(serve, reference):
    """guided_json, OpenAI's response_format (json_schema, json_object) and LoRAX's
    response_format give the engine's answer for the same schema; it parses."""
    import json

    import lorax

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "s": {"type": "string", "maxLength": 3}},
              "required": ["ok", "s"]}
    sp = SamplingParams(max_tokens=48, guided_json=schema)
    want = reference.generate(PROMPT, sp, adapters="a1")[0]
    want_any = reference.generate(PROMPT, SamplingParams(max_tokens=48, guided_json={
        "type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"]}))[0]
    base = dict(model="a1", prompt=PROMPT, max_tokens=48, temperature=0)
    with serve() as live:
        texts = [post(live, "/v1/completions", {**base, **kw}).json()["choices"][0]["text"]
                 for kw in (dict(guided_json=schema),
                            dict(response_format={"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": schema}}),
                            dict(structured_outputs={"json": schema}))]
        anything = post(live, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 48,
            "response_format": {"type": "json_object"}, "temperature": 0}).json()
        lx = lorax.Client(live.url).generate(PROMPT, adapter_id="a1", max_new_tokens=48,
                                             response_format={"type": "json_object",
                                                              "schema": schema})
        lx_enum = lorax.Client(live.url).generate(PROMPT, max_new_tokens=48, response_format={
            "type": "json_object", "schema": {"type": "object", "properties": {
                "k": {"enum": [1, 2]}}, "required": ["k"]}})
        no_schema = post(live, "/v1/completions", {**base, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x"}}})
    assert texts == [want.text] * 3 and json.loads(want.text)["s"] is not None
    # any object: a random model may run out of tokens inside a string; what it wrote leads on
    # to an object, and is one where it stopped
    from slora.guided import Regex
    from slora.json_regex import json_object_regex

    choice = anything["choices"][0]
    rx = Regex(json_object_regex())
    assert rx.step(rx.start, choice["message"]["content"])
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert lx.generated_text == want.text and lx_enum.generated_text == want_any.text
    assert no_schema.status_code == 400 and "json_schema.schema" in no_schema.text


def test_prompt_truncation_and_special_tokens(serve, reference):
    ids = reference.tokenizer.encode(PROMPT)
    assert ids[0] == 0  # the tokenizer's BOS
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    with serve() as live:
        cut = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                             "ignore_eos": True, "truncate_prompt_tokens": 5,
                                             "echo": True}).json()
        bare = post(live, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                              "temperature": 0, "ignore_eos": True,
                                              "add_special_tokens": False}).json()
        chat_cut = post(live, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "truncate_prompt_tokens": 3}).json()
    want = reference.generate([ids[-5:]], sp)[0]
    echoed = reference.tokenizer.decode(ids[-5:], skip_special_tokens=False)
    assert cut["choices"][0]["text"] == echoed + want.text
    assert cut["usage"]["prompt_tokens"] == 5
    assert bare["usage"]["prompt_tokens"] == len(ids) - 1
    assert bare["choices"][0]["text"] == reference.generate([ids[1:]], sp)[0].text
    assert chat_cut["usage"]["prompt_tokens"] == 3


def test_chat_continues_the_final_message_and_passes_template_kwargs(serve, reference):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Paris is"}]
    tok = reference.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=False,
                                   continue_final_message=True)
    assert text.endswith("Paris is") and not text.endswith("\n")
    want = reference.generate([tok.encode(text, add_special_tokens=False)],
                              SamplingParams(max_tokens=4, ignore_eos=True))[0]
    with serve() as live:
        res = post(live, "/v1/chat/completions", {
            "messages": messages, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True,
            "chat_template_kwargs": {"enable_thinking": False}}).json()
        ids = post(live, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                       "continue_final_message": True}).json()
        both = post(live, "/v1/chat/completions", {
            "messages": messages, "continue_final_message": True})
    assert res["choices"][0]["message"]["content"] == want.text
    assert ids["tokens"] == want.prompt_token_ids
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_vllm_fields_slora_does_not_implement_are_400(serve):
    cases = [("/v1/completions", "length_penalty", 2.0),
             ("/v1/completions", "logits_processors", ["x"]),
             ("/v1/completions", "structured_outputs", {"grammar": "root ::= a"}),
             ("/v1/completions", "guided_grammar", "root ::= a"),
             ("/v1/completions", "spaces_between_special_tokens", False),
             ("/v1/completions", "prompt_embeds", "AAAA"),
             ("/v1/chat/completions", "chat_template", "{{ messages }}"),
             ("/v1/chat/completions", "documents", [{"text": "x"}]),
             ("/v1/chat/completions", "echo", True)]
    with serve() as live:
        for path, field, value in cases:
            body = {"model": BASE, "max_tokens": 2, field: value}
            body.update({"prompt": "Hi"} if path == "/v1/completions"
                        else {"messages": [{"role": "user", "content": "Hi"}]})
            res = post(live, path, body)
            assert res.status_code == 400, (field, res.text)
            error = res.json()["error"]
            assert error["param"] == field and "not supported" in error["message"], error


def test_chat_template_flag_and_load_inplace(serve, reference):
    """--chat-template renders the base model's chats (an adapter keeps its own template);
    load_inplace gives a loaded name new weights, a plain load of it is a 400."""
    from .conftest import OWN_TEMPLATE

    template = "{% for m in messages %}({{ m.role }}) {{ m.content }}{% endfor %}>"
    chat = [{"role": "user", "content": "Hi"}]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    want = {name: reference.generate(PROMPT, sp, adapters=name)[0].text for name in ("a0", "a1")}
    with serve(chat_template=template) as live:
        base = post(live, "/tokenize", {"messages": chat}).json()["tokens"]
        own = post(live, "/tokenize", {"model": "chatty", "messages": chat}).json()["tokens"]
        body = {"model": "swap", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        assert post(live, "/v1/load_lora_adapter", {"lora_name": "swap",
                                                     "lora_path": "a0"}).status_code == 200
        first = post(live, "/v1/completions", body).json()["choices"][0]["text"]
        again = post(live, "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": "a1"})
        swapped = post(live, "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": "a1",
                                                       "load_inplace": True})
        second = post(live, "/v1/completions", body).json()["choices"][0]["text"]
        assert post(live, "/v1/unload_lora_adapter", {"lora_name": "swap"}).status_code == 200
    tok = reference.tokenizer
    assert base == tok.encode("(user) Hi>", add_special_tokens=False)
    own_text = OWN_TEMPLATE.replace("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
                                    "{% endfor %}", "[user] Hi\n")
    assert own == tok.encode(own_text, add_special_tokens=False)
    assert (first, second) == (want["a0"], want["a1"]) and first != second
    assert again.status_code == 400 and "already loaded" in again.text
    assert swapped.status_code == 200


def test_priority_needs_the_priority_policy(serve):
    with serve() as live:
        res = post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 1})
        plain = post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": 0})
    assert res.status_code == 400 and res.json()["error"]["param"] == "priority"
    assert "--policy priority" in res.json()["error"]["message"]
    assert plain.status_code == 200


def test_continuous_usage_stats_put_usage_in_every_chunk(serve):
    import json

    with serve() as live:
        with httpx.stream("POST", f"{live.url}/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                timeout=30) as res:
            events = [json.loads(line[6:]) for line in res.iter_lines()
                      if line.startswith("data: {")]
    chunks = [e for e in events if e["choices"]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == list(range(1, 5))
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"]
               + c["usage"]["completion_tokens"] for c in chunks)
    assert events[-1]["usage"]["completion_tokens"] == 4 and not events[-1]["choices"]


def test_reasoning_effort_is_the_templates_variable(serve, reference):
    """Chat's reasoning_effort and the Responses API's reasoning.effort reach the chat
    template as `reasoning_effort` (gpt-oss's template reads it); a value OpenAI does not
    define, and the Responses API's reasoning fields other than effort, are 400."""
    template = "{% for m in messages %}{{ m.content }}{% endfor %} effort {{ reasoning_effort }}"
    tok = reference.tokenizer

    def prompt_tokens(effort: str) -> int:
        return len(tok.encode(f"Hi effort {effort}", add_special_tokens=False))

    messages = [{"role": "user", "content": "Hi"}]
    with serve(chat_template=template) as live:
        chat = [post(live, "/v1/chat/completions", {
            "messages": messages, "max_tokens": 1, **effort}).json()["usage"]["prompt_tokens"]
            for effort in ({"reasoning_effort": "high"}, {})]
        responses = post(live, "/v1/responses", {"input": "Hi", "max_output_tokens": 1,
                                                 "reasoning": {"effort": "low"}}).json()
        bad = post(live, "/v1/chat/completions", {"messages": messages,
                                                  "reasoning_effort": "extreme"})
        summary = post(live, "/v1/responses", {"input": "Hi", "reasoning": {"summary": "auto"}})
    assert chat == [prompt_tokens("high"), prompt_tokens("")]
    assert responses["usage"]["input_tokens"] == prompt_tokens("low")
    assert responses["reasoning"] == {"effort": "low"}
    assert bad.status_code == 400 and "reasoning_effort" in bad.text
    assert summary.status_code == 400 and summary.json()["error"]["param"] == "reasoning"


def test_an_assistants_reasoning_reaches_the_template(serve, reference):
    """An assistant message's reasoning_content goes to the template under that name and as
    `thinking` (Qwen3's and gpt-oss's names)."""
    template = ("{% for m in messages %}{{ m.content }}|{{ m.reasoning_content }}|"
                "{{ m.thinking }};{% endfor %}")
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Yes", "reasoning_content": "why"},
                {"role": "user", "content": "Go"}]
    with serve(chat_template=template) as live:
        got = post(live, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    want = reference.tokenizer.encode("Hi||;Yes|why|why;Go||;", add_special_tokens=False)
    assert got.json()["usage"]["prompt_tokens"] == len(want)
