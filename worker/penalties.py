"""Presence, frequency and repetition penalties of one sample, as vLLM applies them (what
OpenAI-API clients expect), on the logits before temperature, top-k, top-p or greedy argmax:

    repetition:  every token in the prompt or generated:  logit / r  if logit > 0  else  logit * r
    frequency:   logit -= frequency_penalty * (times the token was generated)
    presence:    logit -= presence_penalty               (if it was generated at all)

The state is incremental and lives on the logits' device, one float per vocabulary entry for
each kind of penalty: what to subtract (kept as `frequency * count + presence`) and what to
divide or multiply by (r where seen, else 1; the prompt's distinct ids are marked once, and
only when r != 1). A generated token updates a few entries, without a device sync; applying is
one subtraction and four elementwise operations for repetition over one vocabulary row, however
long the sequence. An unpenalized sample holds no state at all (`create` returns None).

A resumed sample's prompt ends with its generated tokens: they are in the repetition set either
way, and `replay` (worker/engine.py `_replay`) counts them to the very same values that
recording them one by one gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker.sampling_params import SamplingParams


@dataclass(slots=True)
class Penalties:
    presence: float
    frequency: float
    repetition: float
    counts: torch.Tensor | None
    """[vocab] float32: how many times each token was generated (None: no presence or
    frequency penalty)."""
    offsets: torch.Tensor | None
    """[vocab] float32: subtracted from the logits, `frequency * count + presence` where the
    count is not 0."""
    scale: torch.Tensor | None
    """[vocab] float32: the repetition penalty at tokens of the prompt or generated, 1
    elsewhere (None: repetition is 1)."""

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        prompt: Sequence[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> Penalties | None:
        """The penalty state of a sample of `prompt`, or None if `params` penalize nothing."""
        if not params.penalized:
            return None
        counts = offsets = scale = None
        if params.presence_penalty or params.frequency_penalty:
            counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            offsets = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.repetition_penalty != 1.0:
            scale = torch.ones(vocab_size, dtype=torch.float32, device=device)
            distinct = torch.tensor(sorted(set(prompt)), dtype=torch.int64, device=device)
            scale[distinct] = params.repetition_penalty
        return cls(
            params.presence_penalty,
            params.frequency_penalty,
            params.repetition_penalty,
            counts,
            offsets,
            scale,
        )

    def record(self, token: int) -> None:
        """Count one generated token."""
        if self.counts is not None and self.offsets is not None:
            self.counts[token] += 1
            self.offsets[token] = self.counts[token] * self.frequency + self.presence
        if self.scale is not None:
            self.scale[token] = self.repetition

    def replay(self, tokens: Sequence[int]) -> None:
        """Count tokens generated elsewhere (a resumed sample's) all at once, to the values
        `record`ing them one by one gives."""
        ids = torch.tensor(tokens, dtype=torch.int64)
        if self.counts is not None and self.offsets is not None:
            ids = ids.to(self.counts.device)
            self.counts += torch.bincount(ids, minlength=self.counts.shape[0]).float()
            generated = self.counts > 0
            self.offsets = torch.where(
                generated, self.counts * self.frequency + self.presence, self.offsets
            )
        if self.scale is not None:
            self.scale[ids.to(self.scale.device)] = self.repetition

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The penalized copy of a logits row [vocab] (never changed in place: a request's
        samples draw from the same row, and logprobs are taken from it)."""
        scores = logits
        if self.scale is not None:
            scores = torch.where(logits > 0, logits / self.scale, logits * self.scale)
        if self.offsets is not None:
            scores = scores - self.offsets
        return scores
