"""What the text index (cache/text_index.py) needs from a tokenizer: token ids with the
character each one ends at, CUT and SPLIT flags, and whether split tokenization is exact here.

`TokenSpans(tokenizer)` checks the tokenizer once. Split tokenization (tokenise a text's head
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

import numpy as np
from tokenizers import pre_tokenizers

from cache.text_index import CUT, SPLIT
from worker.tokenizer import Tokenizer

_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Split"}
_POST_PROCESSORS = {None, "ByteLevel", "TemplateProcessing", "Sequence"}
_PROBE = "Hello  world123 <|x|>é漢字\n\n  x!!  "


@dataclass(frozen=True, slots=True)
class Spans:
    """A text's tokens: `ends[i]` is the character after token i, `flags[i]` its CUT / SPLIT.
    A token that ends inside a character (not a CUT) ends where the next CUT does, so the same
    ids always come with the same ends, whichever way they were produced."""

    ids: array
    ends: array
    flags: bytearray
    spelled: bool = True
    """The ids spell the whole text. False when the text has a character with a byte the
    vocabulary has no token for (SmolLM2 lacks 21 of the 256, 0x04 and the first byte of
    U+40000 among them): the tokenizer drops such bytes, so `ends` and `flags` mean nothing
    (every end is the text's end, only the last token a CUT) and the text must not join the
    index. Its ids are still those of tokenising it alone."""

    def __len__(self) -> int:
        return len(self.ids)


class TokenSpans:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.margin = 1
        """The longest special token in characters (>= 1)."""
        self.lead: list[int] = list(tokenizer.encode("", add_special_tokens=True))
        """What `add_special_tokens` puts before a text's own ids."""
        self._spellable = self._spellable_bytes()
        self.reason = self._config_reason() or self._probe_reason()
        """Why split tokenization is not exact for this tokenizer (None: it is)."""

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
        if "ByteLevel" not in {part.get("type") for part in parts}:
            return "it has no ByteLevel pre-tokenizer (the rule assumes byte-level pieces)"
        return self._tokens_reason(config)

    def _tokens_reason(self, config: dict[str, Any]) -> str | None:
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

    def _spellable_bytes(self) -> bytes:
        """The bytes the vocabulary has a token for, found through ByteLevel's own mapping of
        bytes to characters (a character holding the byte, mapped, looked up)."""
        level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        spellable = bytearray()
        for byte in range(256):
            if byte not in _HOLDERS:  # never in UTF-8 text
                spellable.append(byte)
                continue
            char, position = _HOLDERS[byte]
            mapped = level.pre_tokenize_str(char)[0][0][position]
            if self.tokenizer.token_to_id(mapped) is not None:
                spellable.append(byte)
        return bytes(spellable)

    def spelled(self, text: str) -> bool:
        """Whether the vocabulary spells every byte of `text` (a C-speed pass)."""
        data = text.encode("utf-8", "surrogatepass")
        return not data.translate(None, self._spellable)

    def spans(self, text: str) -> Spans:
        """`text` tokenised on its own, with no special tokens added."""
        if not text:
            return Spans(array("q"), array("q"), bytearray())
        if not self.spelled(text):
            ids = array("q", self.tokenizer.encode(text, add_special_tokens=False))
            flags = bytearray(len(ids))
            if ids:
                flags[-1] = CUT | SPLIT
            return Spans(ids, array("q", [len(text)] * len(ids)), flags, spelled=False)
        encoding = self.tokenizer.encode_with_offsets(text)
        spans = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        words = np.array(
            [-1 - i if w is None else w for i, w in enumerate(encoding.word_ids)]
            if None in encoding.word_ids
            else encoding.word_ids,
            dtype=np.int64,
        )
        ends = spans[:, 1].copy()
        ends[-1] = len(text)
        cut = spans[1:, 0] >= ends[:-1]  # the next token starts a character of its own
        split = cut & (words[1:] != words[:-1])
        marks = np.full(len(ends), CUT | SPLIT, dtype=np.uint8)
        marks[:-1] = cut * CUT | split * SPLIT
        cuts = np.flatnonzero(marks & CUT)  # inside a character: end where the next cut does
        ends = ends[cuts][np.searchsorted(cuts, np.arange(len(ends)))]
        return Spans(array("q", encoding.ids), array("q", ends.tobytes()), bytearray(marks))

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
        following = len(decoder.text)
        for i in range(len(ids) - 1, -1, -1):  # inside a character: end where the next cut does
            if flags[i] & CUT:
                following = ends[i]
            else:
                ends[i] = following
        return decoder.text, Spans(array("q", ids), ends, flags)


def _holders() -> dict[int, tuple[str, int]]:
    """For each byte UTF-8 uses, a character that holds it and where: U+0000-U+07FF cover the
    one- and two-byte forms and every continuation byte, one character per lead byte the rest."""
    leads = [0x800, *range(0x1000, 0x10000, 0x1000), 0x10000, 0x40000, 0x80000, 0xC0000, 0x100000]
    holders: dict[int, tuple[str, int]] = {}
    for code in [*range(0x800), *leads]:
        for position, byte in enumerate(chr(code).encode()):
            holders.setdefault(byte, (chr(code), position))
    return holders


_HOLDERS = _holders()
