"""Running an `EngineLoop` to completion in the unit tests."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.loop import EngineLoop
from pdserve.request import SamplingParams


def generate(loop: EngineLoop, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """Every prompt's output tokens (ignore_eos, greedy defaults), in the prompts' order."""
    ids = [loop.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    done = {}
    for _ in range(5000):
        if not loop.has_unfinished_requests():
            break
        for o in loop.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    return [done[i] for i in ids]
