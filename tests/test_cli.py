"""The `slora` command, called in-process: help texts, trace synthesis, clear errors, plots, and a
replay of a short trace on a tiny model."""

import json

import pytest

from slora.config import ConfigError, EngineConfig
from slora.cli import main
from slora.metrics import RequestRecord, result_dict, summarize
from slora.workload import read_trace


@pytest.mark.parametrize("argv", [["--help"], ["trace", "--help"], ["trace", "synth", "--help"],
                                  ["replay", "--help"], ["plot", "--help"], ["simulate", "--help"],
                                  ["profile", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: slora" in out and ("examples:" in out or argv == ["trace", "--help"])


def test_top_level_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("generate", "trace", "replay", "plot", "simulate", "profile"):
        assert command in out


def test_generate_help_comes_from_the_demo(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0 and "usage: slora generate" in capsys.readouterr().out


def test_trace_synth(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert main(["trace", "synth", "--num-adapters", "8", "--rate", "4", "--cv", "2", "--alpha", "0.5",
                 "--duration", "10", "--input-len", "4", "16", "--output-len", "2", "8",
                 "--ranks", "8,16", "--seed", "3", "-o", str(out)]) == 0
    trace = read_trace(out)
    assert len(trace) == 40 and trace.adapters == {f"lora-{j}": (8, 16)[j % 2] for j in range(8)}
    assert all(4 <= r.prompt_len <= 16 and 2 <= r.output_len <= 8 for r in trace.requests)
    assert trace.params["cv"] == 2 and "wrote" in capsys.readouterr().out


def test_trace_synth_shared_prefix(tmp_path):
    out = tmp_path / "p.jsonl"
    assert main(["trace", "synth", "--num-adapters", "3", "--rate", "4", "--duration", "5",
                 "--input-len", "4", "8", "--shared-prefix", "20", "--vocab-size", "100",
                 "-o", str(out)]) == 0
    trace = read_trace(out)
    heads = {}
    for r in trace.requests:  # each adapter's system prompt, then the request's own tokens
        assert 24 <= len(r.prompt) <= 28 and all(0 <= t < 100 for t in r.prompt)
        assert heads.setdefault(r.adapter, r.prompt[:20]) == r.prompt[:20]
    assert len(set(map(tuple, heads.values()))) == len(heads) > 1
    assert trace.params["shared_prefix"] == 20


def test_bad_ranks_and_misplaced_tokenizer(tmp_path, capsys):
    base = ["trace", "synth", "--num-adapters", "2", "--rate", "1", "--duration", "5", "-o",
            str(tmp_path / "t.jsonl")]
    with pytest.raises(SystemExit):
        main(base + ["--ranks", "8,x"])
    assert "comma-separated integers" in capsys.readouterr().err
    assert main(base + ["--tokenizer", str(tmp_path)]) == 1
    assert "--tokenizer only applies with --sharegpt" in capsys.readouterr().err


def test_replay_of_a_malformed_trace_names_the_line(tmp_path, capsys):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"arrival_time": 0, "adapter": null, "prompt_len": 3, "output_len": 2}\n'
                     '{"arrival_time": 1, "adapter": null, "prompt_len": 3}\n')
    assert main(["replay", str(trace), "--model", str(tmp_path), "-o", str(tmp_path / "r.json")]) == 1
    err = capsys.readouterr().err
    assert f"{trace}:2: missing 'output_len'" in err


def fake_result(source, num_adapters, policy="fcfs", scale=1.0):
    records = [RequestRecord(i * 0.5, i * 0.5 + 0.2 * scale, i * 0.5 + num_adapters * 0.01 * scale, 8, 4)
               for i in range(10)]
    return result_dict(summarize(records), source=source, config={
        "workload": {"num_adapters": num_adapters, "rate": 2.0, "ranks": [8, 16]},
        "engine": {"policy": policy}})


def write_results(tmp_path, results):
    paths = []
    for i, r in enumerate(results):
        paths.append(tmp_path / f"r{i}.json")
        paths[-1].write_text(json.dumps(r))
    return [str(p) for p in paths]


def test_plot_writes_a_png(tmp_path):
    results = [fake_result(src, n, scale=s) for src, s in (("replay", 1.0), ("simulate", 1.1))
               for n in (5, 100, 1000)]
    fig = tmp_path / "fig.png"
    assert main(["plot", *write_results(tmp_path, results), "-o", str(fig)]) == 0
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_categorical_axis_and_explicit_series(tmp_path):
    results = [fake_result("replay", n, policy=p) for p in ("fcfs", "cluster", "abort") for n in (5, 50)]
    fig = tmp_path / "sub" / "policies.png"
    assert main(["plot", *write_results(tmp_path, results), "-o", str(fig), "--x", "policy",
                 "--series", "num_adapters"]) == 0
    assert fig.stat().st_size > 1000


def test_plot_of_results_without_latencies_and_no_axis_says_what_to_do(tmp_path, capsys):
    """Results of one setting plot as latency distributions, which need the per-request
    latencies a result stores; without them the error names --x."""
    paths = write_results(tmp_path, [fake_result("replay", 5), fake_result("replay", 5)])
    assert main(["plot", *paths, "-o", str(tmp_path / "f.png")]) == 1
    err = capsys.readouterr().err
    assert "hold no per-request latencies" in err and "--x" in err


def test_plot_of_a_replay_and_its_simulation_draws_distributions(tmp_path, capsys):
    records = [RequestRecord(i * 0.5, i * 0.5 + 0.2, i * 0.5 + 1.0, 8, 4) for i in range(10)]
    results = [result_dict(summarize(records), source=source, records=records, config={
        "workload": {"num_adapters": 5}, "engine": {"dtype": dtype, "model": model}})
        for source, dtype, model in (("replay", "auto", "/models/tiny"),
                                     ("simulate", "float32", "tiny"))]
    fig = tmp_path / "latency.png"
    assert main(["plot", *write_results(tmp_path, results), "-o", str(fig)]) == 0
    assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in capsys.readouterr().out


def test_replay_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    trace, out = tmp_path / "t.jsonl", tmp_path / "result.json"
    assert main(["trace", "synth", "--num-adapters", "3", "--rate", "6", "--duration", "1",
                 "--input-len", "3", "12", "--output-len", "1", "6", "--ranks", "4,8", "-o", str(trace)]) == 0
    assert main(["replay", str(trace), "--model", str(tiny_model_dir), "--synthetic-adapters",
                 "--device", "cpu", "--num-pages", "64", "--no-progress", "-o", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["num_requests"] == result["num_completed"] == 6 and result["num_failed"] == 0
    assert result["source"] == "replay" and result["config"]["workload"]["num_adapters"] == 3
    assert result["config"]["engine"]["num_pages"] == 64 and "pages_total" in result["stats"]
    assert 0 <= result["ttft_p50_s"] <= result["ttft_p90_s"] <= result["ttft_p99_s"]
    assert "SLO attainment" in capsys.readouterr().out
    # every completed request's latencies, last, one list to a line; then the token gaps,
    # [seconds, tokens] pairs, one per token after each request's first
    lat = result["latencies"]
    assert list(lat) == ["ttft_s", "e2e_s", "itl_s"] and len(lat["ttft_s"]) == len(lat["e2e_s"]) == 6
    assert sum(n for _, n in lat["itl_s"]) == sum(
        json.loads(line)["output_len"] - 1 for line in trace.read_text().splitlines()[1:])
    assert list(result)[-1] == "latencies" and out.read_text().count("\n") < 200
    assert all(t <= e for t, e in zip(result["latencies"]["ttft_s"], result["latencies"]["e2e_s"]))


def test_replay_engine_options_carry_the_gemm_row_limit():
    from slora.cli import _engine_options, build_parser

    args = build_parser().parse_args(["replay", "t.jsonl", "--model", "m", "-o", "r.json",
                                      "--gemm-max-rows", "0", "--num-pages", "64"])
    assert _engine_options(args) == {"gemm_max_rows": 0, "num_pages": 64}


def test_serve_takes_vllms_adapter_and_template_flags(tmp_path):
    from slora.cli import build_parser
    from slora.server.serve import _adapter_spec, _template

    args = build_parser().parse_args([
        "serve", "--adapter", "a=/x", "--lora-modules", "b=/y", '{"name": "c", "path": "/z"}',
        "--chat-template", "{{ messages }}"])
    assert [_adapter_spec(s) for s in args.adapter] == [("a", "/x"), ("b", "/y"), ("c", "/z")]
    assert _template(args.chat_template) == "{{ messages }}"
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert _template(str(tmp_path / "t.jinja")).startswith("{% for m in messages")
    for bad in ("noequals", '{"name": "c"}'):
        with pytest.raises(ValueError, match="--adapter"):
            _adapter_spec(bad)


def test_serve_takes_a_vllm_command_line():
    """vLLM's serve flags parse: its spellings of slora's own set the same fields, the flags
    slora needs no switch for change nothing, and the two it does not apply are named with
    the reason."""
    from slora.cli import build_parser
    from slora.server.serve import unapplied_vllm_flags
    from slora.server.settings import engine_config_from_args

    args = build_parser().parse_args([
        "serve", "--enable-lora", "--lora-modules", "a=/x", "--max-lora-rank", "64",
        "--max-loras", "4", "--max-num-batched-tokens", "4096", "--gpu-memory-utilization",
        "0.9", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--trust-remote-code", "--disable-log-requests", "--max-model-len", "2048",
        "--dtype", "half"])
    config = engine_config_from_args(args)
    assert (config.max_lora_rank, config.max_batch_tokens, config.gpu_memory_fraction,
            config.max_model_len, config.dtype) == (64, 4096, 0.9, 2048, "float16")
    assert EngineConfig(dtype="float").dtype == "float32"
    with pytest.raises(ConfigError, match=r"EngineConfig.dtype='double'.*or vLLM's half, float"):
        EngineConfig(dtype="double")
    assert args.tool_call_parser == "hermes"
    [line] = unapplied_vllm_flags(args)
    assert line.startswith("--max-loras 4 is not applied: adapters share the paged pool")
    plain = build_parser().parse_args(["serve"])
    assert unapplied_vllm_flags(plain) == [] and engine_config_from_args(plain).max_lora_rank is None
