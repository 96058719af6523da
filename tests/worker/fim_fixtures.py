"""A code model for tests: the tiny checkpoint with Qwen2.5-Coder's three fill-in-the-middle
tokens among its special tokens (worker/fill_in_middle.py)."""

from __future__ import annotations

from pathlib import Path

from worker.fill_in_middle import FIM_FORMS, FimTokens
from worker.tiny_model import SPECIAL_TOKENS, build_tiny_checkpoint

QWEN = FIM_FORMS[0]


def fim_checkpoint(path: Path, form: FimTokens = QWEN) -> Path:
    """The tiny checkpoint's config and weights, its tokenizer trained with `form`'s three
    tokens after the usual special tokens (ids 3, 4, 5)."""
    return build_tiny_checkpoint(
        path, special_tokens=(*SPECIAL_TOKENS, form.prefix, form.suffix, form.middle)
    )
