"""The per-sample sampler: one token from a logits row, its randomness a function of the
request's seed, the sample's index and the token's position.

    draw at position p of sample i  ~  Generator(seed = mix(sample_seed(request seed, i), p))

Nothing carries over from one draw to the next, so a seeded sample produces the same tokens
whatever else shares its batch, run after run, and on any worker that continues it from its
position: a stream the router moves to another worker mid-way (cluster/router_service.py) draws
exactly what the uninterrupted one would have. temperature 0 is greedy.

A request's logit bias, allowed tokens and min_tokens (worker/logit_shaping.py) and its bad
words (worker/bad_words.py) change the logits first, then penalties (worker/penalties.py),
before any of that, greedy included, as vLLM orders them; after temperature, min_p drops the
unlikely tokens before top-k and top-p. Penalties, bad words and min_tokens depend on the
prompt and the tokens generated so far, which the sampler counts as it draws them; the
randomness is still seeded by the same three, so a resumed sample that `replay`s its generated
tokens draws exactly what the uninterrupted one would.

A structured output's constraint (worker/structured_output.py) then sets every token its grammar
does not allow next to -inf, and follows the token drawn; a resumed sample replays its tokens
through it too.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from worker.bad_words import BadWords
from worker.logit_shaping import LogitShaping
from worker.penalties import Penalties
from worker.sampling_params import SamplingParams
from worker.structured_output import Constraint
from worker.thinking_tokens import ThinkingTokens

_SEED_MIX = 0x9E3779B97F4A7C15
_POSITION_MIX = 0xD6E8FEB86659FD93
_MASK64 = (1 << 64) - 1


def sample_seed(request_seed: int | None, index: int) -> int:
    """The seed of sample `index`: derived from the request seed, else random."""
    if request_seed is None:
        return int.from_bytes(os.urandom(8), "little") & (_MASK64 >> 1)
    return ((request_seed * _SEED_MIX + index * 0xBF58476D1CE4E5B9) & _MASK64) >> 1


def draw_seed(seed: int, position: int) -> int:
    """The generator seed of the draw at `position` (a splitmix64 round of seed and position)."""
    z = (seed + (position + 1) * _POSITION_MIX) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


class NothingToDraw(ValueError):
    """A request's own bans (allowed_token_ids, bad_words, min_tokens) left no token."""

    def __init__(self) -> None:
        super().__init__(
            "every token is excluded by the request's allowed_token_ids, bad_words and "
            "min_tokens together: nothing can be drawn"
        )


def greedy(logits: torch.Tensor) -> int:
    """`torch.argmax` of a logits row (the first of equal largest values; the first NaN, if
    any), through `max` along the row, which returns the same index: 35 against 82 us for
    SmolLM2's 49,152 logits on a CPU (tests/worker/test_stop_and_sampling.py holds them equal).
    On other devices `max` does not promise the first of equal values: argmax there."""
    if logits.device.type != "cpu":
        return int(torch.argmax(logits))
    return int(logits.max(dim=-1).indices)


