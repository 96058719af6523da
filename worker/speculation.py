"""Speculative decoding by n-gram lookup (vLLM's `method: ngram`, "prompt lookup decoding").

A decoding sample whose last tokens (at least `prompt_lookup_min` of them, the longest match
up to `prompt_lookup_max` preferred: `NgramIndex`) occurred earlier in its prompt or output
proposes the tokens that followed them then, up to `num_speculative_tokens`: a draft. The
step computes the sample's pending token and its draft in one chunk, with logits at every row,
and the engine draws from them in order:

    chunk      [ t  d1  d2  d3 ]          t: the pending token; d: the draft
    row i      logits after t, d1 .. di
    draw 1     from row 0: the next token, whatever the draft says
    draw i+1   from row i, only while every earlier draw equalled its draft token

Every token is drawn by the sample's own sampler, from the logits of the true sequence before
it, so the output is the one decoding without a draft gives: greedy and seeded samples produce
the same tokens, token for token (worker/sampling.py: a draw's randomness is a function of the
seed and the position), and an unseeded one the same distribution (up to the last bits the
kernels compute differently: a drafted step computes its rows as a chunk). A draw that differs
from the draft ends the verification; the KV written for the rest of the draft lies past the
sample's computed positions, where the next steps overwrite it, and the pages past its next
position go back to the pool. Against rejection sampling with
a one-hot draft (vLLM's, for n-grams) this accepts a draft token with the same probability,
p(draft token); what it adds is that penalties, grammars, bad words and thinking budgets need
nothing of their own: every draw goes through them as it would one token a step.

A draft takes only what the step's token budget leaves after the scheduler's plan, and is cut
to the pages the pool has free: speculation never delays a prompt's prefill, evicts cached
pages or preempts anyone.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

MAX_SPECULATIVE_TOKENS: Final = 64
"""The most draft tokens a step verifies for one sample (a bound on a config mistake)."""
CANDIDATES: Final = 8
"""The most recent occurrences of a suffix's last `prompt_lookup_min` tokens a lookup reads."""


@dataclass(frozen=True, slots=True)
class SpeculationConfig:
    num_speculative_tokens: int = 0
    """The longest draft; 0: no speculation."""
    prompt_lookup_max: int = 4
    """The longest suffix looked up (tried first)."""
    prompt_lookup_min: int = 2
    """The shortest suffix looked up."""
    num_prediction_tokens: int = 0
    """The longest draft from a request's predicted output (worker/predicted_output.py); 0:
    none. Independent of `num_speculative_tokens`."""

    def __post_init__(self) -> None:
        for name in ("num_speculative_tokens", "num_prediction_tokens"):
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= MAX_SPECULATIVE_TOKENS:
                raise ValueError(
                    f"{name} must be an int in [0, {MAX_SPECULATIVE_TOKENS}], got {value!r}"
                )
        if type(self.prompt_lookup_min) is not int or self.prompt_lookup_min < 1:
            raise ValueError(
                f"prompt_lookup_min must be an int >= 1, got {self.prompt_lookup_min!r}"
            )
        if type(self.prompt_lookup_max) is not int or (
            self.prompt_lookup_max < self.prompt_lookup_min
        ):
            raise ValueError(
                f"prompt_lookup_max must be an int >= prompt_lookup_min "
                f"({self.prompt_lookup_min}), got {self.prompt_lookup_max!r}"
            )

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0


def draft_limit(longest: int, generated: int, max_tokens: int, room: int) -> int:
    """The longest draft (of at most `longest` tokens) worth verifying for a sample that has
    generated `generated` tokens of `max_tokens`, with `room` positions left in its context: a
    step keeps at most the draft and one more token."""
    return min(longest, max_tokens - generated - 1, room - 1)


class NgramIndex:
    """Where each n-gram of `prompt_lookup_min` tokens ended in a token list, kept up to date as
    the list grows: `propose` indexes the positions added since it last ran, then takes the
    most recent occurrences (at most `CANDIDATES`) of the list's last `lo` tokens and extends
    each match backwards, up to `hi` tokens. The longest match wins, the most recent of equals;
    what followed it is the draft. 4 bytes a position plus an entry per distinct n-gram (89
    bytes a position in all, measured on markdown: docs/worker.md)."""

    __slots__ = ("ends", "hi", "indexed", "lo")

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.ends: dict[tuple[int, ...], array[int]] = {}
        """n-gram of `lo` tokens -> the positions right after each occurrence, ascending."""
        self.indexed = 0
        """The n-grams ending before position `end` are indexed for every end < indexed."""

    def copy(self) -> NgramIndex:
        twin = NgramIndex(self.lo, self.hi)
        twin.ends = {key: array("i", ends) for key, ends in self.ends.items()}
        twin.indexed = self.indexed
        return twin

    def extend(self, tokens: Sequence[int], upto: int) -> None:
        """Index the n-grams `tokens[end - lo : end]` for end in [indexed, upto)."""
        lo, ends = self.lo, self.ends
        for end in range(max(self.indexed, lo), upto):
            key = tuple(tokens[end - lo : end])
            found = ends.get(key)
            if found is None:
                ends[key] = array("i", (end,))
            else:
                found.append(end)
        self.indexed = max(self.indexed, upto)

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens that followed the best earlier match of the end of `tokens`;
        [] when its last `lo` tokens never occurred before."""
        size, lo, hi = len(tokens), self.lo, self.hi
        if limit <= 0 or size <= lo:
            return []
        self.extend(tokens, size)  # every n-gram with a token after it: the suffix is not
        found = self.ends.get(tuple(tokens[size - lo :]))
        if found is None:
            return []
        best, longest = -1, 0
        for end in reversed(found[-CANDIDATES:]):
            n = lo
            while n < hi and end > n and tokens[end - n - 1] == tokens[size - n - 1]:
                n += 1
            if n > longest:
                best, longest = end, n
                if n == hi:
                    break
        return list(tokens[best : best + limit])
