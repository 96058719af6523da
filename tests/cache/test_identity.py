"""Block identity: stable across processes and restarts, and sensitive to every input."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cache import (
    DEFAULT_NAMESPACE,
    IDENTITY_SCHEME_VERSION,
    BlockHasher,
    CacheKey,
    CacheNamespace,
    CoordToken,
    IdentityMismatch,
    IdentityScheme,
    ImageToken,
    to_cache_keys,
)

SCHEME = IdentityScheme(block_size=4, model_revision="smollm2-135m@r1")
KEYS = list(range(100, 117))  # four whole blocks and one position over


def hashes(
    keys: list[CacheKey], ns: CacheNamespace = DEFAULT_NAMESPACE, scheme: IdentityScheme = SCHEME
) -> list[int]:
    return BlockHasher(scheme).hashes(keys, ns)


def test_one_hash_per_complete_block_chained() -> None:
    full = hashes(KEYS)
    assert len(full) == 4
    assert hashes(KEYS[:8]) == full[:2]
    assert len(set(full)) == 4
    assert all(0 <= h < 1 << 64 for h in full)


def test_changing_one_key_changes_its_block_and_every_later_one_only() -> None:
    changed = list(KEYS)
    changed[5] += 1  # block 1
    a, b = hashes(KEYS), hashes(changed)
    assert a[0] == b[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_same_block_under_a_different_parent_hashes_differently() -> None:
    one = hashes([1, 2, 3, 4, 9, 9, 9, 9])
    two = hashes([5, 6, 7, 8, 9, 9, 9, 9])
    assert one[1] != two[1]


@pytest.mark.parametrize(
    "other",
    [
        CacheNamespace(adapter="sql-lora"),
        CacheNamespace(tenant="acme"),
        CacheNamespace(tenant=""),
        CacheNamespace(adapter="acme"),
        CacheNamespace(image_hash=7),
    ],
)
def test_every_namespace_field_salts_the_chain(other: CacheNamespace) -> None:
    assert set(hashes(KEYS)).isdisjoint(hashes(KEYS, other))


def test_adapter_and_tenant_with_the_same_name_do_not_collide() -> None:
    assert hashes(KEYS, CacheNamespace(adapter="x")) != hashes(KEYS, CacheNamespace(tenant="x"))


def test_model_revision_and_block_size_change_the_hashes() -> None:
    other_model = IdentityScheme(block_size=4, model_revision="smollm2-135m@r2")
    assert set(hashes(KEYS)).isdisjoint(hashes(KEYS, scheme=other_model))
    wider = IdentityScheme(block_size=8, model_revision=SCHEME.model_revision)
    assert hashes(KEYS, scheme=wider)[0] not in hashes(KEYS)


def test_typed_keys_never_hash_like_text() -> None:
    scheme = IdentityScheme(block_size=1, model_revision="m")
    assert hashes([3], scheme=scheme) != hashes(to_cache_keys([CoordToken(0.5, 3)]), scheme=scheme)
    img_a = to_cache_keys([ImageToken(1 << 100, 2)])
    img_b = to_cache_keys([ImageToken((1 << 100) + 1, 2)])
    assert hashes(img_a, scheme=scheme) != hashes(img_b, scheme=scheme)


def test_extend_is_incremental() -> None:
    hasher = BlockHasher(SCHEME)
    grown: list[int] = []
    for upto in (3, 4, 9, 17, 17):
        hasher.extend(grown, KEYS, CacheNamespace(), upto)
        assert grown == hasher.hashes(KEYS[:upto], CacheNamespace())


def test_scheme_mismatch_is_refused_naming_the_fields() -> None:
    SCHEME.require_compatible(IdentityScheme(4, "smollm2-135m@r1"))
    with pytest.raises(IdentityMismatch, match="block_size: 4 != 16") as err:
        SCHEME.require_compatible(IdentityScheme(16, "other"))
    assert "model_revision" in str(err.value)
    with pytest.raises(IdentityMismatch, match="version"):
        SCHEME.require_compatible(IdentityScheme(4, "smollm2-135m@r1", IDENTITY_SCHEME_VERSION + 1))


_CHILD = """
import json, sys
from cache import BlockHasher, CacheNamespace, IdentityScheme, ImageToken, to_cache_keys
keys = to_cache_keys([*range(100, 110), ImageToken(1 << 90, 6), 5, 6])
ns = CacheNamespace(adapter="lora-a", tenant="acme", image_hash=12345)
print(json.dumps(BlockHasher(IdentityScheme(4, "rev")).hashes(keys, ns)))
"""


def test_other_processes_with_other_hash_seeds_compute_the_same_hashes() -> None:
    keys = to_cache_keys([*range(100, 110), ImageToken(1 << 90, 6), 5, 6])
    ns = CacheNamespace(adapter="lora-a", tenant="acme", image_hash=12345)
    here = BlockHasher(IdentityScheme(4, "rev")).hashes(keys, ns)
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, env=env
        )
        assert json.loads(out.stdout) == here


def test_scheme_version_2_is_frozen() -> None:
    """A golden vector: if this changes, so must IDENTITY_SCHEME_VERSION (routers would drift)."""
    assert IDENTITY_SCHEME_VERSION == 2
    got = hashes([1, 2, 3, 4], CacheNamespace(tenant="t"), IdentityScheme(4, "golden"))
    assert got == [GOLDEN]


GOLDEN = 12997290416692875406


def test_the_whole_id_range_hashes() -> None:
    top = (1 << 64) - 1  # a typed key's range reaches it
    assert hashes([top] * 4) != hashes([0] * 4)
    mixed = to_cache_keys([(1 << 63) - 1, 0, ImageToken(1, 2)])
    assert len(hashes(mixed)) == 1


def test_chains_of_several_blocks_are_frozen() -> None:
    """Golden chains of version 2 (XXH3 seeded by the parent): text-only and mixed spans."""
    scheme, ns = IdentityScheme(4, "golden"), CacheNamespace(tenant="t")
    assert hashes(list(range(1, 13)), ns, scheme) == [GOLDEN, *GOLDEN_TEXT_CHAIN]
    mixed = to_cache_keys([1, 2, 3, 4, ImageToken(7, 3), 9, (1 << 63) - 1, 0, 5])
    assert hashes(mixed, ns, scheme) == [GOLDEN, GOLDEN_MIXED_BLOCK]


GOLDEN_TEXT_CHAIN = [350180328271403658, 6004046551898577415]
GOLDEN_MIXED_BLOCK = 1316747425030059434


def test_version_2_is_xxh3_seeded_by_the_parent() -> None:
    """The definition, computed independently: a block's hash is XXH3-64 of its keys as
    little-endian uint64, seeded with the previous hash (the namespace seed for the first)."""
    xxhash = pytest.importorskip("xxhash")
    hasher = BlockHasher(IdentityScheme(4, "golden"))
    ns = CacheNamespace(tenant="t")
    parent = hasher.namespace_seed(ns)
    expected = []
    for block in ([1, 2, 3, 4], [5, 6, 7, 8]):
        raw = b"".join(k.to_bytes(8, "little") for k in block)
        parent = xxhash.xxh3_64_intdigest(raw, parent)
        expected.append(parent)
    assert hasher.hashes(list(range(1, 9)), ns) == expected


def test_a_typed_key_later_in_the_span_leaves_earlier_text_blocks_unchanged() -> None:
    """An image after text leaves the text blocks' hashes as they are without it, and adds
    blocks of its own."""
    text = hashes(KEYS[:16])
    with_image = to_cache_keys([*KEYS[:16], ImageToken(1 << 100, 4)])
    assert hashes(with_image)[:4] == text
    assert len(hashes(with_image)) == 5


@pytest.mark.parametrize("split", [0, 1, 2, 3, 4])
def test_extending_from_any_prefix_of_the_chain_gives_the_same_chain(split: int) -> None:
    keys = [*range(200, 232), *to_cache_keys([ImageToken(3, 8)])]  # 8 text, 2 image blocks
    full = hashes(keys)
    hasher = BlockHasher(SCHEME)
    assert hasher.extend(full[:split], keys, DEFAULT_NAMESPACE) == full
    assert hasher.extend(full[:split], keys, DEFAULT_NAMESPACE, upto=24) == full[:6]


def test_salting_and_chaining_hold_on_long_spans() -> None:
    keys = list(range(4096))
    base = hashes(keys)
    assert len(base) == len(set(base)) == 1024
    assert set(base).isdisjoint(hashes(keys, CacheNamespace(tenant="acme")))
    assert set(base).isdisjoint(hashes(keys, CacheNamespace(adapter="acme")))
    changed = [7, *keys[1:]]  # the first key differs: every block after it differs too
    assert all(a != b for a, b in zip(base, hashes(changed), strict=True))
