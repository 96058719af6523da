"""Sampling parameters, their validation, and the per-request sampler.

Each sample (a request's n-th output) owns a `torch.Generator` seeded from the request's seed
and the sample index, and draws from its own logits row only, so a seeded request produces the
same tokens whatever else shares its batch, and run after run. temperature 0 is greedy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from worker.errors import InvalidRequest

MAX_N = 16
_SEED_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    """0 disables (all tokens)."""
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    """Strings that end generation; they are not included in the output text."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def validate(self, vocab_size: int, max_new_tokens: int) -> None:
        """Raise `InvalidRequest` naming the first field out of range."""
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= max_new_tokens:
            raise InvalidRequest(
                "max_tokens", f"must be in [1, {max_new_tokens}], got {self.max_tokens}"
            )
        if not self.temperature >= 0:  # also refuses NaN
            raise InvalidRequest("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidRequest("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest("seed", f"must be a non-negative int, got {self.seed}")
        if self.n > 1 and self.temperature == 0:
            raise InvalidRequest("n", "n > 1 needs temperature > 0 (greedy samples are identical)")
        for token in self.stop_token_ids:
            if not 0 <= token < vocab_size:
                raise InvalidRequest("stop_token_ids", f"{token} is outside [0, {vocab_size})")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_seed(request_seed: int | None, index: int) -> int:
    """The generator seed of sample `index`: derived from the request seed, else random."""
    if request_seed is None:
        return int.from_bytes(os.urandom(8), "little") & (_MASK64 >> 1)
    return ((request_seed * _SEED_MIX + index * 0xBF58476D1CE4E5B9) & _MASK64) >> 1


@dataclass(slots=True)
class Sampler:
    """Draws one sample's tokens."""

    params: SamplingParams
    generator: torch.Generator = field(default_factory=torch.Generator)

    @classmethod
    def create(cls, params: SamplingParams, index: int) -> Sampler:
        generator = torch.Generator()
        generator.manual_seed(sample_seed(params.seed, index))
        return cls(params, generator)

    def __call__(self, logits: torch.Tensor) -> int:
        """One token from a float32 logits row [vocab] (on any device; sampled on the CPU)."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scores = logits.detach().to("cpu", torch.float64) / p.temperature
        if p.top_k and p.top_k < scores.shape[0]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1:
            ordered, order = torch.sort(probs, descending=True)
            before = torch.cumsum(ordered, dim=0) - ordered
            ordered = ordered.masked_fill(before >= p.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, ordered)
        return int(torch.multinomial(probs, 1, generator=self.generator))
