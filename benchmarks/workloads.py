"""Seeded request streams for the cache and router benchmarks, and the Mooncake trace replay.

Each request is a prompt of token ids and the tokens a model will generate for it. Everything is
derived from a seed, so two runs (and two implementations in one run) see the same stream.

The Mooncake trace is read and expanded by cluster/loadtest/trace.py (the load test replays it
too); here it becomes token-id requests for the cache and router simulations.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from cluster.loadtest.trace import MOONCAKE_BLOCK, MOONCAKE_TRACE, BlockExpander, read_trace

VOCAB = 49_152


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output: list[int]
    tenant: str | None = None
    arrival_ms: float = 0.0
    adapter: str | None = None
    """The LoRA adapter the request names (None: the base model)."""


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


def system_prompts(
    seed: int = 0, n: int = 2000, prompts: int = 32, prompt_len: int = 1024, zipf: float = 1.1
) -> list[Request]:
    """System prompts of Zipf popularity (prompt k is chosen with weight 1 / k^zipf), each
    followed by a short distinct question: a few prompts are hot, the tail is cold."""
    rng = random.Random(seed)
    systems = [
        _tokens(rng, rng.randint(prompt_len // 2, prompt_len * 3 // 2)) for _ in range(prompts)
    ]
    weights = [1 / (k + 1) ** zipf for k in range(prompts)]
    chosen = rng.choices(systems, weights, k=n)
    return [Request(s + _tokens(rng, rng.randint(16, 128)), _tokens(rng, 32)) for s in chosen]


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


def lora_zipf(
    seed: int = 0,
    n: int = 3000,
    adapters: int = 16,
    zipf: float = 1.1,
    prompts_per_adapter: int = 2,
    prompt_len: int = 512,
) -> list[Request]:
    """Multi-LoRA serving: each request names adapter k (lora-k) with weight 1 / (k + 1)^zipf
    and starts with one of that adapter's own system prompts (its task), then a short distinct
    question. Prefixes are shared only within an adapter (its KV is its own namespace)."""
    rng = random.Random(seed)
    tasks = [
        [
            _tokens(rng, rng.randint(prompt_len // 2, prompt_len * 3 // 2))
            for _ in range(prompts_per_adapter)
        ]
        for _ in range(adapters)
    ]
    weights = [1 / (k + 1) ** zipf for k in range(adapters)]
    chosen = rng.choices(range(adapters), weights, k=n)
    return [
        Request(
            rng.choice(tasks[k]) + _tokens(rng, rng.randint(16, 128)),
            _tokens(rng, 32),
            adapter=f"lora-{k}",
        )
        for k in chosen
    ]


def mooncake(
    path: Path = MOONCAKE_TRACE, block_tokens: int = 32, limit: int | None = None, seed: int = 0
) -> list[Request]:
    """The Mooncake conversation trace, lengths scaled by block_tokens / 512."""
    expander = BlockExpander(block_tokens, VOCAB)
    rng = random.Random(seed)
    requests = []
    for record in read_trace(path, limit):
        prompt = expander.prompt(record.hash_ids, expander.scaled(record.input_length))
        output = _tokens(rng, expander.scaled(record.output_length))
        requests.append(Request(prompt, output, arrival_ms=record.timestamp_ms))
    return requests


__all__ = ["MOONCAKE_BLOCK", "MOONCAKE_TRACE", "BlockExpander", "Request", "mooncake"]

SYNTHETIC = {
    "shared-prefix": shared_prefix,
    "system-prompts": system_prompts,
    "multi-turn": multi_turn,
    "few-shot": few_shot,
    "no-sharing": no_sharing,
    "lora-zipf": lora_zipf,
}
