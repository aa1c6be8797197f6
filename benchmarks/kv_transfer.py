"""KV transfer for prefill/decode disaggregation on the real model: bytes, time, overlap.

    .venv/bin/python benchmarks/kv_transfer.py [--lengths 128,512,1024,2048] [--backends shm,tcp] [--repeats 3]

For each prompt length and backend, in one process (a prefill and a decode engine, the real bundled
model in bf16):
- KV bytes per token from the model's shape (2 x layers x kv_heads x head_dim x 2 bytes) and per prompt;
- the prefill step alone (colocated engine, same prompt) vs the prefill step that also gathers and sends
  every layer's KV as it is written: the difference is what sending costs on the prefill's critical path;
- the decode side's step that applies the arrived KV (copy into its blocks) and the whole transfer, from
  open to acknowledgement, as the connector records it (this includes the prefill compute: sending
  overlaps it);
- the same bytes moved by the transport alone (no model), as MB/s.
Both engines share the cores of this process: on 2 cores this measures costs, not a deployment.
Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pdserve import SamplingParams
from pdserve.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from pdserve.transfer.connector import RemoteDecode, RemotePrefill
from pdserve.engine.llm_engine import LLMEngine
from pdserve.transfer.base import KVLayout
from pdserve.transfer.registry import transport_class

PARAMS = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def engine(role: str, backend: str | None, threads: int | None, kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            num_threads=threads,
            cache=CacheConfig(kv_cache_memory_gb=0.5, enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096, max_model_len=4096),
            kv_transfer=KVTransferConfig(role=role, backend=backend),
        )
    )


def prompt_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def colocated_prefill(e: LLMEngine, prompt: list[int], rid: str) -> float:
    e.add_request(prompt, PARAMS, req_id=rid)
    while e.has_unfinished_requests():
        e.step()
    return next(r.duration for r in reversed(e.step_records) if r.num_prefill_tokens)


def disaggregated(p: LLMEngine, d: LLMEngine, prompt: list[int], tid: str) -> dict:
    d.add_request(prompt, PARAMS, req_id="d" + tid, kv_transfer=RemotePrefill(tid))
    d.step()
    ((_, skip),) = d.take_kv_reservations()
    assert d.connector is not None and p.connector is not None
    p.add_request(prompt, PARAMS, req_id="p" + tid, kv_transfer=RemoteDecode(tid, d.connector.address, skip))
    p.step()  # prefill + layer-wise send
    prefill_step = p.step_records[-1].duration
    apply = 0.0
    while d.has_unfinished_requests() or p.has_unfinished_requests():
        t0 = time.perf_counter()
        d.step()
        apply = max(apply, time.perf_counter() - t0)
        p.step()
    send = [r for r in p.connector.take_records() if r.direction == "send"]
    recv = [r for r in d.connector.take_records() if r.direction == "receive"]
    assert send and send[0].ok and recv and recv[0].ok, (send, recv)
    return {"prefill_step_s": prefill_step, "apply_step_s": apply, "transfer_s": send[0].duration,
            "bytes": send[0].num_bytes}


def transport_only(backend: str, layout: KVLayout, n: int, repeats: int) -> float:
    """Seconds to move n tokens of every layer from one transport to another in this process."""
    cls = transport_class(backend)
    a, b = cls(layout), cls(layout)  # type: ignore[call-arg]
    if layout.quantized:  # values and scales as the payload's bytes (kv/cache.py)
        kv = torch.randint(0, 256, layout.chunk_shape(n), dtype=torch.uint8)
    else:
        kv = torch.randn(layout.chunk_shape(n)).to(layout.dtype)
    times = []
    try:
        for i in range(repeats):
            tid = f"raw{i}"
            b.open_receive(tid, 0, n)
            t0 = time.perf_counter()
            a.open_send(tid, b.address, 0, n)
            for layer in range(layout.num_layers):
                a.send_chunk(tid, layer, 0, kv)
            a.send_done(tid, 0, None)
            got = 0
            while got < layout.num_layers + 1:
                got += len(b.poll_received())
                a.poll_acks()  # as the prefill engine's loop does: lets queued sends go
            b.ack(tid, True)
            while not a.poll_acks():
                pass
            times.append(time.perf_counter() - t0)
            a.close_send(tid)
            b.close_receive(tid)
    finally:
        a.close()
        b.close()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,1024,2048")
    ap.add_argument("--backends", default="shm,tcp")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | bfloat16 | int8 | fp8_e4m3")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    backends = args.backends.split(",")

    colo = engine("both", None, args.num_threads, args.kv_cache_dtype)
    cfg = colo.model_config
    layout: KVLayout = colo.kv_layout
    print(f"model: {colo.model_name}, {colo.dtype}, {torch.get_num_threads()} threads, KV {layout.describe()}")
    print(f"KV bytes per token = 2 (K,V) x {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x "
          f"{layout.token_row_bytes} bytes per row = {layout.bytes_per_token:,}")
    rows = []
    for n in lengths:  # warm-up: first runs of a shape pay for allocation and kernel selection
        colocated_prefill(colo, prompt_of(n, 99), f"warm{n}")
    colocated_s = {n: statistics.median(colocated_prefill(colo, prompt_of(n, r), f"c{n}-{r}")
                                        for r in range(args.repeats)) for n in lengths}
    for backend in backends:
        p = engine("prefill", backend, args.num_threads, args.kv_cache_dtype)
        d = engine("decode", backend, args.num_threads, args.kv_cache_dtype)
        for n in lengths:
            disaggregated(p, d, prompt_of(n, 99), f"{backend}{n}warm")
            runs = [disaggregated(p, d, prompt_of(n, r), f"{backend}{n}x{r}") for r in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            raw = transport_only(backend, layout, n, args.repeats)
            rows.append({"backend": backend, "prompt_tokens": n, "kv_mb": med["bytes"] / 1e6,
                         "colocated_prefill_ms": colocated_s[n] * 1e3,
                         "prefill_with_send_ms": med["prefill_step_s"] * 1e3,
                         "send_overhead_pct": 100 * (med["prefill_step_s"] / colocated_s[n] - 1),
                         "decode_apply_ms": med["apply_step_s"] * 1e3,
                         "transfer_open_to_ack_ms": med["transfer_s"] * 1e3,
                         "transport_only_ms": raw * 1e3, "transport_only_gb_s": med["bytes"] / raw / 1e9})
        p.close()
        d.close()
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bytes_per_token": layout.bytes_per_token, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
