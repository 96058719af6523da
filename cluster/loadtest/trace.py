"""Mooncake-format traces (FAST'25): reading them and expanding hash ids into token blocks.

Every hash id becomes one block of `block_tokens` token ids drawn from a PRNG seeded by the id,
so equal ids give equal blocks and real prefix sharing; a prompt's last block is cut to its
(scaled) input length. The trace's 512-token blocks scale to `block_tokens` tokens (32 by
default: 1/16), and lengths with them. The trace file lies beside the checkout
(../shared/traces) or at $RADIXMESH_TRACE_DIR.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK = 512
TRACE_DIR = Path(
    os.environ.get("RADIXMESH_TRACE_DIR", Path(__file__).resolve().parents[3] / "shared" / "traces")
)
MOONCAKE_TRACE = TRACE_DIR / "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(ValueError):
    """A trace line that is not a Mooncake record."""


def parse_record(line: str) -> TraceRecord:
    raw = json.loads(line)
    hash_ids = raw["hash_ids"]
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
        raise TypeError("hash_ids is not a list of integers")
    timestamp, prompt, output = raw["timestamp"], raw["input_length"], raw["output_length"]
    return TraceRecord(float(timestamp), int(prompt), int(output), tuple(hash_ids))


def read_trace(path: Path = MOONCAKE_TRACE, limit: int | None = None) -> Iterator[TraceRecord]:
    """The first `limit` records (blank lines skipped); a TraceError names the first line that
    is not a record."""
    count = 0
    with path.open() as f:
        for number, line in enumerate(f, start=1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            try:
                record = parse_record(line)
            except (ValueError, KeyError, TypeError) as err:
                problem = f"no {err} field" if isinstance(err, KeyError) else str(err)
                raise TraceError(f"the trace {path}, line {number}: {problem}") from err
            count += 1
            yield record


class BlockExpander:
    """Hash id -> `block_tokens` deterministic token ids in [0, vocab) (memoised)."""

    def __init__(self, block_tokens: int, vocab: int = 49_152) -> None:
        if block_tokens < 1 or vocab < 2:
            raise ValueError(f"need block_tokens >= 1 and vocab >= 2, got {block_tokens}, {vocab}")
        self.block_tokens = block_tokens
        self.vocab = vocab
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        block = self._blocks.get(hash_id)
        if block is None:
            rng = random.Random(hash_id)
            block = [rng.randrange(self.vocab) for _ in range(self.block_tokens)]
            self._blocks[hash_id] = block
        return block

    def prompt(self, hash_ids: tuple[int, ...] | list[int], length: int) -> list[int]:
        """The first `length` tokens of the concatenated blocks of `hash_ids`."""
        tokens: list[int] = []
        for hash_id in hash_ids:
            if len(tokens) >= length:
                break
            tokens.extend(self.block(hash_id))
        return tokens[:length]

    def scaled(self, length: int) -> int:
        """A trace length (tokens, as the trace counts them: 512 to a block) in this expansion's
        tokens, `block_tokens` to a block (at least 1)."""
        return max(1, round(length * self.block_tokens / MOONCAKE_BLOCK))
