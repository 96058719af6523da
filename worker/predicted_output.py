"""Predicted outputs (OpenAI's `prediction`): drafts taken from the text a client expects back.

A client rewriting a file sends the file as its prediction; most of the answer is the file
again. A sample follows its place in the prediction token by token (`PredictionCursor`) and,
while its output agrees, proposes the prediction's next tokens as its draft, which the step
verifies as it verifies an n-gram draft (worker/speculation.py): every token is still drawn by
the sample's own sampler, so the output is the one decoding without a prediction gives.

Where the output leaves the prediction (the edit), the cursor is lost until the output's last
tokens occur in the prediction again, looked for at every token it writes: its last `lo` tokens
are looked up among the prediction's n-grams and each occurrence is extended backwards, up to
`hi` tokens; the longest match wins, the nearest to the cursor's last place of equals (the
first after it, else the last before it: a rewrite keeps the prediction's order). What the
cursor does depends on the tokens alone, never on how steps cut them.

The usage counts what OpenAI's does: `accepted_prediction_tokens`, the output's tokens that the
prediction had at their place (each equal to the token after the cursor); and
`rejected_prediction_tokens`, the prediction's draft tokens computed and not drawn (the rest of
a draft after the first token that differed, or after the sample ended: `PredictionCheck`).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence
from typing import Final

from worker.bad_words import WordEncoder
from worker.errors import InvalidRequest
from worker.speculation import NgramIndex

CANDIDATES: Final = 8
"""Occurrences of an n-gram read on each side of the cursor's last place when realigning."""
CHARS_PER_TOKEN: Final = 32
"""A prediction is cut to this many characters a position of the context before it is
tokenized (then to the context's positions): no more is ever drafted from."""
PREDICTION_LOOKUP_MAX: Final = 8
"""Realigning compares up to this many of the output's last tokens (or `prompt_lookup_max`,
if more): a rewrite repeats short runs of tokens (a closing brace and a newline) more often
than a prompt does."""


class PredictedOutput:
    """A request's prediction as tokens, with where each n-gram of `lo` tokens ends in it; read
    by its samples' cursors, never changed."""

    __slots__ = ("ends", "hi", "lo", "tokens")

    def __init__(self, tokens: Sequence[int], lo: int, hi: int) -> None:
        self.tokens = array("i", tokens)
        self.lo, self.hi = lo, hi
        index = NgramIndex(lo, hi)  # the n-gram drafts' index, of the prediction's tokens
        index.extend(self.tokens, len(self.tokens))
        self.ends = index.ends
        """n-gram -> the positions right after each occurrence with a token after it, ascending."""

    def align(self, tokens: Sequence[int], near: int) -> int | None:
        """Where in the prediction the end of `tokens` continues: the position after the best
        match of its last `lo` (up to `hi`) tokens; None when they occur nowhere in it."""
        size, lo, hi, predicted = len(tokens), self.lo, self.hi, self.tokens
        if size < lo:
            return None
        found = self.ends.get(tuple(tokens[size - lo :]))
        if found is None:
            return None
        split = bisect_left(found, near)
        best, longest = None, 0
        after, before = found[split : split + CANDIDATES], found[max(0, split - CANDIDATES) : split]
        for end in (*after, *reversed(before)):  # the nearest first on each side
            n = lo
            while n < min(hi, size, end) and predicted[end - n - 1] == tokens[size - n - 1]:
                n += 1
            if n > longest:
                best, longest = end, n
        return best


class PredictionCursor:
    """One sample's place in its request's prediction: the position of the token it is
    expected to write next (None: lost), found again from its last tokens when lost."""

    __slots__ = ("at", "last", "predicted", "recent")

    def __init__(self, predicted: PredictedOutput, written: Sequence[int] = ()) -> None:
        """`written`: what the sample generated before (a resumed one's)."""
        self.predicted = predicted
        self.at: int | None = 0
        """The prediction's position the sample's next token is expected to equal."""
        self.last = 0
        """Where the cursor last was (realigning prefers occurrences near it)."""
        self.recent: list[int] = []
        """The sample's last `hi` tokens, which a lost cursor realigns on."""
        for token in written:
            self.follow(token)

    def follow(self, token: int) -> bool:
        """Step past the sample's next token: True when the prediction had it at its place;
        otherwise the cursor is lost, unless the output's last tokens, this one included,
        occur in the prediction."""
        predicted, recent, at = self.predicted, self.recent, self.at
        recent.append(token)
        if len(recent) > predicted.hi:
            del recent[0]
        if at is not None and at < len(predicted.tokens) and predicted.tokens[at] == token:
            self.at = self.last = at + 1
            return True
        self.at = predicted.align(recent, self.last)
        if self.at is not None:
            self.last = self.at
        return False

    def propose(self, limit: int) -> list[int]:
        """Up to `limit` tokens of the prediction from the cursor; [] when it is lost or the
        prediction is used up."""
        at = self.at
        if at is None or limit <= 0:
            return []
        return list(self.predicted.tokens[at : at + limit])


class PredictionCheck:
    """A prediction's draft being verified, from position `at` of its sample's tokens."""

    __slots__ = ("at", "draft")

    def __init__(self, draft: Sequence[int], at: int) -> None:
        self.draft, self.at = draft, at

    def rejected(self, position: int, token: int, ended: bool) -> int:
        """The draft's tokens that drawing `token` at `position` leaves undrawn (`ended`: the
        sample ends with it): the rest of the draft, once a token differs from it or ends the
        sample; after that, none."""
        k, draft = position - self.at, self.draft
        if k >= len(draft):  # the token drawn after the whole draft, or the draft is settled
            return 0
        hit = draft[k] == token
        if hit and not ended:
            return 0
        self.draft = ()
        return len(draft) - k - int(hit)


def predicted_output(
    text: str, tokenizer: WordEncoder | None, vocab_size: int, max_tokens: int, lo: int, hi: int
) -> PredictedOutput | None:
    """A request's prediction, tokenized as the model writes text (no special tokens) and cut
    to `max_tokens` (a sequence's positions: no answer is longer) and before its first id past
    the model's `vocab_size` (a tokenizer may spell more ids than its model has: a hint is cut,
    never refused, as vLLM and OpenAI never fail a request for its prediction); None for none.
    Refused when the model has no tokenizer."""
    if not text:
        return None
    if tokenizer is None:
        raise InvalidRequest("prediction", "this model has no tokenizer to read it with")
    tokens = tokenizer.encode(text[: max_tokens * CHARS_PER_TOKEN], add_special_tokens=False)
    tokens = tokens[:max_tokens]
    outside = next((i for i, token in enumerate(tokens) if token >= vocab_size), len(tokens))
    return PredictedOutput(tokens[:outside], lo, hi)
