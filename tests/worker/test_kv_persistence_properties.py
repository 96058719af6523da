"""Property: whatever the cache held, a save and a load give back the same prefixes in the same
namespaces with the same KV, and a damaged file costs exactly its own node and those below it.

Random trees (shared prefixes, several tenants and adapters, both tiers) are built by inserting
sequences with random KV written into their pages, without a forward pass; hypothesis draws the
sequences and which file to damage.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache import CacheNamespace, Node
from cache.integrity import check_sequence_cache
from tests.worker.helpers import LLAMA
from worker.engine import Engine, EngineConfig
from worker.kv_persistence import MANIFEST
from worker.model import CausalLM
from worker.tiny_model import tiny_model

PS = 4
NAMESPACES = [CacheNamespace(), CacheNamespace(tenant="a"), CacheNamespace(adapter="x")]
MODEL: list[CausalLM] = []
sequences = st.lists(
    st.tuples(
        st.sampled_from(range(len(NAMESPACES))),
        st.sampled_from([[], [7] * 8, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]),
        st.lists(st.integers(1, 300), min_size=4, max_size=24),
    ),
    min_size=1,
    max_size=8,
)


def engine(directory: Path, host_pages: int = 0) -> Engine:
    if not MODEL:
        MODEL.append(tiny_model(LLAMA, seed=2))
    config = EngineConfig(
        num_pages=40, page_size=PS, max_running=4, host_pages=host_pages,
        persist_dir=str(directory), persist_interval_s=0.0,
    )  # fmt: skip
    return Engine(MODEL[0], None, config, source="w")


Drawn = list[tuple[int, list[int], list[int]]]
"""(namespace index, shared prefix, tail) of each sequence."""


def insert_each(
    target: Engine, drawn: Drawn, write: Callable[[int, list[int], int, list[int]], None]
) -> None:
    """Insert each sequence (whole pages), as a worker's prefill would: match (promoting from
    the host), lock, allocate (evicting), perform the queued copies, then `write(namespace
    index, keys, first new page's index in the sequence, the new pages)` fills the KV, insert,
    unlock."""
    cache = target.cache
    for ns_index, prefix, tail in drawn:
        keys = (prefix + tail)[: len(prefix + tail) // PS * PS]
        if not keys:
            continue
        ns = NAMESPACES[ns_index]
        match = cache.tree.match(keys, ns)
        if match.host_node is not None:
            match = cache.tree.promote(match)
        cache.tree.lock(match.last_node)
        fresh = cache.table.allocate_pages(len(keys) // PS - len(match.pages))
        target.runner.copy_pages(cache.take_tier_copies())
        write(ns_index, keys, len(match.pages), list(fresh))
        result = cache.tree.insert(keys, match.pages + fresh, ns, from_node=match.last_node)
        cache.pool.free_private(fresh[: len(result.existing_pages)])
        cache.tree.unlock(match.last_node)
        target.runner.copy_pages(cache.take_tier_copies())


def fill(target: Engine, drawn: Drawn, seed: int) -> None:
    """Insert each sequence with random KV in the pages it brings."""
    generator = torch.Generator().manual_seed(seed)

    def random_kv(ns_index: int, keys: list[int], first: int, fresh: list[int]) -> None:
        index = torch.tensor(fresh, dtype=torch.long)
        for k, v in target.runner.kv:
            k[index] = torch.randn(k[index].shape, generator=generator)
            v[index] = torch.randn(v[index].shape, generator=generator)

    insert_each(target, drawn, random_kv)


def cached_nodes(target: Engine) -> Iterator[tuple[CacheNamespace, Node, tuple[int, ...], list]]:
    """Each cached node: its namespace, itself, the keys up to its end, its tier's (k, v)s."""
    for ns, root in target.cache.tree.roots.items():
        stack: list[tuple[Node, tuple[int, ...]]] = [(c, ()) for c in root.children.values()]
        while stack:
            node, above = stack.pop()
            keys = above + tuple(node.keys)
            kv = target.runner.kv if node.tier == 0 else target.runner.host_kv
            yield ns, node, keys, kv
            stack.extend((child, keys) for child in node.children.values())


def contents(target: Engine) -> dict[tuple[CacheNamespace, tuple[int, ...]], torch.Tensor]:
    """Every cached path (namespace, keys up to a node's end) -> the K of its last node."""
    out = {}
    for ns, node, keys, kv in cached_nodes(target):
        index = torch.tensor(list(node.pages), dtype=torch.long)
        out[(ns, keys)] = torch.stack([k[index] for k, _ in kv])
    return out


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(drawn=sequences, host=st.sampled_from([0, 24]), seed=st.integers(0, 1000))
def test_a_save_and_a_load_give_back_every_prefix_with_its_kv(
    tmp_path_factory, drawn, host, seed
) -> None:  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("kv")
    first = engine(directory, host)
    fill(first, drawn, seed)
    before = contents(first)
    first.stop()
    second = engine(directory, host)
    check_sequence_cache(second.cache)
    after = contents(second)

    # the same positions are cached in each namespace (nodes may be cut differently)
    def positions(found: dict) -> set:
        return {(ns, keys[:end]) for (ns, keys) in found for end in range(PS, len(keys) + 1, PS)}

    assert positions(after) == positions(before)
    for (ns, keys), k in after.items():  # and the KV of each loaded node is the saved KV
        owner = next(
            (kb, key)
            for key, kb in before.items()
            if key[0] == ns and len(key[1]) >= len(keys) and key[1][: len(keys)] == keys
        )
        kb, (_, saved_keys) = owner
        start = (len(keys) - k.shape[1] * PS) // PS
        node_start = (len(saved_keys) - kb.shape[1] * PS) // PS
        assert torch.equal(k, kb[:, start - node_start : start - node_start + k.shape[1]]), keys


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(drawn=sequences, pick=st.integers(0, 100), seed=st.integers(0, 1000))
def test_a_damaged_file_costs_exactly_its_subtree(tmp_path_factory, drawn, pick, seed) -> None:  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("kv")
    first = engine(directory)
    fill(first, drawn, seed)
    first.stop()
    manifest = json.loads((directory / "w" / MANIFEST).read_text())
    nodes = manifest["nodes"]
    if not nodes:
        return
    victim = nodes[pick % len(nodes)]
    below = {victim["name"]}
    for node in nodes:  # parents come first
        if node["parent"] in below:
            below.add(node["name"])
    path = directory / "w" / f"{victim['name']}.safetensors"
    data = bytearray(path.read_bytes())
    data[pick % len(data)] ^= 0x40
    path.write_bytes(bytes(data))
    second = engine(directory)
    assert second.loaded.dropped == len(below)
    assert second.loaded.nodes == len(nodes) - len(below)
    check_sequence_cache(second.cache)
    loaded = {record.name for record in second.store.records(second)[0]}  # type: ignore[union-attr]
    kept = {node["name"] for node in nodes} - below
    assert loaded == kept, "the loaded tree is the saved one less the damaged subtree"
