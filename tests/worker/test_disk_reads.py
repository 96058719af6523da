"""The disk tier read off the engine thread and priced against recomputing: running requests
keep decoding while a disk hit is read, a sample that ends mid-read leaves every page accounted
for, samples wanting the same saved nodes share one read, and a hit priced slower than
recomputing is recomputed (with the same outputs)."""

from __future__ import annotations

import os
import random
import shutil
import struct
import threading
import time
from pathlib import Path

import torch

from cache import DEFAULT_NAMESPACE, KvEvent, KvEventKind, to_cache_keys
from cache.integrity import check_sequence_cache
from tests.worker.helpers import greedy, relative_error
from tests.worker.test_kv_persistence import TURNS, ask, config, model, serve
from worker.engine import Engine
from worker.kv_persistence import BackgroundSaver, KvStore, StoreIdentity
from worker.request import RequestOutput

PAGE = 4
PROMPT = [*TURNS[0], 5, 6]
SAVED = len(TURNS[0]) // PAGE * PAGE  # what turn 1 left cached: its whole pages


def saved_and_cleared(
    directory: Path, turns: list[list[int]] = TURNS[:1], **overrides: object
) -> Engine:
    """An engine whose `turns` (the first, by default) are saved to disk and then gone from
    every tier."""
    engine = Engine(model(), None, config(directory, **overrides), source="w0")
    serve(engine, turns)
    assert engine.store is not None
    engine.store.save(engine)  # as the background saver would, while serving
    engine.cache.tree.clear()
    engine.runner.copy_pages(engine.cache.take_tier_copies())
    assert engine.cache.tree.node_count == 0
    return engine


def reading(engine: Engine) -> list:
    """The waiting samples whose disk hit is being read."""
    return [s for s in engine.scheduler.waiting if s.disk_read is not None]


def drained(engine: Engine, outputs: list) -> tuple[RequestOutput, list[int]]:
    """Step until idle; the finished output of `outputs` and every token they carried."""
    while engine.step():
        pass
    return next(o for o in outputs if o.finished), [t for o in outputs for t in o.token_ids]


def gate_reads(store: KvStore) -> tuple[threading.Event, list[str]]:
    """Hold every disk read on the reader thread until the returned event is set; the list
    gets each node read."""
    gate, names = threading.Event(), []
    read = store.read

    def gated(record, identity):  # type: ignore[no-untyped-def]
        assert gate.wait(10.0), "the test never opened the gate"
        names.append(record.name)
        return read(record, identity)

    store.read = gated  # type: ignore[method-assign]
    return gate, names


