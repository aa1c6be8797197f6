"""`pdserve bench` reports draft acceptance from the server's `/metrics`: a fake OpenAI server whose
spec-decode counters move with each request, under pdserve's names, vLLM's, or none at all."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from pdserve.bench.client import spec_decode_counters
from pdserve.bench.metrics import SpecDecodeCounters, spec_decode_metrics
from pdserve.bench.serve_bench import run_bench

NUM_PROMPTS = 3
# Per request the fake server "ran" 2 verification steps of 4 drafts, accepting 3 then 2 of them.
DRAFTS, DRAFT_TOKENS, ACCEPTED, PER_POS = 2, 8, 5, (2, 2, 1, 0)


class FakeTokenizer:
    vocab_size = 26

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 65 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def fake_server(prefix: str | None, serve_metrics: bool = True) -> ThreadingHTTPServer:
    """Streams two tokens per completion; its counters (under `prefix`, none if None) start at values
    left by earlier runs and grow by one request's counts per completion."""
    registry = CollectorRegistry()
    counters: dict[str, Counter] = {}
    if prefix is not None:
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            counters[name] = Counter(prefix + name, name, ["model_name"], registry=registry)
            counters[name].labels("m").inc(100)  # an earlier run's counts: the bench must subtract them
        counters["per_pos"] = Counter(
            prefix + "num_accepted_tokens_per_pos", "per pos", ["model_name", "position"], registry=registry
        )
        for pos in range(len(PER_POS)):
            counters["per_pos"].labels("m", str(pos)).inc(7)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path != "/metrics" or not serve_metrics:
                self.send_error(404)
                return
            with lock:
                body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            if counters:
                with lock:
                    counters["num_drafts"].labels("m").inc(DRAFTS)
                    counters["num_draft_tokens"].labels("m").inc(DRAFT_TOKENS)
                    counters["num_accepted_tokens"].labels("m").inc(ACCEPTED)
                    for pos, n in enumerate(PER_POS):
                        counters["per_pos"].labels("m", str(pos)).inc(n)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunks = [{"choices": [{"text": "A"}]}, {"choices": [{"text": "B"}]},
                      {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}]
            for c in chunks:
                self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def serve() -> Iterator:
    started: list[ThreadingHTTPServer] = []

    def start(prefix: str | None, serve_metrics: bool = True) -> str:
        started.append(fake_server(prefix, serve_metrics))
        return f"http://127.0.0.1:{started[-1].server_port}"

    yield start
    for s in started:
        s.shutdown()
        s.server_close()


def bench(url: str, tmp_path) -> tuple:  # type: ignore[no-untyped-def]
    table, out = io.StringIO(), tmp_path / "r.json"
    result = run_bench(
        url, "m", "random", NUM_PROMPTS, max_concurrency=1, out=str(out), random_input_len=4,
        random_output_len=2, tokenizer=FakeTokenizer(), count_outputs=False, show_progress=False,
        stdout=table,
    )
    return result, table.getvalue(), json.loads(out.read_text())


@pytest.mark.parametrize("prefix", ["pdserve:spec_decode_", "vllm:spec_decode_"])
def test_acceptance_of_the_run_is_reported(serve, tmp_path, prefix):  # type: ignore[no-untyped-def]
    result, table, report = bench(serve(prefix), tmp_path)
    assert all(r.success for r in result.records)
    spec = result.spec_decode
    assert spec is not None
    n = NUM_PROMPTS
    counts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)
    assert counts == (n * DRAFTS, n * DRAFT_TOKENS, n * ACCEPTED)
    assert spec.acceptance_rate == pytest.approx(ACCEPTED / DRAFT_TOKENS)
    assert spec.mean_acceptance_length == pytest.approx(1 + ACCEPTED / DRAFTS)
    assert spec.per_position_acceptance == pytest.approx([p / DRAFTS for p in PER_POS])
    assert "Speculative Decoding" in table
    assert "Acceptance rate (%):" in table and "62.50" in table
    assert "Mean acceptance length:" in table and "3.50" in table
    assert "Per-position acceptance (%):" in table and "100.0 100.0 50.0 0.0" in table
    assert report["spec_decode"]["acceptance_rate"] == pytest.approx(0.625)
    assert report["spec_decode"]["mean_acceptance_length"] == pytest.approx(3.5)


@pytest.mark.parametrize("prefix,serve_metrics", [(None, True), (None, False)])
def test_no_spec_metrics_no_section(serve, tmp_path, prefix, serve_metrics):  # type: ignore[no-untyped-def]
    result, table, report = bench(serve(prefix, serve_metrics), tmp_path)
    assert all(r.success for r in result.records)
    assert result.spec_decode is None
    assert "Speculative Decoding" not in table and "Acceptance" not in table
    assert report["spec_decode"] is None


def test_counters_parse_and_subtract() -> None:
    text = (
        '# TYPE pdserve:spec_decode_num_drafts counter\n'
        'pdserve:spec_decode_num_drafts_total{model_name="a"} 3.0\n'
        'pdserve:spec_decode_num_drafts_total{model_name="b"} 1.0\n'
        'pdserve:spec_decode_num_drafts_created{model_name="a"} 1.7e9\n'
        '# TYPE pdserve:spec_decode_num_draft_tokens counter\n'
        'pdserve:spec_decode_num_draft_tokens_total{model_name="a"} 12.0\n'
        '# TYPE pdserve:spec_decode_num_accepted_tokens counter\n'
        'pdserve:spec_decode_num_accepted_tokens_total{model_name="a"} 6.0\n'
        '# TYPE pdserve:spec_decode_num_accepted_tokens_per_pos counter\n'
        'pdserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="0"} 4.0\n'
        'pdserve:spec_decode_num_accepted_tokens_per_pos_total{model_name="a",position="2"} 1.0\n'
    )
    after = spec_decode_counters(text)
    assert after == SpecDecodeCounters(4, 12, 6, (4, 0, 1))  # summed over models; position 1 never seen: 0
    assert spec_decode_counters("# nothing here\n") is None
    assert spec_decode_counters(None) is None
    delta = after.minus(SpecDecodeCounters(2, 4, 1, (1,)))
    assert delta == SpecDecodeCounters(2, 8, 5, (3, 0, 1))
    assert spec_decode_metrics(SpecDecodeCounters(0, 0, 0, ())) is None  # speculation off: nothing to say
