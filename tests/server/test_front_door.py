"""The front door: every bad input gets a JSON error in OpenAI's shape naming the field and
the reason, a full queue gets 503 with Retry-After, a client that goes away aborts its
request, an engine error fails only its own request, and the API key is enforced."""

from __future__ import annotations

import json
import threading
import time

import httpx
import lorax
import pytest
from lorax.errors import BadRequestError, NotFoundError

from .conftest import BASE, wait_idle

pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")


def error_of(res: httpx.Response, status: int, param: str | None = None) -> str:
    """The error message of an answer that must be `status` in OpenAI's error shape."""
    assert res.status_code == status, res.text
    err = res.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param
    return err["message"]


@pytest.fixture
def live(serve):
    with serve() as live:
        yield live


def post(live, path, body, **kw) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=30, **kw)


def test_malformed_json_and_bad_types_are_400_naming_the_field(live):
    res = httpx.post(f"{live.url}/v1/completions", content=b'{"prompt": "Hi",',
                     headers={"Content-Type": "application/json"})
    assert "malformed JSON" in error_of(res, 400)
    res = post(live, "/v1/completions", {"prompt": "Hi", "temperature": "hot"})
    assert "valid number" in error_of(res, 400, "temperature")
    res = post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": 2.5})
    assert "integer" in error_of(res, 400, "max_tokens")
    assert "required" in error_of(post(live, "/v1/chat/completions", {"model": BASE}), 400,
                                  "messages")
    res = post(live, "/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": "many"}})
    assert "integer" in error_of(res, 400, "parameters.max_new_tokens")
    assert "n:" in error_of(post(live, "/v1/completions", {"prompt": "Hi", "n": 0}), 400, "n")


def test_bad_sampling_values_are_400_naming_the_field(live):
    cases = [("/v1/completions", {"prompt": "Hi", "top_p": 3}, "top_p"),
             ("/v1/completions", {"prompt": "Hi", "temperature": -1}, "temperature"),
             ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                       "top_k": -5}, "top_k"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                       "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
             ("/generate", {"inputs": "Hi", "parameters": {"max_new_tokens": 0}},
              "parameters.max_new_tokens"),
             ("/v1/completions", {"prompt": "Hi", "presence_penalty": 3}, "presence_penalty"),
             ("/v1/completions", {"prompt": "Hi", "frequency_penalty": -2.5},
              "frequency_penalty"),
             ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty"),
             ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "min_tokens": 3},
              "min_tokens"),
             ("/v1/completions", {"prompt": "Hi", "min_p": 1.5}, "min_p"),
             ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 50}, "prompt_logprobs"),
             ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 50}, "logprobs"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                       "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
             ("/generate_stream", {"inputs": "Hi", "parameters": {
                 "details": True, "decoder_input_details": True}},
              "parameters.decoder_input_details"),
             ("/v1/completions", {"prompt": "Hi", "logit_bias": {"3": 500}}, "logit_bias"),
             ("/generate", {"inputs": "Hi", "parameters": {"repetition_penalty": -1}},
              "parameters.repetition_penalty")]
    for path, body, param in cases:
        assert param in error_of(post(live, path, body), 400, param)
    res = post(live, "/v1/completions", {"prompt": "Hi", "logit_bias": {"abc": 1}})
    assert "'abc' is not a token id" in error_of(res, 400, "logit_bias")
    res = post(live, "/v1/completions", {"prompt": "Hi", "logit_bias": {"99999": 1}})
    assert "logit_bias token ids [99999] are outside the vocabulary" in error_of(res, 400)
    res = post(live, "/generate", {"inputs": "Hi", "parameters": {"typical_p": 0.5}})
    assert "not supported" in error_of(res, 400, "parameters.typical_p")
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for field, value in (("response_format", {"type": "grammar"}),
                         ("best_of", 2), ("guided_grammar", "root ::= a"),
                         ("structured_outputs", {"grammar": "root ::= a"})):
        res = post(live, "/v1/chat/completions", {**chat, field: value})
        assert "not supported by slora" in error_of(res, 400, field)
    # their neutral values pass
    res = post(live, "/v1/chat/completions", {**chat, "response_format": {"type": "text"},
                                              "tools": [], "best_of": 1})
    assert res.status_code == 200, res.text


def test_unknown_adapter_is_404(live):
    res = post(live, "/v1/completions", {"model": "nope", "prompt": "Hi"})
    assert "'nope'" in error_of(res, 404, "model")
    with pytest.raises(NotFoundError, match="nope"):
        lorax.Client(live.url).generate("Hi", adapter_id="nope")


def test_prompt_longer_than_the_model_is_400(live):
    long = "Hello world " * 200
    assert "max_model_len" in error_of(post(live, "/v1/completions", {"prompt": long}), 400,
                                       "prompt")
    res = post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": long}]})
    assert "tokens" in error_of(res, 400, "messages")
    with pytest.raises(BadRequestError, match="max_model_len"):
        lorax.Client(live.url).generate(long)


def test_body_over_the_limit_is_413_read_or_not(serve):
    with serve(max_body_bytes=1000) as live:
        big = {"prompt": "x" * 2000}
        assert "1000 bytes" in error_of(post(live, "/v1/completions", big), 413)

        def chunks():  # no Content-Length: the size is counted as the body arrives
            data = json.dumps(big).encode()
            for i in range(0, len(data), 256):
                yield data[i:i + 256]

        res = httpx.post(f"{live.url}/v1/completions", content=chunks(),
                         headers={"Content-Type": "application/json"})
        error_of(res, 413)
        assert post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def block_engine(async_engine, seconds: float) -> threading.Thread:
    """Hold the engine thread for `seconds`: requests sent meanwhile wait in the queue."""
    thread = threading.Thread(target=async_engine.call, args=(time.sleep, seconds))
    thread.start()
    time.sleep(0.05)
    return thread


