"""Token types expand to one non-colliding 64-bit key per KV position; bad tokens get typed
errors."""

from __future__ import annotations

from array import array

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cache import (
    CoordToken,
    ImageToken,
    InvalidToken,
    SizeToken,
    TextToken,
    UnknownTokenType,
    to_cache_keys,
)
from cache.tokens import COORD, IMAGE, SIZE, TEXT_ID_LIMIT, has_typed_keys, typed_key


def test_plain_ids_are_their_own_keys() -> None:
    ids = [5, 0, 49151, 7]
    keys = to_cache_keys(ids)
    assert keys.typecode == "Q" and keys.tolist() == ids
    assert to_cache_keys(np.array(ids, dtype=np.int64)).tolist() == ids
    assert to_cache_keys(np.array(ids, dtype=np.int32)).tolist() == ids
    assert to_cache_keys(keys) == keys and to_cache_keys(keys) is not keys  # a copy


def test_each_type_has_its_own_tagged_key() -> None:
    keys = to_cache_keys(
        [TextToken(3), CoordToken(0.25, 3), SizeToken(0.5, 0.5, 3, 3), ImageToken(3, 2)]
    )
    expected = [3, typed_key(COORD, 3), typed_key(SIZE, 3, 3)]
    expected += [typed_key(IMAGE, 3, 2, 0), typed_key(IMAGE, 3, 2, 1)]
    assert keys.tolist() == expected
    assert len(set(keys)) == len(keys)
    assert all(k >= TEXT_ID_LIMIT for k in keys[1:]), "typed keys have the top bit set"


def test_typed_keys_depend_on_every_field_and_on_the_tag() -> None:
    base = typed_key(IMAGE, 3, 2, 0)
    others = [typed_key(IMAGE, 4, 2, 0), typed_key(IMAGE, 3, 3, 0), typed_key(IMAGE, 3, 2, 1)]
    others += [typed_key(SIZE, 3, 2), typed_key(COORD, 3)]
    assert base not in others and len(set(others)) == len(others)
    assert typed_key(IMAGE, 1, 23, 0) != typed_key(IMAGE, 12, 3, 0)


def test_typed_keys_refuse_fields_they_cannot_hold() -> None:
    with pytest.raises(InvalidToken, match=r"SizeToken\.height_bin"):
        typed_key(SIZE, 0, 1024)  # would read as (1, 0) if unchecked
    with pytest.raises(InvalidToken, match=r"CoordToken\.bin"):
        typed_key(COORD, 1 << 62)  # would spill into the tag bits
    with pytest.raises(InvalidToken, match="outside its 4 positions"):
        typed_key(IMAGE, 7, 4, 4)


def test_an_images_positions_are_consecutive_keys_from_its_base() -> None:
    keys = to_cache_keys([ImageToken(99, 5)])
    assert [(k - keys[0]) % (1 << 61) for k in keys] == [0, 1, 2, 3, 4]  # mod: a base may wrap
    assert {k >> 61 for k in keys} == {4 | IMAGE}
    assert list(keys) == [typed_key(IMAGE, 99, 5, i) for i in range(5)]


def test_types_never_collide_and_coord_and_size_keys_are_exact() -> None:
    """The top bit marks a typed key and the next two bits its type; a coord's bin and a size's
    bins are the payload itself, so distinct ones never share a key."""
    coords = {typed_key(COORD, b) for b in range(1024)}
    sizes = {typed_key(SIZE, w, h) for w in range(0, 1024, 7) for h in range(0, 1024, 11)}
    images = {typed_key(IMAGE, 5, 9, i) for i in range(9)}
    assert len(coords) == 1024 and len(sizes) == 147 * 94 and len(images) == 9
    for keys, tag in ((coords, COORD), (sizes, SIZE), (images, IMAGE)):
        assert {k >> 61 for k in keys} == {4 | tag}
    assert typed_key(SIZE, 3, 5) == (1 << 63) | SIZE << 61 | 3 << 10 | 5


def test_coord_and_size_keys_ignore_the_continuous_values() -> None:
    assert to_cache_keys([CoordToken(0.1, 7)]) == to_cache_keys([CoordToken(0.9, 7)])
    assert to_cache_keys([SizeToken(0.1, 0.2, 4, 5)]) == to_cache_keys([SizeToken(9, 9, 4, 5)])


