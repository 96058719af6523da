"""One sample's thinking tokens, read from its raw text: counted (the usage's reasoning tokens),
and, with a budget (vLLM's `thinking_token_budget`, Anthropic's `thinking.budget_tokens`),
closed at it: once the sample has generated that many tokens inside its reasoning, its next
tokens are `</think>`'s, forced, and it goes on to its answer.

    prompt ... <think>  r1 r2 ... rB  </think>  answer ...
                        \\_ budget B _/  forced

Where the reasoning is, is read as the split reads it (worker/reasoning.py), from the sample's
own text before stop strings hold any of it back: a prompt that opens `<think>`, or a `<think>`
the model writes first. The tokens counted against the budget are those generated inside it; a
sample that closes its reasoning itself before the budget is never forced. A budget of 0 forces
the close as the first token of a sample whose prompt opened the reasoning.

The forced tokens are the tokenizer's spelling of `</think>` (one token in Qwen3's and
DeepSeek-R1's vocabularies). The sampler writes them in place of a draw (worker/sampling.py):
the request's bias, bans and penalties do not hold them back (the penalties and bad words still
count them), but its structured output's grammar and its `min_tokens` do. Where the grammar
does not allow the whole close next, or `min_tokens` holds back one of its tokens (a stop
token), the sampler gives the forcing up and the sample draws as usual. A resumed sample
`step`s through the tokens it generated before, and so goes on forcing the rest of a close
that was cut mid-way.

A structured output that constrains the answer from its first token (JSON, a required tool
call) of a prompt that opened the reasoning waits for the reasoning to end (`grammar_waits`),
as vLLM holds its grammar back: the sampler draws the reasoning freely, and the grammar starts
with the text that follows `</think>` in the closing token (`after_close`, less its leading
whitespace if the grammar refuses it whole: `Sampler._grammar`) and the tokens after.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.reasoning import ReasoningSplit


class ThinkingTokens:
    """One sample's reasoning, from its raw text: its tokens counted, and the close it is made
    to write at `budget` (None: no budget; it only counts)."""

    def __init__(
        self,
        budget: int | None,
        close_ids: Sequence[int],
        inside: bool,
        grammar_waits: bool = False,
    ) -> None:
        """`inside`: the prompt opened the reasoning (worker/reasoning.py `prompt_opens`).
        `grammar_waits`: the sample's grammar starts where its reasoning ends."""
        self.budget = budget
        self.grammar_waits = grammar_waits
        self.after_close: str | None = None
        """With `grammar_waits`: the text after `</think>` in the token that closed the
        reasoning, until the sampler gives it to the grammar."""
        self.close_ids = tuple(close_ids)
        self.split = ReasoningSplit(inside)
        self.used = 0
        """Tokens generated inside the reasoning before the close was forced."""
        self.pending: list[int] = []
        """The rest of the close to force, next first."""
        self.checked = False
        """Whether the sampler has found `pending` allowed (worker/sampling.py)."""
        self.closed = False
        """The close was begun (or given up): the budget forces nothing more."""
        self._check()

    @property
    def forced(self) -> int | None:
        """The token the sample must write next; None: it draws."""
        return self.pending[0] if self.pending else None

    def step(self, token: int, text: str) -> int:
        """Follow one generated token and its text (as the decoder gave it); how many tokens
        it makes the reasoning's (`ReasoningSplit.feed_token`)."""
        if self.pending:
            if token == self.pending[0]:
                self.pending.pop(0)
            else:  # drawn instead (a replay of another worker's choice): no more forcing
                self.give_up()
        inside = self.split.reasoning
        _, content, counted = self.split.feed_token(text)
        if inside and self.split.reasoning and not self.closed:
            self.used += 1
        if inside and not self.split.reasoning and self.grammar_waits:
            self.after_close = content
        self._check()
        return counted

    def give_up(self) -> None:
        """Force nothing more (the sample's grammar or min_tokens does not allow the close)."""
        self.pending.clear()
        self.closed = True

    def _check(self) -> None:
        if self.budget is None or self.closed:
            return
        if self.split.reasoning and self.used >= self.budget:
            self.closed, self.checked = True, False
            self.pending = list(self.close_ids)
