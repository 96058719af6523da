"""`merged`, the several-prompts stream, on plain async generators: choices renumbered, nothing
before every prompt's first message, a failure mid-way raised with every other stream closed,
and closing the merged stream closing them all."""

from __future__ import annotations

import asyncio

import pytest

from cluster.http.several_prompts import Responses, merged, prompts_of
from protos.radixmesh.v1 import serving_pb2


class Closed:
    def __init__(self) -> None:
        self.names: list[str] = []


async def stream(
    name: str, closed: Closed, samples: int, steps: int, fail_at: int | None = None
) -> Responses:
    try:
        for step in range(steps):
            await asyncio.sleep(0.001 * (1 + len(name)))
            if step == fail_at:
                raise RuntimeError(f"{name} failed")
            for index in range(samples):
                yield serving_pb2.GenerateResponse(request_id=name, index=index, text=f"{step}")
    finally:
        closed.names.append(name)


async def gather(merged_stream: Responses) -> list[tuple[str, int]]:
    return [(m.request_id, m.index) async for m in merged_stream]


def test_choices_are_renumbered_prompt_by_n() -> None:
    closed = Closed()
    streams = [stream(name, closed, 2, 3) for name in ("a", "bb", "ccc")]
    got = asyncio.run(gather(merged(streams, 2)))
    expected = {"a": {0, 1}, "bb": {2, 3}, "ccc": {4, 5}}
    assert {(name, index) for name, index in got} == {
        (name, i) for name, indices in expected.items() for i in indices
    }
    assert len(got) == 3 * 2 * 3
    assert got[:3] == [("a", 0), ("bb", 2), ("ccc", 4)], "every prompt's first message first"
    assert sorted(closed.names) == ["a", "bb", "ccc"]


def test_a_failure_after_the_first_messages_is_raised_and_closes_the_rest() -> None:
    closed = Closed()
    streams = [stream("a", closed, 1, 50), stream("bb", closed, 1, 50, fail_at=2)]

    async def run() -> list[tuple[str, int]]:
        seen = []
        with pytest.raises(RuntimeError, match="bb failed"):
            async for message in merged(streams, 1):
                seen.append((message.request_id, message.index))
        return seen

    seen = asyncio.run(run())
    assert ("a", 0) in seen and ("bb", 1) in seen
    assert sorted(closed.names) == ["a", "bb"]


def test_closing_the_merged_stream_closes_every_prompt() -> None:
    closed = Closed()
    streams = [stream(name, closed, 1, 1000) for name in ("a", "bb")]

    async def run() -> None:
        together = merged(streams, 1)
        for _ in range(5):
            await anext(together)
        await together.aclose()

    asyncio.run(run())
    assert sorted(closed.names) == ["a", "bb"]


def test_prompts_of_reads_every_shape() -> None:
    assert prompts_of("hi") == ["hi"]
    assert prompts_of([1, 2]) == [[1, 2]]
    assert prompts_of(["a", "b"]) == ["a", "b"]
    assert prompts_of([[1], [2, 3]]) == [[1], [2, 3]]
    assert prompts_of([]) == [[]]
