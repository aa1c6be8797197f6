"""The router <-> instance structs (pdserve/server/wire.py): what each side encodes decodes on the other,
and what is out of bounds does not decode."""

from __future__ import annotations

import msgspec
import pytest

from pdserve.server import wire


def test_remote_prefill_params_encode_to_the_documented_shape():
    params = wire.KVTransferParams(remote_prefill=True, transfer_id="abc_1")
    assert msgspec.json.decode(msgspec.json.encode(params)) == {"remote_prefill": True, "transfer_id": "abc_1"}


def test_remote_decode_params_round_trip_with_every_field():
    target = wire.RemoteDecode(transfer_id="t1", address="tcp://10.0.0.1:5000", backend="tcp", skip_tokens=16)
    raw = msgspec.json.encode(wire.KVTransferParams(remote_decode=target))
    assert msgspec.json.decode(raw) == {
        "remote_decode": {"transfer_id": "t1", "address": "tcp://10.0.0.1:5000", "backend": "tcp", "skip_tokens": 16}
    }
    assert msgspec.json.decode(raw, type=wire.KVTransferParams).remote_decode == target


@pytest.mark.parametrize(
    "body",
    [
        {"remote_decode": {"transfer_id": "../etc", "address": "a"}},  # path characters in the id
        {"remote_decode": {"transfer_id": "t", "address": "a", "skip_tokens": -1}},
        {"remote_decode": {"transfer_id": "t", "address": ""}},
        {"remote_prefill": "yes", "transfer_id": "t"},
    ],
)
def test_out_of_bounds_kv_transfer_params_do_not_convert(body):
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(body, wire.KVTransferParams)


def test_reservation_header_bounds():
    good = wire.KVReservation(transfer_id="t", address="a", backend="shm", skip_tokens=0)
    assert msgspec.json.decode(msgspec.json.encode(good), type=wire.KVReservation) == good
    bad = wire.KVReservation(transfer_id="t", address="a", backend="shm", skip_tokens=-3)  # built unchecked
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(msgspec.json.encode(bad), type=wire.KVReservation)


def test_load_report_keeps_transfer_totals_and_rejects_impossible_counts():
    report = wire.LoadReport(
        role="decode", num_running=2, num_waiting=1, kv_cache_usage=0.5, num_in_flight=3,
        kv_backend="tcp", kv_address="tcp://h:1", kv_transfers={"in": wire.TransferTotals(ok=4, bytes=1024)},
    )
    decoded = msgspec.json.decode(msgspec.json.encode(report), type=wire.LoadReport)
    assert decoded == report and decoded.kv_transfers["in"].failed == 0
    for field, value in (("num_running", -5), ("num_waiting", 2**70), ("kv_cache_usage", 7)):
        body = {"role": "both", "num_running": 0, "num_waiting": 0, "kv_cache_usage": 0, field: value}
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(body, wire.LoadReport)
