"""Real linear kernels on a fake clock: the autotune's selection tested with injected timings."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


class FakeClock:
    """A timer the kernels below advance; pass it as the autotune's `timer`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_kernels(
    kernels: Mapping[str, Callable[[Any], Any]],
    clock: FakeClock,
    cost: Callable[[str, int], float],
    served: list[tuple[str, int]] | None = None,
) -> dict[str, Callable[[Any], Any]]:
    """`kernels` (name -> packing class) whose packed calls advance `clock` by `cost(name, rows)` and,
    with `served`, log (name, rows) of every call; the result still computes with the real kernel."""

    def wrap(name: str, cls: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def pack(w: Any) -> Any:
            inner = cls(w)

            def call(x: Any) -> Any:
                clock.now += cost(name, x.shape[0])
                if served is not None:
                    served.append((name, x.shape[0]))
                return inner(x)

            call.kernel = name  # type: ignore[attr-defined]
            if hasattr(inner, "weight_tensors"):
                call.weight_tensors = inner.weight_tensors  # type: ignore[attr-defined]
            return call

        return pack

    return {name: wrap(name, cls) for name, cls in kernels.items()}
