"""The cost model: how long one engine step takes, from the shape of the scheduler's plan.

A step's forward time is the larger of two linear models over fifteen features of the plan
(`FEATURES`), each a sum the runner's kernels scale with: the device's work, over all of them,

    device  = c0                                   fixed: launch, scheduling, sampling overhead
            + c_prefill_tokens * prefill_tokens    GEMMs over the new tokens of prefill rows (a
                                                   prefix found in the prefix cache is not new;
                                                   a chunked prompt: this step's chunk)
            + c_prefill_attn   * prefill_attn      prefill attention: sum of new x context tokens
                                                   (a chunk's context: its cached prefix and
                                                   itself)
            + c_decode_seqs    * decode_seqs       per decode row (GEMM rows, metadata, sampling)
            + c_decode_ctx     * decode_ctx        decode attention: KV tokens read, summed
            + c_adapters       * adapters          distinct adapters in the batch (LoRA metadata,
                                                   kernel segments)
            + c_lora_prefill   * lora_prefill      MBGMM: sum over prefill rows of new tokens x
                                                   adapter pages (pages ~ rank x sum(d_in + d_out))
            + c_lora_decode    * lora_decode       MBGMV: sum over decode rows of adapter pages
            + c_eager          * eager             1 when the step has prefill rows (and more
                                                   tokens than mixed_graph_tokens): it runs
                                                   eagerly, outside the CUDA graphs, and pays
                                                   every kernel launch from Python
            + c_eager_lora     * eager_lora        1 when such a step also has adapters: the
                                                   LoRA kernels' launches, eagerly too
            + c_lora           * lora              1 when any row has an adapter: the LoRA
                                                   kernels' fixed cost, in graphs too (small
                                                   launches, a few per layer)
            + c_eager_adapters * eager_adapters    distinct adapters in an eager step
            + c_mixed          * mixed             1 when the step has prompts and decode rows:
                                                   it runs both kernel sets (decode attention
                                                   and MBGMV for the decode rows, prefill
                                                   attention and MBGMM for the prompts)
            + c_mixed_adapters * mixed_adapters    distinct adapters in a step with prompts
            + c_padded         * padded            a graphed step's padding: its token bucket
                                                   (slora.config.TOKEN_BUCKETS) less its tokens,
                                                   rows the GEMMs compute all the same

and the host's, over HOST_FEATURES (`host_coeffs`; None: the device's alone):

    forward = max(device, h . x)

An eager step whose kernels finish faster than Python launches them takes the host's time,
flat in its tokens while its device work grows with them: the host piece models that, and
`fit_max` fits both pieces.

Why the indicator features exist (each models a cost the sums above do not scale with):

- eager, eager_lora: a step with prompts beyond the graphed sizes runs eagerly and pays
  every kernel launch from Python, the LoRA kernels' launches again when it has adapters;
  a small prefill then costs far more than its tokens' GEMMs.
- lora, eager_adapters: any adapter in a step adds the LoRA kernels' fixed cost (many small
  launches per step, in graphs too), and every distinct adapter of an eager step adds its
  own launches and metadata.
- mixed, mixed_adapters: a step with both prompts and decode rows runs both kernel sets
  (decode attention and MBGMV for the decode rows, prefill attention and MBGMM for the
  prompts), each distinct adapter its segments in both.
- padded: a graphed step with prompts computes its whole token bucket, so the rows between
  its tokens and the bucket cost what a prompt token costs.

Adapter pages stand in for rank because they are proportional to the bytes the LoRA kernels
read and the FLOPs they do (rank x the target modules' widths), for any choice of targets.

Adapter copies (the runner issues them with the forward, in plan order: loads, then prefetch):

    disk   = sum over host-cache misses of nbytes / disk_gbps     (read + pack + pin, on the CPU)
    h2d(x) = load_overhead_s + nbytes / h2d_gbps                  (one copy into pool pages)
    b      = h2d(blocking loads), K = load_pieces
    step   = disk + b / K + overlap(forward, b * (1 - 1/K) + h2d(prefetch))
    overlap(f, p) = f + p - prefetch_overlap * min(f, p)

A what-if, not a measurement: `prompt_overlap` (0 in every profile, as the engine runs) hides
that share of a step's prompt work under its decode attention, as an engine that ran them beside
each other on the SMs would:
    device -= prompt_overlap * min(c_decode_ctx * decode_ctx, prompt)
where `prompt` is the sum of the PROMPT_FEATURES terms (prefill_tokens, prefill_attn,
lora_prefill, mixed, mixed_adapters, padded): at share 1 a step with prompts and decode rows
pays the longer of the two, not their sum.
`prefetch_overlap` is measured: 1 means prefetch copies hide under the forward (max(f, p)),
0 means they serialise with it (f + p), as copies on the compute stream do. The step's own
loads (`b`) arrive in K pieces of layers, the forward waiting for each piece before its first
layer (on the GPU, the pieces of its graphs): the first piece's copies come before any
compute, the rest run beside it as a prefetch does. K = 1: all of them before the forward
(the CPU, whose runner copies on the compute stream; and a profile that records no K).

`fit(samples)` chooses the coefficients by least squares on *relative* error (weights 1/t), so
the many short decode steps count as much as the few long prefills, and keeps every
coefficient >= 0 (a feature whose coefficient comes out negative is dropped and the rest refit),
so no batch shape is predicted to take negative time.

No torch here; numpy only inside `fit`.
"""