def test_full_waiting_queue_is_503_with_retry_after(serve, async_engine):
    with serve(max_waiting=2) as live:
        blocker = block_engine(async_engine, 1.0)
        answers = []
        senders = [threading.Thread(target=lambda: answers.append(post(
            live, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}))) for _ in range(2)]
        for t in senders:
            t.start()
        while live.state.pending < 2:  # both submitted, neither has a token yet
            time.sleep(0.01)
        res = post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert "too many requests waiting" in error_of(res, 503)
        assert res.headers["Retry-After"] == "1"
        for t in senders + [blocker]:
            t.join()
    assert [a.status_code for a in answers] == [200, 200]


@pytest.fixture
def aborts(async_engine, monkeypatch):
    """The ids of requests the engine aborted while they were unfinished."""
    seen = []
    engine = async_engine.engine
    real = engine.abort

    def abort(rid):
        seen.append(rid)
        real(rid)

    monkeypatch.setattr(engine, "abort", abort)
    return seen


def test_client_that_disconnects_aborts_its_request(live, async_engine, aborts):
    body = {"prompt": "Hi", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}) as r:
        next(r.iter_lines())  # the first event; then the client goes away
    deadline = time.monotonic() + 10
    while not aborts and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(aborts) == 1
    stats = wait_idle(async_engine)
    assert stats["pages_kv"] == 0 and stats["num_running"] == 0

    blocker = block_engine(async_engine, 1.0)  # the request waits; the client gives up first
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json=body, timeout=0.3)
    blocker.join()
    while len(aborts) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(aborts) == 2 and wait_idle(async_engine)["pages_kv"] == 0
    metrics = httpx.get(f"{live.url}/metrics").text
    assert f'slora_requests_total{{adapter="{BASE}",finish_reason="abort"}} 2.0' in metrics


def test_engine_error_fails_its_request_and_the_server_serves_on(serve, adapter_dir, tmp_path):
    import shutil

    broken = adapter_dir / "broken"
    shutil.copytree(adapter_dir / "a1", broken)
    try:
        with serve() as live:
            assert post(live, "/v1/load_lora_adapter",
                        {"lora_name": "broken", "lora_path": "broken"}).status_code == 200
            (broken / "adapter_model.safetensors").unlink()  # its weights vanish before use
            res = post(live, "/v1/completions", {"model": "broken", "prompt": "Hi"})
            assert "broken" in error_of(res, 500)
            with httpx.stream("POST", f"{live.url}/v1/completions", json={
                    "model": "broken", "prompt": "Hi", "stream": True}) as r:
                assert r.status_code == 500 and "broken" in r.read().decode()
            ok = post(live, "/v1/completions", {"model": "a0", "prompt": "Hi", "max_tokens": 3})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
            assert post(live, "/v1/unload_lora_adapter", {"lora_name": "broken"}).status_code == 200
    finally:
        shutil.rmtree(broken)


def test_api_key_is_required_but_not_for_health(serve):
    with serve(api_key="s3cret") as live:
        body = {"prompt": "Hi", "max_tokens": 2}
        assert "API key" in error_of(post(live, "/v1/completions", body), 401)
        res = post(live, "/v1/completions", body, headers={"Authorization": "Bearer wrong"})
        assert res.status_code == 401 and res.headers["WWW-Authenticate"] == "Bearer"
        assert httpx.get(f"{live.url}/metrics").status_code == 401
        assert httpx.get(f"{live.url}/health").status_code == 200
        res = post(live, "/v1/completions", body, headers={"Authorization": "Bearer s3cret"})
        assert res.status_code == 200


def test_draining_answers_503_and_unknown_routes_are_json(live):
    error_of(httpx.get(f"{live.url}/nowhere"), 404)
    error_of(httpx.get(f"{live.url}/v1/completions"), 405)
    assert httpx.get(f"{live.url}/health").status_code == 200
    live.state.draining = True
    res = httpx.get(f"{live.url}/health")
    assert res.status_code == 503 and res.headers["Retry-After"] == "1"
    res = post(live, "/v1/completions", {"prompt": "Hi"})
    assert "shutting down" in error_of(res, 503) and res.headers["Retry-After"] == "1"


def test_engine_error_mid_stream_ends_it_with_an_error_event(live, monkeypatch):
    from lorax.errors import GenerationError

    from slora.tokenizer import IncrementalDecoder

    real = IncrementalDecoder.update

    def update(self, ids):  # detokenising fails at the fourth token of any request
        if len(ids) == 4:
            raise RuntimeError("injected detokenising fault")
        return real(self, ids)

    monkeypatch.setattr(IncrementalDecoder, "update", update)
    body = {"prompt": "Hi", "max_tokens": 10, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body) as res:
        events = [line[6:] for line in res.iter_lines() if line.startswith("data: ")]
    assert res.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 500 and "injected detokenising fault" in error["message"]
    with pytest.raises(GenerationError, match="injected"):
        list(lorax.Client(live.url).generate_stream("Hi", max_new_tokens=10))
    monkeypatch.undo()
    ok = post(live, "/v1/completions", {"prompt": "Hi", "max_tokens": 5, "ignore_eos": True})
    assert ok.json()["usage"]["completion_tokens"] == 5
