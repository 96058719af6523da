"""Seeded request streams for the cache and router benchmarks, and the Mooncake trace replay.

Each request is a prompt of token ids and the tokens a model will generate for it. Everything is
derived from a seed, so two runs (and two implementations in one run) see the same stream.

Mooncake trace expansion (../shared/traces/README.md): every hash id becomes one block of
`block_tokens` token ids drawn from a PRNG seeded by the id, so equal ids give equal blocks and
real prefix sharing; a prompt's last block is cut to its (scaled) input length. The trace's
512-token blocks scale to `block_tokens` (32 by default, 1/16), lengths with them. The trace is
read from ../shared/traces beside the checkout, or from $RADIXMESH_TRACE_DIR.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

VOCAB = 49_152
MOONCAKE_BLOCK = 512
TRACE_PATH = Path(
    os.environ.get("RADIXMESH_TRACE_DIR", Path(__file__).resolve().parents[2] / "shared" / "traces")
)
MOONCAKE_TRACE = TRACE_PATH / "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output: list[int]
    tenant: str | None = None
    arrival_ms: float = 0.0


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def shared_prefix(
    seed: int = 0, n: int = 4000, prompts: int = 8, prompt_len: int = 1024
) -> list[Request]:
    """K system prompts, each followed by short distinct questions."""
    rng = random.Random(seed)
    systems = [_tokens(rng, prompt_len) for _ in range(prompts)]
    return [
        Request(rng.choice(systems) + _tokens(rng, rng.randint(16, 128)), _tokens(rng, 32))
        for _ in range(n)
    ]


def multi_turn(seed: int = 0, conversations: int = 200, turns: int = 6) -> list[Request]:
    """Chats whose every turn resends the whole history, the previous answers included.

    Turns of different conversations interleave (round robin), as they would on a server.
    """
    rng = random.Random(seed)
    histories = [_tokens(rng, rng.randint(32, 128)) for _ in range(conversations)]
    requests = []
    for _ in range(turns):
        for c, history in enumerate(histories):
            prompt = history + _tokens(rng, rng.randint(32, 256))
            answer = _tokens(rng, rng.randint(32, 256))
            requests.append(Request(prompt, answer))
            histories[c] = prompt + answer
    return requests


def few_shot(seed: int = 0, n: int = 1000, templates: int = 4, length: int = 4096) -> list[Request]:
    """Long few-shot templates shared by many short questions."""
    rng = random.Random(seed)
    shots = [_tokens(rng, length) for _ in range(templates)]
    return [
        Request(rng.choice(shots) + _tokens(rng, rng.randint(32, 96)), _tokens(rng, 32))
        for _ in range(n)
    ]


def no_sharing(seed: int = 0, n: int = 1000) -> list[Request]:
    """Distinct random prompts: nothing to reuse, the cost of the cache alone."""
    rng = random.Random(seed)
    return [Request(_tokens(rng, rng.randint(256, 2048)), _tokens(rng, 32)) for _ in range(n)]


def mooncake_records(path: Path = MOONCAKE_TRACE, limit: int | None = None) -> Iterator[dict]:
    with path.open() as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                return
            yield json.loads(line)


class BlockExpander:
    """Hash id -> `block_tokens` deterministic token ids (memoised)."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        block = self._blocks.get(hash_id)
        if block is None:
            block = self._blocks[hash_id] = _tokens(random.Random(hash_id), self.block_tokens)
        return block

    def prompt(self, hash_ids: list[int], length: int) -> list[int]:
        tokens: list[int] = []
        for hash_id in hash_ids:
            tokens.extend(self.block(hash_id))
        return tokens[:length]


def mooncake(
    path: Path = MOONCAKE_TRACE, block_tokens: int = 32, limit: int | None = None, seed: int = 0
) -> list[Request]:
    """The Mooncake conversation trace, lengths scaled by block_tokens / 512."""
    scale = block_tokens / MOONCAKE_BLOCK
    expander = BlockExpander(block_tokens)
    rng = random.Random(seed)
    requests = []
    for record in mooncake_records(path, limit):
        length = max(1, round(record["input_length"] * scale))
        output = max(1, round(record["output_length"] * scale))
        prompt = expander.prompt(record["hash_ids"], length)
        requests.append(Request(prompt, _tokens(rng, output), arrival_ms=record["timestamp"]))
    return requests


SYNTHETIC = {
    "shared-prefix": shared_prefix,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "no-sharing": no_sharing,
}
