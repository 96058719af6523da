"""Text and chat prompts tokenised through the router's text index (cache/text_index.py).

A text prompt is matched by characters against the texts the router has seen in its namespace;
the ids of the matched part (backed off per mode) are reused and only the rest is tokenised.
The prompt then joins the index, and so does each finished sample's answer, so the next turn of
a conversation matches through the previous answer:

    turn 1   | system + user 1 |                                  tokenised in full
    turn 2   | system + user 1 | answer 1 | user 2 |               matched up to the back-off,
                                                                    the rest tokenised
    exact:    the answer's text joins as it would tokenise; the ids always equal a full
              tokenization of the prompt
    anchored: the answer joins with the ids the model generated (the ids the workers cached),
              so the next turn reuses them even where tokenising the text would not give them

Modes: "exact" (default), "anchored", "off" (router.text_index.mode; a request may ask for
another). A tokenizer whose split tokenization is not exact (worker/tokenizer_spans.py) gets
"off" in every mode, logged once. Thread-safe: prompts are prepared on threads.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cache.text_index import TextIndex, TextMatch, TextMatchMode
from protos.radixmesh.v1 import serving_pb2
from worker.fill_in_middle import FimTokens
from worker.tokenizer import Tokenizer
from worker.tokenizer_spans import Spans, TokenSpans

log = logging.getLogger(__name__)
OFF = "off"
_REQUESTED: dict[int, str] = {
    serving_pb2.TEXT_MATCH_EXACT: TextMatchMode.EXACT.value,
    serving_pb2.TEXT_MATCH_ANCHORED: TextMatchMode.ANCHORED.value,
    serving_pb2.TEXT_MATCH_OFF: OFF,
}


@dataclass(frozen=True)
class TextTurn:
    """A prompt as the index took it: what `TextPrompts.finished` needs to add its answers."""

    namespace: Hashable
    mode: TextMatchMode
    text: str
    spans: Spans
    """The text's own ids (no BOS) with their ends and flags."""
    exact: bool = True
    """The ids are a full tokenization's (how the text joins the index)."""


@dataclass
class TextIndexCounters:
    prompts: int = 0
    """Text prompts tokenised through the index."""
    prompt_chars: int = 0
    reused_chars: int = 0
    """Characters whose ids came from the index."""
    reused_tokens: int = 0
    tokenized_chars: int = 0
    backoff_tokens: int = 0
    """Tokens of matched text tokenised again: what backing off to a safe boundary cost."""
    seconds: float = 0.0
    """Time in matching, tokenising and inserting prompts."""
    outcomes: dict[str, int] = field(default_factory=dict)


class PromptEncoder:
    """`validation.PromptTokenizer` for one request: encodes through the index and keeps the
    turn it took; `keep()` adds the prompt to the index once the request is accepted."""

    def __init__(self, prompts: TextPrompts, namespace: Hashable, mode: str) -> None:
        self._prompts, self._namespace, self._mode = prompts, namespace, mode
        self.turn: TextTurn | None = None
        self.probe = prompts.tokenizer
        """For size checks of part of the text (validation's head check): not through the
        index, which must see only whole prompts."""

    def keep(self) -> None:
        if self.turn is not None:
            self._prompts.keep(self.turn)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, self.turn = self._prompts.encode(
            self._namespace, text, self._mode, add_special_tokens, keep=False
        )
        return ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        return self._prompts.tokenizer.apply_chat_template(messages, tools=tools, **variables)

    @property
    def renders_tools(self) -> bool:
        return self._prompts.tokenizer.renders_tools

    @property
    def fim_tokens(self) -> FimTokens | None:
        return self._prompts.tokenizer.fim_tokens