from __future__ import annotations

import json
import dataclasses
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from operator import attrgetter, mul
from pathlib import Path

from slora.config import TOKEN_BUCKETS, bucket, buckets_up_to

FEATURES = ("const", "prefill_tokens", "prefill_attn", "decode_seqs", "decode_ctx", "adapters",
            "lora_prefill", "lora_decode", "eager", "eager_lora", "lora", "eager_adapters",
            "mixed", "mixed_adapters", "padded")
# The terms of a step's prompt work (`CostModel.prompt_overlap` hides them under decode attention)
PROMPT_FEATURES = ("prefill_tokens", "prefill_attn", "lora_prefill", "mixed", "mixed_adapters",
                   "padded")
# The host piece of the model (`fit_max`): what Python pays to prepare and launch a step.
HOST_FEATURES = ("const", "decode_seqs", "adapters", "eager", "eager_lora", "eager_adapters")
PROFILE_FORMAT = "slora-profile/1"
MIN_STEP_S = 1e-6  # a step always advances the clock, so an idle-looking loop cannot spin
# the features of a decode-only plan that can be nonzero (`decode_features`), in FEATURES order
_DECODE = ("const", "decode_seqs", "decode_ctx", "adapters", "lora_decode", "lora")
# a request's fields, for per-row sums without a Python loop (`plan_features`)
_adapter = attrgetter("adapter")
_prompt = attrgetter("prompt_token_ids")
_output = attrgetter("output_token_ids")


