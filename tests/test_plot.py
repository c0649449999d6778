"""`slora.plot`: which figure a set of results makes, which lines it draws and what they are
called, checked on the matplotlib Figure (Agg), not on pixels."""

import pytest

pytest.importorskip("matplotlib")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from slora.metrics import RequestRecord, result_dict, summarize  # noqa: E402
from slora.plot import figure, plot_results, series_keys  # noqa: E402


def result(source="replay", scale=1.0, n=12, latencies=True, **config):
    """A result of `n` requests; config keys go to "workload" (num_adapters, rate) or "engine"."""
    records = [RequestRecord(i * 0.5, i * 0.5 + 0.1 * scale * (1 + i % 3),
                             i * 0.5 + scale * (1 + i % 4), 8, 4) for i in range(n)]
    workload = {k: config.pop(k) for k in ("num_adapters", "rate") if k in config}
    return result_dict(summarize(records), source=source, config={
        "workload": {"num_adapters": 5, "rate": 2.0, **workload}, "engine": config},
        records=records if latencies else None)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def labels(ax):
    return [line.get_label() for line in ax.lines]


def test_one_result_draws_its_two_latency_distributions():
    r = result()
    fig = figure([r])
    ttft, e2e = fig.axes
    assert [ax.get_xlabel() for ax in fig.axes] == ["first-token latency (s)",
                                                   "end-to-end latency (s)"]
    assert labels(ttft) == labels(e2e) == ["replay (12 requests)"]
    for ax, key in ((ttft, "ttft_s"), (e2e, "e2e_s")):
        xs, ys = ax.lines[0].get_data()
        assert sorted(xs) == list(xs) and sorted(r["latencies"][key]) == list(xs[1:])
        assert ys[0] == 0 and ys[-1] == pytest.approx(1.0)  # a CDF from 0 to every request


def test_a_replay_and_its_simulation_are_one_line_each_named_by_source():
    """Their configs also differ in incidental keys (dtype "auto" against the profile's,
    a model path against a name): those vary with the source and split nothing."""
    replay = result("replay", dtype="auto", model="/models/tiny", policy="fcfs")
    sim = result("simulate", scale=1.1, dtype="float32", model="tiny", policy="fcfs")
    assert series_keys([replay, sim]) == ["source"]
    fig = figure([replay, sim])
    assert len(fig.axes) == 2
    for ax in fig.axes:
        assert labels(ax) == ["replay (12 requests)", "simulate (12 requests)"]
    # the legend, once for the figure, below every axes and its labels
    assert [t.get_text() for t in fig.legends[0].get_texts()] == labels(fig.axes[0])
    assert_legend_clear_of_labels(fig)


def test_millisecond_latencies_get_readable_ticks():
    assert_legend_clear_of_labels(figure([result(scale=0.0123), result("simulate", scale=0.004)]))


def test_a_key_that_splits_a_source_is_kept():
    rs = [result("replay", dtype="float32"), result("replay", dtype="bfloat16"),
          result("simulate", dtype="float32")]
    assert series_keys(rs) == ["source", "dtype"]
    assert labels(figure(rs).axes[0]) == ["replay, dtype=float32 (12 requests)",
                                          "replay, dtype=bfloat16 (12 requests)",
                                          "simulate, dtype=float32 (12 requests)"]


def test_repeated_runs_of_one_setting_are_numbered():
    assert labels(figure([result(), result(scale=1.2)]).axes[0]) == [
        "replay (1) (12 requests)", "replay (2) (12 requests)"]


def test_a_sweep_plots_its_metrics_against_the_axis_that_varies():
    rs = [result(src, scale=s, num_adapters=n, dtype=dtype)
          for src, s, dtype in (("replay", 1.0, "auto"), ("simulate", 1.1, "float32"))
          for n in (1000, 5, 100)]
    fig = figure(rs)
    assert len(fig.axes) == 4
    assert {ax.get_xlabel() for ax in fig.axes} == {"num_adapters"}
    assert [ax.get_ylabel() for ax in fig.axes] == [
        "throughput (req/s)", "average latency (s)", "first-token latency p90 (s)",
        "SLO attainment"]
    for ax in fig.axes:
        assert labels(ax) == ["replay", "simulate"]
        assert [list(line.get_xdata()) for line in ax.lines] == [[5, 100, 1000]] * 2
    want = sorted((r["config"]["workload"]["num_adapters"], r["avg_latency_s"])
                  for r in rs if r["source"] == "replay")
    assert list(fig.axes[1].lines[0].get_ydata()) == [y for _, y in want]
    assert_legend_clear_of_labels(fig)


def test_stored_token_gaps_add_the_inter_token_latency_distribution():
    """A replay and a simulation that store their gaps: a third panel, the CDF over tokens
    (a gap counted once per token after it), its points the stored gaps binned to 0.1 ms."""
    records = [RequestRecord(0.0, 0.1, 1.0, 8, 4), RequestRecord(0.2, 0.3, 1.2, 8, 4)]
    rs = [result_dict(summarize(records, token_gaps=gaps), source=src, records=records,
                      token_gaps=gaps, config={})
          for src, gaps in (("replay", {0.02001: 3, 0.02004: 1, 0.05: 2}),
                            ("simulate", {0.021: 6}))]
    assert rs[0]["latencies"]["itl_s"] == [[0.02, 4], [0.05, 2]]
    fig = figure(rs)
    assert [ax.get_xlabel() for ax in fig.axes][-1] == "inter-token latency (s)"
    xs, ys = fig.axes[-1].lines[0].get_data()
    assert list(xs) == [0.02, 0.02, 0.05] and list(ys) == pytest.approx([0, 4 / 6, 1])
    assert labels(fig.axes[-1]) == labels(fig.axes[0])
    # a result without gaps (an older file) leaves the panel out for all
    del rs[1]["latencies"]["itl_s"]
    assert len(figure(rs).axes) == 2


