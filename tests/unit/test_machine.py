import math

import torch

from pdserve.bench.machine import (
    MachineLimits,
    measure_machine,
    measure_matmul_flops,
    measure_memory_bandwidth,
)


def positive_finite(x: float) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_matmul_flops_positive():
    for dtype in (torch.float32, torch.bfloat16):
        assert positive_finite(measure_matmul_flops(16, 32, 8, dtype, seconds=0.01))


def test_memory_bandwidth_positive():
    assert positive_finite(measure_memory_bandwidth(1 << 20, seconds=0.01))


def test_measure_machine():
    limits = measure_machine(dtypes=("float32", "bfloat16"), hidden=16, seconds=0.01, nbytes=1 << 20)
    assert isinstance(limits, MachineLimits)
    assert set(limits.matmul_flops) == {"float32", "bfloat16"}
    assert all(positive_finite(v) for v in limits.matmul_flops.values())
    assert positive_finite(limits.memory_bandwidth)
    assert limits.num_threads == torch.get_num_threads() >= 1
    assert limits.cpu


def test_cpu_flags_are_the_relevant_ones():
    from pdserve.bench.machine import RELEVANT_FLAGS, cpu_flags

    flags = cpu_flags()
    assert tuple(flags) == RELEVANT_FLAGS and all(isinstance(v, bool) for v in flags.values())


def tiny_linear_weights():
    from pdserve.model.llama import LlamaModel, random_weights
    from tests.support.tiny import TINY

    model = LlamaModel(TINY)
    model.load_hf_weights(random_weights(TINY, seed=3))
    return model.to(torch.bfloat16).linear_weights()


def test_machine_report_on_the_tiny_model():
    import json

    from pdserve.bench.machine import format_report, machine_report
    from pdserve.model.linear import available_kernels
    from tests.support.tiny import TINY

    weights = tiny_linear_weights()
    r = machine_report(weights, "tiny", rows=(1, 8), repeats=1, seconds=0.01, dram_bytes=1 << 20,
                       cache_bytes=(1 << 16,), hidden=16)
    json.dumps(r, allow_nan=False)  # plain JSON: no inf/nan
    assert set(r["read_bandwidth"]) == {str(1 << 16), str(1 << 20)}
    assert all(positive_finite(v) for v in r["read_bandwidth"].values())
    k = r["kernels"]
    assert k["ops"]["qkv"] == [TINY_QKV_ROWS(), TINY.hidden_size, TINY.num_layers] and k["ops"]["lm_head"][2] == 1
    assert [row["rows"] for row in k["rows"]] == [1, 8]
    kernels = set(available_kernels())
    for row in k["rows"]:
        assert set(row["ms"]) == kernels and all(positive_finite(v) for v in row["ms"].values())
        assert set(row["winners"]) == set(weights) and set(row["winners"].values()) <= kernels
        assert row["chosen_ms"] <= min(row["ms"].values()) + 1e-9  # per-op winners never lose to one kernel
        assert positive_finite(row["layer_flops"]) and positive_finite(row["weight_bytes_per_s"])
    text = format_report(r)
    assert "matmul roof" in text and "GB/s at 1 MiB" in text
    assert any(line.split()[:1] == ["8"] for line in text.splitlines())


def test_machine_report_with_int8_weights():
    from pdserve.bench.machine import format_report, machine_report
    from pdserve.model.linear import available_kernels, quantize_int8

    bf16 = tiny_linear_weights()
    weights = {op: [quantize_int8(w) for w in ws] for op, ws in bf16.items()}
    r = machine_report(weights, "tiny", rows=(1, 4), repeats=1, seconds=0.01, dram_bytes=1 << 20,
                       cache_bytes=(1 << 16,), hidden=16)
    k = r["kernels"]
    assert k["weight_dtype"] == "int8"
    assert k["weight_bytes"] == sum(w.numel() for ws in bf16.values() for w in ws)  # one byte per weight
    assert all(set(row["ms"]) == set(available_kernels("int8")) for row in k["rows"])
    assert "int8-weight projections" in format_report(r)


def TINY_QKV_ROWS() -> int:
    from tests.support.tiny import TINY

    return (TINY.num_heads + 2 * TINY.num_kv_heads) * TINY.head_dim


def test_bench_machine_command_json(capsys):
    import argparse
    import json

    from pdserve.bench.commands import add_bench_parser

    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "machine", "--no-kernels", "--json", "--seconds", "0.01", "--dram-mb", "1"])
    assert args.func(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kernels"] is None and set(r["matmul_flops"]) == {"float32", "bfloat16"} and r["cpu"]


def test_machine_report_with_w8a8_weights():
    from pdserve.bench.machine import format_report, machine_report
    from pdserve.model.linear import available_kernels, quantize_int8

    weights = {op: [quantize_int8(w) for w in ws] for op, ws in tiny_linear_weights().items()}
    r = machine_report(weights, "tiny", rows=(1, 16), repeats=1, seconds=0.01, dram_bytes=1 << 20,
                       cache_bytes=(1 << 16,), hidden=16, weight_dtype="w8a8")
    k = r["kernels"]
    assert k["weight_dtype"] == "w8a8"
    assert all(set(row["ms"]) == set(available_kernels("w8a8")) for row in k["rows"])
    assert any(name.endswith("-a8") for name in k["rows"][0]["ms"])
    assert "w8a8 projections" in format_report(r)
