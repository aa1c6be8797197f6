"""`pdserve bench` end to end: a small benchmark against a tiny random-weights pdserve server over real HTTP,
checking that every per-request record is complete and the JSON report is written."""

from __future__ import annotations

import io
import json
import math

import pytest

from pdserve.bench.metrics import SLO
from pdserve.bench.serve_bench import load_samples, run_bench
from pdserve.cli import main
from pdserve.model.loader import default_model_path
from pdserve.model.tokenizer import load_tokenizer
from pdserve.server.launcher import ServerProcess
from tests.support.server import MODEL, quiet_env, scrape, tiny_server_args

NUM_PROMPTS = 8
INPUT_LEN, OUTPUT_LEN = 24, 12


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(tiny_server_args("--stats-interval", "0"), env=quiet_env()).start()
    try:
        yield srv.wait_ready()
    finally:
        srv.close()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def _check_records(records: list[dict]) -> None:
    assert len(records) == NUM_PROMPTS
    for rec in records:
        assert rec["success"] and rec["error"] == "", rec
        assert rec["usage_reported"], rec
        # ignore_eos: the server generates exactly what was asked for.
        assert rec["output_len"] == rec["requested_output_len"], rec
        # One timestamp per chunk; the server folds a token whose text is held back (a partial character)
        # into the next chunk, so a few chunks carry two tokens, never fewer than one.
        assert 1 <= len(rec["token_times"]) <= rec["output_len"], rec
        assert rec["prompt_len"] > 0
        times = rec["token_times"]
        assert rec["arrival_time"] <= rec["send_time"] < times[0], rec  # TTFT > 0
        assert times == sorted(times) and times[-1] <= rec["end_time"], rec
    num_chunks = sum(len(r["token_times"]) for r in records)
    num_tokens = sum(r["output_len"] for r in records)
    assert num_chunks >= 0.9 * num_tokens, (num_chunks, num_tokens)


def test_bench_records_complete_and_report_written(server, tokenizer, tmp_path):
    out = tmp_path / "results.json"
    table = io.StringIO()
    result = run_bench(
        server.url,
        None,  # from /v1/models
        "random",
        NUM_PROMPTS,
        math.inf,
        seed=0,
        slo=SLO(ttft_ms=60_000, tpot_ms=60_000, itl_ms=60_000),  # generous: every request meets it
        out=str(out),
        random_input_len=INPUT_LEN,
        random_output_len=OUTPUT_LEN,
        tokenizer=tokenizer,
        show_progress=False,
        stdout=table,
    )
    assert result.model == MODEL
    m = result.metrics
    assert (m.completed, m.failed) == (NUM_PROMPTS, 0)
    assert m.total_output_tokens == NUM_PROMPTS * OUTPUT_LEN
    assert m.itl.count == sum(len(r.token_times) - 1 for r in result.records)
    assert m.tpot.count == NUM_PROMPTS
    assert m.ttft.mean > 0 and m.e2el.mean >= m.ttft.mean
    assert m.num_good == NUM_PROMPTS and m.slo_attainment == 100.0
    assert "Successful requests:" in table.getvalue() and "P99 ITL (ms):" in table.getvalue()

    report = json.loads(out.read_text())
    assert report["config"]["request_rate"] == "inf" and report["config"]["model"] == MODEL
    assert report["metrics"]["completed"] == NUM_PROMPTS
    _check_records(report["records"])
    # The server's usage agrees with the tokenizer's count of the prompts the client sent.
    samples = load_samples(tokenizer, "random", NUM_PROMPTS, 0, INPUT_LEN, OUTPUT_LEN)
    assert [r["prompt_len"] for r in report["records"]] == [s.prompt_len for s in samples]


