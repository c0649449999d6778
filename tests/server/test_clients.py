"""The real `openai` and `lorax-client` packages against a real server: completions and chat,
streamed and not, base model and adapters in one concurrent burst, each answer's tokens
equal to the in-process engine's for the same request (greedy)."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
from pathlib import Path

import httpx
import lorax
import pytest
from openai import AsyncOpenAI, NotFoundError, OpenAI

import slora
from slora import SamplingParams

from .conftest import BASE, OWN_TEMPLATE

MAX_TOKENS = 8
CHAT = [{"role": "user", "content": "Hello! How are you today?"}]
IDS = {"return_tokens_as_token_ids": True}
# lorax-client calls pydantic's deprecated .dict()
pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")


def _ids(tokens) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def chat_prompt(reference, adapter) -> list[int]:
    tok = reference.tokenizer
    if adapter == "chatty":  # its directory's own template
        tok = copy.copy(tok)
        tok.chat_template = OWN_TEMPLATE
    return tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)


async def completion(client, model, prompt, stream):
    kw = dict(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
              extra_body=IDS)
    if not stream:
        choice = (await client.completions.create(**kw)).choices[0]
        return _ids(choice.logprobs.tokens), choice.text
    tokens, text = [], ""
    async for chunk in await client.completions.create(stream=True, **kw):
        tokens += chunk.choices[0].logprobs.tokens
        text += chunk.choices[0].text
    return _ids(tokens), text


async def chat(client, model, stream):
    kw = dict(model=model, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
              extra_body=IDS)
    if not stream:
        choice = (await client.chat.completions.create(**kw)).choices[0]
        return _ids(t.token for t in choice.logprobs.content), choice.message.content
    tokens, text = [], ""
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0]
        text += delta.delta.content or ""
        tokens += [t.token for t in (delta.logprobs.content if delta.logprobs else [])]
    return _ids(tokens), text


async def lorax_generate(client, adapter, prompt, stream):
    if not stream:
        res = await client.generate(prompt, adapter_id=adapter, max_new_tokens=MAX_TOKENS)
        assert res.details.generated_tokens == len(res.details.tokens)
        return [t.id for t in res.details.tokens], res.generated_text
    tokens, text, last = [], "", None
    async for event in client.generate_stream(prompt, adapter_id=adapter,
                                              max_new_tokens=MAX_TOKENS):
        tokens.append(event.token.id)
        text += event.token.text
        last = event
    assert last.generated_text == text and last.details.generated_tokens == len(tokens)
    return tokens, text


def test_openai_and_lorax_clients_in_one_burst_equal_in_process_generate(serve, reference):
    prompts = ["Hello world", "The quick brown fox", "Paris is the capital of"]
    jobs, want = [], []  # each job's coroutine, and (prompt ids, adapter) it must equal
    with serve() as live:
        oa = AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        lx = lorax.AsyncClient(live.url)
        for k, adapter in enumerate([None, "a0", "a1"]):
            model, prompt = adapter or BASE, prompts[k]
            for stream in (False, True):
                jobs += [completion(oa, model, prompt, stream), chat(oa, model, stream),
                         lorax_generate(lx, adapter, prompt, stream)]
                ids = reference.tokenizer.encode(prompt)
                want += [(ids, adapter), (chat_prompt(reference, adapter), adapter),
                         (ids, adapter)]
        jobs.append(chat(oa, "chatty", False))
        want.append((chat_prompt(reference, "chatty"), "chatty"))

        async def burst():
            return await asyncio.gather(*jobs)

        got = asyncio.run(burst())
    outs = reference.generate([ids for ids, _ in want],
                              SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                              adapters=[a for _, a in want])
    for (tokens, text), out, (_, adapter) in zip(got, outs, want):
        assert tokens == out.token_ids, adapter
        assert text == out.text, adapter
    # the adapters change the output, so the comparison above tells them apart
    assert len({tuple(o.token_ids) for o in outs[:18:6]}) == 3


def test_n_choices_usage_and_models(serve, reference):
    prompt = "The quick brown fox"
    with serve() as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        res = client.completions.create(model="a1", prompt=prompt, n=2, max_tokens=5,
                                        temperature=0)
        by_ids = client.completions.create(model="a1", prompt=reference.tokenizer.encode(prompt),
                                           max_tokens=5, temperature=0)
        models = client.models.list()
        one = client.models.retrieve("a0")
        with pytest.raises(NotFoundError, match="nope"):
            client.models.retrieve("nope")
        version = httpx.get(f"{live.url}/version").json()
    want = reference.generate(prompt, SamplingParams(max_tokens=5), adapters="a1")[0]
    assert [c.text for c in res.choices] == [want.text] * 2
    assert [c.index for c in res.choices] == [0, 1] and by_ids.choices[0].text == want.text
    assert res.usage.prompt_tokens == len(want.prompt_token_ids)  # each prompt once
    assert res.usage.completion_tokens == 2 * len(want.token_ids)
    listed = {m.id: m for m in models.data}
    assert set(listed) == {BASE, "a0", "a1", "chatty"}
    assert listed["a0"].parent == BASE and listed[BASE].parent is None
    assert one.id == "a0" and one.parent == BASE
    assert version == {"version": slora.__version__}


def test_seeded_choices_differ_and_repeat(serve, reference):
    """n seeded choices are n draws (choice j with seed + j, as vLLM's): they differ, the
    same request gives them again, and choice j equals the engine's draw with seed + j."""
    kw = dict(model=BASE, prompt="The quick brown fox", n=3, max_tokens=MAX_TOKENS,
              temperature=1.5, seed=11, extra_body={"ignore_eos": True})
    with serve() as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        first, again = (client.completions.create(**kw) for _ in range(2))
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices] and len(set(texts)) == 3
    for j, text in enumerate(texts):
        want = reference.generate("The quick brown fox", SamplingParams(
            max_tokens=MAX_TOKENS, temperature=1.5, seed=11 + j, ignore_eos=True))[0]
        assert text == want.text