def plan_features(plan, adapters, graph_tokens: int = 0) -> tuple[float, ...]:
    """The FEATURES of a `SchedulerPlan` (between schedule and update: each prefill row's
    tokens are its chunk, `plan.chunks`, from its `num_computed` on).

    `adapters` is the `AdapterManager` (for each adapter's page count, `pages_of`).
    `graph_tokens`: the engine's `mixed_graph_tokens`; a step with prompts and at most that
    many tokens replays a CUDA graph, so it is not `eager`.
    """
    pages = adapters.pages_of
    names = set()
    add = names.add
    prefill_tokens = prefill_attn = lora_prefill = 0
    chunks = plan.chunks
    for r in plan.prefill:
        new = chunks[r.request_id]
        prefill_tokens += new
        prefill_attn += new * (r.num_computed + new)
        lora_prefill += new * pages[r.adapter]
        add(r.adapter)
    decode = plan.decode
    # the decode rows are most of a step's rows: their sums without a Python loop over them
    decode_names = list(map(_adapter, decode))
    decode_ctx = sum(map(len, map(_prompt, decode))) + sum(map(len, map(_output, decode)))
    lora_decode = sum(map(pages.__getitem__, decode_names))
    names.update(decode_names)
    names.discard(None)
    tokens = prefill_tokens + len(decode)
    eager = 1.0 if plan.prefill and tokens > graph_tokens else 0.0
    prompts = 1.0 if plan.prefill else 0.0
    return (1.0, prefill_tokens, prefill_attn, len(decode), decode_ctx, len(names),
            lora_prefill, lora_decode, eager, eager if names else 0.0,
            1.0 if names else 0.0, eager * len(names),
            prompts if decode else 0.0, prompts * len(names),
            padding(tokens, graph_tokens) if prompts and not eager else 0.0)


def decode_features(rows: int, ctx: int, adapters: int, lora_decode: int) -> tuple[float, ...]:
    """`plan_features` of a plan of `rows` decode rows and no prefill: `ctx` context tokens in
    all, `adapters` distinct adapters, `lora_decode` adapter pages summed over the rows."""
    return (1.0, 0, 0, rows, ctx, adapters, 0, lora_decode, 0.0, 0.0, 1.0 if adapters else 0.0,
            0.0, 0.0, 0.0, 0.0)


def padding(tokens: int, graph_tokens: int) -> float:
    """The padded rows of a graphed step with prompts of `tokens` tokens in all."""
    return float(bucket(tokens, _graph_buckets(graph_tokens)) - tokens)


@lru_cache(maxsize=None)
def _graph_buckets(graph_tokens: int) -> tuple[int, ...]:
    """The token buckets of mixed-step graphs up to `graph_tokens` (made once per setting)."""
    return buckets_up_to(TOKEN_BUCKETS, graph_tokens)


