"""Fill-in-the-middle: a completion inserted between a prompt and a suffix (OpenAI's `suffix`),
written in the form the model was trained on. Imports no torch.

A code model trained to fill in the middle has three added tokens, and takes the text before
the insertion point and the text after it in prefix-suffix-middle order (StarCoder's paper
calls it PSM); what it writes after the third token is the middle:

    [BOS] <pre> prefix <suf> suffix <mid> | middle ... <end>

The tokens are found among the tokenizer's added tokens (special or not: Qwen2.5-Coder's,
CodeGemma's and DeepSeek-Coder's are not marked special, StarCoder's are; the tokenizer splits
either kind out of a text whole), by the spellings of the model families that have them
(`FIM_FORMS`). A tokenizer with none of them has no fill-in-the-middle, and a request with a
suffix is refused by name. A text prompt becomes the text of its form (the tokens written in
it), so it is tokenised, counted and indexed as any text prompt is; token ids are placed in the
form's ids. The middle ends where the model ends a text, or where it writes a token that opens
something else (`FIM_ENDS`, and the form's own three), as llama.cpp ends an infill.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class FimTokens:
    """The three tokens of a model's fill-in-the-middle form, as the vocabulary spells them, and
    the ids that end a middle (the tokenizer's; none in `FIM_FORMS`)."""

    prefix: str
    suffix: str
    middle: str
    ends: tuple[int, ...] = ()

    def text(self, prefix: str, suffix: str) -> str:
        """The prompt that asks for what goes between `prefix` and `suffix`."""
        return f"{self.prefix}{prefix}{self.suffix}{suffix}{self.middle}"

    def ids(
        self, prefix: Sequence[int], suffix: str, encode: Callable[[str, bool], list[int]]
    ) -> list[int]:
        """The same for a prefix given as token ids. `encode(text, add_special_tokens)`: the
        tokenizer's. The form is tokenised as a text prompt is (with a BOS before it, where the
        tokenizer adds one) and the ids go after its first token; a copy of that BOS leading
        them is dropped, so ids encoded as a client encodes a text give the text's prompt."""
        form = encode(self.text("", suffix), True)
        (first,) = encode(self.prefix, False)
        at = form.index(first) + 1
        begin, given = form[: at - 1], list(prefix)
        if begin and given[: len(begin)] == begin:
            del given[: len(begin)]
        return [*form[:at], *given, *form[at:]]


FIM_FORMS = (
    FimTokens("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder, CodeGemma
    FimTokens("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    FimTokens("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek-Coder
)
"""The forms recognised, by their tokens' spellings."""

FIM_ENDS = (
    "<|file_separator|>",  # CodeGemma: the end of a middle
    "<|file_sep|>",  # Qwen2.5-Coder: the next file of a repository
    "<file_sep>",  # StarCoder2
    "<|repo_name|>",
    "<repo_name>",
    "<|fim_pad|>",
    "<fim_pad>",
)
"""Tokens that end a middle where the vocabulary has them: each opens another file or pads."""


def fim_tokens(added: Mapping[str, int]) -> FimTokens | None:
    """The fill-in-the-middle form whose three tokens are all among `added` (the tokenizer's
    added tokens, text -> id), with the ids that end a middle; None: the model has none."""
    for form in FIM_FORMS:
        own = (form.prefix, form.suffix, form.middle)
        if all(token in added for token in own):
            ends = dict.fromkeys(added[token] for token in (*own, *FIM_ENDS) if token in added)
            return replace(form, ends=tuple(ends))
    return None