def cold_answer(prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    tokens, _, logits = ask(Engine(model(), None, config(None), source="w0"), prompt)
    return tokens, logits


def test_requests_keep_decoding_while_a_disk_hit_is_read(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path)
    assert engine.store is not None and engine.disk_reads is not None
    gate, names = gate_reads(engine.store)
    decoding: list[int] = []
    engine.submit(greedy("decoding", TURNS[2][::-1], 24), lambda o: decoding.extend(o.token_ids))
    outputs: list = []
    engine.submit(greedy("hit", PROMPT, 6), outputs.append)
    before = len(decoding)
    for _ in range(8):
        assert engine.step()
    waiting = [s for s in engine.scheduler.waiting if s.request.request_id == "hit"]
    assert waiting and waiting[0].disk_read is not None, "the hit waits for its read"
    assert len(decoding) - before >= 6, "the running request decoded while the read was held"
    assert not outputs and not names
    gate.set()
    final, tokens = drained(engine, outputs)
    assert final.cached_prompt_tokens == SAVED and engine.stats().disk_hit_tokens == SAVED
    assert tokens == cold_answer(PROMPT)[0] and len(decoding) == 24
    check_sequence_cache(engine.cache)


def test_a_request_aborted_mid_read_leaves_every_page_accounted_for(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path)
    assert engine.store is not None and engine.disk_reads is not None
    gate, _ = gate_reads(engine.store)
    outputs: list = []
    engine.submit(greedy("aborted", PROMPT, 6), outputs.append)
    engine.step()
    assert reading(engine), "its read is in flight"
    engine.abort("aborted")
    engine.step()
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert not reading(engine) and not engine.disk_reads._shared
    gate.set()
    while engine.step():
        pass
    check_sequence_cache(engine.cache)
    assert engine.cache.pool.num_private == 0 and engine.cache.tree.node_count == 0
    tokens, cached, logits = ask(engine, PROMPT)  # the engine serves, and reads the hit again
    cold_tokens, cold_logits = cold_answer(PROMPT)
    assert cached == SAVED and tokens == cold_tokens
    assert relative_error(logits, cold_logits) < 1e-5
    check_sequence_cache(engine.cache)


def test_samples_wanting_the_same_saved_nodes_share_one_read(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path)
    assert engine.store is not None and engine.disk_reads is not None
    gate, names = gate_reads(engine.store)
    wanted, held = engine.store.wanted(engine, to_cache_keys(PROMPT), DEFAULT_NAMESPACE)
    assert wanted and held == 0
    outputs: list = []
    for i in range(3):
        engine.submit(greedy(f"same{i}", PROMPT, 4), outputs.append)
    engine.step()
    assert len(reading(engine)) == 3
    gate.set()
    while engine.step():
        pass
    assert sorted(names) == sorted(n.name for n, _ in wanted), "each node was read once"
    finals = [o for o in outputs if o.finished]
    assert len(finals) == 3 and all(f.cached_prompt_tokens == SAVED for f in finals)
    assert engine.stats().disk_hit_tokens == SAVED, "the other two hit what the first put back"
    check_sequence_cache(engine.cache)


def test_a_disk_hit_priced_slower_than_recomputing_is_recomputed(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path)
    costs = engine.tier_costs
    for tokens in range(1, 257, 4):  # passes whose positions cost a microsecond each
        costs.observe_pass(tokens, 1e-3 + 1e-6 * tokens)
    costs.observe_read(1, 1.0)  # and a disk that takes a second a position
    assert costs.recompute_s is not None and costs.read_s is not None
    tokens, cached, logits = ask(engine, PROMPT)
    cold_tokens, cold_logits = cold_answer(PROMPT)
    assert cached == 0 and engine.stats().disk_hit_tokens == 0
    assert engine.stats().disk_skipped_tokens == SAVED
    assert tokens == cold_tokens and relative_error(logits, cold_logits) < 1e-5

    faster = saved_and_cleared(tmp_path / "faster")
    for tokens in range(1, 257, 4):  # the same passes; a disk a thousand times faster
        faster.tier_costs.observe_pass(tokens, 1e-3 + 1e-6 * tokens)
    faster.tier_costs.observe_read(1000, 1e-6)
    tokens, cached, _ = ask(faster, PROMPT)
    assert cached == SAVED and faster.stats().disk_hit_tokens == SAVED
    assert faster.stats().disk_skipped_tokens == 0 and tokens == cold_tokens
    check_sequence_cache(engine.cache)
    check_sequence_cache(faster.cache)


def test_the_engine_learns_both_rates_from_what_it_serves(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path)
    costs = engine.tier_costs
    assert costs.read_s is None, "nothing was read yet"
    ask(engine, PROMPT)
    read_s = costs.read_s
    assert read_s is not None and 0 < read_s < 1.0, "the read it made priced the disk"
    serve(engine, [TURNS[1], TURNS[2]])
    recompute_s = costs.recompute_s
    assert recompute_s is not None and 0 < recompute_s < 1.0
    assert costs.read_s == read_s, "passes do not move the read rate"


def test_what_a_save_writes_is_published_as_saved_and_kept_in_the_snapshot(
    tmp_path: Path,
) -> None:
    engine = Engine(model(), None, config(tmp_path), source="w0")
    events: list[KvEvent] = []
    engine.cache.events.subscribe(events.append)
    serve(engine, TURNS[:2])
    assert engine.store is not None
    cached = engine.kv_snapshot().block_hashes
    assert cached and not engine.kv_snapshot().disk_block_hashes
    saver = BackgroundSaver(engine, engine.store, 3600.0)
    thread = threading.Thread(target=saver.save_once)
    thread.start()  # its engine calls run between steps: step until it is done
    while thread.is_alive():
        engine.step()
        thread.join(0.01)
    engine.step()  # the publish it queued last
    saved = [e for e in events if e.kind is KvEventKind.SAVED]
    assert len(saved) == 1 and frozenset(saved[0].block_hashes) == cached
    engine.cache.tree.clear()
    snapshot = engine.kv_snapshot()
    assert not snapshot.block_hashes and snapshot.disk_block_hashes == cached
    assert snapshot.seq == engine.cache.events.seq
    engine.store.save(engine)  # the cache is empty: what it evicted stays on disk
    engine.publish_disk_blocks()
    assert not [e for e in events if e.kind is KvEventKind.UNSAVED]
    assert engine.kv_snapshot().disk_block_hashes == cached
    engine.store.max_bytes = 1  # until newer KV needs the bytes (here: none may stay)
    engine.stop()
    unsaved = [e for e in events if e.kind is KvEventKind.UNSAVED]
    assert len(unsaved) == 1 and frozenset(unsaved[0].block_hashes) == cached
    assert not engine.kv_snapshot().disk_block_hashes


def test_a_restarted_engine_says_what_its_disk_holds(tmp_path: Path) -> None:
    first = Engine(model(), None, config(tmp_path), source="w0")
    serve(first, TURNS)
    cached = first.kv_snapshot().block_hashes
    first.stop()
    second = Engine(model(), None, config(tmp_path), source="w0")
    snapshot = second.kv_snapshot()
    assert snapshot.block_hashes == cached, "loaded into the cache"
    assert snapshot.disk_block_hashes == cached, "and on disk"
    assert snapshot.seq == second.cache.events.seq


def test_a_disk_hit_says_how_many_of_its_tokens_came_from_disk(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path)
    outputs: list = []
    engine.submit(greedy("hit", PROMPT, 3), outputs.append)
    final, _ = drained(engine, outputs)
    assert final.cached_prompt_tokens == final.disk_cached_tokens == SAVED
    outputs.clear()
    engine.submit(greedy("again", PROMPT, 3), outputs.append)  # now a device hit
    final, _ = drained(engine, outputs)
    assert final.cached_prompt_tokens == SAVED and final.disk_cached_tokens == 0


def test_a_prompt_that_shares_part_of_a_saved_node_reads_its_whole_pages(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path)
    assert engine.store is not None
    [(node, end)] = engine.store.lookup(to_cache_keys(TURNS[0]), DEFAULT_NAMESPACE)
    assert end == node.record.positions == SAVED, "turn 1 was saved as one node"
    prompt = [*TURNS[0][:45], 1, 2, 3, 4, 5]  # leaves it inside its 12th page
    tokens, cached, logits = ask(engine, prompt)
    cold_tokens, cold_logits = cold_answer(prompt)
    assert cached == 44 and engine.stats().disk_hit_tokens == 44
    assert tokens == cold_tokens and relative_error(logits, cold_logits) < 1e-5
    check_sequence_cache(engine.cache)


def test_while_part_of_a_read_is_in_the_engine_waits_instead_of_spinning(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path, TURNS[:2])  # the system prompt, then each tail
    assert engine.store is not None
    prompt = [*TURNS[1], 5, 6]
    wanted, _ = engine.store.wanted(engine, to_cache_keys(prompt), DEFAULT_NAMESPACE)
    assert len(wanted) == 2
    gate = threading.Event()
    read = engine.store.read

    def last_node_held(record, identity):  # type: ignore[no-untyped-def]
        if record.name == wanted[-1][0].name:
            assert gate.wait(10.0)
        return read(record, identity)

    engine.store.read = last_node_held  # type: ignore[method-assign]
    outputs: list = []
    engine.submit(greedy("hit", prompt, 3), outputs.append)
    steps, began = 0, time.monotonic()
    while time.monotonic() - began < 0.3:  # the first node is read, the second is held
        assert engine.step()
        steps += 1
    assert steps < 30, f"{steps} steps in 0.3 s: the engine spun while the read was held"
    gate.set()
    final, _ = drained(engine, outputs)
    assert final.cached_prompt_tokens == len(TURNS[1]) // PAGE * PAGE
    check_sequence_cache(engine.cache)


def test_reads_begun_and_samples_running_stay_within_max_running(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path, max_running=2), source="w0")
    serve(engine, TURNS)
    assert engine.store is not None and engine.disk_reads is not None
    engine.store.save(engine)
    engine.cache.tree.clear()
    gate, _ = gate_reads(engine.store)
    outputs: list = []
    for i, turn in enumerate(TURNS):
        engine.submit(greedy(f"hit{i}", [*turn, 5, 6], 3), outputs.append)
    for _ in range(3):
        engine.step()
        assert len(engine.scheduler.running) + engine.disk_reads.pending <= 2
    assert engine.disk_reads.pending == 2, "two reads under way, the third waits its turn"
    gate.set()
    while engine.step():
        assert len(engine.scheduler.running) + engine.disk_reads.pending <= 2
    finals = [o for o in outputs if o.finished]
    assert len(finals) == 3 and all(f.cached_prompt_tokens > 0 for f in finals)
    check_sequence_cache(engine.cache)