@dataclass
class CostModel:
    """Coefficients of the step-time model (seconds per unit of each feature) and transfers."""

    coeffs: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FEATURES, 0.0))
    # the host piece (`fit_max`): forward = max(coeffs . x, host_coeffs . x); None: linear only
    host_coeffs: dict[str, float] | None = None
    h2d_gbps: float = 20.0  # host -> device copy bandwidth, GB/s (1e9 bytes)
    disk_gbps: float | None = 2.0  # disk -> host (read, pack, pin) on a host-cache miss; None: free
    load_overhead_s: float = 0.0  # fixed cost of one adapter copy
    prefetch_overlap: float = 1.0  # 1: prefetch copies hide under the forward; 0: they add
    load_pieces: int = 1  # the step's own loads arrive in this many pieces of layers (see above)
    prompt_overlap: float = 0.0  # what-if: share of prompt work hidden under decode attention

    def __post_init__(self) -> None:
        unknown = set(self.coeffs) - set(FEATURES)
        if unknown:
            raise ValueError(f"cost model: unknown coefficient(s) {sorted(unknown)}; "
                             f"features are {', '.join(FEATURES)}")
        self.coeffs = {k: float(self.coeffs.get(k, 0.0)) for k in FEATURES}
        if self.h2d_gbps <= 0 or (self.disk_gbps is not None and self.disk_gbps <= 0):
            raise ValueError("cost model: bandwidths must be positive (disk_gbps may be null: free)")
        if not 0.0 <= self.prefetch_overlap <= 1.0:
            raise ValueError(f"cost model: prefetch_overlap={self.prefetch_overlap} must be in [0, 1]")
        if not 0.0 <= self.prompt_overlap <= 1.0:
            raise ValueError(f"cost model: prompt_overlap={self.prompt_overlap} must be in [0, 1]")
        if self.load_pieces < 1:
            raise ValueError(f"cost model: load_pieces={self.load_pieces} must be >= 1")
        if self.host_coeffs is not None:
            unknown = set(self.host_coeffs) - set(HOST_FEATURES)
            if unknown:
                raise ValueError(f"cost model: unknown host coefficient(s) {sorted(unknown)}; "
                                 f"host features are {', '.join(HOST_FEATURES)}")
            self.host_coeffs = {k: float(self.host_coeffs.get(k, 0.0)) for k in HOST_FEATURES}
        self._c = tuple(self.coeffs[k] for k in FEATURES)
        self._attn = (FEATURES.index("decode_ctx"), self.coeffs["decode_ctx"])
        self._prompt = tuple((FEATURES.index(k), self.coeffs[k]) for k in PROMPT_FEATURES)
        self._h = tuple((FEATURES.index(k), v) for k, v in (self.host_coeffs or {}).items() if v)
        # the features a decode-only plan can have nonzero (`decode_features`), in FEATURES
        # order, for `decode_time`: their device coefficients, and the host piece's terms
        self._dc = tuple(self.coeffs[k] for k in _DECODE)
        self._dh = tuple((_DECODE.index(FEATURES[j]), v) for j, v in self._h
                         if FEATURES[j] in _DECODE)

    def forward_time(self, features: tuple[float, ...]) -> float:
        device = sum(map(mul, self._c, features))
        if self.prompt_overlap:
            prompt = sum(c * features[j] for j, c in self._prompt)
            attn = self._attn[1] * features[self._attn[0]]
            device -= self.prompt_overlap * min(attn, prompt)
        if not self._h:
            return device
        return max(device, sum(c * features[j] for j, c in self._h))

    def decode_time(self, rows: int, ctx: int, adapters: int, lora_decode: int) -> float:
        """`step_time(forward_time(decode_features(...)), 0, 0, 0)`, the time of a step of
        decode rows alone with no copies, in fewer operations: the same sum of the same
        products in the same order, less the terms of zero features (a 0.0 added to a sum of
        non-negative terms leaves it as it is), so the same float."""
        values = (1.0, rows, ctx, adapters, lora_decode, 1.0 if adapters else 0.0)
        device = sum(map(mul, self._dc, values))
        if self._h:
            device = max(device, sum(c * values[k] for k, c in self._dh))
        return max(MIN_STEP_S, device)

    def copy_time(self, nbytes: int) -> float:
        return self.load_overhead_s + nbytes / (self.h2d_gbps * 1e9)

    def disk_time(self, nbytes: int) -> float:
        return 0.0 if self.disk_gbps is None else nbytes / (self.disk_gbps * 1e9)

    def step_time(self, forward: float, blocking: float, prefetch: float, disk: float) -> float:
        first = blocking / self.load_pieces
        beside = blocking - first + prefetch
        overlapped = forward + beside - self.prefetch_overlap * min(forward, beside)
        return max(MIN_STEP_S, disk + first + overlapped)

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Fitting


def fit(samples: list[tuple[tuple[float, ...], float]], features: tuple[str, ...] = FEATURES
        ) -> tuple[dict[str, float], dict]:
    """Non-negative least squares on relative error: coefficients and fit statistics.

    samples: (features as `plan_features` returns them, measured seconds). Features that never
    vary from zero in the samples get coefficient 0. Returns ({feature: coefficient}, stats) with
    stats = {"samples", "mean_rel_err", "max_rel_err", "dropped"}.
    """
    import numpy as np

    X, y = _arrays(samples)
    coef, dropped = _nnls_rel(X, y, list(range(X.shape[1])), features)
    rel = np.abs(X @ coef - y) / y
    stats = {"samples": len(samples), "mean_rel_err": float(rel.mean()),
             "max_rel_err": float(rel.max()), "dropped": dropped}
    return {k: float(v) for k, v in zip(features, coef)}, stats