def test_cli_bench_chat_endpoint_with_rate(server, tmp_path, capsys):
    out = tmp_path / "chat.json"
    rc = main(
        [
            "bench",
            "--base-url",
            server.url + "/v1",
            "--model",
            MODEL,
            "--endpoint",
            "chat",
            "--dataset",
            "random",
            "--num-prompts",
            str(NUM_PROMPTS),
            "--random-input-len",
            str(INPUT_LEN),
            "--random-output-len",
            str(OUTPUT_LEN),
            "--request-rate",
            "50",
            "--max-concurrency",
            "3",
            "--slo",
            "ttft=60000",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    assert "Request goodput (req/s):" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["config"]["endpoint"] == "chat" and report["config"]["max_concurrency"] == 3
    _check_records(report["records"])
    arrivals = [r["arrival_time"] for r in report["records"]]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and arrivals[-1] > 0


def test_cli_bench_sends_per_request_slo_classes(server, tmp_path, capsys):
    """Smoke: two request classes sent with their own targets; the server accepts them, every record
    carries its class, goodput is judged per request, and the server's per-request goodput moved."""
    out = tmp_path / "classes.json"
    before = scrape(server.url)
    rc = main(
        [
            "bench", "--base-url", server.url, "--model", MODEL, "--dataset", "random",
            "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(OUTPUT_LEN),
            "--slo-classes", "ttft=60000,itl=60000@1;ttft=0.001@1", "--out", str(out), "--no-progress",
        ]
    )
    assert rc == 0
    assert "each request's own (--slo-classes)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    _check_records(report["records"])
    own = [r["slo"]["ttft_ms"] for r in report["records"]]
    assert set(own) <= {60000.0, 0.001} and len(own) == NUM_PROMPTS
    assert report["metrics"]["num_good"] == own.count(60000.0)
    after = scrape(server.url)
    judged = sum(
        after.get(f"pdserve:request_slo_{k}_total", 0.0) - before.get(f"pdserve:request_slo_{k}_total", 0.0)
        for k in ("met", "missed")
    )
    assert judged >= NUM_PROMPTS  # each request: its ttft (and itl) plus "all"


def test_failed_requests_are_recorded_not_raised(server, tokenizer):
    result = run_bench(
        server.url,
        "no-such-model",  # the server answers 404
        "random",
        2,
        math.inf,
        random_input_len=INPUT_LEN,
        random_output_len=OUTPUT_LEN,
        tokenizer=tokenizer,
        show_progress=False,
        stdout=io.StringIO(),
    )
    assert (result.metrics.completed, result.metrics.failed) == (0, 2)
    assert all(r.error.startswith("HTTP 404") and not r.success for r in result.records)


def test_speculating_server_reports_acceptance_on_code_edit(tmp_path, capsys):
    """A tiny server with n-gram speculation, benchmarked on the code-edit dataset through the CLI: the
    report carries the run's acceptance from the server's `pdserve:spec_decode_*` counters."""
    spec = json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    )
    srv = ServerProcess(
        tiny_server_args("--stats-interval", "0", "--speculative-config", spec), env=quiet_env()
    ).start()
    try:
        url = srv.wait_ready().url
        out = tmp_path / "spec.json"
        args = [
            "bench", "--base-url", url, "--dataset", "code-edit", "--num-prompts", "3",
            "--code-edit-max-len", "200", "--code-edit-output-len", "24", "--code-edit-max-total-len", "512",
            "--out", str(out), "--no-progress",
        ]
        assert main(args) == 0
    finally:
        srv.close()
    table = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["metrics"]["completed"] == 3
    spec_report = report["spec_decode"]
    assert spec_report is not None and spec_report["num_drafts"] > 0, table
    assert 0.0 <= spec_report["acceptance_rate"] <= 1.0
    assert spec_report["mean_acceptance_length"] == pytest.approx(
        1 + spec_report["num_accepted_tokens"] / spec_report["num_drafts"]
    )
    assert "Mean acceptance length:" in table


def test_plain_server_reports_no_acceptance(server, tokenizer):
    result = run_bench(
        server.url, None, "random", 2, math.inf, random_input_len=INPUT_LEN, random_output_len=OUTPUT_LEN,
        tokenizer=tokenizer, show_progress=False, stdout=io.StringIO(),
    )
    assert result.metrics.completed == 2 and result.spec_decode is None
