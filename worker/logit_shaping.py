"""What a request adds to every logits row before penalties, as vLLM orders it:

    allowed_token_ids:  every other token  -> -inf
    logit_bias:         logit += bias           (OpenAI's, per token id)
    min_tokens:         the tokens that would end the sample -> -inf, until it has that many

The first two are one dense row built once per request on the logits' device (`bias`), added
to a copy of the row: the raw row stays as it is, for the request's other samples and for
logprobs. The third writes -inf into the copy at a handful of ids while the sample is short.
A request that asks for none of them holds no state (`create` returns None).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from worker.sampling_params import SamplingParams


@dataclass(slots=True)
class LogitShaping:
    bias: torch.Tensor | None
    """[vocab] float32: the logit bias, -inf outside the allowed tokens (None: neither)."""
    held: torch.Tensor | None
    """int64 ids that cannot be drawn before `min_tokens` (None: nothing held)."""
    min_tokens: int

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        end_token_ids: Iterable[int],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> LogitShaping | None:
        """The shaping of `params`' samples, or None if they ask for none."""
        bias = None
        if params.logit_bias or params.allowed_token_ids:
            bias = torch.zeros(vocab_size, dtype=torch.float32)
            if params.allowed_token_ids:
                bias.fill_(float("-inf"))
                bias[list(params.allowed_token_ids)] = 0.0
            if params.logit_bias:
                ids, values = zip(*params.logit_bias, strict=True)
                allowed = torch.isfinite(bias[list(ids)])
                biased = torch.tensor(values, dtype=torch.float32)
                bias[list(ids)] = torch.where(allowed, biased, float("-inf"))
            bias = bias.to(device)
        held_ids = sorted(t for t in params.held_tokens(end_token_ids) if 0 <= t < vocab_size)
        held = torch.tensor(held_ids, dtype=torch.int64, device=device) if held_ids else None
        if bias is None and held is None:
            return None
        return cls(bias, held, params.min_tokens)

    def holds(self, tokens: Sequence[int], generated: int) -> bool:
        """Whether `min_tokens` holds back one of `tokens`, written from a sample that has
        generated `generated` tokens."""
        if self.held is None:
            return False
        held = set(self.held.tolist())
        return any(t in held for i, t in enumerate(tokens) if generated + i < self.min_tokens)

    def apply(self, logits: torch.Tensor, generated: int) -> torch.Tensor:
        """The shaped copy of a logits row [vocab] for a sample that has generated `generated`
        tokens (the row itself is never changed)."""
        scores = logits + self.bias if self.bias is not None else logits
        if self.held is not None and generated < self.min_tokens:
            if scores is logits:
                scores = logits.clone()
            scores[self.held] = float("-inf")
        return scores
