"""An executor without a model: the scheduler's tests and the simulator drive the real scheduler and
engine loop with it.

It keeps a model of what every KV slot holds, on the device and in the host tier: the token prefix whose
K/V a slot would contain. A step that reads K/V nobody computed (a bad prefix hit, a block given to two
requests, a lost recomputation, a swap copied from or to the wrong block or in the wrong order), or that
writes into a block other requests share or that the prefix cache already indexes, raises
`KVConsistencyError`. Its default "model" samples a token that depends on the whole sequence, so a lost or
duplicated output token changes every later one. With a `ManualClock` and a `step_time`, each step
advances simulated time by its modeled duration.

With `num_spec_tokens` = k it also speculates: after each sampling step it proposes k draft tokens per
request (from `draft`, by default a perfect copy of the model), and a step that runs drafts verifies them
greedily against the model, returning the accepted drafts plus the model's next token (1..k+1 tokens).
What it writes into the slot model comes from the step's `Batch` (drafts included), what it checks reads
against is the requests' true sequences, so a rolled-back draft that is read as context fails.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.batch import BatchRequest, ModelOutput
from pdserve.kv.block_manager import BlockManager
from pdserve.request import Request
from pdserve.scheduler.scheduler import SchedulerOutput


class KVConsistencyError(AssertionError):
    """The scheduler handed the executor a step whose KV reads or writes are wrong."""


class ManualClock:
    """A clock that moves only when told: pass it as `clock=` to the scheduler and the engine loop."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0.0, "time runs forward"
        self.now += seconds


def model_token(tokens: list[int]) -> int:
    """The fake model's next token after `tokens` (0..3; with the tests' EOS of 0, sometimes EOS): a
    rolling hash of the whole sequence, so a token lost, duplicated or reordered changes the later ones.
    (A plain sum would not: it settles into repeating one token after the first.)"""
    h = 0
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
    return (h >> 3) % 4


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    """What greedy generation of `max_tokens` with the default fake model gives (no stop conditions)."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model_token(tokens))
    return tokens[len(prompt) :]


@dataclass
class FakeExecutor:
    """Implements `pdserve.engine.executor.Executor` on the slot model of `block_manager`'s cache."""

    block_manager: BlockManager
    sample: Callable[[Request], int] | None = None  # scripted tokens instead of `model` (no speculation)
    model: Callable[[list[int]], int] = model_token  # the next token after a sequence
    num_spec_tokens: int = 0  # draft tokens proposed per request per step
    draft: Callable[[list[int]], int] = model_token  # the proposer's guess of the next token
    clock: ManualClock | None = None
    step_time: Callable[[SchedulerOutput], float] | None = None  # seconds a step takes (with `clock`)
    # Keep the slot model and check every step's reads and writes against it (O(context) per request per
    # step in Python: the tests' mode). The simulator turns it off and scripts tokens with `sample`.
    check_kv: bool = True
    slots: dict[int, tuple[int, ...]] = field(default_factory=dict)  # slot -> prefix whose K/V it holds
    host_slots: dict[int, tuple[int, ...]] = field(default_factory=dict)  # the same for the host tier
    released: list[str] = field(default_factory=list)  # req ids, in the order released
    num_steps: int = 0

    def __post_init__(self) -> None:
        if self.sample is not None and self.num_spec_tokens:
            raise ValueError("speculation verifies drafts against `model`; scripted `sample` tokens cannot")

    def apply_swaps(self, swap_in: list[tuple[int, int]], swap_out: list[tuple[int, int]]) -> None:
        """What `KVCache.swap` does, on the slot model: swap-ins first, then swap-outs."""
        bs = self.block_manager.block_size
        for src_tier, dst_tier, pairs in (
            (self.host_slots, self.slots, swap_in),
            (self.slots, self.host_slots, swap_out),
        ):
            for src, dst in pairs:
                for o in range(bs):
                    content = src_tier.get(src * bs + o)
                    if content is None:
                        dst_tier.pop(dst * bs + o, None)
                    else:
                        dst_tier[dst * bs + o] = content

    def execute(self, out: SchedulerOutput, after_layer: Callable[[int], None] | None = None) -> ModelOutput:
        bm = self.block_manager
        bs = bm.block_size
        batch = out.to_batch()
        for s, br in zip(out.scheduled, batch.requests):
            if not self.check_kv:
                break
            truth = s.req.all_token_ids()
            for pos in range(br.start):  # the context attention reads
                slot = br.block_ids[pos // bs] * bs + pos % bs
                if self.slots.get(slot) != tuple(truth[: pos + 1]):
                    raise KVConsistencyError(f"{br.req_id}: attention would read foreign K/V at {pos}")
            seq = truth[: br.start] + br.token_ids
            if seq[: len(truth)] != truth[: len(seq)]:
                raise KVConsistencyError(f"{br.req_id}: the batch runs tokens the request does not have")
            for pos in range(br.start, br.context_len):
                block = br.block_ids[pos // bs]
                if bm.ref_counts[block] != 1 or bm.block_hashes[block] is not None:
                    raise KVConsistencyError(f"{br.req_id}: write to a shared block ({block})")
                self.slots[block * bs + pos % bs] = tuple(seq[: pos + 1])
        if after_layer is not None:
            after_layer(0)  # one "layer": all of this step's K/V are written
        tokens: list[list[int]] = []
        drafts: list[list[int]] = []
        for s, br in zip(out.scheduled, batch.requests):
            if not br.samples:
                continue
            accepted = self._verify(s.req, br) if self.sample is None else [self.sample(s.req)]
            tokens.append(accepted)
            drafts.append(self._propose(s.req.all_token_ids() + accepted) if self.num_spec_tokens else [])
        self.num_steps += 1
        duration = 0.0
        if self.clock is not None and self.step_time is not None:
            duration = self.step_time(out)
            self.clock.advance(duration)
        spec = drafts if self.num_spec_tokens else None
        return ModelOutput(tokens, [None] * len(tokens), duration, spec)

    def _verify(self, req: Request, br: BatchRequest) -> list[int]:
        """Greedy verification: the model's token at each position, while the drafts agree with it."""
        drafts = br.token_ids[len(br.token_ids) - br.num_spec_tokens :] if br.num_spec_tokens else []
        context = req.all_token_ids()
        accepted = []
        for i in range(len(drafts) + 1):
            token = self.model(context)
            accepted.append(token)
            if i == len(drafts) or drafts[i] != token:
                break
            context.append(token)
        return accepted

    def _propose(self, tokens: list[int]) -> list[int]:
        drafts: list[int] = []
        for _ in range(self.num_spec_tokens):
            drafts.append(self.draft(tokens + drafts))
        return drafts

    def release(self, req_id: str) -> None:
        self.released.append(req_id)

    def skip_draws(self, req: Request, num_draws: int) -> None:
        pass  # the fake model draws nothing