def test_a_chunk_sweep_adds_the_inter_token_latency_panel():
    """Results that count inter-token gaps (replay, simulate) and vary `max_prefill_chunk`:
    a sweep against it, with the ITL p99 as a fifth panel."""
    rs = []
    for chunk, p99 in ((2048, 0.07), (0, 0.08), (256, 0.03)):
        records = [RequestRecord(0.0, 0.1, 1.0, 8, 4)]
        rs.append(result_dict(summarize(records, token_gaps={0.02: 98, p99: 2}),
                              source="simulate", records=records,
                              config={"engine": {"max_prefill_chunk": chunk}}))
    fig = figure(rs)
    assert {ax.get_xlabel() for ax in fig.axes} == {"max_prefill_chunk"}
    assert fig.axes[-1].get_ylabel() == "inter-token latency p99 (s)"
    xs, ys = fig.axes[-1].lines[0].get_data()
    assert list(xs) == [0, 256, 2048] and list(ys) == [0.08, 0.03, 0.07]


def test_a_named_axis_makes_a_sweep_even_of_one_setting(tmp_path):
    rs = [result(latencies=False), result(latencies=False)]
    fig = figure(rs, x="rate")
    assert len(fig.axes) == 4 and fig.axes[0].get_xlabel() == "rate"
    out = plot_results(rs, tmp_path / "sub" / "f.svg", x="rate", title="two runs")
    assert out.read_text().lstrip().startswith("<?xml")


def test_a_categorical_axis_with_explicit_series():
    rs = [result(policy=p, num_adapters=n) for p in ("fcfs", "cluster", "abort") for n in (5, 50)]
    fig = figure(rs, x="policy", series=["num_adapters"])
    ax = fig.axes[0]
    assert labels(ax) == ["num_adapters=5", "num_adapters=50"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["abort", "cluster", "fcfs"]


def fleet(router, replicas, attainment, loads):
    """A result of simulated replicas (`slora simulate --replicas`), its per-replica load."""
    r = result(latencies=False)
    r["config"].update(replicas=replicas, router=router)
    r["slo_attainment"] = attainment
    r["stats"] = {"adapter_loads": sum(loads)}
    r["per_replica"] = [{"replica": i, "requests": 10 + i, "adapter_loads": n,
                         "slo_attainment": 1 - i / 100} for i, n in enumerate(loads)]
    return r


def test_replicas_against_attainment_a_line_per_router_and_loads_per_replica():
    rs = [fleet(router, n, a, [k * n] * n)
          for router, k in (("random", 5), ("adapter-affinity", 2))
          for n, a in ((2, 0.5), (8, 0.99), (4, 0.9))]
    fig = figure(rs)
    assert [ax.get_xlabel() for ax in fig.axes] == ["replicas"] * 5
    assert fig.axes[3].get_ylabel() == "SLO attainment"
    assert fig.axes[4].get_ylabel() == "adapter loads per replica"
    for ax in fig.axes:
        assert labels(ax) == ["router=random", "router=adapter-affinity"]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "4", "8"]
    assert list(fig.axes[3].lines[0].get_ydata()) == [0.5, 0.9, 0.99]
    assert list(fig.axes[4].lines[1].get_ydata()) == [4.0, 8.0, 16.0]  # loads / replicas
    assert_legend_clear_of_labels(fig)


def test_per_replica_load_ranks_each_results_replicas(tmp_path):
    rs = [fleet("random", 4, 0.9, [3, 9, 1, 5]), fleet("adapter-affinity", 4, 0.95, [2, 2, 4, 1])]
    fig = figure(rs, kind="load")
    assert [ax.get_ylabel() for ax in fig.axes] == [
        "requests per replica", "adapter loads per replica", "SLO attainment per replica"]
    loads = fig.axes[1]
    assert labels(loads) == ["router=random", "router=adapter-affinity"]
    assert [list(line.get_ydata()) for line in loads.lines] == [[9, 5, 3, 1], [4, 2, 2, 1]]
    assert list(fig.axes[2].lines[0].get_ydata()) == [0.97, 0.98, 0.99, 1.0]
    with pytest.raises(ValueError, match="per-replica"):
        figure([result()], kind="load")
    assert plot_results(rs, tmp_path / "load.png", kind="load").stat().st_size > 0


def assert_legend_clear_of_labels(fig):
    """The legend overlaps no axes and no label; no two tick labels of an axis overlap."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    for ax in fig.axes:
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert not any(a.overlaps(b) for a, b in zip(ticks, ticks[1:])), ax.get_xlabel()
        for text in [ax.xaxis.label, ax.yaxis.label, *ax.get_xticklabels(), *ax.get_yticklabels()]:
            if text.get_text():
                assert not legend.overlaps(text.get_window_extent(renderer)), text.get_text()
        assert not legend.overlaps(ax.get_window_extent(renderer))
