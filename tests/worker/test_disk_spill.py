"""What eviction drops from the last tier goes to disk (worker/disk_spill.py): a prefix cached
and evicted from every tier before any save is read back from disk with a cold run's outputs,
a drain writes what is still queued, a full queue drops as before with every page accounted
for, tenants stay apart, and a spill writes the unsaved nodes above the dropped one so that it
can be read back at once."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from cache import DEFAULT_NAMESPACE, CacheNamespace
from cache.integrity import check_sequence_cache
from cache.radix_cache import as_pages
from cache.tiers import DEVICE, HOST, SpillCopy, TierCopy
from tests.worker.helpers import relative_error
from tests.worker.test_kv_persistence import ask, config, model, serve
from worker.engine import Engine
from worker.kv_persistence import MANIFEST, StoreIdentity
from worker.metrics import EngineCollector
from worker.servicer import worker_stats

RNG = random.Random(15)
FIRST = [RNG.randrange(1, 384) for _ in range(40)]
"""A conversation's prompt: 10 pages of 4 positions."""
OTHERS = [[RNG.randrange(1, 384) for _ in range(40)] for _ in range(4)]
"""Unrelated prompts that push it out of both tiers (a device of 24 pages, a host of 16)."""
TIERS = {"num_pages": 24, "host_pages": 16}


def evicted_everywhere(engine: Engine, ns: CacheNamespace = DEFAULT_NAMESPACE) -> None:
    """Serve FIRST (in `ns`), then OTHERS until FIRST is in neither tier; no save runs."""
    serve(engine, [FIRST], ns)
    serve(engine, OTHERS)
    match = engine.cache.tree.match([*FIRST, 1], ns)
    assert match.length + match.host_length == 0, "FIRST is still cached"
    assert engine.store is not None and not engine.store.written, "no save ran"


def listed(engine: Engine) -> int:
    """Write what eviction spilled and list it, as the saver's thread does."""
    assert engine.saver is not None
    return engine.saver.list_spills(0.0)


def test_a_prefix_evicted_from_every_tier_before_any_save_is_read_back_from_disk(
    tmp_path: Path,
) -> None:
    engine = Engine(model(), None, config(tmp_path, **TIERS), source="w0")
    evicted_everywhere(engine)
    assert listed(engine) > 0
    stats = engine.stats()
    assert stats.disk_spilled_pages >= 10 and stats.disk_spill_skipped_pages == 0
    prompt = [*FIRST, 5, 6]
    tokens, cached, logits = ask(engine, prompt)
    cold_tokens, _, cold_logits = ask(Engine(model(), None, config(None)), prompt)
    assert cached == len(FIRST), "the spilled prompt was read back"
    assert engine.stats().disk_hit_tokens >= len(FIRST)
    assert tokens == cold_tokens and relative_error(logits, cold_logits) < 1e-5
    check_sequence_cache(engine.cache)


def test_without_persist_evicted_the_same_prefix_is_recomputed(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path, **TIERS, persist_evicted=False), source="w0")
    evicted_everywhere(engine)
    assert engine.spill is None and engine.saver is None
    _, cached, _ = ask(engine, [*FIRST, 5, 6])
    assert cached == 0 and engine.stats().disk_hit_tokens == 0


def test_a_drain_writes_what_is_still_queued_and_the_restart_reads_it(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path, **TIERS), source="w0")
    evicted_everywhere(engine)
    engine.stop()  # nothing was listed while serving: the drain writes and lists it
    names = {n["name"] for n in json.loads((tmp_path / "w0" / MANIFEST).read_text())["nodes"]}
    assert names == {p.stem for p in (tmp_path / "w0").glob("*.safetensors")}
    restarted = Engine(model(), None, config(tmp_path, **TIERS), source="w0")
    restarted.cache.tree.clear()
    _, cached, _ = ask(restarted, [*FIRST, 5, 6])
    assert cached == len(FIRST), "the spilled prompt came back after the restart"


def test_a_full_queue_drops_as_before_and_keeps_serving(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path, **TIERS), source="w0")
    assert engine.spill is not None
    engine.spill.max_queued_bytes = engine.spill.page_bytes  # one drop at a time, then full
    evicted_everywhere(engine)  # nothing is written meanwhile: the first drop fills it
    stats = engine.stats()
    assert stats.disk_spill_skipped_pages > 0 and engine.spill._queued_bytes > 0
    check_sequence_cache(engine.cache)
    assert listed(engine) >= 1 and engine.spill._queued_bytes == 0
    tokens, _, _ = ask(engine, [*FIRST, 5, 6])
    assert len(tokens) == 6
    check_sequence_cache(engine.cache)


def test_a_spilled_node_never_serves_another_tenant(tmp_path: Path) -> None:
    acme = CacheNamespace(tenant="acme")
    engine = Engine(model(), None, config(tmp_path, **TIERS), source="w0")
    evicted_everywhere(engine, acme)
    assert listed(engine) > 0
    _, other, _ = ask(engine, [*FIRST, 5, 6], CacheNamespace(tenant="globex"))
    _, shared, _ = ask(engine, [*FIRST, 5, 6])
    assert (other, shared) == (0, 0)
    _, own, _ = ask(engine, [*FIRST, 5, 6], acme)
    assert own == len(FIRST)


