"""vLLM's `bad_words`: words a sample never writes, as token sequences banned one token at a
time. Imports torch only to mask a row.

Each word is tokenized as vLLM tokenizes it: alone, and after a space (the word inside a text,
where a byte-level BPE writes it with its space), the second kept only when it is a different
sequence of the same length. A sequence's last token is -inf whenever the sample's generated
tokens end with the rest of it, so a one-token word is never drawn, and a longer one is cut
before its last token. Only generated tokens count, as in vLLM: the prompt may end with the
start of a word.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from worker.errors import InvalidRequest


class WordEncoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def bad_word_ids(
    words: Sequence[str], tokenizer: WordEncoder | None, vocab_size: int
) -> tuple[tuple[int, ...], ...]:
    """The token sequences `words` ban (vLLM's two spellings of each)."""
    if not words:
        return ()
    if tokenizer is None:
        raise InvalidRequest("bad_words", "this model has no tokenizer to spell them with")
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not alone:
            raise InvalidRequest("bad_words", f"{word!r} spells no token")
        sequences.append(alone)
        if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    for sequence in sequences:
        if any(not 0 <= t < vocab_size for t in sequence):
            raise InvalidRequest("bad_words", f"a token of {sequence} is outside the vocabulary")
    return tuple(sequences)


@dataclass(slots=True)
class BadWords:
    """One sample's ban: the sequences, and its last generated tokens (as many as the longest
    sequence's prefix)."""

    sequences: tuple[tuple[int, ...], ...]
    recent: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, sequences: tuple[tuple[int, ...], ...]) -> BadWords | None:
        return cls(sequences) if sequences else None

    @property
    def _keep(self) -> int:
        return max(len(s) for s in self.sequences) - 1

    def record(self, token: int) -> None:
        self.recent.append(token)
        del self.recent[: max(0, len(self.recent) - self._keep)]

    def replay(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.record(token)

    def banned(self) -> list[int]:
        """The tokens that would complete a sequence now."""
        out = []
        for sequence in self.sequences:
            prefix = len(sequence) - 1
            if prefix == 0 or (
                prefix <= len(self.recent) and tuple(self.recent[-prefix:]) == sequence[:-1]
            ):
                out.append(sequence[-1])
        return out

    def apply(self, scores: torch.Tensor, owned: bool) -> torch.Tensor:
        """`scores` with the banned tokens at -inf (in place when the caller `owned` the row,
        else in a copy)."""
        banned = self.banned()
        if not banned:
            return scores
        out = scores if owned else scores.clone()
        out[torch.tensor(banned, dtype=torch.int64, device=out.device)] = float("-inf")
        return out
