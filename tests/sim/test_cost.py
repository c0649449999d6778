"""The cost model: its fit recovers known coefficients and stays non-negative, the host piece
of `fit_max`, a stored profile's samples refit under the current features, the features of a
step that replays a mixed-step graph, and the step time of loads copied in pieces."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from slora.sim import CostModel, Profile, fit
from slora.sim.cost import FEATURES, HOST_FEATURES, fit_bandwidth, fit_max, padding, plan_features


def test_fit_recovers_coefficients_and_stays_non_negative():
    true = dict(zip(FEATURES, (2e-3, 1e-5, 1e-9, 3e-5, 2e-7, 1e-4, 5e-8, 1e-6, 4e-3, 9e-3, 1e-3,
                               3e-4, 2e-3, 1e-4, 2e-5)))
    rng = random.Random(0)
    samples = []
    for _ in range(200):  # prefill, decode and mixed shapes, with and without adapters
        n_pre, n_dec = rng.choice((0, 1, 4)), rng.choice((0, 8, 64))
        plen, ctx = rng.randint(8, 512), rng.randint(8, 1024)
        n_a, pages = rng.choice((0, 1, 5)), rng.choice((2, 16))
        lora = 1 if n_a else 0
        tokens = n_pre * plen + n_dec
        eager = 1.0 if n_pre and tokens > 512 else 0.0  # past the mixed graphs
        prompts = 1.0 if n_pre else 0.0
        f = (1.0, n_pre * plen, n_pre * plen * plen, n_dec, n_dec * ctx, n_a,
             lora * n_pre * plen * pages * rng.random(), lora * n_dec * pages * rng.random(),
             eager, eager * lora, lora, eager * n_a, prompts * (n_dec > 0), prompts * n_a,
             padding(tokens, 512) if prompts and not eager else 0.0)
        samples.append((f, sum(true[k] * v for k, v in zip(FEATURES, f))))
    coeffs, stats = fit(samples)
    for k in FEATURES:
        assert coeffs[k] == pytest.approx(true[k], rel=1e-6, abs=1e-15)
    assert stats["mean_rel_err"] < 1e-9
    # a feature that only adds noise with a negative slope is dropped, never negative
    noisy = [((1.0, x) + (0,) * (len(FEATURES) - 2), 1e-3 + 1e-6 * x - 1e-7 * (x % 3))
             for x in range(1, 50)]
    noisy += [((1.0, x) + (0,) * (len(FEATURES) - 2), 1e-3) for x in (1000, 2000)]
    coeffs, _ = fit(noisy)
    assert all(v >= 0 for v in coeffs.values())
    overhead, gbps = fit_bandwidth([(b, 1e-5 + b / 25e9) for b in (1e6, 4e6, 16e6)])
    assert overhead == pytest.approx(1e-5) and gbps == pytest.approx(25)


def test_fit_max_finds_the_host_bound_steps():
    """Steps bound by the host (an eager step whose kernels finish before Python launches the
    next) take max(device work, host work): fit_max recovers both pieces where a linear fit
    cannot, and falls back to the linear model (host None) where nothing is host-bound."""
    rng = random.Random(1)
    device = dict.fromkeys(FEATURES, 0.0) | {"const": 2e-3, "prefill_tokens": 2e-5,
                                             "decode_seqs": 1e-5, "decode_ctx": 1e-7, "eager": 1e-3}
    host = dict.fromkeys(HOST_FEATURES, 0.0) | {"const": 2e-3, "eager": 12e-3, "decode_seqs": 2e-5}
    samples = []
    for _ in range(300):
        tokens = rng.choice((0, 16, 128, 512, 1024, 2048))
        n_dec = rng.choice((0, 1, 8, 32, 128))
        if not tokens and not n_dec:
            continue
        f = [0.0] * len(FEATURES)
        f[0], f[1], f[3], f[4], f[8] = 1.0, tokens, n_dec, n_dec * rng.randint(8, 1024), float(tokens > 0)
        d = sum(device[k] * v for k, v in zip(FEATURES, f))
        h = sum(host[k] * f[FEATURES.index(k)] for k in HOST_FEATURES)
        samples.append((tuple(f), max(d, h) * (1 + 0.01 * rng.uniform(-1, 1))))
    linear, lstats = fit(samples)
    coeffs, host_coeffs, stats = fit_max(samples)
    assert host_coeffs is not None and 0 < stats["host_bound"] < len(samples)
    assert stats["mean_rel_err"] < 0.02 < lstats["mean_rel_err"]
    cost = CostModel(coeffs=coeffs, host_coeffs=host_coeffs)
    for f, t in samples:
        assert cost.forward_time(f) == pytest.approx(t, rel=0.05)
    # linear data: no host piece, the linear fit
    lin = [(f, sum(device[k] * v for k, v in zip(FEATURES, f))) for f, _ in samples]
    coeffs, host_coeffs, stats = fit_max(lin)
    assert stats["mean_rel_err"] < 1e-6
    # a profile with a host piece round-trips
    p = Profile(model="m", gpu="g", cost=cost, model_config={})
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))).cost.host_coeffs == cost.host_coeffs
    with pytest.raises(ValueError, match="unknown host coefficient"):
        CostModel(host_coeffs={"prefill_tokens": 1.0})


def test_refit_derives_missing_features_from_the_stored_ones():
    """A profile whose samples hold only the first eight features (none of `eager`,
    `eager_lora`, `lora`, `eager_adapters`, `mixed`, `mixed_adapters`) refits from them."""
    old_keys = FEATURES[:8]
    samples = []
    for n_pre in (0, 1, 3):
        for n_a in (0, 1, 3):
            for n_dec in (0, 1, 8, 32):
                if not n_pre and not n_dec:
                    continue
                f = dict(zip(old_keys, (1.0, 64.0 * n_pre, 0.0, n_dec, 100.0 * n_dec, n_a, 0.0, 0.0)))
                eager = 1.0 if n_pre else 0.0
                t = 5e-3 + 2e-5 * f["prefill_tokens"] + 1e-5 * n_dec + 4e-3 * eager + 9e-3 * eager * (n_a > 0)
                samples.append({"features": f, "seconds": t})
    p = Profile(model="m", gpu="g", cost=CostModel(), model_config={}, samples=samples)
    q = p.refit()
    assert q.cost.coeffs["eager"] == pytest.approx(4e-3, rel=1e-6)
    assert q.cost.coeffs["eager_lora"] == pytest.approx(9e-3, rel=1e-6)
    assert q.cost.coeffs["lora"] == pytest.approx(0, abs=1e-9)
    assert q.cost.coeffs["eager_adapters"] == pytest.approx(0, abs=1e-9)
    assert q.cost.coeffs["mixed"] == pytest.approx(0, abs=1e-9)
    assert q.fit_stats["refit"] and q.fit_stats["mean_rel_err"] < 1e-9


def test_steps_that_replay_mixed_graphs_are_not_eager():
    """With `mixed_graph_tokens` set, a step with prompts of at most that many tokens in all
    replays a CUDA graph: the cost model's `eager` features are 0 for it."""
    pre = SimpleNamespace(request_id="p", num_computed=0, adapter="a")
    dec = SimpleNamespace(prompt_token_ids=[1] * 5, output_token_ids=[2], adapter=None)
    plan = SimpleNamespace(prefill=[pre], decode=[dec, dec], chunks={"p": 10})
    adapters = SimpleNamespace(pages_of={None: 0, "a": 3})
    idx = {k: FEATURES.index(k) for k in ("eager", "eager_lora", "eager_adapters", "lora")}
    for graph_tokens, eager in ((0, 1.0), (11, 1.0), (12, 0.0), (64, 0.0)):
        f = plan_features(plan, adapters, graph_tokens)
        assert [f[idx[k]] for k in ("eager", "eager_lora", "eager_adapters")] == [eager] * 3
        assert f[idx["lora"]] == 1.0


