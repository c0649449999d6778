"""LoRAX/TGI-compatible routes: POST /generate (one answer), POST /generate_stream
(server-sent token events) and POST / (what lorax-client posts: a one-element list, or the
token events when `stream` is true).

`parameters.adapter_id` names the adapter (none: the base model). With `adapter_source`
"local" or "hub" (or none) an id that is not registered is looked up under --adapter-dir
and loaded on first use; "s3" and "pbase" are not served. `merged_adapters` serves a merge
of adapters (`ServedAdapters.merge`). Sampling follows LoRAX: greedy
unless `do_sample` is set or temperature, top_k or top_p ask for sampling. Token log-probs
(required by the token events) are computed for streams and for `details`.
"""

from __future__ import annotations

import json
from dataclasses import fields

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from slora.model.merge import MergeSpec
from slora.request import RequestOutput, SamplingParams
from slora.server.errors import APIError, sse_error
from slora.server.generation import EventStream, Generation, holdback, until_disconnected
from slora.server.protocol import GenerateParameters, GenerateRequest, MergedAdapters
from slora.server.state import ServerState

# SamplingParams' fields -> the request's names for them (for errors naming the field)
RENAMED = {"max_tokens": "max_new_tokens", "logprobs": "return_k_alternatives",
           "ignore_eos": "ignore_eos_token"}
NAMES = {f.name: f"parameters.{RENAMED.get(f.name, f.name)}" for f in fields(SamplingParams)}


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request):
        return await until_disconnected(request, _generate(state, body, False, False))

    @app.post("/generate_stream")
    async def generate_stream(body: GenerateRequest, request: Request):
        return await until_disconnected(request, _generate(state, body, True, False))

    @app.post("/")
    async def compat_generate(body: GenerateRequest, request: Request):
        return await until_disconnected(request, _generate(state, body, body.stream, True))


def _refuse_unsupported(p: GenerateParameters) -> None:
    refused = {
        "best_of": p.best_of not in (None, 1),
        "typical_p": p.typical_p is not None,
        "watermark": p.watermark,
        "response_format": p.response_format is not None
        and p.response_format.get("type") != "json_object",
    }
    for field, asked in refused.items():
        if asked:
            raise APIError(400, f"parameters.{field} is not supported by slora",
                           f"parameters.{field}")
    if p.adapter_source in ("s3", "pbase"):
        raise APIError(400, f"adapter_source {p.adapter_source!r} is not supported: serve "
                       "adapters from --adapter-dir ('local' or 'hub')",
                       "parameters.adapter_source")


def _merge_spec(m: MergedAdapters) -> MergeSpec:
    try:
        return MergeSpec(tuple(m.ids), None if m.weights is None else tuple(m.weights),
                         m.merge_strategy or "linear", m.density, m.majority_sign_method or "total")
    except ValueError as e:
        raise APIError(400, str(e), "parameters.merged_adapters") from None


def _sampling(p: GenerateParameters, details: bool) -> dict:
    temperature = 1.0 if p.temperature is None else p.temperature
    sample = (p.do_sample or temperature != 1.0 or (p.top_k or 0) > 0
              or (p.top_p is not None and p.top_p < 1.0))
    return dict(max_tokens=p.max_new_tokens, temperature=temperature if sample else 0.0,
                top_k=p.top_k or 0, top_p=1.0 if p.top_p is None else p.top_p, seed=p.seed,
                stop=p.stop, ignore_eos=p.ignore_eos_token,
                repetition_penalty=1.0 if p.repetition_penalty is None else p.repetition_penalty,
                logprobs=(p.return_k_alternatives or 0) if details else None,
                prompt_logprobs=0 if details and p.decoder_input_details else None,
                # LoRAX's structured output: JSON its schema accepts (any object without one)
                guided_json=None if p.response_format is None
                else p.response_format.get("schema") or {"type": "object"})


