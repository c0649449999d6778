"""What every handler of one app shares: the engine, the settings, the adapters, the metrics,
and the counters that bound and drain the traffic."""

from __future__ import annotations

import itertools
import re
import uuid

from slora.async_engine import AsyncEngine, EngineDeadError
from slora.server.adapters import LocalDirResolver, ServedAdapters
from slora.server.errors import APIError
from slora.server.metrics import ServerMetrics
from slora.server.settings import ServerSettings


class ServerState:
    """`pending`: engine requests submitted whose first output has not arrived (bounded by
    `settings.max_waiting`). `inflight`: HTTP requests being answered, streams included.
    `draining`: set on SIGTERM; generation requests and /health answer 503 from then on."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        eng = engine.engine  # fixed at construction: safe to read from the server's thread
        self.tokenizer = eng.tokenizer
        self.tokenizer_of = eng.tokenizer_of  # an adapter's own, where it adds tokens
        self.vocab_size = eng.model_config.vocab_size
        self.max_model_len = eng.max_model_len
        self.max_logprobs = eng.config.max_logprobs
        self.policy = eng.config.policy
        self.eos_token_ids = frozenset(eng.eos_token_ids)
        resolver = settings.resolver
        if resolver is None and settings.adapter_dir is not None:
            resolver = LocalDirResolver(settings.adapter_dir, settings.allow_any_adapter_path)
        self.adapters = ServedAdapters(engine, settings.model_name, resolver,
                                       settings.adapter_dir, settings.allow_any_adapter_path)
        self.metrics = ServerMetrics()
        self.pending = 0
        self.inflight = 0
        self.ready = False
        self.draining = False
        # engine request ids: unique per app, as several apps may share one engine
        self.id_prefix = f"http-{uuid.uuid4().hex[:8]}"
        self.ids = itertools.count()
        self._token_texts: dict[int, str] = {}

    @property
    def retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.settings.retry_after_s)}

    def check_accepting(self) -> None:
        """503 while draining or when the engine thread has ended."""
        if self.draining or not self.ready:
            raise APIError(503, "the server is shutting down" if self.draining
                           else "the server is starting", headers=self.retry_after)
        if not self.engine.alive:
            raise APIError(503, "the engine is not running", headers=self.retry_after)

    def adapter_of(self, model: str | None) -> str | None:
        """The adapter a request's `model` names: None for the base model."""
        return None if model is None or model == self.settings.model_name else model

    async def acquire(self, model: str | None) -> str | None:
        """The adapter `model` names (None: the base model), loaded if need be and counted in
        use until `release`."""
        adapter = self.adapter_of(model)
        if adapter is not None:
            await self.adapters.acquire(adapter)
        return adapter

    def release(self, adapter: str | None) -> None:
        if adapter is not None:
            self.adapters.release(adapter)

    def priority(self, value: int) -> int:
        """A request's priority (vLLM's field); 400 for one the engine's policy ignores."""
        if value and self.policy != "priority":
            raise APIError(400, f"priority={value}: requests take priorities when the server "
                           "runs --policy priority", "priority")
        return value

    def encode(self, text: str, param: str, adapter: str | None = None,
               add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids, with `adapter`'s tokenizer (its own where it adds tokens: call
        once the adapter is loaded)."""
        tokenizer = self.tokenizer_of(adapter)
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send token ids", param)
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_length(self, ids: list[int], param: str) -> None:
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model takes at most "
                           f"{self.max_model_len - 1} (max_model_len {self.max_model_len}, "
                           "prompt and output together)", param)

    def token_text(self, token_id: int, adapter: str | None = None) -> str:
        """One token's text, special tokens included (logprobs, LoRAX token events); a token
        past the base vocabulary is one `adapter` adds, read with its own tokenizer."""
        if token_id >= self.vocab_size:
            tokenizer = self.tokenizer_of(adapter)
            return "" if tokenizer is None else tokenizer.decode([token_id],
                                                                  skip_special_tokens=False)
        text = self._token_texts.get(token_id)
        if text is None:
            text = (self.tokenizer.decode([token_id], skip_special_tokens=False)
                    if self.tokenizer is not None else "")
            self._token_texts[token_id] = text
        return text


_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)")


def sampling_error(e: ValueError, names: dict[str, str]) -> APIError:
    """400 for a SamplingParams ValueError, naming the request's field (`names`: the
    SamplingParams field -> the request's name for it, where they differ)."""
    m = _SAMPLING_FIELD.search(str(e))
    field = m.group(1) if m else None
    param = names.get(field, field)
    message = _SAMPLING_FIELD.sub(lambda _: param, str(e)) if param else str(e)
    return APIError(400, message, param)


def engine_error(e: Exception) -> APIError:
    """The answer to an exception the engine raised for a request."""
    if isinstance(e, KeyError):  # an unknown adapter (unloaded meanwhile)
        return APIError(404, str(e.args[0]) if e.args else str(e), "model")
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e))
    if isinstance(e, RuntimeError):
        return APIError(503, f"the engine is not serving: {e}")
    return APIError(500, f"the engine failed the request: {type(e).__name__}: {e}")