@dataclass(slots=True)
class Sampler:
    """Draws one sample's tokens."""

    params: SamplingParams
    seed: int
    penalties: Penalties | None = None
    """None: the request penalizes nothing."""
    constraint: Constraint | None = None
    """None: free text."""
    shaping: LogitShaping | None = None
    """The request's logit bias, allowed tokens and min_tokens; None: none of them."""
    bad_words: BadWords | None = None
    """The request's bad words, with this sample's recent tokens; None: none."""
    thinking: ThinkingTokens | None = None
    """The sample's thinking tokens, whose budget may force its next ones; None: none."""
    generated: int = 0
    """Tokens this sample has generated (drawn here or replayed)."""
    generator: torch.Generator = field(default_factory=torch.Generator)

    @classmethod
    def create(
        cls,
        params: SamplingParams,
        index: int,
        penalties: Penalties | None = None,
        constraint: Constraint | None = None,
        shaping: LogitShaping | None = None,
        bad_words: BadWords | None = None,
        thinking: ThinkingTokens | None = None,
    ) -> Sampler:
        seed = sample_seed(params.seed, index)
        return cls(params, seed, penalties, constraint, shaping, bad_words, thinking)

    def __call__(self, logits: torch.Tensor, position: int) -> int:
        """The token at `position` (its index in the sequence), from a float32 logits row
        [vocab] (on any device; penalized and constrained there, sampled on the CPU). Counts it
        as generated. `GrammarRefused` if a constraint's allowed tokens are all -inf or NaN.
        A thinking budget's forced token is taken instead of a draw (`_forced`); a grammar
        that waits for the reasoning's end is not applied before it (`_grammar`)."""
        grammar = self._grammar()
        forced = self._forced(grammar)
        if forced is not None:
            return self._record(forced, grammar)
        scores = logits
        if self.shaping is not None:
            scores = self.shaping.apply(scores, self.generated)
        if self.bad_words is not None:
            scores = self.bad_words.apply(scores, owned=scores is not logits)
        if self.penalties is not None:
            scores = self.penalties.apply(scores)
        if grammar is not None:
            scores = grammar.mask(scores, owned=scores is not logits)
        return self._record(self._draw(scores, position), grammar)

    def _grammar(self) -> Constraint | None:
        """The constraint that applies to the next token: none while a grammar that waits for
        the reasoning's end waits. At the end it is first given the text after `</think>` in
        the closing token, or, if it refuses that, the text less its leading whitespace (which
        JSON and tool calls do not allow); text it refuses both ways stays before the answer,
        and the grammar starts at the next token, as vLLM's does."""
        thinking = self.thinking
        if thinking is None or not thinking.grammar_waits or self.constraint is None:
            return self.constraint
        if thinking.split.reasoning:
            return None
        if thinking.after_close is not None:
            text, thinking.after_close = thinking.after_close, None
            if text and not self.constraint.accept_text(text) and text.lstrip():
                self.constraint.accept_text(text.lstrip())  # a refusal changes nothing
        return self.constraint

    def _forced(self, grammar: Constraint | None) -> int | None:
        """The thinking budget's next forced token (worker/thinking_tokens.py). A close is
        checked whole before its first token: if the grammar in force does not allow all of
        it next, or min_tokens holds one of its tokens back, the budget gives the forcing up."""
        thinking = self.thinking
        if thinking is None or not thinking.pending:
            return None
        if not thinking.checked:
            thinking.checked = True
            close = thinking.pending
            held = self.shaping is not None and self.shaping.holds(close, self.generated)
            if held or (grammar is not None and not grammar.allows(close)):
                thinking.give_up()
                return None
        return thinking.pending[0]

    def _record(self, token: int, grammar: Constraint | None) -> int:
        self.generated += 1
        if self.bad_words is not None:
            self.bad_words.record(token)
        if self.penalties is not None:
            self.penalties.record(token)
        if grammar is not None:
            grammar.accept(token)
        return token

    def follow(self, token: int) -> None:
        """A resumed sample's token, replayed through a grammar that waited for the reasoning
        (`replay` leaves that grammar alone): before the token's thinking step, as a draw."""
        grammar = self._grammar()
        if grammar is not None:
            grammar.accept(token)

    @property
    def complete(self) -> bool:
        """A structured output's text is whole (it ended with an end-of-sequence token)."""
        return self.constraint is not None and self.constraint.complete

    def replay(self, generated: Sequence[int]) -> None:
        """Count the tokens generated before this sampler existed (a resumed sample's), and
        follow them through the constraint (`GrammarRefused` if they leave it)."""
        self.generated += len(generated)
        if self.bad_words is not None:
            self.bad_words.replay(generated)
        if self.penalties is not None and generated:
            self.penalties.replay(generated)
        waits = self.thinking is not None and self.thinking.grammar_waits
        if self.constraint is not None and not waits:  # else `follow`, token by token
            for token in generated:
                self.constraint.accept(token)

    def _draw(self, logits: torch.Tensor, position: int) -> int:
        p = self.params
        banning = self.shaping is not None or self.bad_words is not None
        if p.greedy:
            token = greedy(logits)
            if banning and float(logits[token]) == float("-inf"):
                raise NothingToDraw
            return token
        scores = logits.detach().to("cpu", torch.float64) / p.temperature
        if banning and float(scores.max()) == float("-inf"):
            raise NothingToDraw
        if p.min_p:  # after temperature, before top-k and top-p, as vLLM
            probs = torch.softmax(scores, dim=-1)
            scores = scores.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        if p.top_k and p.top_k < scores.shape[0]:
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1:
            ordered, order = torch.sort(probs, descending=True)
            before = torch.cumsum(ordered, dim=0) - ordered
            ordered = ordered.masked_fill(before >= p.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, ordered)
        self.generator.manual_seed(draw_seed(self.seed, position))
        return int(torch.multinomial(probs, 1, generator=self.generator))
