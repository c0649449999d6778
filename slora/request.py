"""Requests, sampling parameters and outputs. No torch: the scheduler and simulator use these."""

from __future__ import annotations

import enum
import functools
import json
import math
import numbers
from dataclasses import dataclass, field

from slora.config import is_int, is_seed


def _is_real(x) -> bool:
    """A finite real number, not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens, and when to stop (vLLM's names and meanings).

    temperature 0 is greedy. top_k 0, top_p 1 and min_p 0 disable those filters. `seed` makes
    sampling reproducible per request. `stop` strings end generation and are cut from the
    text (kept with `include_stop_str_in_output`); `stop_token_ids` and EOS (unless
    `ignore_eos`) end it too, but not before `min_tokens` tokens (the stop ids are masked until
    then, and stop strings wait). `logprobs=N` returns, for every generated token, a dict
    token id -> log-prob holding the chosen token and the top N (log-probs of the model's raw
    distribution, before any of what follows). `prompt_logprobs=N` returns the same for every
    prompt token given the ones before it (None for the first, which has no context); such a
    request skips the prefix cache, whose pages hold no logits.

    Before a token is picked, greedy or sampled, the logits are changed in vLLM's order: every
    token outside `allowed_token_ids` masked (None: all allowed), then each of `bad_words`
    whose tokens up to its last match the end of the output (its last token masked; a word is
    tried as encoded alone and after a space), the stop ids masked (min_tokens),
    `logit_bias` ({token id: bias in [-100, 100]}) added, then
    the penalties: `repetition_penalty` (HF's: a logit of a token in the prompt or the output
    so far divided by it if positive, multiplied if not; 1 is off), `frequency_penalty` times
    the token's count in the output so far and `presence_penalty` once per token in it,
    subtracted (OpenAI's, each in [-2, 2]; 0 is off). Sampling then applies temperature,
    min_p (drops tokens below min_p times the likeliest one's probability), top_k and top_p.
    `skip_special_tokens` (default True) leaves special tokens out of the text.

    Guided decoding (vLLM's): `guided_regex` holds the output to a full match of the pattern,
    `guided_choice` to one of the strings, `guided_json` to JSON that a JSON Schema (a dict or
    its text; kept as text) accepts (`slora.guided`, `slora.json_regex`); the end-of-sequence
    token comes once the output matches. One of the three at most.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    guided_regex: str | None = None
    guided_choice: tuple[str, ...] | None = None
    guided_json: str | dict | None = None
    # {token id: bias}; kept as sorted (id, bias) pairs, so the params stay hashable
    logit_bias: dict[int, float] | tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = bias.items()
        try:
            bias = tuple(sorted((k, v) for k, v in (bias or ())))
        except (TypeError, ValueError):
            raise ValueError(f"SamplingParams.logit_bias={self.logit_bias!r}: expected a dict "
                             "{token id: bias}") from None
        object.__setattr__(self, "logit_bias", bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise ValueError(f"SamplingParams.allowed_token_ids={self.allowed_token_ids!r}: "
                                 "expected None or a non-empty list of token ids")
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.guided_json, (dict, bool)):
            object.__setattr__(self, "guided_json", json.dumps(self.guided_json))
        if self.guided_choice is not None:
            if not isinstance(self.guided_choice, (list, tuple)):
                raise ValueError(f"SamplingParams.guided_choice={self.guided_choice!r}: "
                                 "expected a list of strings")
            object.__setattr__(self, "guided_choice", tuple(self.guided_choice))
        for name in ("stop", "stop_token_ids", "bad_words"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"SamplingParams.{name}={value!r}: expected a list")
            object.__setattr__(self, name, tuple(value))
        seed = self.seed
        checks = [
            (is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
             "must be an integer of at least 1"),
            (_is_real(self.temperature) and self.temperature >= 0, "temperature",
             "must be a finite number >= 0"),
            (is_int(self.top_k) and self.top_k >= 0, "top_k",
             "must be an integer >= 0 (0 disables)"),
            (_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "must be a number in (0, 1]"),
            (seed is None or is_seed(seed), "seed",
             "must be None or an integer that fits 64 bits"),
            (all(isinstance(s, str) and s for s in self.stop), "stop",
             "stop strings must be non-empty strings"),
            (all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative integers"),
            (isinstance(self.ignore_eos, bool), "ignore_eos", "must be True or False"),
            (isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output",
             "must be True or False"),
            (isinstance(self.skip_special_tokens, bool), "skip_special_tokens",
             "must be True or False"),
            (all(is_int(t) and t >= 0 for t in self.allowed_token_ids or ()), "allowed_token_ids",
             "must be token ids (integers >= 0)"),
            (all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
             "must be non-empty strings"),
            (self.guided_choice is None or (self.guided_choice and all(
                isinstance(c, str) and c for c in self.guided_choice)), "guided_choice",
             "must be None or a non-empty list of non-empty strings"),
            (self.guided_regex is None or (isinstance(self.guided_regex, str)
                                           and self.guided_regex), "guided_regex",
             "must be None or a non-empty string"),
            (self.guided_json is None or isinstance(self.guided_json, str), "guided_json",
             "must be None, a JSON Schema (a dict) or its JSON text"),
            (sum(x is not None for x in (self.guided_regex, self.guided_choice,
                                         self.guided_json)) <= 1, "guided_regex",
             "guided_choice and guided_json exclude each other"),
            (self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0), "logprobs",
             "must be None or an integer >= 0"),
            (self.prompt_logprobs is None
             or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0), "prompt_logprobs",
             "must be None or an integer >= 0"),
            (is_int(self.min_tokens) and 0 <= self.min_tokens, "min_tokens",
             "must be an integer >= 0"),
            (not is_int(self.min_tokens) or self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be at most max_tokens={self.max_tokens!r}"),
            (_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be a number in [0, 1]"),
            (_is_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "presence_penalty", "must be a number in [-2, 2]"),
            (_is_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "frequency_penalty", "must be a number in [-2, 2]"),
            (_is_real(self.repetition_penalty) and self.repetition_penalty > 0,
             "repetition_penalty", "must be a number > 0 (1 is off)"),
            (all(is_int(t) and t >= 0 and _is_real(b) and -100 <= b <= 100
                 for t, b in self.logit_bias), "logit_bias",
             "must map token ids (integers >= 0) to biases in [-100, 100]"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def guided(self) -> bool:
        return (self.guided_regex is not None or self.guided_choice is not None
                or self.guided_json is not None)

    @functools.cached_property  # (read for every row of every step: computed once)
    def changes_logits(self) -> bool:
        """Whether the logits are changed before the token is picked (allowed_token_ids,
        bad_words, guided decoding, min_tokens, logit_bias, a penalty): then even a greedy
        row's token is not the raw argmax."""
        return bool(self.allowed_token_ids is not None or self.bad_words or self.guided
                    or self.min_tokens
                    or self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"

    def __repr__(self) -> str:
        return self.name


@dataclass
class RequestMetrics:
    """Wall-clock (or simulated) times in seconds on the engine's clock. `last_token_time`:
    when its latest token was resolved (the first token's time until a second comes)."""

    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None


@dataclass(slots=True)
class Request:
    """One sequence's state through the engine.

    `block_table` holds its KV pages; `num_computed` counts tokens whose KV is in them. After a
    preemption both reset and the prompt plus the tokens generated so far are recomputed
    (the request keeps its output tokens: recompute reproduces the same KV).

    Prefix caching (`slora.core.prefix`): `cache_salt` enters its pages' digest chain; a
    request with `cache_prefix` False neither looks its prefix up nor offers its pages;
    `block_digests` are the digests of its first full pages; its first `num_cached_pages`
    pages have been found in or offered to the cache; `num_cached_tokens` were found cached at
    its last admission (not computed).

    `prompt_logprobs` (asked for by `SamplingParams.prompt_logprobs`): entry p is prompt token
    p's, None for the first; filled chunk by chunk from the logits of the positions before
    (`prompt_logprob_rows`). A recompute after a preemption finds the entries it already has.

    Counters, between steps: 0 <= num_computed <= num_tokens - 1 once running (the last
    known token is the next step's input), and `num_new` = num_tokens - num_computed is
    what is left to compute: 1 for a decode row, more for a prompt (or a recompute) still
    prefilling (a prefix found cached counts as computed). Chunked prefill advances
    num_computed chunk by chunk (`Scheduler.advance`) and only the chunk that reaches
    num_tokens samples a token; a request with pending tokens is decoding (num_new 1), never
    prefilling.

    Slotted (no per-instance dict): the scheduler and the simulator read its fields for every
    running request at every step, and a slot is the smallest and quickest to reach.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    adapter: str | None
    arrival_time: float
    eos_token_ids: tuple[int, ...] = ()
    max_len: int = 1 << 30  # the engine's max_model_len (lowered through `cap_length`)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    skipped: int = 0  # steps passed over by a reordering policy (starvation bound)
    # output tokens still on the device: the last `num_pending` of output_token_ids are
    # PENDING until their step is collected (EngineConfig.async_scheduling)
    num_pending: int = 0
    cache_salt: str | None = None
    cache_prefix: bool = True
    # SamplingParams.bad_words as token ids, by the request's tokenizer (the engine's)
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    guide: object | None = None  # guided decoding's slora.guided.Guide (the engine's)
    priority: int = 0  # lower goes first under the priority policy (slora.core.policies)
    block_digests: list[bytes] = field(default_factory=list)
    num_cached_pages: int = 0
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(init=False)
    # output tokens at which it is at its length: max_tokens, or fewer when the prompt and
    # they would reach max_len (`at_length`; kept by `cap_length`)
    max_output: int = field(init=False)

    def __post_init__(self) -> None:
        assert self.prompt_token_ids, "a request needs at least one prompt token"
        self.metrics = RequestMetrics(self.arrival_time)
        self.cap_length(self.max_len)
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first token's: no context
            self.cache_prefix = False  # every position's logits are needed

    def prompt_logprob_rows(self, start: int, end: int) -> range:
        """The positions among start..end-1 (a chunk's) whose logits give prompt log-probs
        still missing: position q's give prompt token q + 1's. Empty unless asked for. The
        chunk must begin at or before the first missing one (no skipped prefix)."""
        if self.sampling.prompt_logprobs is None:
            return range(0)
        first = len(self.prompt_logprobs) - 1
        assert start <= first or first == len(self.prompt_token_ids) - 1, (self, start)
        return range(max(start, first), min(end, len(self.prompt_token_ids) - 1))

    def cap_length(self, max_len: int) -> None:
        """Lower its limit on prompt plus output tokens to `max_len` (if lower)."""
        self.max_len = min(self.max_len, max_len)
        self.max_output = min(self.sampling.max_tokens, self.max_len - len(self.prompt_token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_from(self, start: int, end: int | None = None) -> list[int]:
        """Token ids of positions `start` to `end` (default: all known; prompt then output),
        copying only those."""
        n, out = len(self.prompt_token_ids), self.output_token_ids
        if end is None:
            end = n + len(out)
        if start >= n:
            return out[start - n:end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + out[:end - n]

    @property
    def num_new(self) -> int:
        """Tokens the next step must compute: 1 in decode, more in a (re)prefill."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_stop(self) -> str | None:
        """Finish reason after the last known token (stop strings are the engine's job)."""
        n = len(self.output_token_ids) - self.num_pending
        last = self.output_token_ids[n - 1]
        if not self.sampling.ignore_eos and last in self.eos_token_ids:
            return "stop"
        if last in self.sampling.stop_token_ids:
            return "stop"
        return "length" if self.at_length(n) else None

    def at_length(self, n_out: int | None = None) -> bool:
        """Whether `n_out` output tokens (default: all, pending ones too) reach max_tokens or
        the model's length (`max_output`)."""
        return (len(self.output_token_ids) if n_out is None else n_out) >= self.max_output


PENDING = -1  # an output token whose step is still running (its value is on the device)


@dataclass
class RequestOutput:
    """What the engine returns for a request (cumulative; `finished` once it is done)."""

    request_id: str
    adapter: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache, not computed
    # each prompt token's {token id: log-prob} (None for the first), once the prompt has run;
    # None unless SamplingParams.prompt_logprobs asks
    prompt_logprobs: list[dict[int, float] | None] | None = None
