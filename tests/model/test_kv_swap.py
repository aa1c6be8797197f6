"""The host tier of the KV cache: blocks copied out and back bit-exactly, in the documented order."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv.cache import KVCache, KVLayout
from tests.support.tiny import TINY


def _layout(block_size: int, dtype: torch.dtype) -> KVLayout:
    return KVLayout(TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, dtype, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swap_out_and_back_is_exact(dtype):
    cache = KVCache(_layout(4, dtype), num_blocks=8, device=torch.device("cpu"), num_host_blocks=6)
    cache.data.copy_(torch.randn(cache.data.shape))
    before = cache.data.clone()
    cache.swap([], [(2, 5), (7, 0)])  # device 2 -> host 5, device 7 -> host 0
    cache.data[:, :, :, [2, 7]] = 0
    cache.swap([(5, 1), (0, 3)], [])  # back, into other device blocks
    assert torch.equal(cache.data[:, :, :, 1], before[:, :, :, 2])
    assert torch.equal(cache.data[:, :, :, 3], before[:, :, :, 7])
    untouched = [0, 4, 5, 6]
    assert torch.equal(cache.data[:, :, :, untouched], before[:, :, :, untouched])


def test_swap_in_runs_before_swap_out():
    """A host block a swap-in reads may be refilled by a swap-out of the same step, and a device block
    a swap-in fills may be swapped straight out again: the swap-in must come first."""
    cache = KVCache(_layout(2, torch.float32), num_blocks=4, device=torch.device("cpu"), num_host_blocks=2)
    cache.data.copy_(torch.randn(cache.data.shape))
    assert cache.host is not None
    cache.host.copy_(torch.randn(cache.host.shape))
    host0, dev3 = cache.host[:, :, :, 0].clone(), cache.data[:, :, :, 3].clone()
    cache.swap([(0, 1)], [(3, 0), (1, 1)])
    assert torch.equal(cache.data[:, :, :, 1], host0)  # read host 0 before device 3 overwrote it
    assert torch.equal(cache.host[:, :, :, 0], dev3)
    assert torch.equal(cache.host[:, :, :, 1], host0)  # device 1 after its swap-in


def test_no_host_tier_without_swap():
    cache = KVCache(_layout(2, torch.float32), num_blocks=4, device=torch.device("cpu"))
    assert cache.host is None
    cache.swap([], [])  # nothing to do is fine
    with pytest.raises(AssertionError, match="host tier"):
        cache.swap([], [(0, 0)])


def test_swap_counters_reach_prometheus(make_tiny_llm):
    """A swapping engine's counters, as the engine core sends them, become the /metrics series."""
    from prometheus_client import generate_latest

    from pdserve import SamplingParams
    from pdserve.engine.process.core import engine_stats
    from pdserve.server.metrics import ServerMetrics
    from tests.support.tiny import random_prompts

    llm = make_tiny_llm(num_blocks=40, scheduler="chunked", max_num_batched_tokens=64, preemption_mode="swap",
                        swap_space_gb=0.01)
    engine = llm.engine
    for p in random_prompts(12, 30, 70, seed=3):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    metrics = ServerMetrics("m")
    max_swapped = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine_stats(engine)
        max_swapped = max(max_swapped, stats.num_swapped)
        metrics.observe_engine(stats, None)
    text = generate_latest(metrics.registry).decode()
    sched = engine.scheduler
    assert max_swapped > 0 and sched.num_swapped_out_blocks > 0
    assert f'pdserve:kv_swap_blocks_total{{direction="out",model_name="m"}} {float(sched.num_swapped_out_blocks)}' in text
    assert f'pdserve:kv_swap_blocks_total{{direction="in",model_name="m"}} {float(sched.num_swapped_in_blocks)}' in text
    assert 'pdserve:num_requests_swapped{model_name="m"} 0.0' in text
    assert f'pdserve:preemptions_total{{model_name="m"}} {float(sched.num_preemptions)}' in text