def test_a_request_with_nothing_on_disk_runs_while_reads_fill_max_running(
    tmp_path: Path,
) -> None:
    engine = saved_and_cleared(tmp_path, TURNS, max_running=2)
    assert engine.disk_reads is not None and engine.store is not None
    gate, _ = gate_reads(engine.store)
    for i, turn in enumerate(TURNS[:2]):
        engine.submit(greedy(f"hit{i}", [*turn, 5, 6], 3), lambda o: None)
    engine.step()
    assert engine.disk_reads.pending == 2, "both reads under way: max_running is reached"
    fresh: list = []
    engine.submit(greedy("fresh", TURNS[2][::-1], 3), fresh.append)
    for _ in range(5):
        engine.step()
    assert fresh and fresh[-1].finished, "it needed no read, so it ran meanwhile"
    gate.set()
    while engine.step():
        pass
    check_sequence_cache(engine.cache)


def test_a_prefix_evicted_during_the_read_is_read_back_too(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path, TURNS[:2])
    assert engine.store is not None
    serve(engine, [TURNS[0][:44]])  # the system prompt is back in the cache
    prompt = [*TURNS[1], 5, 6]
    _, held = engine.store.wanted(engine, to_cache_keys(prompt), DEFAULT_NAMESPACE)
    assert held == 40
    gate, _ = gate_reads(engine.store)
    outputs: list = []
    engine.submit(greedy("hit", prompt, 3), outputs.append)
    engine.step()
    assert reading(engine)
    engine.cache.tree.evict(engine.cache.tree.evictable_pages)  # the system prompt goes
    engine.runner.copy_pages(engine.cache.take_tier_copies())
    assert engine.store.held(engine, to_cache_keys(prompt), DEFAULT_NAMESPACE) == 0
    gate.set()
    final, tokens = drained(engine, outputs)
    assert final.cached_prompt_tokens == len(TURNS[1]) // PAGE * PAGE, "all of it, from disk"
    assert tokens == cold_answer(prompt)[0][:3]
    check_sequence_cache(engine.cache)


