"""Prefill/decode disaggregation inside one process: the router's protocol without HTTP.

Two engines, one with role `prefill` and one with `decode`, share an `inproc` (or any) transport. Each
request is first given to the decode engine, which reserves its blocks; once reserved, the prefill
engine gets it with the decode side's address and prefix-cache hit count; the decode engine's outputs are
the request's outputs. Tests use this to check that disaggregated output equals colocated output, and the
simulator drives the same two schedulers this way.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.transfer.connector import RemoteDecode, RemotePrefill
from pdserve.engine.llm_engine import LLMEngine
from pdserve.outputs import RequestOutput
from pdserve.request import SamplingParams


def generate_disaggregated(
    prefill: LLMEngine,
    decode: LLMEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    max_steps: int = 100_000,
) -> list[RequestOutput]:
    """Run every prompt through `prefill` then `decode`; returns the decode side's final outputs in
    prompt order. A request that fails on the prefill side fails on the decode side too."""
    assert prefill.connector is not None and decode.connector is not None, "both engines need a KV transport"
    ids = {f"d{i}": i for i in range(len(prompts))}
    for rid, i in ids.items():
        decode.add_request(list(prompts[i]), params, req_id=rid, kv_transfer=RemotePrefill(f"t{i}"))
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not (decode.has_unfinished_requests() or prefill.has_unfinished_requests()):
            break
        for out in decode.step():
            if out.finished:
                finals[out.request_id] = out
        for rid, skip in decode.take_kv_reservations():
            i = ids[rid]
            spec = RemoteDecode(f"t{i}", decode.connector.address, skip)
            prefill.add_request(list(prompts[i]), params, req_id=f"p{i}", kv_transfer=spec)
        for out in prefill.step():
            if out.finished and out.error is not None:
                decode.abort_request(f"d{out.request_id[1:]}")  # as the router does when a prefill fails
    else:
        raise RuntimeError(f"disaggregated generation did not finish in {max_steps} steps")
    return [finals[rid] for rid in ids]
