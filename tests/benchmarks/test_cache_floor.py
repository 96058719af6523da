"""benchmarks/cache_floor.py: on a stream where nothing hits, each floor ends with the leaves
radixmesh's tree ends with (keys and block hashes) and keeps every page accounted for; its checks
refuse bad moves, the run bookkeeping merges a freed run with the top of its free stack, and a
sequence larger than the pool is refused by name. No timing is asserted."""

from __future__ import annotations

import json
from array import array
from pathlib import Path

import numpy as np
import pytest

from benchmarks import against_sglang, cache_floor, workloads


def no_hit_stream() -> list[workloads.Request]:
    return workloads.multi_turn(seed=3, conversations=12, turns=4)


def capacity_of(requests: list[workloads.Request]) -> int:
    distinct = against_sglang.distinct_tokens(requests)
    return against_sglang.capacity_tokens(requests, distinct, 0.05, 1)


@pytest.mark.parametrize("bookkeeping", list(cache_floor.BOOKKEEPING))
def test_a_floor_caches_what_radixmesh_caches_and_keeps_every_page(bookkeeping: str) -> None:
    requests = no_hit_stream()
    capacity = capacity_of(requests)
    ours = against_sglang.Radixmesh(capacity, 1)
    reused = [ours.serve(ours.prepare(req)) for req in requests]
    assert not any(reused) and ours.tree.evicted_pages > 0, "the stream must evict, never hit"
    floor = cache_floor.Floor(capacity, bookkeeping)
    for req in requests:
        floor.serve(floor.prepare(req))
    # the same leaves, keys and block hashes: same LRU order, same trims, same hashing
    leaves = sorted((leaf.keys.tobytes(), leaf.blocks) for _, leaf in floor.heap)
    nodes = sorted((node.keys.tobytes(), tuple(node.blocks)) for node in ours.tree.nodes())
    assert leaves == nodes
    assert floor.evicted_tokens() == ours.evicted_tokens()
    cached = sum(leaf.size for _, leaf in floor.heap)
    assert floor.num_free + cached == capacity
    pages = floor.pages
    if isinstance(pages, cache_floor.RunPages):
        assert sum(count for _, count in pages.stack) == floor.num_free
        assert pages.state.count(cache_floor.FREE) == floor.num_free
        assert pages.state.count(cache_floor.CACHED) == cached
        assert pages.state.count(cache_floor.PRIVATE) == 0
    else:
        assert pages.top == floor.num_free
    if isinstance(pages, cache_floor.CheckedPages):
        counts = np.bincount(pages.state, minlength=4)
        assert counts[cache_floor.FREE] == floor.num_free
        assert counts[cache_floor.CACHED] == cached and counts[cache_floor.PRIVATE] == 0


@pytest.mark.parametrize("bookkeeping", list(cache_floor.BOOKKEEPING))
def test_a_sequence_larger_than_the_pool_is_refused_and_moves_nothing(bookkeeping: str) -> None:
    request = no_hit_stream()[0]
    size = len(request.prompt) + len(request.output)
    floor = cache_floor.Floor(size - 1, bookkeeping)
    with pytest.raises(ValueError, match=f"{size} positions cannot fit {size - 1} pages"):
        floor.serve(floor.prepare(request))
    assert floor.num_free == size - 1 and not floor.heap and floor.evicted_tokens() == 0


def test_checked_moves_refuse_a_page_in_the_wrong_state_or_listed_twice() -> None:
    pages = cache_floor.CheckedPages(64)
    taken = pages.allocate(40)
    with pytest.raises(cache_floor.BadMove, match="listed twice"):
        pages.claim(array("i", [*taken[:39], taken[0]]))
    with pytest.raises(cache_floor.BadMove, match="is not"):
        pages.release(taken)  # private, not cached
    pages.claim(taken)
    with pytest.raises(cache_floor.BadMove, match="is not"):
        pages.claim(taken)  # cached already
    pages.release(taken)
    assert pages.top == 63 and (pages.state[1:] == cache_floor.FREE).all()


def test_run_moves_refuse_overlaps_and_free_runs_come_back_in_the_order_freed() -> None:
    pages = cache_floor.RunPages(101)  # pages 1..100
    taken = pages.allocate(30)
    assert taken == [1, 30] and pages.stack == [(31, 70)]
    with pytest.raises(cache_floor.BadMove, match="listed twice"):
        pages.claim([1, 10, 5, 10])
    with pytest.raises(cache_floor.BadMove, match="not pages of this pool"):
        pages.claim([-5, 3])
    pages.claim(taken)
    head, tail = pages.split(taken, 12)
    assert (head, tail) == ([1, 12], [13, 18])
    pages.release(tail)  # [13, 31) touches the top of the stack, [31, 101): one run
    assert pages.stack == [(13, 88)]
    with pytest.raises(cache_floor.BadMove, match="is not"):
        pages.release(tail)
    pages.release(head)
    assert pages.stack == [(1, 100)]
    pages.claim(pages.allocate(100))
    pages.release([50, 10, 1, 10])  # the first run freed is the first handed out
    assert pages.allocate(15) == [50, 10, 1, 5]
    assert pages.allocate(5) == [6, 5]  # [1, 6) went out above: the rest of that run
    assert pages.state.count(cache_floor.FREE) == 0


def test_offline_it_measures_the_floors_and_radixmesh_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    out = tmp_path / "rows.jsonl"
    argv = ["--rounds", "2", "--scale", "0.03", "--sglang-wheel-dir", str(tmp_path)]
    assert cache_floor.main([*argv, "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["workload"] for row in rows] == [name for name, _ in cache_floor.CELLS]
    for row in rows:
        sides = row["sides"]
        assert set(sides) == {"floor, checked", "floor, runs", "floor, unchecked", "radixmesh"}
        assert len({side["evicted_tokens"] for side in sides.values()}) == 1
        assert all(len(side["us_all"]) == 2 for side in sides.values())
        assert row["runs_per_move"] >= 1 and not any(row["evicted_gap_tokens"].values())
    assert "could not be fetched" in capsys.readouterr().err
