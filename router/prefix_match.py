"""How many leading blocks of a prompt each worker holds, for all workers in one walk.

Workers' block sets are prefix-closed (a radix tree evicts leaves first, and a chained hash
names its whole prefix), so walking the prompt's hashes while narrowing a mask of workers that
still hold every block so far finds each worker's match length: a worker drops out of the mask
at the first block it lacks. The walk stops when the mask is empty. O(matched blocks).
"""

from __future__ import annotations


def prefix_groups(
    hashes: tuple[int, ...], confirmed: dict[int, int], pending: dict[int, int]
) -> list[tuple[int, int]]:
    """[(mask, depth)]: the workers in `mask` hold exactly `depth` (>= 1) leading blocks,
    by `confirmed` (the block index) or `pending` (unconfirmed routes). Deepest group last."""
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
