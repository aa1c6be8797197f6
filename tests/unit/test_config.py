"""Config is written once: every config dataclass in pdserve/config.py is frozen and keyword-only, and
the command line's defaults are the dataclasses' own (`add_config_argument`), so `pdserve serve` with
no flags builds exactly the default configs."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from pdserve import config
from pdserve.cli import build_parser, engine_config, kv_transfer_config, router_config
from pdserve.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoadConfig,
    LongPromptMix,
    RouterConfig,
    SchedulerConfig,
    ServerConfig,
    Workload,
    add_config_argument,
    field_default,
)

CONFIG_CLASSES = [
    obj for _, obj in inspect.getmembers(config, inspect.isclass)
    if dataclasses.is_dataclass(obj) and obj.__module__ == config.__name__
]


def test_every_config_dataclass_is_frozen_and_keyword_only() -> None:
    assert {c.__name__ for c in CONFIG_CLASSES} >= {
        "ModelConfig", "CacheConfig", "SchedulerConfig", "KVTransferConfig", "SpeculativeConfig",
        "EngineConfig", "RandomModelSpec", "ServerConfig", "RouterConfig", "LongPromptMix", "Workload",
        "LoadConfig",
    }
    for cls in CONFIG_CLASSES:
        assert cls.__dataclass_params__.frozen, cls  # type: ignore[attr-defined]
        assert all(f.kw_only for f in dataclasses.fields(cls)), cls
    with pytest.raises(TypeError):
        CacheConfig(16)  # type: ignore[misc]


def test_the_cli_builds_the_default_configs() -> None:
    parser = build_parser()
    serve = parser.parse_args(["serve"])
    assert engine_config(serve) == EngineConfig()
    assert kv_transfer_config(serve) == KVTransferConfig()
    d = ServerConfig()
    assert (serve.host, serve.port, serve.max_waiting, serve.stats_interval, serve.heartbeat_timeout) == (
        d.host, d.port, d.max_waiting, d.stats_interval_s, d.heartbeat_timeout_s
    )
    assert (serve.max_body_bytes, serve.max_connections, serve.read_timeout, serve.request_timeout) == (
        d.max_body_bytes, d.max_connections, d.header_timeout_s, d.request_timeout_s
    )
    router = parser.parse_args(["router", "--prefill", "http://p:1", "--decode", "http://d:2"])
    expected = RouterConfig(prefill_urls=("http://p:1",), decode_urls=("http://d:2",))
    assert router_config(router) == dataclasses.replace(expected, body_timeout_s=expected.header_timeout_s)
    bench = parser.parse_args(["bench"])
    w, load = Workload(), LoadConfig(base_url="", model="")
    assert (bench.dataset, bench.num_prompts, bench.seed, bench.random_input_len) == (
        w.dataset, w.num_prompts, w.seed, w.random_input_len
    )
    assert (bench.endpoint, bench.request_rate, bench.burstiness, bench.max_concurrency) == (
        load.endpoint, load.request_rate, load.burstiness, load.max_concurrency
    )
    assert bench.long_prompt_max_len == LongPromptMix().max_len


def test_flags_reach_their_fields() -> None:
    args = build_parser().parse_args([
        "serve", "--kv-cache-dtype", "int8", "--block-size", "8", "--scheduler", "decode-priority",
        "--attention-backend", "torch", "--role", "prefill", "--kv-transfer", "tcp", "--kv-key-scaling", "off",
    ])
    engine = engine_config(args)
    assert (engine.cache.kv_cache_dtype, engine.cache.block_size, engine.cache.kv_key_scaling) == ("int8", 8, "off")
    assert engine_config(build_parser().parse_args(["serve"])).cache.kv_key_scaling == "auto"
    assert (engine.scheduler.policy, engine.attention_backend) == ("decode-priority", "torch")
    assert (kv_transfer_config(args).role, kv_transfer_config(args).backend) == ("prefill", "tcp")
    with pytest.raises(SystemExit):  # choices come from config's tuples
        build_parser().parse_args(["serve", "--kv-cache-dtype", "int3"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--kv-key-scaling", "maybe"])


def test_add_config_argument_reads_default_type_and_shows_it() -> None:
    p = argparse.ArgumentParser()
    add_config_argument(p, "--slo-itl-ms", SchedulerConfig, "slo_itl_ms", help="target")
    add_config_argument(p, "--chunk-size", SchedulerConfig, "chunk_size", type=int)
    assert p.parse_args([]).slo_itl_ms == SchedulerConfig().slo_itl_ms
    assert p.parse_args(["--slo-itl-ms", "7"]).slo_itl_ms == 7.0  # float, from the default's type
    assert p.parse_args([]).chunk_size is None
    assert f"(default: {SchedulerConfig().slo_itl_ms})" in p.format_help()
    assert field_default(EngineConfig, "cache") == CacheConfig()  # a factory is called
    with pytest.raises(KeyError):
        field_default(RouterConfig, "prefill_urls")  # no default


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: CacheConfig(block_size=0), "block_size"),
        (lambda: CacheConfig(num_blocks=0), "num_blocks"),
        (lambda: CacheConfig(kv_cache_memory_gb=0.0), "kv_cache_memory_gb"),
        (lambda: EngineConfig(dtype="int4"), "unknown dtype"),
        (lambda: EngineConfig(attention_backend="flash"), "unknown attention backend"),
        (lambda: EngineConfig(linear_kernel="mkl"), "unknown linear kernel"),
        (lambda: EngineConfig(num_threads=0), "num_threads"),
        (lambda: RouterConfig(prefill_urls=("http://a",), decode_urls=("http://b",), prefill_policy="x"),
         "unknown instance policy 'x'"),
        (lambda: Workload(dataset="nope"), "unknown dataset"),
        (lambda: LoadConfig(base_url="", model="", endpoint="embeddings"), "endpoint"),
    ],
)
def test_validated_at_construction(make, match: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        make()
