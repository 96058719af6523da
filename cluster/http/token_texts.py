"""The text of single tokens, for logprobs: what OpenAI's `token` and `bytes` fields show."""

from __future__ import annotations

from functools import lru_cache
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class TokenTexts:
    """Each token decoded alone, special tokens included (cached: a stream asks again and again
    for the same few thousand tokens)."""

    def __init__(self, tokenizer: Decoder | None) -> None:
        self.tokenizer = tokenizer
        self.text = lru_cache(maxsize=1 << 16)(self._decode)

    def _decode(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
