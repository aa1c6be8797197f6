"""The engine runs its loop over the model runner through the `Executor` seam, like the fake executor."""

from __future__ import annotations

from pdserve.engine.executor import Executor
from pdserve.engine.loop import EngineLoop
from pdserve.kv.block_manager import BlockManager
from pdserve.sim.fake_executor import FakeExecutor


def test_model_runner_and_fake_executor_are_executors(make_tiny_llm) -> None:
    engine = make_tiny_llm().engine
    assert isinstance(engine, EngineLoop)
    assert engine.executor is engine.runner and isinstance(engine.runner, Executor)
    assert isinstance(FakeExecutor(BlockManager(4, 2)), Executor)
    assert engine.scheduler.clock is engine.clock  # one clock for every time stamp
