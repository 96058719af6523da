"""Token types and the cache keys they expand to: one 64-bit key per KV position.

A plain text token's key is its id (the fast path: a prompt of ids is its own key array). Every
other type expands to keys with the top bit set and its type's tag in the next two bits, so no
typed key equals a text id (ids are below 2^63) and keys of different types never collide; the
61 bits left hold a coord's or a size's bins exactly, and an image position's index added to its
image's base, a 61-bit blake2b digest of the image's content hash and length:

    TextToken(id)                    -> id                                   1 position
    CoordToken(pos, bin)             -> typed(COORD, bin)                    1 position
    SizeToken(w, h, w_bin, h_bin)    -> typed(SIZE, w_bin, h_bin)            1 position
    ImageToken(content_hash, n)      -> typed(IMAGE, hash, n, 0) ... typed(IMAGE, hash, n, n-1)

Keys travel as `array("Q")`: the tree slices and compares them with memcmp, and the block
hasher reads their bytes without packing them again.

Expanding an image into its positions keeps the tree, the page table and the block hashes in one
unit (KV positions). A cached prefix may end inside an image: the KV of an image position depends
only on the whole image, so the worker recomputes the rest of it from the image's embeddings.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from hashlib import blake2b
from numbers import Integral
from typing import TypeAlias

import numpy as np

from cache.errors import InvalidToken, UnknownTokenType

CacheKey: TypeAlias = int
Keys: TypeAlias = "array[int]"
"""One key per position, typecode "Q"."""
TEXT_ID_LIMIT = 1 << 63
"""Text ids lie in [0, 2^63); typed keys have the top bit set."""
_TYPED = 1 << 63
_PAYLOAD = (1 << 61) - 1

COORD = 1
SIZE = 2
IMAGE = 3
_BIN_BITS = 10
_BINS = 1 << _BIN_BITS
_HASH_BITS = 128
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(frozen=True, slots=True)
class TextToken:
    token_id: int


@dataclass(frozen=True, slots=True)
class CoordToken:
    pos: float
    """The continuous value, used for the embedding and ignored by the cache."""
    bin: int


@dataclass(frozen=True, slots=True)
class SizeToken:
    width: float
    height: float
    width_bin: int
    height_bin: int


@dataclass(frozen=True, slots=True)
class ImageToken:
    content_hash: int
    """First 128 bits of the SHA-256 of the image bytes, as an int."""
    kv_length: int
    """KV positions the image occupies (729 for a SigLIP 27x27 grid)."""


CacheToken: TypeAlias = int | TextToken | CoordToken | SizeToken | ImageToken


def _check_bin(name: str, value: object) -> int:
    if type(value) is not int or not 0 <= value < _BINS:
        raise InvalidToken(f"{name} must be an int in [0, {_BINS}), got {value!r}")
    return value


def typed_key(tag: int, *fields: int) -> CacheKey:
    """The key of a non-text position: the top bit, the type's tag in the next two bits, then
    61 bits of payload. A coord's bin and a size's two bins fit there exactly; an image
    position's payload is its image's base (61 bits of a blake2b digest of the content hash and
    the length) plus its index. So keys of different types never collide, coord and size keys
    never at all, and the positions of two images only if their bases land within their lengths
    of each other (about n / 2^60 for a pair of n-position images)."""
    if tag == COORD:
        (bin_,) = fields
        return _TYPED | COORD << 61 | _check_bin("CoordToken.bin", bin_)
    if tag == SIZE:
        width, height = fields
        width = _check_bin("SizeToken.width_bin", width)
        return _TYPED | SIZE << 61 | width << _BIN_BITS | _check_bin("SizeToken.height_bin", height)
    if tag == IMAGE:
        content_hash, length, index = fields
        if not 0 <= index < length:
            raise InvalidToken(f"image position {index} is outside its {length} positions")
        return _image_key(_image_base(content_hash, length), index)
    raise ValueError(f"unknown typed key tag {tag}")


def _image_key(base: int, index: int) -> CacheKey:
    return _TYPED | IMAGE << 61 | (base + index) & _PAYLOAD


def _image_base(content_hash: int, length: int) -> int:
    """61 bits of blake2b over the image's content hash and KV length: a preimage for a given
    image costs about 2^61 digests, so one tenant's crafted image cannot take another's keys."""
    raw = content_hash.to_bytes(16, "little") + length.to_bytes(8, "little")
    return int.from_bytes(blake2b(raw, digest_size=8, person=b"radixmesh-img").digest(), "little")


def _image_keys(token: ImageToken) -> list[CacheKey]:
    h, n = token.content_hash, token.kv_length
    if type(h) is not int or not 0 <= h < 1 << _HASH_BITS:
        raise InvalidToken(f"ImageToken.content_hash must be a 128-bit int, got {h!r}")
    if type(n) is not int or n < 1:
        raise InvalidToken(f"ImageToken.kv_length must be a positive int, got {n!r}")
    base = _image_base(h, n)
    return [_image_key(base, i) for i in range(n)]


def _keys_of(token: object) -> list[CacheKey]:
    if isinstance(token, Integral) and not isinstance(token, bool):
        token = int(token)
    if type(token) is int:
        if not 0 <= token < TEXT_ID_LIMIT:
            raise InvalidToken(f"token ids are non-negative ints below 2^63, got {token}")
        return [token]
    if isinstance(token, TextToken):
        return _keys_of(token.token_id)
    if isinstance(token, CoordToken):
        return [typed_key(COORD, token.bin)]
    if isinstance(token, SizeToken):
        return [typed_key(SIZE, token.width_bin, token.height_bin)]
    if isinstance(token, ImageToken):
        return _image_keys(token)
    raise UnknownTokenType(
        f"cannot cache a token of type {type(token).__name__} ({token!r}); expected an int id, "
        "TextToken, CoordToken, SizeToken or ImageToken"
    )


def as_keys(keys: Sequence[CacheKey]) -> Keys:
    """`keys` as an `array("Q")` (as given when it is one already)."""
    if type(keys) is array and keys.typecode == "Q":
        return keys
    return array("Q", keys)


_NUMPY_FROM = 2048
"""Keys from which numpy's min (a fixed ~2 us a call) beats slicing out their top bytes."""