def test_step_loads_in_pieces_wait_for_the_first_piece_only():
    """CostModel.step_time: the step's own loads in K pieces of layers, the forward waiting for
    each piece: the first piece's copy before any compute, the rest beside the forward as
    prefetch copies are. K = 1 (the CPU; a profile that records no K): every load before it."""
    whole = CostModel(prefetch_overlap=1.0)
    pieces = CostModel(prefetch_overlap=1.0, load_pieces=4)
    assert whole.step_time(forward=10.0, blocking=4.0, prefetch=0.0, disk=0.0) == pytest.approx(14.0)
    assert pieces.step_time(forward=10.0, blocking=4.0, prefetch=0.0, disk=0.0) == pytest.approx(11.0)
    # copies longer than the forward: the copy stream sets the time
    assert pieces.step_time(forward=1.0, blocking=8.0, prefetch=2.0, disk=0.5) == pytest.approx(10.5)
    serial = CostModel(prefetch_overlap=0.0, load_pieces=4)
    assert serial.step_time(forward=10.0, blocking=4.0, prefetch=0.0, disk=0.0) == pytest.approx(14.0)
    p = Profile(model="m", gpu="g", cost=pieces, model_config={})
    assert Profile.from_dict(json.loads(json.dumps(p.to_dict()))).cost.load_pieces == 4
    old = {k: v for k, v in p.to_dict().items() if k != "load_pieces"}
    assert Profile.from_dict(old).cost.load_pieces == 1
    with pytest.raises(ValueError, match="load_pieces=0"):
        CostModel(load_pieces=0)