def fit_max(samples: list[tuple[tuple[float, ...], float]], iterations: int = 50
            ) -> tuple[dict[str, float], dict[str, float] | None, dict]:
    """Fit forward = max(device . x, host . x): the linear model (`fit`) for the GPU's work and a
    second one over HOST_FEATURES for the host's, which bounds a step that launches its kernels
    eagerly from Python (a mixed step whose kernels finish faster than Python issues them).

    Alternating fit of a two-piece max-affine function: each sample goes to the piece that
    predicts more, each piece is refitted (non-negative, relative error) on its own samples, until
    no sample changes side. Returns (device coefficients, host coefficients or None when the
    linear model alone fits at least as well, stats as `fit`'s plus "host_bound": the samples the
    host piece explains).
    """
    import numpy as np

    X, y = _arrays(samples)
    coef, dropped = _nnls_rel(X, y, list(range(X.shape[1])), FEATURES)
    best = (_mean_rel(np.maximum(X @ coef, 0.0), y), coef, None, 0)
    hcols = [FEATURES.index(k) for k in HOST_FEATURES]
    eager = X[:, FEATURES.index("eager")] > 0
    tokens = X[:, FEATURES.index("prefill_tokens")]
    small = tokens <= np.median(tokens[eager]) if eager.any() else eager
    # starts: the host piece explains the eager steps with the fewer prompt tokens, or the eager
    # steps the linear model under-predicts; the device piece the rest. The best result is kept.
    starts = (eager & small, eager & (X @ coef < y))
    for host_side in starts:
        if host_side.sum() < 2 or (~host_side).sum() < 2:
            continue
        for _ in range(iterations):
            dev, _ = _nnls_rel(X[~host_side], y[~host_side], list(range(X.shape[1])), FEATURES)
            host, _ = _nnls_rel(X[host_side], y[host_side], hcols, FEATURES)
            pred_dev, pred_host = X @ dev, X @ host
            err = _mean_rel(np.maximum(pred_dev, pred_host), y)
            if err < best[0] - 1e-12:
                best = (err, dev, host, int((pred_host > pred_dev).sum()))
            side = pred_host > pred_dev
            if (side == host_side).all() or side.sum() < 2 or (~side).sum() < 2:
                break
            host_side = side
    err, coef, host, host_bound = best
    pred = X @ coef if host is None else np.maximum(X @ coef, X @ host)
    rel = np.abs(pred - y) / y
    stats = {"samples": len(samples), "mean_rel_err": float(rel.mean()),
             "max_rel_err": float(rel.max()), "dropped": dropped, "host_bound": host_bound}
    host_coeffs = None if host is None else {k: float(host[FEATURES.index(k)]) for k in HOST_FEATURES}
    return {k: float(v) for k, v in zip(FEATURES, coef)}, host_coeffs, stats


def _arrays(samples):
    import numpy as np

    if len(samples) < 2:
        raise ValueError(f"fit: need at least 2 samples, got {len(samples)}")
    X = np.array([s[0] for s in samples], dtype=float)
    y = np.array([s[1] for s in samples], dtype=float)
    if (y <= 0).any():
        raise ValueError("fit: measured step times must be positive")
    return X, y


def _mean_rel(pred, y) -> float:
    return float((abs(pred - y) / y).mean())


def _nnls_rel(X, y, columns: list[int], features: tuple[str, ...]):
    """Least squares on relative error over `columns` of X, every coefficient >= 0: a column
    whose coefficient comes out negative is dropped and the rest refitted; columns that are all
    zero get 0. Returns (coefficients over all of X's columns, names of the dropped features)."""
    import numpy as np

    w = 1.0 / y
    Xw, yw = X * w[:, None], y * w  # relative error: (x.c - y) / y
    active = [j for j in columns if j == 0 or np.any(X[:, j] != 0)]
    dropped = [features[j] for j in columns if j not in active]
    coef = np.zeros(X.shape[1])
    while active:
        A = Xw[:, active]
        scale = np.abs(A).max(axis=0)
        scale[scale == 0] = 1.0
        sol, *_ = np.linalg.lstsq(A / scale, yw, rcond=None)
        sol = sol / scale
        if (sol >= 0).all():
            coef[active] = sol
            break
        worst = active[int(np.argmin(sol))]  # the most negative goes; refit the rest
        active.remove(worst)
        dropped.append(features[worst])
    return coef, dropped


