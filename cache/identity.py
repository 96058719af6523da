"""Cache identity: the one block hash that workers, KV events and the router all compute.

A block is `block_size` consecutive KV positions. Its hash chains

    parent block hash | the block's position keys (image content hashes included)

and the chain starts from a namespace seed that digests the scheme version, the model revision,
the adapter, the tenant salt and the namespace image hash. The digest is blake2b (8 bytes), so
every process, every restart and every machine computes the same value; Python's `hash()` is
never used (it is salted per process). Workers and router exchange their `IdentityScheme` when
they meet and refuse a mismatch rather than drift apart silently.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

from cache.errors import IdentityMismatch
from cache.namespace import CacheNamespace
from cache.tokens import CacheKey

IDENTITY_SCHEME_VERSION = 1
_DIGEST = 8
_PERSON = b"radixmesh-kv"
_TEXT_BLOCK = b"T"
_MIXED_BLOCK = b"M"
_BLOCK_DIGEST = blake2b(digest_size=_DIGEST, person=_PERSON)
"""Empty block digest; each block hashes into a `copy()` (cheaper than a new keyed object)."""


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


def _pack_text(keys: Sequence[CacheKey]) -> bytes | None:
    """`keys` as little-endian uint64 bytes, or None if any key is not a plain int."""
    try:
        packed = array("Q", keys)  # type: ignore[type-var]  # TypeError on tuple keys
    except TypeError:
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _encode_block(keys: Sequence[CacheKey]) -> bytes:
    packed = _pack_text(keys)
    if packed is not None:
        return _TEXT_BLOCK + packed
    parts = [_MIXED_BLOCK]
    for key in keys:
        if isinstance(key, int):
            parts.append(b"t" + key.to_bytes(8, "little"))
        else:
            parts.append(b"k" + len(key).to_bytes(1, "little"))
            parts.extend(_field(v) for v in key)
    return b"".join(parts)


class BlockHasher:
    """Computes chained block hashes under one `IdentityScheme`."""

    def __init__(self, scheme: IdentityScheme) -> None:
        if scheme.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {scheme.block_size}")
        self.scheme = scheme
        self.block_size = scheme.block_size
        self._seeds: dict[CacheNamespace, bytes] = {}

    def namespace_seed(self, namespace: CacheNamespace) -> int:
        """The hash every chain in `namespace` starts from."""
        return int.from_bytes(self._seed(namespace), "little")

    def _seed(self, namespace: CacheNamespace) -> bytes:
        seed = self._seeds.get(namespace)
        if seed is None:
            fields = (
                self.scheme.version,
                self.scheme.model_revision,
                namespace.adapter,
                namespace.tenant,
                namespace.image_hash,
            )
            seed = blake2b(
                b"".join(_field(f) for f in fields), digest_size=_DIGEST, person=_PERSON
            ).digest()
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

        Text keys are packed once for the whole span (one C call), then each block is one
        blake2b over `parent digest | b"T" | its packed bytes`; the digests are turned into ints
        together at the end.
        """
        size = self.block_size
        first = len(hashes)
        end = (len(keys) if upto is None else min(upto, len(keys))) // size
        if first >= end:
            return hashes
        parent = hashes[-1].to_bytes(_DIGEST, "little") if hashes else self._seed(namespace)
        new_block = _BLOCK_DIGEST.copy
        digests = bytearray()
        packed = _pack_text(keys[first * size : end * size])
        if packed is not None:
            step = size * 8
            for off in range(0, len(packed), step):
                digest = new_block()
                digest.update(parent + _TEXT_BLOCK + packed[off : off + step])
                parent = digest.digest()
                digests += parent
        else:  # image, coordinate or size keys somewhere in the span: encode block by block
            for b in range(first, end):
                digest = new_block()
                digest.update(parent + _encode_block(keys[b * size : (b + 1) * size]))
                parent = digest.digest()
                digests += parent
        values = array("Q", digests)
        if sys.byteorder == "big":
            values.byteswap()
        hashes.extend(values.tolist())
        return hashes

    def hashes(self, keys: Sequence[CacheKey], namespace: CacheNamespace) -> list[int]:
        """Hashes of every complete block of `keys`, from the first."""
        return self.extend([], keys, namespace)