def has_typed_keys(keys: Keys, end: int | None = None) -> bool:
    """Whether any of the first `end` keys (all of them: None) has the top bit set (a typed
    key, or an id of 2^63 or more). Below `_NUMPY_FROM` keys, the most significant byte of each
    key (every 8th byte from the 8th in little-endian order) is sliced out and checked for a
    byte of 128 or more by `isascii`; above, one numpy pass over the array's memory, copying
    nothing."""
    if end is not None and end < 0:
        raise ValueError(f"end counts keys from the first: got {end}")
    count = len(keys) if end is None else min(end, len(keys))
    if count == 0:
        return False
    if count < _NUMPY_FROM and _LITTLE_ENDIAN:
        head = keys if count == len(keys) else keys[:count]
        return not head.tobytes()[7::8].isascii()
    return bool(np.minimum.reduce(np.frombuffer(keys, dtype=np.int64, count=count)) < 0)


def to_cache_keys(tokens: Iterable[CacheToken]) -> Keys:
    """Expand tokens into one cache key per KV position, validating each.

    A sequence of plain integer ids (int, numpy integers) is checked and converted at C speed.
    """
    if type(tokens) is array and tokens.typecode == "Q":
        keys = array("Q", tokens)
    else:
        tokens = tokens if isinstance(tokens, list) else list(tokens)
        try:  # unsigned: a negative id or a non-int raises here, at C speed
            keys = array("Q", tokens)  # type: ignore[arg-type]
        except (TypeError, OverflowError):
            keys = array("Q")
            for token in tokens:
                keys.extend(_keys_of(token))
            return keys
    if has_typed_keys(keys):  # from ids: an id of 2^63 or more
        bad = next(k for k in keys if k >= TEXT_ID_LIMIT)
        raise InvalidToken(f"token ids are non-negative ints below 2^63, got {bad}")
    return keys
