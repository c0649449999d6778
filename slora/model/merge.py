"""Merged adapters (LoRAX's `merged_adapters`): one adapter made from several registered
ones, registered and served like any other.

Each LoRA matrix merges on its own, as LoRAX merges them: module m's A in layer l is a merge
of the adapters' A of (l, m), its B of their B (each adapter's B already scaled by its own
alpha / r). Adapters that have (l, m) must agree on its rank there; the merged adapter has
that rank and the union of their modules, so it costs no more to serve than one of them.
With weights w_i over the adapters that have the module:

- linear: sum_i w_i X_i.
- ties: each X_i keeps its `density` share of largest magnitudes (the rest 0); each element
  takes the majority sign (the sign of sum_i X_i with "total", of sum_i sign(X_i) with
  "frequency"; 0 counts as +), and is the mean of the w_i X_i of that sign (0 where none).
- dare_linear, dare_ties: each element of each X_i is kept with probability `density` and
  rescaled by 1 / density, then merged as linear or ties. The draws come from `seed`, so a
  merge is the same every time.

LoRAX scales the merged B by the first adapter's alpha / r alone; here each adapter's B keeps
its own scaling, which is the same where the adapters share it.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

STRATEGIES = ("linear", "ties", "dare_linear", "dare_ties")
SIGN_METHODS = ("total", "frequency")


@dataclass(frozen=True)
class MergeSpec:
    """What to merge and how (LoRAX's names). `weights` default to 1 each; `density` in
    (0, 1] is the share of elements the ties and dare strategies keep."""

    adapters: tuple[str, ...]
    weights: tuple[float, ...] | None = None
    strategy: str = "linear"
    density: float = 1.0
    majority_sign_method: str = "total"
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "adapters", tuple(self.adapters))
        if self.weights is not None:
            object.__setattr__(self, "weights", tuple(self.weights))
        n = len(self.adapters)
        checks = [
            (n >= 1 and all(isinstance(a, str) and a for a in self.adapters)
             and len(set(self.adapters)) == n, "adapters",
             "must be one or more distinct adapter names"),
            (self.weights is None or (len(self.weights) == n and all(
                isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                for w in self.weights)), "weights",
             f"must be {n} finite numbers, one per adapter"),
            (self.strategy in STRATEGIES, "strategy", f"must be one of {', '.join(STRATEGIES)}"),
            (isinstance(self.density, (int, float)) and 0 < self.density <= 1, "density",
             "must be a number in (0, 1]"),
            (self.majority_sign_method in SIGN_METHODS, "majority_sign_method",
             f"must be one of {', '.join(SIGN_METHODS)}"),
            (isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed",
             "must be an integer"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ValueError(f"merged adapters: {name}={getattr(self, name)!r}: {why}")

    def weight_list(self) -> list[float]:
        return [1.0] * len(self.adapters) if self.weights is None else list(self.weights)

    def identity(self, identities: list[str]) -> str:
        """The merged adapter's identity: its constituents' identities and the spec."""
        text = repr((identities, self.weight_list(), self.strategy, float(self.density),
                     self.majority_sign_method, self.seed))
        return "merged:" + hashlib.sha256(text.encode()).hexdigest()


def merge_tensors(tensors: list[torch.Tensor], weights: list[float], spec: MergeSpec,
                  gen: torch.Generator) -> torch.Tensor:
    """One merged matrix from the adapters' same-shaped `tensors` (float32) and weights."""
    x = torch.stack(tensors)
    w = torch.tensor(weights, dtype=x.dtype).view(-1, *[1] * (x.dim() - 1))
    if spec.strategy.startswith("dare"):
        keep = torch.rand(x.shape, generator=gen) < spec.density
        x = torch.where(keep, x / spec.density, 0)
    elif spec.strategy == "ties":
        x = torch.stack([_top_share(t, spec.density) for t in x])
    if spec.strategy in ("linear", "dare_linear"):
        return (w * x).sum(0)
    votes = x.sum(0) if spec.majority_sign_method == "total" else x.sign().sum(0)
    sign = torch.where(votes >= 0, 1.0, -1.0)
    agree = x.sign() == sign
    return (w * x * agree).sum(0) / agree.sum(0).clamp(min=1)


def _top_share(t: torch.Tensor, density: float) -> torch.Tensor:
    """`t` with all but its int(density * numel) largest magnitudes set to 0."""
    k = int(density * t.numel())
    flat = t.flatten()
    kept = torch.zeros_like(flat)
    if k:
        top = flat.abs().topk(k).indices
        kept[top] = flat[top]
    return kept.view_as(t)


def merge_weights(parts: list[dict], spec: MergeSpec) -> dict:
    """{(layer, module): (A, B)} of the merged adapter from each adapter's (`parts`, in
    `spec.adapters` order); ValueError where two adapters give one module different ranks."""
    gen = torch.Generator().manual_seed(spec.seed)
    weights = spec.weight_list()
    merged = {}
    for key in sorted({k for p in parts for k in p}, key=lambda k: (k[0], k[1])):
        have = [(w, p[key]) for w, p in zip(weights, parts) if key in p]
        ranks = {a.shape[0] for _, (a, _) in have}
        if len(ranks) > 1:
            names = [n for n, p in zip(spec.adapters, parts) if key in p]
            raise ValueError(f"merged adapters: layer {key[0]} {key[1]} has ranks "
                             f"{[a.shape[0] for _, (a, _) in have]} in {names}; adapters "
                             "merge where their ranks agree")
        w = [w for w, _ in have]
        merged[key] = (merge_tensors([a.float() for _, (a, _) in have], w, spec, gen),
                       merge_tensors([b.float() for _, (_, b) in have], w, spec, gen))
    return merged