def sample_row(features: dict, graph_tokens: int = 0) -> tuple[float, ...]:
    """A stored sample's features in FEATURES order. A feature the sample lacks is derived from
    those it has (every indicator is a function of the sums; `padded` also of the profile's
    `mixed_graph_tokens`), so any stored sample refits under the current FEATURES."""
    f = dict(features)
    f.setdefault("eager", 1.0 if f.get("prefill_tokens", 0) > 0 else 0.0)
    f.setdefault("eager_lora", f["eager"] if f.get("adapters", 0) > 0 else 0.0)
    f.setdefault("lora", 1.0 if f.get("adapters", 0) > 0 else 0.0)
    f.setdefault("eager_adapters", f["eager"] * f.get("adapters", 0))
    prompts = 1.0 if f.get("prefill_tokens", 0) > 0 else 0.0
    f.setdefault("mixed", prompts if f.get("decode_seqs", 0) > 0 else 0.0)
    f.setdefault("mixed_adapters", prompts * f.get("adapters", 0))
    if "padded" not in f:
        tokens = f.get("prefill_tokens", 0) + f.get("decode_seqs", 0)
        graphed = prompts and not f["eager"] and tokens <= graph_tokens
        f["padded"] = padding(int(tokens), graph_tokens) if graphed else 0.0
    return tuple(float(f.get(k, 0.0)) for k in FEATURES)


def fit_bandwidth(points: list[tuple[int, float]]) -> tuple[float, float | None]:
    """Fit t = overhead + bytes / (gbps * 1e9) to (bytes, seconds) points: (overhead_s, gbps).

    gbps is None when the time does not grow with size (free at this resolution).
    """
    n = len(points)
    if n == 0:
        raise ValueError("fit_bandwidth: no points")
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    slope = sum((b - mx) * (t - my) for b, t in points) / sxx if sxx > 0 else 0.0
    if slope <= 0:
        return max(0.0, my), None
    overhead = my - slope * mx
    if overhead < 0:  # through the origin instead
        slope = sum(b * t for b, t in points) / sum(b * b for b, _ in points)
        overhead = 0.0
    return overhead, 1.0 / (slope * 1e9)


# ---------------------------------------------------------------------------------------------
# Profiles


