"""One registry for every pluggable piece (attention backends, KV transports, scheduler and router
policies, benchmark datasets): a name maps to `"module:attr"`, and the module is imported only when that
name is first asked for, so a registry costs nothing at import time and pulls in torch only for the
backend actually used.

Registries live beside what they register (`attention/base.py`, `transfer/registry.py`, ...); this module
sits on the lowest floor so that any floor can own one. `config.py` validates against the same names,
spelled there so it imports nothing above it; `tests/unit/test_layering.py` keeps the spellings equal.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, str], Generic[T]):
    """`kind` names what is registered, for the error message ("attention backend", ...). As a mapping it
    is name -> "module:attr" in registration order; `load(name)` imports and returns the attribute."""

    def __init__(self, kind: str, entries: Mapping[str, str]) -> None:
        for name, target in entries.items():
            module, sep, attr = target.partition(":")
            if not (module and sep and attr):
                raise ValueError(f"{kind} {name!r}: target {target!r} is not 'module:attr'")
        self.kind = kind
        self._entries = dict(entries)

    def __getitem__(self, name: str) -> str:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def check(self, name: str) -> None:
        """Raise ValueError naming the choices if `name` is not registered (imports nothing)."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; choose from {', '.join(self._entries)}")

    def load(self, name: str) -> T:
        """The registered attribute (a class or factory), its module imported on first use (Python's
        module cache makes later calls a dict lookup; the registry itself keeps no state)."""
        self.check(name)
        module, _, attr = self._entries[name].partition(":")
        return getattr(importlib.import_module(module), attr)