async def _generate(state: ServerState, body: GenerateRequest, stream: bool, as_list: bool):
    state.check_accepting()
    p = body.parameters or GenerateParameters()
    _refuse_unsupported(p)
    if p.decoder_input_details and stream:
        raise APIError(400, "parameters.decoder_input_details is not streamed (as in TGI); "
                       "ask without stream", "parameters.decoder_input_details")

    def prompts(adapter: str | None) -> list[list[int]]:
        ids = state.encode(body.inputs, "inputs", adapter)
        if p.truncate is not None:
            ids = ids[-p.truncate:]
        state.check_length(ids, "inputs")
        return [ids]

    model = merged = None
    if p.merged_adapters is not None:
        if p.adapter_id:
            raise APIError(400, "give parameters.adapter_id or parameters.merged_adapters, not "
                           "both", "parameters.merged_adapters")
        model = merged = await state.adapters.merge(_merge_spec(p.merged_adapters),
                                                    "parameters.merged_adapters")
    try:
        gen = await Generation.open(state, model or p.adapter_id, prompts,
                                    _sampling(p, p.details or stream), names=NAMES,
                                    cache_salt=p.cache_salt)
    finally:
        state.release(merged)  # (Generation holds its own use of it)
    if stream:
        try:
            await gen.wait_started()
        except BaseException:
            gen.close()
            raise
        return EventStream(_events(state, body, p, gen))
    try:
        (out,) = await gen.finals()
    finally:
        gen.close()
    answer = {"generated_text": _full_text(body, p, out)}
    if p.details:
        tokens = [_token(state, p, out, j) for j in range(len(out.token_ids))]
        # the prompt's tokens with decoder_input_details (the first one's log-prob null)
        prefill = [{"id": t, "text": state.token_text(t, out.adapter),
                    "logprob": None if probs is None else probs[t]}
                   for t, probs in zip(out.prompt_token_ids, out.prompt_logprobs or ())]
        answer["details"] = {**_details(state, p, out), "prefill": prefill, "tokens": tokens,
                             "best_of_sequences": None}
    return JSONResponse([answer] if as_list else answer)


def _full_text(body: GenerateRequest, p: GenerateParameters, out: RequestOutput) -> str:
    return body.inputs + out.text if p.return_full_text else out.text


def _details(state: ServerState, p: GenerateParameters, out: RequestOutput) -> dict:
    if out.finish_reason == "length":
        reason = "length"
    elif (out.token_ids and out.token_ids[-1] in state.eos_token_ids
          and not p.ignore_eos_token):
        reason = "eos_token"
    else:
        reason = "stop_sequence"
    return {"finish_reason": reason, "prompt_tokens": len(out.prompt_token_ids),
            "generated_tokens": len(out.token_ids), "seed": p.seed}


def _token(state: ServerState, p: GenerateParameters, out: RequestOutput, j: int,
           text: str | None = None) -> dict:
    """Token j of `out` as a TGI token (`text`: its text, default: the token's own)."""
    tid, probs = out.token_ids[j], out.logprobs[j]
    alternatives = None
    if p.return_k_alternatives:
        top = sorted(probs.items(), key=lambda kv: -kv[1])[:p.return_k_alternatives]
        alternatives = [{"id": t, "text": state.token_text(t, out.adapter), "logprob": v}
                        for t, v in top]
    return {"id": tid, "text": state.token_text(tid, out.adapter) if text is None else text,
            "logprob": probs[tid], "special": tid in state.eos_token_ids,
            "alternative_tokens": alternatives}


async def _events(state: ServerState, body: GenerateRequest, p: GenerateParameters,
                  gen: Generation):
    """One event per generated token. A token's text is what it adds to the output text
    (so the texts add up to generated_text, stop strings cut); text that may begin a stop
    string waits for the token that settles it. The last event carries generated_text and,
    with `details`, the details."""
    sent_text = sent_tokens = 0
    try:
        async for _, out in gen.outputs():
            end = len(out.text) if out.finished else holdback(out.text, p.stop)
            delta = out.text[sent_text:end]
            sent_text = max(sent_text, end)
            # a final output adds a token (EOS, the stop string's, the last one); should one
            # add none, its event repeats the last token with no text
            new = list(range(sent_tokens, len(out.token_ids)))
            if not new and out.finished:
                new = [len(out.token_ids) - 1]
            sent_tokens = len(out.token_ids)
            for j in new:
                last = j == new[-1]
                event = {"token": _token(state, p, out, j, delta if last else ""),
                         "generated_text": None, "details": None}
                if last and out.finished:
                    event["generated_text"] = _full_text(body, p, out)
                    event["details"] = _details(state, p, out) if p.details else None
                yield f"data: {json.dumps(event)}\n\n"
    except APIError as e:
        state.metrics.rejected.labels(str(e.status)).inc()
        yield sse_error(e)
    finally:
        gen.close()