class TextPrompts:
    def __init__(
        self,
        tokenizer: Tokenizer,
        mode: str = TextMatchMode.EXACT.value,
        max_chars: int = 16_000_000,
        min_fraction: float = 0.8,
    ) -> None:
        self.tokenizer = tokenizer
        self.spans = TokenSpans(tokenizer)
        self.default = mode
        if self.spans.reason is not None:
            log.warning("text index off: split tokenization is not exact: %s", self.spans.reason)
        self.index = TextIndex(max_chars, min_fraction)
        self.counters = TextIndexCounters()
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget every text (Admin.ClearCaches); the counters stay."""
        with self._lock:
            self.index = TextIndex(self.index.max_chars, self.index.min_fraction)

    def mode(self, requested: int) -> str:
        """The mode a request runs in: the one it asked for (serving.proto TextMatch), else the
        configured one; "off" whatever was asked when the tokenizer cannot split exactly."""
        if self.spans.reason is not None:
            return OFF
        return _REQUESTED.get(requested, self.default)

    def encoder(self, namespace: Hashable, mode: str) -> PromptEncoder:
        return PromptEncoder(self, namespace, mode)

    def encode(
        self,
        namespace: Hashable,
        text: str,
        mode: str,
        add_special_tokens: bool = True,
        keep: bool = True,
    ) -> tuple[list[int], TextTurn | None]:
        """The prompt's ids (BOS included when `add_special_tokens` and the tokenizer adds one)
        and the turn the index took (None: "off", nothing to index, or a text the vocabulary
        cannot spell: `Spans.spelled`). `keep=False`: the prompt joins the index only when
        `keep(turn)` is called (the router calls it once the request is accepted)."""
        if mode == OFF or not text:
            return self.tokenizer.encode(text, add_special_tokens), None
        began = time.perf_counter()
        match_mode = TextMatchMode(mode)
        spans, match, backoff = self._through_index(namespace, text, match_mode)
        with self._lock:
            c = self.counters
            c.prompts += 1
            c.prompt_chars += len(text)
            c.reused_chars += match.reused_chars
            c.reused_tokens += len(match.ids)
            c.tokenized_chars += len(text) - match.reused_chars
            c.backoff_tokens += backoff
            c.outcomes[match.outcome.value] = c.outcomes.get(match.outcome.value, 0) + 1
            c.seconds += time.perf_counter() - began
        lead = self.spans.lead if add_special_tokens else []
        turn = TextTurn(namespace, match_mode, text, spans, match.exact) if spans.spelled else None
        if keep and turn is not None:
            self.keep(turn)
        return lead + spans.ids.tolist(), turn

    def keep(self, turn: TextTurn) -> None:
        """The prompt joins the index."""
        self._insert(turn.namespace, turn.text, turn.spans, turn.exact)

    def _through_index(
        self, namespace: Hashable, text: str, mode: TextMatchMode, insert: bool = False
    ) -> tuple[Spans, TextMatch, int]:
        """Match, tokenise the rest (and insert): the text's spans, the match and its back-off
        (tokens of matched text tokenised again)."""
        with self._lock:
            match = self.index.match(namespace, text, mode, self.spans.margin)
        start = match.reused_chars
        tail = self.spans.spans(text[start:])
        spans = Spans(
            match.ids + tail.ids,
            match.ends + _shifted(tail.ends, start),
            match.flags + tail.flags,
            tail.spelled,
        )
        if insert and spans.spelled:  # (what the index holds is spelled: the match's part is)
            self._insert(namespace, text, spans, match.exact)
        backoff = bisect.bisect_right(tail.ends, match.matched_chars - start)
        return spans, match, backoff

    def finished(self, turn: TextTurn, samples: Sequence[Sequence[int]]) -> None:
        """Each sample's answer joins the index after its prompt: as the model generated it
        (anchored), or as its text tokenises (exact)."""
        for generated in samples:
            if not generated:
                continue
            answer, spans = self.spans.generated(generated)
            text = turn.text + answer
            if turn.mode is TextMatchMode.EXACT:
                self._through_index(turn.namespace, text, TextMatchMode.EXACT, insert=True)
                continue
            start = len(turn.text)
            joined = Spans(
                turn.spans.ids + spans.ids,
                turn.spans.ends + _shifted(spans.ends, start),
                turn.spans.flags + spans.flags,
            )
            self._insert(turn.namespace, text, joined, exact=False)

    def _insert(self, namespace: Hashable, text: str, spans: Spans, exact: bool) -> None:
        """Into the index; a text it refuses is logged and left out, never failing a request
        (its ids are right whether or not it is kept)."""
        try:
            with self._lock:
                self.index.insert(namespace, text, spans.ids, spans.ends, spans.flags, exact)
        except ValueError as err:  # e.g. an answer whose last bytes were not a character
            log.debug("text index: a text of %d characters left out: %s", len(text), err)


def _shifted(ends: array, by: int) -> array:
    """Character ends counted from `by` characters earlier."""
    if not by:
        return ends
    return array("q", (np.frombuffer(ends, dtype=np.int64) + by).tobytes())
