"""Adapters at run time: vLLM's load and unload endpoints, paths confined to the adapter
directory, lookup by name on first use (OpenAI `model`, LoRAX `adapter_id` with
adapter_source "local"), an unload that lets running requests finish, a pluggable resolver."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import httpx
import lorax
import pytest

from slora import SamplingParams
from slora.server.adapters import AdapterResolver

from .test_front_door import error_of, post

pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecatedSince20")


@pytest.fixture
def extra(adapter_dir):
    """Adapter directories made for one test (copies of a0 and a1), removed after it."""
    made = []

    def copy(name: str, like: str = "a0") -> Path:
        path = adapter_dir / name
        shutil.copytree(adapter_dir / like, path)
        made.append(path)
        return path

    yield copy
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def names(live) -> set[str]:
    return {m["id"] for m in httpx.get(f"{live.url}/v1/models").json()["data"]}


def test_load_use_and_unload(serve, extra, reference):
    extra("rt", like="a1")
    want = reference.generate("Hello", SamplingParams(max_tokens=6), adapters="a1")[0]
    with serve() as live:
        res = post(live, "/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": "rt"})
        assert res.status_code == 200 and "rt" in names(live)
        again = post(live, "/v1/load_lora_adapter", {"lora_name": "rt", "lora_path": "rt"})
        assert "already loaded" in error_of(again, 400, "lora_name")
        out = post(live, "/v1/completions", {"model": "rt", "prompt": "Hello", "max_tokens": 6,
                                             "temperature": 0}).json()
        assert out["choices"][0]["text"] == want.text
        assert post(live, "/v1/unload_lora_adapter", {"lora_name": "rt"}).status_code == 200
        assert "rt" not in names(live)
        error_of(post(live, "/v1/unload_lora_adapter", {"lora_name": "rt"}), 404, "lora_name")


def test_paths_outside_the_adapter_dir_are_refused(serve, adapter_dir, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(adapter_dir / "a0", outside)
    link = adapter_dir / "escape"
    link.symlink_to(outside, target_is_directory=True)
    try:
        with serve() as live:
            for path in ("../outside", str(outside), "escape", f"{adapter_dir}/../outside"):
                res = post(live, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": path})
                assert "outside the adapter directory" in error_of(res, 403, "lora_path")
            res = post(live, "/v1/completions", {"model": "../outside", "prompt": "Hi"})
            error_of(res, 403, "model")
            error_of(post(live, "/v1/completions", {"model": "escape", "prompt": "Hi"}), 403,
                     "model")
            assert "x" not in names(live)
        with serve(adapter_dir=None) as live:  # no adapter directory: no paths at all
            res = post(live, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(outside)})
            assert "--adapter-dir" in error_of(res, 403, "lora_path")
        with serve(allow_any_adapter_path=True) as live:
            res = post(live, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(outside)})
            assert res.status_code == 200
            assert post(live, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 200
    finally:
        link.unlink()


def test_malformed_adapter_is_400(serve, extra):
    bad = extra("bad")
    (bad / "adapter_config.json").write_text('{"r": 0, "peft_type": "LORA"}')
    with serve() as live:
        res = post(live, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "bad"})
        assert "cannot be loaded" in error_of(res, 400, "lora_path")
        error_of(post(live, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": "nothing"}),
                 404, "lora_path")
        assert "bad" not in names(live)


def test_names_and_local_paths_load_on_first_use(serve, extra, adapter_dir, reference):
    path = extra("jit", like="a1")
    want = reference.generate("Hello", SamplingParams(max_tokens=5), adapters="a1")[0]
    with serve() as live:
        assert "jit" not in names(live)
        res = lorax.Client(live.url).generate("Hello", adapter_id=str(path),
                                              adapter_source="local", max_new_tokens=5)
        assert res.generated_text == want.text and str(path) in names(live)
        out = post(live, "/v1/completions", {"model": "jit", "prompt": "Hello", "max_tokens": 5,
                                             "temperature": 0}).json()
        assert out["choices"][0]["text"] == want.text and "jit" in names(live)
        for name in ("jit", str(path)):
            assert post(live, "/v1/unload_lora_adapter", {"lora_name": name}).status_code == 200


def test_unload_waits_for_running_requests(serve, extra):
    extra("busy")
    body = {"model": "busy", "prompt": "Hi", "max_tokens": 60, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with serve() as live:
        assert post(live, "/v1/load_lora_adapter",
                    {"lora_name": "busy", "lora_path": "busy"}).status_code == 200

        async def main():
            async with httpx.AsyncClient(base_url=live.url, timeout=60) as client:
                async with client.stream("POST", "/v1/completions", json=body) as stream:
                    lines = stream.aiter_lines()
                    await anext(lines)  # running now
                    unload = asyncio.create_task(client.post(
                        "/v1/unload_lora_adapter", json={"lora_name": "busy"}))
                    while "busy" not in live.state.adapters.unloading:
                        await asyncio.sleep(0.01)
                    refused = await client.post("/v1/completions", json={**body, "stream": False})
                    rest = [line async for line in lines]
                    assert not unload.done()  # it waits for the stream...
                return refused, rest, await unload  # ...and ends after it

        refused, rest, unload = asyncio.run(main())
        assert "being unloaded" in error_of(refused, 404, "model")
        assert rest[-2:] == ["data: [DONE]", ""] and '"finish_reason": "length"' in rest[-4]
        assert unload.status_code == 200 and "busy" not in names(live)


def test_a_resolver_plugs_in(serve, adapter_dir):
    class Aliases(AdapterResolver):
        def resolve(self, name):
            return adapter_dir / "a1" if name == "alias" else None

    with serve(resolver=Aliases()) as live:
        res = post(live, "/v1/completions", {"model": "alias", "prompt": "Hi", "max_tokens": 2})
        assert res.status_code == 200 and "alias" in names(live)
        error_of(post(live, "/v1/completions", {"model": "other", "prompt": "Hi"}), 404, "model")
        assert post(live, "/v1/unload_lora_adapter", {"lora_name": "alias"}).status_code == 200
