"""What the text index (cache/text_index.py) needs from a tokenizer: token ids with the
character each one ends at, CUT and SPLIT flags, and whether split tokenization is exact here.

`TokenSpans.of(tokenizer)` checks the tokenizer once. Split tokenization (tokenise a text's head
and tail apart, join the ids) equals tokenising the whole text only at a pre-tokenizer split
point whose next two pieces are unchanged and past which no special token can start; the index
finds those points, and this module vouches that the tokenizer works that way:

- no normalizer (a normalizer may change characters across the cut),
- pre-tokenizers among ByteLevel without a prefix space, Digits and regex Split (each piece is
  decided by its own characters and at most the next piece; a prefix space or a Metaspace would
  add a character at the start of every tail),
- special tokens that strip no neighbouring whitespace,
- `add_special_tokens` adds ids only before the text (a BOS), never after it.

A tokenizer that fails any of these gets `reason` set and the caller tokenises in full.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cache.text_index import CUT, SPLIT
from worker.tokenizer import Tokenizer

_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Split"}
_POST_PROCESSORS = {None, "ByteLevel", "TemplateProcessing", "Sequence"}
_PROBE = "Hello  world123 <|x|>é漢字\n\n  x!!  "


@dataclass(frozen=True, slots=True)
class Spans:
    """A text's tokens: `ends[i]` is the character after token i, `flags[i]` its CUT / SPLIT."""

    ids: array
    ends: array
    flags: bytearray
    spelled: bool = True
    """The ids spell the text. False where the tokenizer dropped bytes it has no token for
    (SmolLM2's vocabulary lacks 21 of the 256, among them 0x04 and the first byte of U+40000):
    its offsets are then shifted, so `ends` and `flags` are not to be trusted (here every end
    is the text's end and only the last token a CUT) and the text must not join the index."""

    def __len__(self) -> int:
        return len(self.ids)


class TokenSpans:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.margin = 1
        """The longest special token in characters (>= 1)."""
        self.lead: list[int] = list(tokenizer.encode("", add_special_tokens=True))
        """What `add_special_tokens` puts before a text's own ids."""
        self.reason = self._config_reason() or self._probe_reason()
        """Why split tokenization is not exact for this tokenizer (None: it is)."""

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TokenSpans:
        return cls(tokenizer)

    def _config_reason(self) -> str | None:
        config: dict[str, Any] = json.loads(self.tokenizer.backend.to_str())
        if config.get("normalizer") is not None:
            return f"it has a normalizer ({config['normalizer'].get('type')})"
        pre = config.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        for part in parts:
            if part.get("type") not in _PRE_TOKENIZERS:
                return f"its pre-tokenizer {part.get('type')} may change text across a cut"
            if part.get("type") == "ByteLevel" and part.get("add_prefix_space"):
                return "its ByteLevel pre-tokenizer adds a prefix space to every tail"
        post = (config.get("post_processor") or {}).get("type")
        if post not in _POST_PROCESSORS:
            return f"its post-processor {post} may add ids after the text"
        for token in config.get("added_tokens", []):
            if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
                return f"special token {token['content']!r} strips or needs its neighbours"
            self.margin = max(self.margin, len(token["content"]))
        return None

    def _probe_reason(self) -> str | None:
        probe = _PROBE
        ids = self.tokenizer.encode(probe, add_special_tokens=True)
        if ids != self.lead + self.tokenizer.encode(probe, add_special_tokens=False):
            return "add_special_tokens adds ids after the text"
        spans = self.spans(probe)
        for i, (end, flag) in enumerate(zip(spans.ends, spans.flags, strict=True)):
            decoded = self.tokenizer.decode(list(spans.ids[: i + 1]), skip_special_tokens=False)
            if flag & CUT and decoded != probe[:end]:
                return "its offsets do not map tokens to the characters they spell"
        return None

    def spans(self, text: str) -> Spans:
        """`text` tokenised on its own, with no special tokens added."""
        if not text:
            return Spans(array("q"), array("q"), bytearray())
        (encoding,) = self.tokenizer.backend.encode_batch([text], add_special_tokens=False)
        offsets, words = encoding.offsets, encoding.word_ids
        n = len(offsets)
        if self.tokenizer.backend.decode(encoding.ids, skip_special_tokens=False) != text:
            flags = bytearray(n)
            if n:
                flags[-1] = CUT | SPLIT
            return Spans(array("q", encoding.ids), array("q", [len(text)] * n), flags, False)
        ends = array("q", [end for _, end in offsets])
        flags = bytearray(n)
        for i in range(n - 1):
            if offsets[i + 1][0] >= ends[i]:  # the next token starts a character of its own
                flags[i] = CUT | SPLIT if words[i + 1] != words[i] else CUT
        flags[n - 1] = CUT | SPLIT
        ends[n - 1] = len(text)
        return Spans(array("q", encoding.ids), ends, flags)

    def generated(self, ids: Sequence[int]) -> tuple[str, Spans]:
        """Generated ids as the text they spell and their spans: a CUT wherever the ids so far
        spell whole characters, no SPLIT (these are not a tokenization of the text)."""
        decoder = self.tokenizer.incremental_decoder(skip_special_tokens=False)
        ends, flags = array("q"), bytearray(len(ids))
        for i, token_id in enumerate(ids):
            if decoder.step(token_id):
                flags[i] = CUT
            ends.append(len(decoder.text))
        decoder.finish()
        if ids:
            ends[-1], flags[-1] = len(decoder.text), CUT
        return decoder.text, Spans(array("q", ids), ends, flags)
