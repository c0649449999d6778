"""The app: `build_app(async_engine, settings) -> FastAPI`, and `DrainingServer`, the uvicorn
server that drains on SIGTERM.

Routes: the OpenAI API (slora.server.openai_api, and its Responses API in
slora.server.responses_api), the LoRAX API (slora.server.lorax_api),
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), GET /health, GET /metrics.

The front door (`FrontDoor`, an ASGI middleware) checks, before any handler runs: the Bearer
key (every route but /health, when `api_key` is set; 401) and the body size (413, the body
left unread past the limit); it counts the requests being answered. Every error is JSON in
OpenAI's shape (slora.server.errors).

Draining: SIGTERM sets `draining` (new generation requests and /health answer 503), uvicorn
closes the listening socket and waits for the open connections to finish their answers,
then the lifespan waits for the last request; the engine keeps stepping meanwhile. Whoever
made the AsyncEngine shuts it down after the server returns.
"""

from __future__ import annotations

import asyncio
import hmac
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from slora.async_engine import AsyncEngine
from slora.server import lorax_api, openai_api, responses_api
from slora.server.errors import APIError, error_body
from slora.server.metrics import engine_snapshot
from slora.server.protocol import LoadAdapterRequest, UnloadAdapterRequest
from slora.server.settings import ServerSettings
from slora.server.state import ServerState


def build_app(engine: AsyncEngine, settings: ServerSettings | None = None) -> FastAPI:
    """The HTTP app over a running AsyncEngine (warmed up by the caller if wanted). The app
    does not own the engine. `app.state.slora` is its ServerState."""
    settings = settings or ServerSettings()
    state = ServerState(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.ready = True
        yield
        state.draining = True
        while state.inflight:
            await asyncio.sleep(0.05)

    app = FastAPI(title="slora", summary="OpenAI- and LoRAX-compatible LoRA serving",
                  lifespan=lifespan)
    app.state.slora = state
    app.add_middleware(FrontDoor, state=state)
    _add_error_handlers(app, state)

    @app.get("/health")
    async def health():
        if state.ready and not state.draining and engine.alive:
            return Response(status_code=200)
        reason = ("draining" if state.draining else "starting" if not state.ready
                  else "the engine is not running")
        return JSONResponse(error_body(503, reason), 503, headers=state.retry_after)

    @app.get("/metrics")
    async def metrics():
        loop = asyncio.get_running_loop()
        try:
            snapshot = await loop.run_in_executor(None, engine.call, engine_snapshot,
                                                  engine.engine)
        except RuntimeError:  # the engine has ended: the server's own metrics only
            snapshot = None
        return Response(state.metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadAdapterRequest):
        await state.adapters.load(body.lora_name, body.lora_path, body.load_inplace)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadAdapterRequest):
        await state.adapters.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 "successfully.")

    openai_api.register(app, state)
    responses_api.register(app, state)
    lorax_api.register(app, state)
    return app


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    def answer(error: APIError) -> JSONResponse:
        state.metrics.rejected.labels(str(error.status)).inc()
        return JSONResponse(error.body(), error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return answer(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return answer(validation_answer(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return answer(APIError(e.status_code, str(e.detail), headers=e.headers))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        return answer(APIError(500, f"internal error: {type(e).__name__}: {e}"))


def validation_answer(errors) -> APIError:
    """400 for a body FastAPI could not parse or validate: malformed JSON, a missing field, a
    value of the wrong type or out of range, each naming the field (`param`: the first)."""
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            why = err.get("ctx", {}).get("error", err.get("msg"))
            parts.append(f"malformed JSON body: {why}"
                         + (f" (at character {loc[0]})" if loc else ""))
            continue
        where = ".".join(loc) or "body"
        param = param or where
        parts.append(f"{where}: {err.get('msg')}")
    more = f" (and {len(parts) - 3} more)" if len(parts) > 3 else ""
    return APIError(400, "; ".join(parts[:3]) + more, param)


class FrontDoor:
    """ASGI middleware: API key, body size limit, in-flight count (see the module docstring).
    A body within the limit is read whole and replayed to the app."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.settings.api_key
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.state.inflight += 1
        try:
            await self._handle(scope, receive, send)
        finally:
            self.state.inflight -= 1

    async def _handle(self, scope, receive, send) -> None:
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await self._refuse(scope, receive, send, APIError(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    headers={"WWW-Authenticate": "Bearer"}))
        limit = self.state.settings.max_body_bytes
        too_big = APIError(413, f"the request body exceeds {limit} bytes (--max-body-bytes)")
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, too_big)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client has gone
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._refuse(scope, receive, send, too_big)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)

        async def replay():
            nonlocal body
            if body is not None:
                message, body = {"type": "http.request", "body": body, "more_body": False}, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, error: APIError) -> None:
        self.state.metrics.rejected.labels(str(error.status)).inc()
        response = JSONResponse(error.body(), error.status, headers=error.headers)
        await response(scope, receive, send)


class DrainingServer(uvicorn.Server):
    """uvicorn's server over a `build_app` app; on SIGTERM (or `handle_exit`) the app starts
    draining before uvicorn's graceful shutdown (see the module docstring)."""

    def __init__(self, app: FastAPI, **config) -> None:
        super().__init__(uvicorn.Config(app, **config))
        self.app_state: ServerState = app.state.slora

    def handle_exit(self, sig, frame) -> None:
        self.app_state.draining = True
        super().handle_exit(sig, frame)