def test_stopping_does_not_wait_for_a_read_under_way(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path)
    assert engine.store is not None and engine.disk_reads is not None
    gate, _ = gate_reads(engine.store)
    outputs: list = []
    engine.start()
    engine.submit(greedy("hit", PROMPT, 3), outputs.append)
    deadline = time.monotonic() + 5
    while not engine.disk_reads.pending and time.monotonic() < deadline:
        time.sleep(0.005)
    began = time.monotonic()
    engine.stop(timeout=2.0)
    assert time.monotonic() - began < 1.5, "stop waited for the held read"
    gate.set()
    assert outputs and outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert engine.disk_reads.pending == 0
    check_sequence_cache(engine.cache)


def test_what_both_tiers_evicted_stays_on_disk_across_saves(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path), source="w0")
    serve(engine, TURNS[:1])
    assert engine.store is not None
    engine.store.save(engine)
    engine.cache.tree.clear()  # turn 1 is on disk alone
    serve(engine, [TURNS[2][::-1]])  # other work, saved after it
    engine.store.save(engine)
    files = {p.stem for p in (tmp_path / "w0").glob("*.safetensors")}
    assert len(files) == 2, "turn 1's node and the new one"
    tokens, cached, _ = ask(engine, PROMPT)
    assert cached == SAVED and engine.stats().disk_hit_tokens == SAVED
    assert tokens == cold_answer(PROMPT)[0]


def test_a_saved_node_the_tree_trimmed_is_still_read_whole(tmp_path: Path) -> None:
    """The cache trims a saved node (an eviction); the next save writes the head anew and
    keeps the whole one listed: a prompt over all of it reads the whole one. (Without
    `persist_evicted`: a spilling tree drops whole leaves and trims nothing.)"""
    engine = Engine(model(), None, config(tmp_path, persist_evicted=False), source="w0")
    serve(engine, [TURNS[0]])
    assert engine.store is not None
    engine.store.save(engine)
    engine.cache.tree.evict(3)  # no host tier: the leaf loses its last 3 pages
    engine.runner.copy_pages(engine.cache.take_tier_copies())
    engine.store.save(engine)
    assert sorted(r.positions for r in engine.store._listed.values()) == [SAVED - 12, SAVED]
    engine.cache.tree.clear()
    tokens, cached, _ = ask(engine, PROMPT)
    assert cached == SAVED, "the whole node, not the trimmed head"
    assert tokens == cold_answer(PROMPT)[0]