def test_stop_string_streamed_never_sends_text_it_cuts(serve, reference):
    full = reference.generate("Hello world", SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2:][:3]
    if not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string here")
    want = reference.generate("Hello world", SamplingParams(max_tokens=12, ignore_eos=True,
                                                            stop=[stop]))[0]
    body = {"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop": stop}
    with serve() as live:
        plain = httpx.post(f"{live.url}/v1/completions", json=body).json()["choices"][0]
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        chunks = list(client.completions.create(model=BASE, stream=True, **{
            k: v for k, v in body.items() if k != "ignore_eos"}, extra_body={"ignore_eos": True}))
        events = list(lorax.Client(live.url).generate_stream(
            "Hello world", max_new_tokens=12, ignore_eos_token=True, stop_sequences=[stop]))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert plain["text"] == streamed == want.text and stop not in streamed
    assert plain["finish_reason"] == chunks[-1].choices[0].finish_reason == "stop"
    assert "".join(e.token.text for e in events) == events[-1].generated_text == want.text
    assert events[-1].details.finish_reason == "stop_sequence"


def test_penalties_bias_and_min_tokens_reach_the_engine(serve, reference):
    """OpenAI's penalties and logit_bias (keys as strings), vLLM's repetition_penalty, min_p
    and min_tokens, and LoRAX's repetition_penalty give the in-process engine's tokens."""
    prompt, eos = "The quick brown fox", reference.eos_token_ids[0]
    forced = reference.tokenizer.encode(prompt)[-1]
    cases = [(dict(frequency_penalty=1.5, presence_penalty=0.5),
              dict(frequency_penalty=1.5, presence_penalty=0.5)),
             (dict(logit_bias={str(forced): 100}), dict(logit_bias={forced: 100.0})),
             (dict(extra_body={"repetition_penalty": 1.7, "min_p": 0.5}),
              dict(repetition_penalty=1.7, min_p=0.5)),
             (dict(logit_bias={str(eos): 100}, extra_body={"min_tokens": 3}),
              dict(logit_bias={eos: 100.0}, min_tokens=3))]
    with serve() as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        got = [client.completions.create(model="a0", prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, logprobs=0, **{
                                             **kw, "extra_body": {**IDS, **kw.get(
                                                 "extra_body", {})}}).choices[0]
               for kw, _ in cases]
        lx = lorax.Client(live.url).generate(prompt, adapter_id="a0", max_new_tokens=MAX_TOKENS,
                                             repetition_penalty=1.7)
        stop_kept = httpx.post(f"{live.url}/v1/completions", json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": [" "],
            "include_stop_str_in_output": True})
    for choice, (_, ours) in zip(got, cases):
        want = reference.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, **ours),
                                  adapters="a0")[0]
        assert _ids(choice.logprobs.tokens) == want.token_ids, ours
        assert choice.finish_reason == want.finish_reason
    assert _ids(got[1].logprobs.tokens) == [forced] * MAX_TOKENS
    ended = _ids(got[3].logprobs.tokens)  # EOS as soon as min_tokens allows
    assert len(ended) == 4 and ended[-1] == eos and got[3].finish_reason == "stop"
    want = reference.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS,
                                                     repetition_penalty=1.7), adapters="a0")[0]
    assert [t.id for t in lx.details.tokens] == want.token_ids
    kept = stop_kept.json()["choices"][0]
    assert kept["text"] == reference.generate(prompt, SamplingParams(
        max_tokens=MAX_TOKENS, stop=[" "], include_stop_str_in_output=True))[0].text
    assert kept["text"].endswith(" ") and kept["finish_reason"] == "stop"


