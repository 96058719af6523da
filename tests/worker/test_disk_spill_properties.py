"""Property: with what eviction drops written to disk, nothing the cache ever held is lost. After
any sequence of inserts into small tiers (evicting, demoting, dropping, splitting nodes on the
way) and a drain, a restarted engine with room for all of it holds every prefix that was ever
cached, in its namespace, with the KV it had.

Each position's K and V are a function of its namespace and the keys up to it (as a real
model's are), written into fresh pages without a forward pass; hypothesis draws the sequences.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cache.integrity import check_sequence_cache
from tests.worker.helpers import LLAMA
from tests.worker.test_kv_persistence_properties import (
    NAMESPACES,
    PS,
    Drawn,
    cached_nodes,
    insert_each,
)
from worker.engine import Engine, EngineConfig
from worker.model import CausalLM
from worker.tiny_model import tiny_model

MODEL: list[CausalLM] = []
sequences = st.lists(
    st.tuples(
        st.sampled_from(range(len(NAMESPACES))),
        st.sampled_from([[], [7] * 8, list(range(1, 13))]),
        st.lists(st.integers(1, 300), min_size=4, max_size=28),
    ),
    min_size=1,
    max_size=12,
)


def engine(directory: Path, pages: int, host_pages: int) -> Engine:
    if not MODEL:
        MODEL.append(tiny_model(LLAMA, seed=2))
    config = EngineConfig(
        num_pages=pages, page_size=PS, max_running=4, host_pages=host_pages,
        persist_dir=str(directory), persist_interval_s=0.0,
    )  # fmt: skip
    return Engine(MODEL[0], None, config, source="w")


def value(ns: int, keys: tuple[int, ...]) -> float:
    """What a position's K and V hold: a function of its namespace and the keys up to it."""
    return float(hash((ns, keys)) % 100_003)


def fill(target: Engine, drawn: Drawn) -> set:
    """Insert each sequence, writing `value` into the pages it brings; returns every
    (namespace, prefix) cached on the way, at each page's end."""
    cached = set()

    def valued_kv(ns_index: int, keys: list[int], first: int, fresh: list[int]) -> None:
        for i, page in enumerate(fresh):
            for slot in range(PS):
                position = (first + i) * PS + slot
                fill_value = value(ns_index, tuple(keys[: position + 1]))
                for k, v in target.runner.kv:
                    k[page, slot] = fill_value
                    v[page, slot] = -fill_value
        cached.update((ns_index, tuple(keys[:end])) for end in range(PS, len(keys) + 1, PS))

    insert_each(target, drawn, valued_kv)
    return cached


def held(target: Engine) -> set:
    """Every (namespace, prefix at a page's end) the tree holds, checking each position's KV."""
    index_of = {ns: i for i, ns in enumerate(NAMESPACES)}
    out = set()
    for ns, node, keys, kv in cached_nodes(target):
        for j in range(len(node.keys)):
            position = node.start + j
            want = value(index_of[ns], keys[: position + 1])
            page, slot = node.pages[j // PS], j % PS
            for k, v in kv:
                assert torch.all(k[page, slot] == want), (ns, position)
                assert torch.all(v[page, slot] == -want), (ns, position)
        starts = range(node.start + PS, node.start + len(node.keys) + 1, PS)
        out.update((index_of[ns], keys[:end]) for end in starts)
    return out


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(drawn=sequences, host=st.sampled_from([0, 6]))
def test_nothing_ever_cached_is_lost(tmp_path_factory, drawn, host) -> None:  # type: ignore[no-untyped-def]
    directory = tmp_path_factory.mktemp("kv")
    small = engine(directory, 12, host)  # 11 usable pages: most sequences evict others
    ever = fill(small, drawn)
    check_sequence_cache(small.cache)
    small.stop()  # writes what eviction dropped, then saves the tree
    roomy = engine(directory, 400, 0)
    check_sequence_cache(roomy.cache)
    assert roomy.loaded.dropped == 0 and roomy.loaded.on_disk == 0
    missing = ever - held(roomy)
    assert not missing, f"{len(missing)} prefixes lost, e.g. {sorted(missing)[:2]}"


def test_the_property_needs_the_spill(tmp_path: Path) -> None:
    """Without `persist_evicted` the same kind of run loses what eviction dropped."""
    directory = tmp_path / "kv"
    small = engine(directory, 12, 0)
    small.cache.tree.on_drop = None
    drawn = [(0, [], list(range(1, 25))), (1, [], list(range(30, 54)))]  # 6 pages each
    ever = fill(small, drawn)
    small.stop()
    assert ever - held(engine(directory, 400, 0)), "the first sequence should be gone"
