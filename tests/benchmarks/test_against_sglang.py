"""`cache_bench --against sglang`: both caches serve the same loop correctly (no timings are
asserted), every page stays accounted for, and the comparison skips cleanly offline."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from benchmarks import against_sglang, sglang_radix, workloads
from benchmarks.cache_bench import main
from cache.integrity import check_tree


def small_stream() -> list[workloads.Request]:
    return workloads.few_shot(seed=1, n=60, templates=3, length=256)


@pytest.mark.parametrize("page_size", [1, 16])
def test_radixmesh_loop_keeps_every_page_accounted_for(page_size: int) -> None:
    requests = small_stream()
    capacity = against_sglang.capacity_tokens(
        requests, against_sglang.distinct_tokens(requests), 0.05, page_size
    )
    cache = against_sglang.Radixmesh(capacity, page_size)
    reused = [cache.serve(cache.prepare(req)) for req in requests]
    pool = cache.pool
    pool.check()
    check_tree(cache.tree)
    assert pool.num_private == 0, "the loop leaked private pages"
    assert pool.num_free + pool.num_cached == pool.usable_pages
    assert cache.evicted_tokens() > 0, "5 % of the distinct tokens must force eviction"
    assert sum(reused) > 0 and all(r % page_size == 0 for r in reused)


def test_capacity_is_whole_pages_and_holds_the_longest_request_twice() -> None:
    requests = small_stream()
    longest = max(len(r.prompt) + len(r.output) for r in requests)
    for page_size in (1, 16):
        capacity = against_sglang.capacity_tokens(requests, 1000, 0.001, page_size)
        assert capacity % page_size == 0 and capacity >= 2 * longest


def test_offline_it_says_so_and_compares_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    assert sglang_radix.fetch_wheel(tmp_path) is None
    argv = ["--against", "sglang", "--sglang-wheel-dir", str(tmp_path), "--no-memory"]
    assert main([*argv, "--workloads", "few-shot", "--quiet"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "could not download sglang==0.5.23" in out.err


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> sglang_radix.SGLang:
    where = tmp_path_factory.mktemp("sglang")
    wheel = sglang_radix.fetch_wheel(where)
    if wheel is None:
        pytest.skip("pip cannot download the sglang wheel here (no package index)")
    return sglang_radix.load(wheel, where / "src")


@pytest.mark.slow
def test_sglang_is_its_own_code_and_agrees_on_hits_when_nothing_is_evicted(
    sglang: sglang_radix.SGLang,
) -> None:
    source = Path(inspect.getfile(sglang.RadixCache)).read_text()
    assert "class RadixCache(BasePrefixCache)" in source and "Copyright 2023-2024 SGLang" in source
    requests = small_stream()
    roomy = sum(len(r.prompt) + len(r.output) for r in requests) + 64
    for page_size in (1, 16):
        capacity = roomy - roomy % page_size
        ours = against_sglang.serve_all(against_sglang.Radixmesh(capacity, page_size), requests)
        theirs = against_sglang.serve_all(
            against_sglang.SGLangCache(sglang, capacity, page_size), requests
        )
        assert ours.evicted_tokens == theirs.evicted_tokens == 0
        assert ours.hit_rate == theirs.hit_rate > 0.5


@pytest.mark.slow
def test_a_cell_is_one_json_row_with_both_caches(sglang: sglang_radix.SGLang) -> None:
    requests = small_stream()
    distinct = against_sglang.distinct_tokens(requests)
    row = against_sglang.compare(sglang, requests, distinct, 0.05, 16, rounds=2, memory=True)
    json.dumps(row)
    for name in ("radixmesh", "sglang"):
        side = row[name]
        assert len(side["requests_per_s_all"]) == 2 and side["requests_per_s"] > 0
        assert side["evicted_tokens"] > 0 and 0 < side["hit_rate"] < 1
        assert side["peak_bytes"] > 0 and side["pool_bytes_per_page"] > 0
    assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
    assert row["radixmesh"]["hit_rate"] >= row["sglang"]["hit_rate"]


def test_distinct_tokens_counts_every_distinct_prefix_once() -> None:
    requests = workloads.multi_turn(seed=2, conversations=4, turns=3)
    prefixes = set()
    for req in requests:
        whole = req.prompt + req.output
        prefixes.update(tuple(whole[: i + 1]) for i in range(len(whole)))
    assert against_sglang.distinct_tokens(requests) == len(prefixes) > 0
