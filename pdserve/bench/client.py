"""Async load generator for any OpenAI-compatible server: replays a workload with Poisson or gamma arrivals
and records, per request, the time of every streamed token.

`run_requests` draws the inter-arrival gaps up front (seeded), starts one task per request when it is due,
and lets `--max-concurrency` hold tasks back with a semaphore (the wait shows up as arrival → send, not
in TTFT). Each task streams `/v1/completions` (or `/v1/chat/completions`) with `ignore_eos`, greedy
sampling, `max_tokens` = the sample's output length and `stream_options.include_usage`, stamps every chunk
that carries choices (keeping its text), and takes the output token count from the final usage chunk
(`stream_options.continuous_usage_stats`, a running count in every chunk, is not asked for: the final count
is all the metrics need). Errors (HTTP status, error events in the stream, connection failures) end up in
the record, never as exceptions.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Sequence

import httpx
import numpy as np
from tqdm import tqdm

from pdserve.bench.datasets import SampleRequest
from pdserve.config import LoadConfig
from pdserve.bench.metrics import SLO, RequestRecord, SpecDecodeCounters

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PREFIX_HITS_METRIC = "pdserve:prefix_cache_hit_tokens_total"
# `/metrics` name prefixes of the speculative-decoding counters, pdserve's first (a counter `X` is
# exported as the sample `X_total`).
SPEC_METRIC_PREFIXES = ("pdserve:spec_decode_", "vllm:spec_decode_")


def api_root(base_url: str) -> str:
    """`http://host:port` from a base URL given with or without a trailing `/v1`."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is due.

    Gaps are gamma-distributed with shape `burstiness` and mean `1/request_rate` (shape 1: exponential, a
    Poisson process). The first request is due at 0. An infinite rate makes every request due at once.
    """
    if num_requests == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def request_body(cfg: LoadConfig, sample: SampleRequest, slo: SLO | None = None) -> dict:
    """The streamed request for `sample`; with `slo`, its targets as the request's own (pdserve's
    `slo_ttft_ms` / `slo_itl_ms` / `slo_tpot_ms` body fields)."""
    body: dict = {
        "model": cfg.model,
        "max_tokens": sample.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if slo is not None:
        targets = {"slo_ttft_ms": slo.ttft_ms, "slo_itl_ms": slo.itl_ms, "slo_tpot_ms": slo.tpot_ms}
        body.update({name: ms for name, ms in targets.items() if ms is not None})
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        body["prompt"] = sample.prompt
    return body


async def fetch_model_name(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model `GET /v1/models` lists."""
    async with httpx.AsyncClient(trust_env=False, timeout=timeout_s) as http:
        r = await http.get(api_root(base_url) + "/v1/models")
        r.raise_for_status()
        models = r.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url} lists no models")
    return str(models[0]["id"])


def _choice_text(choice: dict) -> str:
    """The text a streamed choice adds: `text` for completions, `delta.content` for chat."""
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta") or {}).get("content") or ""


async def fetch_metrics_text(base_url: str, timeout_s: float = 10.0) -> str | None:
    """The server's Prometheus `/metrics` text; None when it does not answer (another engine may not
    serve it)."""
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=timeout_s) as http:
            r = await http.get(api_root(base_url) + "/metrics")
            r.raise_for_status()
    except httpx.HTTPError:
        return None
    return r.text


def _samples(text: str) -> list:
    from prometheus_client.parser import text_string_to_metric_families

    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def prefix_cache_hits(text: str | None) -> int | None:
    """Prompt tokens the server has found in its prefix cache so far, from pdserve's `/metrics` text;
    None when the server does not export that counter (another engine) or `/metrics` did not answer."""
    if text is None:
        return None
    hits = [s.value for s in _samples(text) if s.name == PREFIX_HITS_METRIC]
    return int(sum(hits)) if hits else None