def test_lorax_sync_client_details_and_alternatives(serve, reference):
    with serve() as live:
        client = lorax.Client(live.url)
        res = client.generate("Hello world", adapter_id="a0", max_new_tokens=6,
                              return_k_alternatives=2)
        plain = httpx.post(f"{live.url}/generate", json={
            "inputs": "Hello world", "parameters": {"adapter_id": "a0", "max_new_tokens": 6,
                                                    "return_full_text": True}}).json()
    want = reference.generate("Hello world", SamplingParams(max_tokens=6), adapters="a0")[0]
    d = res.details
    assert res.generated_text == want.text and [t.id for t in d.tokens] == want.token_ids
    assert d.finish_reason == "length" and d.prompt_tokens == len(want.prompt_token_ids)
    for token in d.tokens:  # the chosen token's log-prob, the top two alternatives
        best = token.alternative_tokens[0]
        assert len(token.alternative_tokens) == 2 and best.logprob >= token.logprob - 1e-6
    assert plain == {"generated_text": "Hello world" + want.text}  # /generate: an object


def example(name: str):
    """examples/NAME.py, imported as a module (its `main(argv)` runs it)."""
    path = Path(__file__).resolve().parents[2] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lorax_example_sends_its_multi_adapter_batch(serve, capsys):
    with serve() as live:
        example("lorax_client").main(["--url", live.url, "--adapters", "a0,a1", "--question",
                                      "Hello world", "--template", "{}",
                                      "--max-new-tokens", "4"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["base", "a0", "a1", "a0, streamed"]
    assert all("(length, 4 tokens)" in line for line in lines[:3])
    answer = lines[1].split(": ", 1)[1].rsplit(" (", 1)[0]
    assert lines[3] == f"a0, streamed: {answer}"  # the stream adds up to the same answer


def test_tokenize_and_detokenize(serve, reference):
    """vLLM's /tokenize (a prompt, or chat messages through the template the model's chats
    use) and /detokenize give the engine's own token ids and text; bad input is a 400."""
    prompt = "The quick brown fox"
    with serve() as live:
        url = live.url
        plain = httpx.post(f"{url}/tokenize", json={"prompt": prompt}).json()
        chat = httpx.post(f"{url}/tokenize", json={"model": "chatty", "messages": CHAT}).json()
        text = httpx.post(f"{url}/detokenize", json={"tokens": plain["tokens"]}).json()
        both = httpx.post(f"{url}/tokenize", json={"prompt": prompt, "messages": CHAT})
        past = httpx.post(f"{url}/detokenize", json={"tokens": [0, 10 ** 6]})
        unknown = httpx.post(f"{url}/tokenize", json={"model": "nope", "prompt": prompt})
    ids = reference.tokenizer.encode(prompt)
    assert plain == {"count": len(ids), "max_model_len": reference.max_model_len, "tokens": ids,
                     "token_strs": None}
    assert chat["tokens"] == chat_prompt(reference, "chatty")  # the adapter's own template
    assert text == {"prompt": reference.tokenizer.decode(ids, skip_special_tokens=False)}
    assert both.status_code == 400 and "either prompt or messages" in both.text
    assert past.status_code == 400 and "[1000000] are outside the vocabulary" in past.text
    assert unknown.status_code == 404


def test_echo_puts_each_prompt_before_its_completion(serve, reference):
    """echo: each choice's text is its prompt (a string as sent, ids as their text) then its
    completion, streamed or not."""
    prompts = ["The quick brown fox", "Paris is"]
    ids = reference.tokenizer.encode("Hello world")
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    wants = reference.generate(prompts + [ids], sp)
    with serve() as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model=BASE, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, n=2,
                  echo=True, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw)
        streamed = ["", "", "", ""]
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                streamed[c.index] += c.text
        by_ids = client.completions.create(**{**kw, "prompt": ids, "n": 1})
    want = [p + w.text for p, w in zip(prompts, wants) for _ in range(2)]
    assert [c.text for c in whole.choices] == want == streamed
    echoed = reference.tokenizer.decode(ids, skip_special_tokens=False)
    assert echoed.startswith("<s>")  # the ids' text keeps their special tokens
    assert by_ids.choices[0].text == echoed + wants[2].text


def test_prompt_logprobs_over_openai_and_lorax(serve, reference):
    """The prompt's log-probs, as the in-process engine gives them: OpenAI's echo with
    logprobs (lm-eval's loglikelihood request: max_tokens 0 or 1), streamed or not; vLLM's
    prompt_logprobs in completions and chat; LoRAX's decoder_input_details."""
    prompt, k = "The quick brown fox", 2
    sp = SamplingParams(max_tokens=3, ignore_eos=True, logprobs=k, prompt_logprobs=k)
    want = reference.generate(prompt, sp, adapters="a0")[0]
    ids, entries = want.prompt_token_ids, want.prompt_logprobs
    chat_ids = chat_prompt(reference, "a1")
    chat_want = reference.generate([chat_ids], SamplingParams(max_tokens=2, prompt_logprobs=1),
                                   adapters="a1")[0]
    with serve() as live:
        client = OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="a0", prompt=prompt, temperature=0, echo=True, logprobs=k,
                  extra_body={"ignore_eos": True, **IDS})
        scored_all = client.completions.create(max_tokens=0, **kw)
        scored = scored_all.choices[0]
        whole = client.completions.create(max_tokens=3, **kw).choices[0]
        chunks = list(client.completions.create(max_tokens=3, stream=True, **kw))
        vllm = httpx.post(f"{live.url}/v1/completions", json={
            "model": "a0", "prompt": prompt, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "prompt_logprobs": k}).json()
        chat = httpx.post(f"{live.url}/v1/chat/completions", json={
            "model": "a1", "messages": CHAT, "max_tokens": 2, "temperature": 0,
            "prompt_logprobs": 1}).json()
        lx = lorax.Client(live.url).generate(prompt, adapter_id="a0", max_new_tokens=3,
                                             decoder_input_details=True)
    # max_tokens 0: the prompt alone, every token scored but the first
    assert scored.text == prompt and scored.finish_reason == "length"
    assert scored_all.usage.completion_tokens == 0
    lp = scored.logprobs
    assert _ids(lp.tokens) == ids and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [e[t] for e, t in zip(entries[1:], ids[1:])]
    for top, e in zip(lp.top_logprobs[1:], entries[1:]):
        best = sorted(e.values(), reverse=True)[:k]
        assert sorted(top.values(), reverse=True) == best
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # with output tokens: the prompt's entries, then the output's, streamed alike
    assert _ids(whole.logprobs.tokens) == ids + want.token_ids
    assert whole.logprobs.token_logprobs[len(ids):] == [
        e[t] for e, t in zip(want.logprobs, want.token_ids)]
    assert _ids([t for c in chunks for t in c.choices[0].logprobs.tokens]) == ids + want.token_ids
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    # vLLM's field: per prompt token, null first, then {id: {logprob, decoded_token}}
    got = vllm["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    assert [{int(t): v["logprob"] for t, v in e.items()} for e in got[1:]] == entries[1:]
    assert vllm["choices"][0]["logprobs"] is None
    assert [{int(t): v["logprob"] for t, v in e.items()} if e else e
            for e in chat["prompt_logprobs"]] == chat_want.prompt_logprobs
    # LoRAX: details.prefill, the prompt's tokens (the first one's log-prob null)
    assert [t.id for t in lx.details.prefill] == ids and lx.details.prefill[0].logprob is None
    assert [t.logprob for t in lx.details.prefill[1:]] == [
        e[t] for e, t in zip(entries[1:], ids[1:])]
    assert [t.id for t in lx.details.tokens] == want.token_ids


def test_lorax_merged_adapters(serve, reference, monkeypatch):
    """LoRAX's merged_adapters through lorax-client: the answer equals the in-process engine
    serving the same merge; the merge stays registered for the next request (not listed as
    a model); past MAX_MERGED the idle one goes; unloading a part unloads its merges."""
    from lorax import MergedAdapters

    import slora.server.adapters as served
    from slora import MergeSpec

    monkeypatch.setattr(served, "MAX_MERGED", 1)
    spec = dict(ids=["m0", "a1"], weights=[0.6, 0.4], merge_strategy="ties", density=0.5)
    reference.add_adapter("m0", reference.adapters.get("a0").source)
    reference.add_merged_adapter("ref-merge", MergeSpec(("m0", "a1"), (0.6, 0.4), "ties", 0.5))
    want = reference.generate("Hello world", SamplingParams(max_tokens=6),
                              adapters="ref-merge")[0]
    reference.remove_adapter("ref-merge")
    reference.remove_adapter("m0")
    with serve() as live:
        assert httpx.post(f"{live.url}/v1/load_lora_adapter", json={
            "lora_name": "m0", "lora_path": "a0"}).status_code == 200
        client = lorax.Client(live.url)
        res = [client.generate("Hello world", merged_adapters=MergedAdapters(**spec),
                               max_new_tokens=6) for _ in range(2)]
        merges = list(live.state.adapters.merged)
        models = httpx.get(f"{live.url}/v1/models").json()["data"]
        other = client.generate("Hello world", max_new_tokens=2, merged_adapters=MergedAdapters(
            ids=["m0", "a1"], weights=[1.0, 1.0], density=1.0))
        after_other = list(live.state.adapters.merged)
        unknown = httpx.post(f"{live.url}/generate", json={"inputs": "Hi", "parameters": {
            "merged_adapters": {"ids": ["a0", "nope"]}}})
        both = httpx.post(f"{live.url}/generate", json={"inputs": "Hi", "parameters": {
            "adapter_id": "a0", "merged_adapters": {"ids": ["a0"]}}})
        ranks = httpx.post(f"{live.url}/generate", json={"inputs": "Hi", "parameters": {
            "merged_adapters": {"ids": ["a0"], "merge_strategy": "svd"}}})
        assert httpx.post(f"{live.url}/v1/unload_lora_adapter",
                          json={"lora_name": "m0"}).status_code == 200
        left = list(live.state.adapters.merged)
        registered = live.state.engine.call(live.state.engine.engine.list_adapters)
    assert [r.generated_text for r in res] == [want.text] * 2
    assert len(merges) == 1 and merges[0] not in {m["id"] for m in models}
    assert other.details.generated_tokens == 2
    assert len(after_other) == 1 and after_other != merges  # the idle merge made room
    assert unknown.status_code == 404 and "nope" in unknown.text
    assert both.status_code == 400 and "not both" in both.text
    assert ranks.status_code == 400 and "strategy='svd'" in ranks.text
    assert left == [] and "m0" not in registered
    assert not any(n.startswith("merged-") for n in registered)


def test_structured_example_gets_what_it_asks_for(serve, capsys):
    with serve() as live:
        example("structured").main(["--url", live.url, "--model", BASE, "--adapter", "a0",
                                    "--max-tokens", "160"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "a0, JSON", "label", "tool call", "log-likelihoods"]
    assert lines[1] in ("label: positive", "label: negative")
    assert lines[2].startswith("tool call: get_weather({'city': ")
    assert "'topic': " in lines[0] and "'answer': " in lines[0]
