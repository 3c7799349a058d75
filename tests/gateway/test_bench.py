"""`loragw bench` (gateway/bench/): the summary math on synthetic
timings, then the command against the directory's live server, as a user runs it."""

from __future__ import annotations

import json
import math
import random

import pytest

from loragw.gateway.bench.client import assign_models
from loragw.gateway.bench.config import BenchConfig
from loragw.gateway.bench.report import Latency, RequestResult, format_table, percentile, summarize
from loragw.gateway.bench.server import free_port
from loragw.gateway.cli import build_parser, main


# ---- the math ------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # numpy.percentile(values, 90)
    assert percentile([7.0], 99) == 7.0
    assert Latency.of([]) is None
    assert Latency.of([0.001, 0.002, 0.003]) == pytest.approx(Latency(2.0, 2.0, 2.8, 2.98))


def test_summary_of_synthetic_timings():
    results = [
        RequestResult("a", ok=True, ttft=0.1, e2e=0.5, output_tokens=5, usage_counted=True),
        RequestResult("b", ok=True, ttft=0.2, e2e=0.6, output_tokens=3, usage_counted=True),
        RequestResult("a", ok=True, ttft=0.3, e2e=0.3, output_tokens=1, usage_counted=True),
        RequestResult("b", error="HTTP 429: queue full"),
    ]
    s = summarize(results, duration_s=2.0)
    assert (s.completed, s.failed, s.total_output_tokens) == (3, 1, 9)
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(4.5)
    assert s.ttft_ms.p50 == pytest.approx(200) and s.ttft_ms.mean == pytest.approx(200)
    # TPOT leaves out the one-token request: (0.5 - 0.1) / 4 and (0.6 - 0.2) / 2.
    assert s.tpot_ms.mean == pytest.approx((100 + 200) / 2)
    assert s.e2e_ms.p99 == pytest.approx(598.0)  # 500 + 0.98 * (600 - 500)
    assert {m: (x.completed, x.failed, x.output_tokens) for m, x in s.per_model.items()} == {
        "a": (2, 0, 6), "b": (1, 1, 3)}
    assert s.first_error == "HTTP 429: queue full" and s.usage_counted
    table = format_table(s, concurrency=4, request_rate=math.inf)
    assert "Failed requests:" in table and "TPOT" in table and "inf" in table


def test_summary_without_streams_or_successes():
    whole = summarize([RequestResult("m", ok=True, e2e=0.4, output_tokens=4)], 1.0)
    assert whole.ttft_ms is None and whole.tpot_ms is None and whole.e2e_ms.p50 == 400
    assert not whole.usage_counted  # counted from chunks: the table says so
    assert "text chunks" in format_table(whole, 1, 2.0)
    failed = summarize([RequestResult("m", error="boom")], 0.0)
    assert (failed.completed, failed.request_throughput, failed.e2e_ms) == (0, 0.0, None)
    assert "n/a" in format_table(failed, 1, math.inf)


def test_adapter_assignment():
    ids = ["a", "b", "c"]
    assert assign_models(ids, 7, "uniform", random.Random(0)) == list("abcabca")
    draws = assign_models(ids, 3000, "zipf", random.Random(0))
    counts = [draws.count(i) for i in ids]
    assert counts[0] > counts[1] > counts[2] > 0  # weights 1, 1/2, 1/3
    assert draws == assign_models(ids, 3000, "zipf", random.Random(0))  # seeded


def test_flags_and_their_environment_variables(monkeypatch, capsys):
    monkeypatch.setenv("LORAGW_NUM_REQUESTS", "5")
    monkeypatch.setenv("LORAGW_STREAM", "0")
    args = build_parser().parse_args(["bench", "--url", "http://x"])
    assert (args.num_requests, args.stream, args.concurrency) == (5, False, 8)
    assert build_parser().parse_args(["bench", "--stream"]).stream is True
    assert main(["bench"]) == 2  # no --url and nothing to serve
    assert "give --url of a running server, or --model PATH or --demo" in capsys.readouterr().err
    assert main(["bench", "--url", "http://x", "--demo"]) == 2
    assert main(["bench", "--url", "http://x", "--concurrency", "0"]) == 2
    with pytest.raises(ValueError, match="request-rate"):
        BenchConfig(url="http://x", request_rate=0)


