"""The next step's batch read ahead (runtime/worker/batch_ahead.py): taken only by its own step,
stage and data source; anything else reads its own batch, so a step trains on the same batch either way."""

from __future__ import annotations

import asyncio

import pytest

from fusionllm.core.errors import FusionError
from fusionllm.runtime.worker.batch_ahead import BatchAhead


class Data:
    def __init__(self) -> None:
        self.reads: list[int] = []

    def step(self, step: int) -> tuple[int]:
        self.reads.append(step)
        return (step,)


class Runtime:
    def feeds(self, step: int) -> dict[int, dict[str, int]]:
        return {0: {"tokens": step}}


def test_the_read_ahead_is_taken_by_its_step_only() -> None:
    async def go() -> None:
        ahead, data, runtime = BatchAhead(), Data(), Runtime()
        assert await ahead.inputs(runtime, 3, None, data) == {0: {"tokens": 3}}
        ahead.read(runtime, 4, data)
        await asyncio.sleep(0.05)
        assert data.reads == [3, 4]
        assert await ahead.inputs(runtime, 4, None, data) == {0: {"tokens": 4}}
        assert data.reads == [3, 4]  # taken, not read again
        ahead.read(runtime, 5, data)
        assert await ahead.inputs(runtime, 4, None, data) == {0: {"tokens": 4}}  # a retry of 4: its own batch
        ahead.read(runtime, 5, data)
        assert await ahead.inputs(Runtime(), 5, None, data) == {0: {"tokens": 5}}  # another stage: read anew
        ahead.read(runtime, 6, data)
        other = Data()
        assert await ahead.inputs(runtime, 6, None, other) == {0: {"tokens": 6}} and other.reads == [6]  # another data source
        with pytest.raises(FusionError):
            await ahead.inputs(runtime, 7, None, None)
    asyncio.run(go())