def test_a_spill_writes_the_unsaved_nodes_above_it_and_lists_them_at_once(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path, num_pages=24), source="w0")
    head = FIRST[:20]
    answer, _, _ = ask(engine, head)  # one node: the head and the answer's first page
    serve(engine, [[*head, *FIRST[20:]]])  # splits it at the head; a new tail below
    tree, store = engine.cache.tree, engine.store
    assert store is not None and not store.written
    tree.evict(1)  # the least recently used leaf: the answer's page, below the unsaved head
    engine.runner.copy_pages(engine.cache.take_tier_copies())
    assert listed(engine) == 2, "the answer's page and the head above it"
    records = list(store._listed.values())
    assert sorted(r.positions for r in records) == [4, 20]
    assert {r.parent for r in records} == {None, next(r.name for r in records if r.positions == 20)}
    assert {p.stem for p in (tmp_path / "w0").glob("*.safetensors")} == set(store._listed)
    tree.clear()
    tokens, cached, _ = ask(engine, [*head, *answer, 1])
    assert cached == 24 and engine.stats().disk_hit_tokens == 24
    cold_tokens, _, _ = ask(Engine(model(), None, config(None)), [*head, *answer, 1])
    assert tokens == cold_tokens


@pytest.mark.parametrize("page_size", [1, 4])
def test_spilling_keeps_every_page_accounted_for_under_pressure(
    tmp_path: Path, page_size: int
) -> None:
    rng = random.Random(page_size)
    engine = Engine(
        model(),
        None,
        config(
            tmp_path, num_pages=96 // page_size, host_pages=32 // page_size, page_size=page_size
        ),
        source="w0",
    )
    prefixes = [[rng.randrange(1, 384) for _ in range(24)] for _ in range(3)]
    for _ in range(12):
        serve(engine, [[*rng.choice(prefixes), *(rng.randrange(1, 384) for _ in range(20))]])
        check_sequence_cache(engine.cache)
        listed(engine)
    assert engine.stats().disk_spilled_pages > 0
    engine.stop()
    restarted = Engine(
        model(), None, config(tmp_path, num_pages=96 // page_size, page_size=page_size), source="w0"
    )
    check_sequence_cache(restarted.cache)
    assert restarted.loaded.dropped == 0


def test_stats_and_metrics_report_what_was_spilled(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path, **TIERS), source="w0")
    evicted_everywhere(engine)
    listed(engine)
    stats = engine.stats()
    wire = worker_stats(engine, "w")
    assert (wire.disk_spilled_pages, wire.disk_spill_skipped_pages) == (
        stats.disk_spilled_pages,
        0,
    )
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, "w"))
    text = generate_latest(registry).decode()
    line = f'radixmesh_worker_disk_spilled_pages_total{{worker="w"}} {stats.disk_spilled_pages:.1f}'
    assert stats.disk_spilled_pages >= 10 and line in text


def queued_spills(tmp_path: Path) -> tuple[Engine, list]:
    """An engine that dropped FIRST from its only tier, its spill copies taken, not performed."""
    engine = Engine(model(), None, config(tmp_path, num_pages=24), source="w0")
    serve(engine, [FIRST])
    engine.cache.tree.evict(engine.cache.tree.evictable_pages)
    copies = engine.cache.take_tier_copies()
    assert copies and all(isinstance(c, SpillCopy) for c in copies)
    return engine, copies


def test_spill_copies_never_performed_let_go_of_what_they_reserved(tmp_path: Path) -> None:
    engine, copies = queued_spills(tmp_path)
    spill = engine.spill
    assert spill is not None and spill._queued_bytes > 0 and spill._queued
    broken = TierCopy(DEVICE, as_pages([1]), HOST, as_pages([1]))  # no host tier: raises
    with pytest.raises(RuntimeError, match="host tier"):
        engine.runner.copy_pages([broken, *copies])
    assert spill._queued_bytes == 0 and not spill._queued, "the lost copies' reservations"
    serve(engine, [FIRST])  # and the same node spills again the next time it is dropped
    engine.cache.tree.evict(engine.cache.tree.evictable_pages)
    assert engine.cache.take_tier_copies(), "refused as 'on its way' for good"


def test_a_writer_under_steady_eviction_returns_to_list_what_it_wrote(tmp_path: Path) -> None:
    engine, copies = queued_spills(tmp_path)
    engine.runner.copy_pages(copies)
    spill, store = engine.spill, engine.store
    assert spill is not None and store is not None
    write = store.write_spilled
    again = list(spill._queue.get_nowait() for _ in range(spill._queue.qsize()))
    for item in again:
        spill._queue.put(item)

    def producing(record, keys, k, v):  # type: ignore[no-untyped-def]
        spill._queue.put(again[0])  # eviction keeps queueing while the writer writes
        return write(record, keys, k, v)

    store.write_spilled = producing  # type: ignore[method-assign]
    assert spill.write_queued() == len(again), "the batch queued when it began, no more"


def test_a_manifest_that_fails_keeps_its_spills_for_the_next(tmp_path: Path) -> None:
    engine, copies = queued_spills(tmp_path)
    engine.runner.copy_pages(copies)
    assert engine.spill is not None and engine.store is not None
    blocker = tmp_path / "w0" / f"{MANIFEST}.tmp"
    blocker.mkdir(parents=True)  # the manifest cannot be written
    with pytest.raises(OSError):
        listed(engine)
    blocker.rmdir()
    assert engine.saver is not None
    engine.store.write_manifest(None, StoreIdentity.of(engine))
    assert len(engine.store._listed) == len(copies), "the spills were listed at the retry"
    engine.cache.tree.clear()
    _, cached, _ = ask(engine, [*FIRST, 5, 6])
    assert cached == len(FIRST)


def test_an_empty_queue_takes_a_drop_bigger_than_its_bound(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path, num_pages=24), source="w0")
    assert engine.spill is not None
    engine.spill.max_queued_bytes = engine.spill.page_bytes  # FIRST's node is 11 pages
    serve(engine, [FIRST])
    engine.cache.tree.evict(engine.cache.tree.evictable_pages)
    engine.runner.copy_pages(engine.cache.take_tier_copies())
    assert listed(engine) == 1 and engine.stats().disk_spill_skipped_pages == 0
