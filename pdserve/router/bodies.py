"""What the router reads and rewrites of a request: the client's body (parsed only as far as routing
needs, with an estimate of its prompt tokens), the bodies sent to the decode and the prefill instance,
and the shape of what comes back (a whole answer that is an error, where SSE events end)."""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.server import wire
from pdserve.server.protocol import bad_request
from pdserve.server.wire import KVReservation


def parse_generation_body(raw: bytes, chat: bool) -> tuple[dict[str, Any], int]:
    """The client's JSON body and an estimate of its prompt tokens (characters / 4, or the number of
    token ids). Raises a 400 for what the router cannot route; the instances validate everything else."""
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise bad_request(
            f"n > 1 (got {n}) is not supported through the router yet; send separate requests", param="n"
        )
    if chat:
        return body, _estimate_chat_tokens(body.get("messages"))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise bad_request(
                f"a list of {len(prompt)} prompts is not supported through the router yet; "
                "send one prompt per request",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        return body, len(prompt) // 4
    if isinstance(prompt, list):
        return body, len(prompt)
    return body, 0


def _estimate_chat_tokens(messages: Any) -> int:
    if not isinstance(messages, list):
        return 0
    num_chars = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            num_chars += len(content)
        elif isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            num_chars += sum(len(t) for t in texts if isinstance(t, str))
    return num_chars // 4


def decode_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """What D gets: the client's body plus the remote-prefill marker (replacing a client's own)."""
    return {**body, "kv_transfer_params": wire.KVTransferParams(remote_prefill=True, transfer_id=transfer_id)}


def prefill_body(body: dict[str, Any], chat: bool, reservation: KVReservation) -> dict[str, Any]:
    """What P gets: the client's body as one non-streaming token, plus where to send the KV."""
    out = {k: v for k, v in body.items() if k not in ("n", "stream_options")}
    out["stream"] = False
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = wire.KVTransferParams(
        remote_decode=wire.RemoteDecode(
            transfer_id=reservation.transfer_id,
            address=reservation.address,
            backend=reservation.backend,
            skip_tokens=reservation.skip_tokens,
        )
    )
    return out


def status_of_whole_body(content: bytes) -> int | None:
    """None for a decode instance's whole (non-streaming) answer that is a result; the status to answer
    with if it is an OpenAI error body instead (its status line said 200: the error came after the
    reservation). 504 for a timeout, else 502: the upstream failed."""
    try:
        body = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return 502
    error = body.get("error") if isinstance(body, dict) else None
    if error is None:
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return 504 if code == "request_timeout" else 502


def last_event_end(buf: bytearray) -> int:
    """Index just past the last complete SSE event in `buf` (0 if none)."""
    lf, crlf = buf.rfind(b"\n\n"), buf.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
