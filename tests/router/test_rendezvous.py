"""Rendezvous hashing: stable across processes, minimal movement when membership changes."""

from __future__ import annotations

import subprocess
import sys

from router.rendezvous import best, weight, worker_seed

WORKERS = [f"w{i}" for i in range(8)]


def owner(key: int, workers: list[str]) -> str:
    return best(key, ((worker_seed(w), w) for w in workers))


def test_stable_across_processes() -> None:
    code = "from router.rendezvous import weight, worker_seed; print(weight(42, worker_seed('w3')))"
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            env={"PYTHONHASHSEED": seed, "PYTHONPATH": "."},
            check=True,
        ).stdout
        for seed in ("0", "1", "random")
    }
    assert runs == {f"{weight(42, worker_seed('w3'))}\n"}


def test_removing_a_worker_moves_only_its_keys_and_load_spreads() -> None:
    keys = range(4000)
    before = {k: owner(k, WORKERS) for k in keys}
    after = {k: owner(k, [w for w in WORKERS if w != "w5"]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "w5")
    counts = [sum(1 for k in keys if before[k] == w) for w in WORKERS]
    assert min(counts) > 350 and max(counts) < 650
