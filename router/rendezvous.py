"""Rendezvous (highest-random-weight) hashing: the same key always prefers the same worker.

Each worker gets a stable 64-bit seed (blake2b of its id, never Python's salted `hash()`); a key's
weight on a worker is a 64-bit mix of key and seed, and the heaviest worker wins. Removing a
worker moves only the keys it held; adding one takes about 1/N of the keys. Must never depend on
the process, the order workers joined, or anything but the key and the worker ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from hashlib import blake2b

_MASK = (1 << 64) - 1
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def worker_seed(worker: str) -> int:
    """The worker's stable 64-bit seed."""
    digest = blake2b(worker.encode("utf-8"), digest_size=8, person=b"radixmesh-rdv")
    return int.from_bytes(digest.digest(), "little")


def weight(key: int, seed: int) -> int:
    """The splitmix64 finaliser of key ^ seed: a well-mixed 64-bit weight."""
    z = (key ^ seed) & _MASK
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def best(key: int, seeds: Iterable[tuple[int, str]]) -> str:
    """The worker of highest weight for `key` among (seed, worker) pairs (ties: larger id)."""
    return max((weight(key, seed), worker) for seed, worker in seeds)[1]
