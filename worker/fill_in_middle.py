"""Fill-in-the-middle: a completion inserted between a prompt and a suffix (OpenAI's `suffix`),
written in the form the model was trained on. Imports no torch.

A code model trained to fill in the middle has three special tokens, and takes the text before
the insertion point and the text after it in prefix-suffix-middle order (StarCoder's paper
calls it PSM); what it writes after the third token is the middle:

    <pre> prefix <suf> suffix <mid> | middle ... <end of text>

The tokens are found among the tokenizer's special tokens, by the spellings of the model
families that have them (`FIM_FORMS`); a tokenizer with none of them has no fill-in-the-middle,
and a request with a suffix is refused by name. A text prompt becomes the text of its form (the
special tokens written in it, which the tokenizer reads as the tokens), so it is tokenised,
counted and indexed as any text prompt is; token ids are wrapped in the tokens' ids.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FimTokens:
    """The three special tokens of a model's fill-in-the-middle form, as the vocabulary spells
    them."""

    prefix: str
    suffix: str
    middle: str

    def text(self, prefix: str, suffix: str) -> str:
        """The prompt that asks for what goes between `prefix` and `suffix`."""
        return f"{self.prefix}{prefix}{self.suffix}{suffix}{self.middle}"

    def ids(
        self, prefix: Sequence[int], suffix: str, encode: Callable[[str], list[int]]
    ) -> list[int]:
        """The same for a prefix given as token ids; `encode` tokenises without adding special
        tokens (the suffix, and each form token by itself)."""
        return [*encode(self.prefix), *prefix, *encode(f"{self.suffix}{suffix}{self.middle}")]


FIM_FORMS = (
    FimTokens("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    FimTokens("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    FimTokens("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
"""The forms recognised, by their special tokens' spellings."""


def fim_tokens(special_tokens: Iterable[str]) -> FimTokens | None:
    """The fill-in-the-middle form whose three tokens are all among `special_tokens` (the
    tokenizer's added tokens, which it never splits); None: the model has none."""
    have = set(special_tokens)
    for form in FIM_FORMS:
        if {form.prefix, form.suffix, form.middle} <= have:
            return form
    return None