def test_decode_time_is_the_step_time_of_a_decode_only_plan():
    """`CostModel.decode_time` (the fast-forward's step time) is, to the last bit, the step time
    of `plan_features` for a plan of decode rows alone, with and without a host piece."""
    from slora.core.scheduler import SchedulerPlan
    from slora.request import Request, SamplingParams
    from slora.sim.cost import decode_features

    rng = random.Random(0)
    pages = {f"a{i}": 1 + i % 7 for i in range(9)}
    manager = SimpleNamespace(pages_of={None: 0, **pages})
    for _ in range(200):
        reqs = [Request(str(i), [0] * rng.randrange(1, 90), SamplingParams(), rng.choice(
            [None, *pages]), 0.0) for i in range(rng.randrange(1, 30))]
        for r in reqs:
            r.output_token_ids += [0] * rng.randrange(0, 50)
        names = {r.adapter for r in reqs} - {None}
        assert plan_features(SchedulerPlan(decode=reqs), manager, 512) == decode_features(
            len(reqs), sum(r.num_tokens for r in reqs), len(names),
            sum(pages[r.adapter] for r in reqs if r.adapter))
    for host in (None, {"const": 3.6e-3, "decode_seqs": 2.2e-5, "adapters": 1e-6, "eager": 0.01}):
        coeffs = {k: rng.choice((0.0, rng.uniform(0, 1e-3), rng.uniform(0, 1e-7))) for k in FEATURES}
        cost = CostModel(coeffs=coeffs, host_coeffs=host, prefetch_overlap=0.7, load_pieces=4)
        for _ in range(2000):
            rows, adapters = rng.randrange(1, 300), rng.randrange(0, 60)
            ctx, lora = rows * rng.randrange(1, 2000), adapters * rng.randrange(1, 40)
            want = cost.step_time(cost.forward_time(decode_features(rows, ctx, adapters, lora)),
                                  0.0, 0.0, 0.0)
            assert cost.decode_time(rows, ctx, adapters, lora) == want


def test_a_chunk_is_charged_its_tokens_and_its_context():
    """A chunk of a prompt counts its own tokens in prefill_tokens and, in prefill_attn, its
    tokens times its context: the cached prefix before it and itself."""
    chunk = SimpleNamespace(request_id="c", num_computed=30, adapter="a")
    whole = SimpleNamespace(request_id="w", num_computed=0, adapter=None)
    plan = SimpleNamespace(prefill=[chunk, whole], decode=[], chunks={"c": 10, "w": 7})
    adapters = SimpleNamespace(pages_of={None: 0, "a": 3})
    f = dict(zip(FEATURES, plan_features(plan, adapters)))
    assert f["prefill_tokens"] == 17
    assert f["prefill_attn"] == 10 * 40 + 7 * 7
    assert f["lora_prefill"] == 10 * 3


def test_prompt_overlap_hides_prompt_work_under_decode_attention_only():
    """The what-if `prompt_overlap` takes share x min(decode attention, prompt work) off a step
    with both; a decode-only or prompt-only step, and every step at share 0, are unchanged."""
    coeffs = dict.fromkeys(FEATURES, 0.0)
    coeffs.update(const=1e-3, prefill_tokens=2e-5, prefill_attn=1e-9, decode_seqs=1e-5,
                  decode_ctx=3e-8, lora_prefill=1e-9, mixed=5e-4, padded=2e-5)
    plain, half, whole = (CostModel(coeffs=coeffs, prompt_overlap=s) for s in (0.0, 0.5, 1.0))

    def features(prompt_tokens, decode_rows, ctx=400):
        f = dict.fromkeys(FEATURES, 0.0)
        f.update(const=1.0, prefill_tokens=prompt_tokens, prefill_attn=prompt_tokens ** 2 / 2,
                 decode_seqs=decode_rows, decode_ctx=decode_rows * ctx,
                 lora_prefill=prompt_tokens * 10, mixed=float(prompt_tokens > 0 < decode_rows),
                 padded=3.0 if prompt_tokens else 0.0)
        return tuple(f[k] for k in FEATURES)

    for tokens, rows in ((0, 200), (256, 0), (256, 200), (4096, 200)):
        x = features(tokens, rows)
        attn = coeffs["decode_ctx"] * rows * 400
        prompt = sum(coeffs[k] * x[FEATURES.index(k)] for k in
                     ("prefill_tokens", "prefill_attn", "lora_prefill", "mixed", "padded"))
        for cost, share in ((plain, 0.0), (half, 0.5), (whole, 1.0)):
            assert cost.forward_time(x) == pytest.approx(
                plain.forward_time(x) - share * min(attn, prompt), rel=1e-12)
        if tokens and rows:  # a mixed step at share 1 takes the longer of its two parts' sum
            assert whole.forward_time(x) < plain.forward_time(x)
    assert whole.decode_time(200, 80000, 0, 0) == plain.decode_time(200, 80000, 0, 0)
    with pytest.raises(ValueError, match="prompt_overlap=1.5 must be in"):
        CostModel(prompt_overlap=1.5)
