"""Cache identity: the one block hash that workers, KV events and the router all compute.

A block is `block_size` consecutive KV positions. Its hash is a 64-bit XXH3 of the block's
position keys (cache/tokens.py: 64-bit keys, little-endian), seeded with its parent block's
hash, so each hash names the whole prefix up to its block. The chain starts from a namespace
seed: a blake2b digest of the scheme version, the model revision, the adapter, the tenant salt
and the namespace image hash. XXH3's output is frozen by its specification and blake2b is a
standard, so every process, every restart and every machine computes the same values; Python's
`hash()` is never used (it is salted per process). Workers and router exchange their
`IdentityScheme` when they meet and refuse a mismatch rather than drift apart silently.

Version history: 1 hashed each block with blake2b over `parent digest | tag | keys`, typed keys
as tagged tuples; 2 (this one) hashes the packed keys with XXH3 seeded by the parent, one C call
a block, and the keys hashed are the uint64 keys of cache/tokens.py. A router and workers of
different versions refuse each other (the version is part of the scheme they exchange), so a
cluster moves from 1 to 2 by restarting its router and workers on the new release together;
a worker's saved cache keeps its nodes' block hashes in its manifest, and a manifest of another
scheme version, model revision or block size is refused whole (worker/kv_persistence.py).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

from xxhash import xxh3_64_intdigest

from cache.errors import IdentityMismatch
from cache.namespace import CacheNamespace
from cache.tokens import CacheKey, as_keys, has_typed_keys

IDENTITY_SCHEME_VERSION = 2
_DIGEST = 8
_PERSON = b"radixmesh-kv"


@dataclass(frozen=True, slots=True)
class IdentityScheme:
    block_size: int
    model_revision: str
    version: int = IDENTITY_SCHEME_VERSION

    def require_compatible(self, other: IdentityScheme) -> None:
        """Raise `IdentityMismatch` naming every field on which `other` differs."""
        diffs = [
            f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}"
            for name in ("version", "block_size", "model_revision")
            if getattr(self, name) != getattr(other, name)
        ]
        if diffs:
            raise IdentityMismatch("cache identity schemes differ: " + "; ".join(diffs))


def _field(value: str | int | None) -> bytes:
    """Length-prefixed, type-tagged encoding, so no two field tuples encode alike."""
    if value is None:
        return b"n"
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return b"s" + len(raw).to_bytes(4, "little") + raw
    raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"i" + len(raw).to_bytes(1, "little") + raw


def pack_keys(keys: Sequence[CacheKey]) -> bytes:
    """`keys` as little-endian uint64 bytes (an `array("Q")` is read as it is)."""
    packed = as_keys(keys)
    if sys.byteorder == "big":
        packed = array("Q", packed)
        packed.byteswap()
    return packed.tobytes()


class BlockHasher:
    """Computes chained block hashes under one `IdentityScheme`."""

    def __init__(self, scheme: IdentityScheme) -> None:
        if scheme.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {scheme.block_size}")
        self.scheme = scheme
        self.block_size = scheme.block_size
        self._seeds: dict[CacheNamespace, int] = {}

    def namespace_seed(self, namespace: CacheNamespace) -> int:
        """The hash every chain in `namespace` starts from."""
        seed = self._seeds.get(namespace)
        if seed is None:
            fields: tuple[str | int | None, ...] = (
                self.scheme.version,
                self.scheme.model_revision,
                namespace.adapter,
                namespace.tenant,
                namespace.image_hash,
            )
            if namespace.salt is not None:  # unsalted chains keep the hashes they had
                fields += (namespace.salt,)
            digest = blake2b(
                b"".join(_field(f) for f in fields), digest_size=_DIGEST, person=_PERSON
            ).digest()
            seed = int.from_bytes(digest, "little")
            if len(self._seeds) > 4096:
                self._seeds.clear()
            self._seeds[namespace] = seed
        return seed

    def extend(
        self,
        hashes: list[int],
        keys: Sequence[CacheKey],
        namespace: CacheNamespace,
        upto: int | None = None,
    ) -> list[int]:
        """Append to `hashes` the hashes of the complete blocks of `keys[:upto]` it lacks.

        The span is packed once (one C call, none for an `array("Q")`); each block is then
        one XXH3 call over its slice of the bytes, seeded with the hash before it.
        """
        size = self.block_size
        first = len(hashes)
        end = (len(keys) if upto is None else min(upto, len(keys))) // size
        if first >= end:
            return hashes
        parent = hashes[-1] if hashes else self.namespace_seed(namespace)
        packed = pack_keys(keys[first * size : end * size])
        append = hashes.append
        step = size * 8
        for off in range(0, len(packed), step):
            parent = xxh3_64_intdigest(packed[off : off + step], parent)
            append(parent)
        return hashes

    def accepts(
        self,
        chain: Sequence[int],
        keys: Sequence[CacheKey],
        namespace: CacheNamespace,
        *,
        text: bool = False,
    ) -> bool:
        """Whether `chain`, computed elsewhere (the router hashes each prompt to route it), may
        stand for the hashes of the first `len(chain)` blocks of `keys`: those blocks are all
        text (the router hashes token ids and knows nothing of images), and the first and the
        last of them hash here as given, so a wrong namespace, scheme or token at either end
        shows. A middle block is not rehashed: that would cost what taking the chain saves.

        `text`: the caller made `keys` from token ids with `to_cache_keys`, which refuses an id
        with the top bit set, so none is typed and the scan for typed keys (a pass over every
        key) is skipped."""
        size = self.block_size
        end = len(chain) * size
        if not chain or end > len(keys):
            return False
        keys = as_keys(keys if isinstance(keys, array) else keys[:end])  # only the head is read
        if not text and has_typed_keys(keys, end):
            return False
        if xxh3_64_intdigest(pack_keys(keys[:size]), self.namespace_seed(namespace)) != chain[0]:
            return False
        return len(chain) == 1 or (
            xxh3_64_intdigest(pack_keys(keys[end - size : end]), chain[-2]) == chain[-1]
        )

    def hashes(self, keys: Sequence[CacheKey], namespace: CacheNamespace) -> list[int]:
        """Hashes of every complete block of `keys`, from the first."""
        return self.extend([], keys, namespace)
