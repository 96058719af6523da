"""How many leading blocks of a prompt each worker holds, for all workers at once.

A worker's block set is prefix-closed: a radix tree evicts from the leaves, and a chained hash
names its whole prefix, so holding block i means holding blocks 0..i-1. The set of workers
holding block i therefore only shrinks as i grows, and the prompt's chain splits into runs of
equal holder masks. `prefix_groups` finds the ends of those runs by galloping (1, 2, 4, ...)
then bisecting, so it costs O(groups x log(matched blocks)) dictionary lookups, not O(blocks).
Must never be given sets that are not prefix-closed; on those it may report a longer match.
"""

from __future__ import annotations

LINEAR_UP_TO = 48
"""Chains up to this many blocks are walked block by block (cheaper than galloping there)."""


def prefix_groups(
    hashes: tuple[int, ...], confirmed: dict[int, int], pending: dict[int, int]
) -> list[tuple[int, int]]:
    """[(mask, depth)]: the workers in `mask` hold exactly `depth` (>= 1) leading blocks,
    by `confirmed` (the block index) or `pending` (unconfirmed routes). Deepest group last."""
    n = len(hashes)
    if n <= LINEAR_UP_TO:
        return _walk(hashes, confirmed, pending)
    get_c, get_p = confirmed.get, pending.get

    def holders(i: int) -> int:
        block = hashes[i]
        return get_c(block, 0) | get_p(block, 0)

    alive = holders(0)
    groups: list[tuple[int, int]] = []
    start = 0
    while alive:
        # the run [start, end) is held by every worker in `alive`; find `end`
        good, step = start, 1
        while good + step < n and holders(good + step) & alive == alive:
            good += step
            step *= 2
        bad = min(good + step, n)
        while bad - good > 1:
            mid = (good + bad) // 2
            if holders(mid) & alive == alive:
                good = mid
            else:
                bad = mid
        end = good + 1
        if end == n:
            groups.append((alive, n))
            return groups
        still = holders(end) & alive
        groups.append((alive & ~still, end))
        alive, start = still, end
    return groups


def _walk(
    hashes: tuple[int, ...], confirmed: dict[int, int], pending: dict[int, int]
) -> list[tuple[int, int]]:
    """`prefix_groups` by one walk down the chain, narrowing the mask at every block."""
    groups: list[tuple[int, int]] = []
    get_c, get_p = confirmed.get, pending.get
    alive = -1
    for depth, block in enumerate(hashes):
        held = (get_c(block, 0) | get_p(block, 0)) & alive
        if held != alive:
            if depth:
                groups.append((alive & ~held, depth))
            if not held:
                return groups
            alive = held
    if hashes:
        groups.append((alive, len(hashes)))
    return groups