@dataclass
class Profile:
    """A calibrated cost model and the facts about the model and device it was measured on.

    model: a name or path; model_config: the model's config.json (the simulator reads shapes
    from it: page size, adapter pages, weight bytes); dtype and block_size the engine ran with;
    quantization: "fp8" when its base linear weights were FP8 (`EngineConfig.quantization` or a
    pre-quantized checkpoint), else None; tensor_parallel_size: the devices the model was
    sharded over (`EngineConfig.tensor_parallel_size`): a profile per degree, its step times
    those of the sharded engine, its num_pages and shapes one rank's;
    num_pages: the pool the engine sized on that device (the simulator's default);
    gpu_memory_gb: the device's total memory; async_scheduling: whether the engine ran with
    `EngineConfig.async_scheduling`, its steps then timed between collections (see
    `slora.sim.steplog.logged_steps`; simulate in the same order); samples: the measurements
    the fit used, [{"features": {...}, "seconds": t}, ...].
    """

    model: str
    gpu: str
    cost: CostModel
    model_config: dict
    dtype: str = "bfloat16"
    quantization: str | None = None
    block_size: int = 16
    num_pages: int | None = None
    gpu_memory_gb: float | None = None
    mixed_graph_tokens: int = 0  # the engine's setting when profiled (simulate's default)
    async_scheduling: bool = False  # the engine's setting when profiled (none recorded: off)
    tensor_parallel_size: int = 1
    fit_stats: dict = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)
    transfer_samples: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        c = self.cost
        return {"format": PROFILE_FORMAT, "model": self.model, "gpu": self.gpu,
                "dtype": self.dtype, "quantization": self.quantization,
                "block_size": self.block_size, "num_pages": self.num_pages,
                "gpu_memory_gb": self.gpu_memory_gb, "mixed_graph_tokens": self.mixed_graph_tokens,
                "async_scheduling": self.async_scheduling,
                "tensor_parallel_size": self.tensor_parallel_size, "coeffs": c.coeffs,
                "host_coeffs": c.host_coeffs, "h2d_gbps": c.h2d_gbps,
                "disk_gbps": c.disk_gbps, "load_overhead_s": c.load_overhead_s,
                "prefetch_overlap": c.prefetch_overlap, "load_pieces": c.load_pieces,
                "fit": self.fit_stats,
                "model_config": self.model_config, "samples": self.samples,
                "transfer_samples": self.transfer_samples}

    @classmethod
    def from_dict(cls, d: dict, source: str = "profile") -> "Profile":
        missing = [k for k in ("model", "coeffs", "h2d_gbps", "model_config") if k not in d]
        if missing:
            raise ValueError(f"{source}: not a slora profile (missing {', '.join(missing)}); "
                             "make one with `slora profile --model DIR -o profile.json`")
        cost = CostModel(coeffs=d["coeffs"], host_coeffs=d.get("host_coeffs"), h2d_gbps=d["h2d_gbps"],
                         disk_gbps=d.get("disk_gbps"), load_overhead_s=d.get("load_overhead_s", 0.0),
                         prefetch_overlap=d.get("prefetch_overlap", 1.0),
                         load_pieces=d.get("load_pieces", 1))
        return cls(model=d["model"], gpu=d.get("gpu", "unknown"), cost=cost,
                   model_config=d["model_config"], dtype=d.get("dtype", "bfloat16"),
                   quantization=d.get("quantization"),
                   block_size=d.get("block_size", 16), num_pages=d.get("num_pages"),
                   gpu_memory_gb=d.get("gpu_memory_gb"),
                   mixed_graph_tokens=d.get("mixed_graph_tokens", 0),
                   async_scheduling=bool(d.get("async_scheduling", False)),
                   tensor_parallel_size=int(d.get("tensor_parallel_size", 1)),
                   fit_stats=d.get("fit", {}), samples=d.get("samples", []),
                   transfer_samples=d.get("transfer_samples", {}))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    def refit(self, extra: list[dict] = ()) -> "Profile":
        """This profile with its step coefficients fitted anew from its own samples under the
        current FEATURES (transfers and overlap kept): for a profile whose coefficients do not
        cover the current FEATURES. No device needed. `extra`: more steps of the same form
        ({"features", "seconds"}), e.g. a replay's step log; they join the stored samples."""
        samples = list(self.samples) + list(extra)
        if not samples:
            raise ValueError(f"profile of {self.model}: no samples stored to refit from")
        coeffs, host, stats = fit_max([(sample_row(s["features"], self.mixed_graph_tokens),
                                        s["seconds"]) for s in samples])
        cost = dataclasses.replace(self.cost, coeffs=coeffs, host_coeffs=host)
        kept = {k: v for k, v in self.fit_stats.items() if k not in stats}
        return dataclasses.replace(self, cost=cost, samples=samples,
                                   fit_stats={**kept, **stats, "refit": True})

    def with_prompt_overlap(self, share: float) -> "Profile":
        """This profile with its cost model's what-if `prompt_overlap` set to `share`."""
        return dataclasses.replace(self, cost=dataclasses.replace(self.cost, prompt_overlap=share))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"profile {path}: cannot read it as JSON ({e})") from None
        return cls.from_dict(d, source=f"profile {path}")
