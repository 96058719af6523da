"""prefix_groups: galloping over long chains agrees with the block-by-block walk."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.block_index import BlockIndex
from router.prefix_match import LINEAR_UP_TO, _walk, prefix_groups

CHAIN = tuple(range(1000, 1300))


@st.composite
def prefix_closed(draw: st.DrawFn) -> tuple[tuple[int, ...], dict[int, int], dict[int, int]]:
    """A chain and, per worker, a held prefix of it (split between confirmed and pending)."""
    n = draw(st.integers(0, len(CHAIN)))
    chain = CHAIN[:n]
    confirmed: dict[int, int] = {}
    pending: dict[int, int] = {}
    for bit in range(draw(st.integers(1, 9))):
        depth = draw(st.integers(0, n))
        split = draw(st.integers(0, depth))
        for i in range(depth):
            target = confirmed if i < split else pending
            target[chain[i]] = target.get(chain[i], 0) | 1 << bit
    return chain, confirmed, pending


@given(prefix_closed())
def test_gallop_equals_walk(case: tuple[tuple[int, ...], dict[int, int], dict[int, int]]) -> None:
    chain, confirmed, pending = case
    assert prefix_groups(chain, confirmed, pending) == _walk(chain, confirmed, pending)


def test_groups_read_as_exact_depths() -> None:
    chain = CHAIN[: LINEAR_UP_TO * 3]
    confirmed = {b: 0b001 for b in chain[:10]}
    for b in chain[:100]:
        confirmed[b] = confirmed.get(b, 0) | 0b010
    pending = {b: 0b100 for b in chain}
    assert prefix_groups(chain, confirmed, pending) == [(0b001, 10), (0b010, 100), (0b100, 144)]
    assert prefix_groups(chain, {}, {}) == []
    assert prefix_groups((), confirmed, pending) == []


@given(prefix_closed())
def test_index_depth_equals_the_walk(
    case: tuple[tuple[int, ...], dict[int, int], dict[int, int]],
) -> None:
    chain, confirmed, _ = case
    index = BlockIndex()
    index.holders = confirmed
    for bit in range(9):
        walked = next((i for i, b in enumerate(chain) if not confirmed.get(b, 0) >> bit & 1), None)
        assert index.depth(bit, chain) == (len(chain) if walked is None else walked)