# ---- against the live server ----------------------------------------------------------------
def test_bench_against_a_running_server(server, adapter_names, wait_idle, tmp_path, capsys):
    out = tmp_path / "bench.json"
    two = adapter_names[:2]
    status = main(["bench", "--url", server.url, "--num-requests", "8", "--concurrency", "4",
                   "--max-tokens", "4", "--ignore-eos", "--adapters", ",".join(two),
                   "--json", str(out)])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "Serving Benchmark Result" in captured.out and "TTFT" in captured.out
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"], result["first_error"]) == (8, 0, None)
    assert {m: s["completed"] for m, s in result["per_model"].items()} == {two[0]: 4, two[1]: 4}
    assert result["usage_counted"] and result["total_output_tokens"] == 8 * 4
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    for r in result["requests"]:
        assert r["ok"] and 0 < r["ttft"] <= r["e2e"] and r["output_tokens"] == 4
    assert result["ttft_ms"]["p50"] <= result["e2e_ms"]["p50"]
    assert result["tpot_ms"]["p99"] > 0
    assert result["config"]["request_rate"] is None  # inf, which JSON cannot hold
    wait_idle(server.services)


def test_bench_chat_base_model_whole_responses(server, base_name, tmp_path, capsys):
    out = tmp_path / "bench.json"
    status = main(["bench", "--url", server.url, "--num-requests", "3", "--max-tokens", "2",
                   "--endpoint", "chat", "--no-stream", "--request-rate", "50",
                   "--api-key", "sk-secret", "--json", str(out)])  # the server takes any key
    assert status == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert list(result["per_model"]) == [base_name] and result["completed"] == 3
    assert result["ttft_ms"] is None and result["e2e_ms"]["p50"] > 0
    assert "sk-secret" not in out.read_text()


def test_unreachable_url_fails_with_a_message(capsys):
    port = free_port()  # nothing listens there
    assert main(["bench", "--url", f"http://127.0.0.1:{port}", "--num-requests", "2"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach http://127.0.0.1:{port}" in err and "Traceback" not in err


def test_unknown_adapter_fails_before_the_benchmark(server, adapter_names, capsys):
    status = main(["bench", "--url", server.url, "--adapters",
                   f"{adapter_names[0]},no-such-adapter", "--num-requests", "4"])
    captured = capsys.readouterr()
    assert status == 1 and "Traceback" not in captured.err
    assert "model 'no-such-adapter' failed its check request: HTTP 404" in captured.err
    assert captured.out == ""  # no table: nothing was benchmarked


@pytest.mark.slow
def test_bench_starts_and_stops_its_own_server(model_dir, adapter_dirs, tmp_path, monkeypatch,
                                                capsys):
    """Without --url: `loragw serve` in a subprocess, with --adapter, then stopped."""
    monkeypatch.setenv("LORAGW_ADAPTER_DIR", str(tmp_path / "store"))  # the server inherits it
    monkeypatch.setenv("LORAGW_DEVICE", "cpu")
    out = tmp_path / "bench.json"
    status = main(["bench", "--model", model_dir, "--adapter", f"lora-0={adapter_dirs['lora-0']}",
                   "--adapters", "all", "--num-requests", "2", "--max-tokens", "2",
                   "--json", str(out)])
    assert status == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["per_model"]["lora-0"]["completed"] == 2


@pytest.mark.slow
def test_a_server_that_fails_to_start_is_reported(tmp_path, capsys):
    assert main(["bench", "--model", str(tmp_path / "no-such-model")]) == 1
    err = capsys.readouterr().err
    assert "the server exited with status 2 during start-up" in err
    assert "no-such-model" in err  # from the server's own log lines
