"""How the router picks an instance: what it knows about each one (`Instance`) and the policies that
choose among the healthy ones, found by name in a registry.

The router keeps two lists of `Instance`s (prefill and decode). Its own bookkeeping (requests in flight,
estimated prompt tokens outstanding) changes as requests pass; the rest comes from polling each instance's
`GET /load`. A policy only reads these fields and returns one of the candidates it is given: it never sees
an instance that is down or already failed this request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.registry import Registry

ROLES = ("prefill", "decode")


@dataclass(slots=True)
class Instance:
    """One upstream instance as the router sees it, for one role (a URL given for both roles is two)."""

    url: str
    role: str  # the role the router uses it for: "prefill" or "decode"
    is_up: bool = False
    down_reason: str | None = None
    # The router's own counts.
    num_in_flight: int = 0
    num_outstanding_tokens: int = 0  # prefill: estimated prompt tokens of the requests in flight
    # The latest `GET /load` report.
    reported_role: str | None = None
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


class InstancePolicy(Protocol):
    """Picks one instance among `candidates` (never empty, all up). May keep state (round-robin)."""

    def select(self, candidates: Sequence[Instance]) -> Instance: ...


class RoundRobin:
    """Each candidate in turn."""

    def __init__(self) -> None:
        self._num_selected = 0

    def select(self, candidates: Sequence[Instance]) -> Instance:
        chosen = candidates[self._num_selected % len(candidates)]
        self._num_selected += 1
        return chosen


class LeastOutstandingTokens:
    """The candidate with the fewest estimated prompt tokens in flight (then fewest requests, then the
    first): the prefill instance that will finish its queue first. The router counts no tokens for
    decode instances, so there it means the fewest requests in flight."""

    def select(self, candidates: Sequence[Instance]) -> Instance:
        return min(candidates, key=lambda i: (i.num_outstanding_tokens, i.num_in_flight))


class LeastKVUsage:
    """The candidate whose KV cache is least full by its last `/load` report (then fewest requests the
    router has in flight there, then the first): the decode instance with the most room to grow."""

    def select(self, candidates: Sequence[Instance]) -> Instance:
        return min(candidates, key=lambda i: (i.kv_cache_usage, i.num_in_flight))


# name -> policy class (built with no arguments); `config.ROUTER_POLICIES` spells the same names for
# validation (tests/unit/test_layering.py holds them equal).
POLICIES: Registry[type[InstancePolicy]] = Registry(
    "instance policy",
    {
        "round-robin": "pdserve.router.policies:RoundRobin",
        "least-outstanding-tokens": "pdserve.router.policies:LeastOutstandingTokens",
        "least-kv-usage": "pdserve.router.policies:LeastKVUsage",
    },
)


def make_policy(name: str) -> InstancePolicy:
    """A new policy object (its own state) by registry name; ValueError names the known ones."""
    return POLICIES.load(name)()