def test_a_restart_keeps_on_disk_what_the_tiers_cannot_hold(tmp_path: Path) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 384) for _ in range(40)] for _ in range(3)]
    engine = Engine(model(), None, config(tmp_path, num_pages=24), source="w0")
    for prompt in prompts:  # three nodes of 10 pages, each evicted after its save
        serve(engine, [prompt])
        assert engine.store is not None
        engine.store.save(engine)
        engine.cache.tree.clear()
    engine.stop()
    assert len(list((tmp_path / "w0").glob("*.safetensors"))) == 3
    restarted = Engine(model(), None, config(tmp_path, num_pages=24), source="w0")
    assert restarted.loaded.nodes == 2 and restarted.loaded.on_disk == 1
    assert restarted.loaded.dropped == 0
    assert restarted.store is not None
    restarted.store.save(restarted)
    assert len(list((tmp_path / "w0").glob("*.safetensors"))) == 3, "the save kept its file"
    restarted.cache.tree.clear()
    for prompt in prompts:
        assert ask(restarted, [*prompt, 1])[1] == 40, "each read back from disk"


def test_a_file_that_fails_its_read_is_dropped_not_retried(tmp_path: Path) -> None:
    engine = saved_and_cleared(tmp_path)
    assert engine.store is not None
    [path] = (tmp_path / "w0").glob("*.safetensors")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped bit
    path.write_bytes(bytes(data))
    assert ask(engine, PROMPT)[1] == 0, "recomputed, never served"
    assert engine.store.lookup(to_cache_keys(PROMPT), DEFAULT_NAMESPACE) == [], "not again"
    engine.cache.tree.clear()
    engine.store.save(engine)  # the tree recomputed other keys: the bad node is not listed
    engine.publish_disk_blocks()
    assert not path.exists() and not engine.kv_snapshot().disk_block_hashes


def test_a_lookup_takes_the_head_whose_children_reach_further(tmp_path: Path) -> None:
    """A saved node trimmed by the tree, the conversation continued past part of its tail:
    the trimmed head and its new children reach further than the whole node's shared pages."""
    rng = random.Random(3)
    first = [rng.randrange(1, 384) for _ in range(40)]  # 10 pages
    second = [*first[:32], *(rng.randrange(1, 384) for _ in range(24))]
    engine = Engine(model(), None, config(tmp_path), source="w0")
    assert engine.store is not None
    serve(engine, [first])
    engine.store.save(engine)
    engine.cache.tree.evict(3)
    engine.runner.copy_pages(engine.cache.take_tier_copies())
    engine.store.save(engine)
    serve(engine, [second])
    engine.store.save(engine)
    engine.cache.tree.clear()
    tokens, cached, _ = ask(engine, [*second, 1])
    assert cached == len(second), "all of it is on disk"
    assert tokens == cold_answer([*second, 1])[0]


def test_a_damaged_key_of_a_node_kept_on_disk_alone_is_not_listed(tmp_path: Path) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 384) for _ in range(40)] for _ in range(3)]
    engine = Engine(model(), None, config(tmp_path, num_pages=24), source="w0")
    for prompt in prompts:
        serve(engine, [prompt])
        assert engine.store is not None
        engine.store.save(engine)
        engine.cache.tree.clear()
    engine.stop()
    probe = Engine(model(), None, config(tmp_path, num_pages=24), source="w0")
    assert probe.store is not None
    in_tree = {r.name for r in probe.store.records(probe)[0]}
    [alone] = [n for n in probe.store._listed if n not in in_tree]
    path = tmp_path / "w0" / f"{alone}.safetensors"
    data = bytearray(path.read_bytes())
    data[8 + struct.unpack("<Q", data[:8])[0] + 3] ^= 1  # a bit of its first key
    path.write_bytes(bytes(data))
    restarted = Engine(model(), None, config(tmp_path, num_pages=24), source="w0")
    assert restarted.loaded.on_disk == 0 and restarted.loaded.dropped == 1
    assert restarted.store is not None
    assert alone not in restarted.store._listed, "nor announced: a lookup could never find it"


def test_what_a_read_returns_does_not_depend_on_its_file_afterwards(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path), source="w0")
    assert engine.store is not None
    serve(engine, [[*range(1, 41)]])
    engine.store.save(engine)
    [record] = engine.store._listed.values()
    got = engine.store.read(record, StoreIdentity.of(engine))
    assert got is not None
    before = got["v"].clone()
    path = tmp_path / "w0" / f"{record.name}.safetensors"
    with open(path, "r+b") as file:  # not something the store does; a damaged disk might
        file.seek(-64, os.SEEK_END)
        file.write(b"\xff" * 64)
    assert got["v"].equal(before), "the tensors are the bytes checksummed"
    os.truncate(path, 8)  # touching a mapping of it now would be SIGBUS
    assert got["v"].equal(before)
    shutil.rmtree(tmp_path / "w0")