def spec_decode_counters(text: str | None) -> SpecDecodeCounters | None:
    """The speculative-decoding counters in `/metrics` text: pdserve's `pdserve:spec_decode_*` or vLLM's
    `vllm:spec_decode_*` (same names and labels), summed over models; None when neither is exported."""
    if text is None:
        return None
    samples = _samples(text)
    for prefix in SPEC_METRIC_PREFIXES:
        totals: dict[str, float] = {}
        per_pos: dict[int, float] = {}
        for s in samples:
            if not s.name.startswith(prefix) or not s.name.endswith("_total"):
                continue
            name = s.name[len(prefix) : -len("_total")]
            if name == "num_accepted_tokens_per_pos":
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            else:
                totals[name] = totals.get(name, 0.0) + s.value
        if "num_draft_tokens" in totals:
            return SpecDecodeCounters(
                int(totals.get("num_drafts", 0)),
                int(totals["num_draft_tokens"]),
                int(totals.get("num_accepted_tokens", 0)),
                tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos, default=-1) + 1)),
            )
    return None


async def _send(
    http: httpx.AsyncClient, url: str, body: dict, rec: RequestRecord, t0: float
) -> None:
    """Stream one request, filling `rec`; times are seconds since `t0`."""
    num_chunks = 0
    texts: list[str] = []
    rec.send_time = time.perf_counter() - t0
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {r.status_code}: {text[:500]}"
                return
            async for line in r.aiter_lines():
                now = time.perf_counter() - t0
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = f"stream error: {json.dumps(chunk['error'])[:500]}"
                    return
                choices = chunk.get("choices")
                if choices:
                    rec.token_times.append(now)
                    num_chunks += 1
                    texts.append(_choice_text(choices[0]))
                usage = chunk.get("usage")
                if usage:
                    rec.output_len = int(usage.get("completion_tokens", 0))
                    rec.prompt_len = int(usage.get("prompt_tokens", rec.prompt_len))
                    rec.usage_reported = True
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return
    finally:
        rec.end_time = time.perf_counter() - t0
        rec.output_text = "".join(texts)
    if not rec.usage_reported:
        rec.output_len = num_chunks
    if num_chunks == 0:
        rec.error = "the stream carried no tokens"
        return
    rec.success = True


async def run_requests(
    cfg: LoadConfig,
    samples: Sequence[SampleRequest],
    show_progress: bool = True,
    slos: Sequence[SLO] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Replay `samples` against the server; return one record per sample (in sample order) and the
    duration in seconds from the start to the end of the last stream. `slos`: per sample, latency
    targets to send as the request's own (and to judge it by)."""
    url = api_root(cfg.base_url) + ENDPOINTS[cfg.endpoint]
    offsets = arrival_offsets(len(samples), cfg.request_rate, cfg.burstiness, cfg.seed)
    own = list(slos) if slos is not None else [None] * len(samples)
    records = [
        RequestRecord(
            req_id=i, prompt_len=s.prompt_len, requested_output_len=s.output_len, arrival_time=a, slo=slo
        )
        for i, (s, a, slo) in enumerate(zip(samples, offsets, own))
    ]
    semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(samples), disable=not show_progress, desc="requests", unit="req")
    # No connection limit: with one, requests would queue inside the client and the wait would count as TTFT.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        trust_env=False, limits=limits, timeout=httpx.Timeout(cfg.timeout_s, connect=30.0)
    ) as http:
        t0 = time.perf_counter()

        async def one(sample: SampleRequest, rec: RequestRecord) -> None:
            delay = rec.arrival_time - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if semaphore is None:
                await _send(http, url, request_body(cfg, sample, rec.slo), rec, t0)
            else:
                async with semaphore:
                    await _send(http, url, request_body(cfg, sample, rec.slo), rec, t0)
            bar.update(1)

        try:
            await asyncio.gather(*(one(s, r) for s, r in zip(samples, records)))
        finally:
            bar.close()
        duration = time.perf_counter() - t0
    return records, duration