def test_image_expands_to_its_kv_length() -> None:
    keys = to_cache_keys([1, ImageToken(0xFFFF, 729), 2])
    assert len(keys) == 731
    assert keys[1] == typed_key(IMAGE, 0xFFFF, 729, 0)
    assert keys[729] == typed_key(IMAGE, 0xFFFF, 729, 728)
    other = to_cache_keys([1, ImageToken(0xFFFE, 729), 2])
    assert keys[1:730] != other[1:730]
    longer = to_cache_keys([1, ImageToken(0xFFFF, 730), 2])
    assert set(keys[1:730]).isdisjoint(longer[1:731])


@pytest.mark.parametrize(
    ("token", "error", "words"),
    [
        (-1, InvalidToken, "non-negative"),
        (1 << 64, InvalidToken, "below 2\\^63"),
        (1 << 63, InvalidToken, "below 2\\^63"),
        (TextToken(-3), InvalidToken, "non-negative"),
        (1.5, UnknownTokenType, "float"),
        ("hello", UnknownTokenType, "str"),
        (None, UnknownTokenType, "NoneType"),
        (CoordToken(0.5, 1024), InvalidToken, "CoordToken.bin"),
        (SizeToken(0.5, 0.5, 1, -1), InvalidToken, "SizeToken.height_bin"),
        (ImageToken(1, 0), InvalidToken, "kv_length"),
        (ImageToken(-1, 4), InvalidToken, "content_hash"),
        (ImageToken(1 << 128, 4), InvalidToken, "content_hash"),
    ],
)
def test_bad_tokens_raise_typed_errors_naming_the_problem(
    token: object, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        to_cache_keys([1, 2, token])  # type: ignore[list-item]


_tokens = st.one_of(
    st.integers(0, 1 << 40),
    st.builds(CoordToken, st.floats(0, 1), st.integers(0, 1023)),
    st.builds(
        SizeToken, st.floats(0, 1), st.floats(0, 1), st.integers(0, 1023), st.integers(0, 1023)
    ),
    st.builds(ImageToken, st.integers(0, (1 << 128) - 1), st.integers(1, 40)),
)


@given(st.lists(_tokens, max_size=30))
def test_one_key_per_position_and_equal_tokens_give_equal_keys(tokens: list[object]) -> None:
    keys = to_cache_keys(tokens)  # type: ignore[arg-type]
    assert len(keys) == sum(t.kv_length if isinstance(t, ImageToken) else 1 for t in tokens)
    assert keys == to_cache_keys(list(tokens))  # type: ignore[arg-type]
    texts = [t for t in tokens if isinstance(t, int)]
    assert [k for k in keys if k < TEXT_ID_LIMIT] == texts, "only text ids are below 2^63"


def test_negative_ids_are_refused_from_lists_and_arrays_alike() -> None:
    with pytest.raises(InvalidToken, match="got -7"):
        to_cache_keys([3, -7, 4])
    with pytest.raises(InvalidToken, match="got -7"):
        to_cache_keys(np.array([3, -7, 4]))
    assert to_cache_keys([TEXT_ID_LIMIT - 1]).tolist() == [TEXT_ID_LIMIT - 1]
    with pytest.raises(InvalidToken, match=f"got {TEXT_ID_LIMIT}"):
        to_cache_keys([TEXT_ID_LIMIT])  # fits the array, refused by the range check
    with pytest.raises(InvalidToken, match="below 2"):
        to_cache_keys([1 << 64])


@given(
    st.integers(0, 5000),
    st.one_of(st.none(), st.integers(0, 5000)),
    st.one_of(st.none(), st.integers(0, 5000)),
)
def test_has_typed_keys_finds_a_top_bit_anywhere_before_the_end(
    length: int, typed_at: int | None, end: int | None
) -> None:
    """Both ways of looking (the keys' top bytes below 2,048 keys, numpy above) agree with a
    plain scan, wherever the typed key sits and wherever `end` cuts."""
    keys = array("Q", range(7, 7 + length))
    if typed_at is not None and typed_at < length:
        keys[typed_at] = typed_key(COORD, typed_at % 1024)
    want = any(k >= TEXT_ID_LIMIT for k in keys[:end])
    assert has_typed_keys(keys, end) is want


def test_has_typed_keys_counts_end_from_the_first_key() -> None:
    with pytest.raises(ValueError, match="from the first"):
        has_typed_keys(array("Q", [typed_key(COORD, 1)]), -1)
