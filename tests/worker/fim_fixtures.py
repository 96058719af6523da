"""A code model for tests: the tiny checkpoint with Qwen2.5-Coder's three fill-in-the-middle
tokens among its added tokens (worker/fill_in_middle.py), not marked special, as Qwen's own
tokenizer.json has them."""

from __future__ import annotations

import json
from pathlib import Path

from worker.fill_in_middle import FIM_FORMS, FimTokens
from worker.tiny_model import SPECIAL_TOKENS, build_tiny_checkpoint

QWEN = FIM_FORMS[0]


def fim_checkpoint(path: Path, form: FimTokens = QWEN, special: bool = False) -> Path:
    """The tiny checkpoint's config and weights, its tokenizer trained with `form`'s three
    tokens after the usual special tokens (ids 3, 4, 5); `special`: whether they are marked
    so (StarCoder's are, Qwen's, CodeGemma's and DeepSeek-Coder's are not)."""
    own = (form.prefix, form.suffix, form.middle)
    path = build_tiny_checkpoint(path, special_tokens=(*SPECIAL_TOKENS, *own))
    file = path / "tokenizer.json"
    tokenizer = json.loads(file.read_text())
    for added in tokenizer["added_tokens"]:
        if added["content"] in own:
            added["special"] = special
    file.write_text(json.dumps(tokenizer))
    return path
