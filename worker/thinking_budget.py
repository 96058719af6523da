"""A thinking model's reasoning cut at a budget of tokens (vLLM's `thinking_token_budget`,
Anthropic's `thinking.budget_tokens`): once a sample has generated that many tokens inside its
reasoning, its next tokens are `</think>`'s, forced, and it goes on to its answer.

    prompt ... <think>  r1 r2 ... rB  </think>  answer ...
                        \\_ budget B _/  forced

Where the reasoning is, is read as the split reads it (worker/reasoning.py), from the sample's
own text before stop strings hold any of it back: a prompt that opens `<think>`, or a `<think>`
the model writes first. The tokens counted are those generated inside it; a sample that closes
its reasoning itself before the budget is never forced. A budget of 0 forces the close as the
first token of a sample whose prompt opened the reasoning.

The forced tokens are the tokenizer's spelling of `</think>` (one token in Qwen3's and
DeepSeek-R1's vocabularies). They take the place of the draw: the request's bias, bans and
penalties do not hold them back (the penalties and bad words still count them), but a
structured output's grammar does: where it does not allow the next forced token, the sample
draws as usual and the budget gives up forcing (a grammar that must write `</think>` itself
decides when). A resumed sample `step`s through the tokens it generated before, and so goes on
forcing the rest of a close that was cut mid-way.
"""

from __future__ import annotations

from collections.abc import Sequence

from worker.reasoning import ReasoningSplit


class ThinkingBudget:
    """One sample's count of reasoning tokens, and the close it is made to write."""

    def __init__(self, budget: int, close_ids: Sequence[int], inside: bool) -> None:
        """`inside`: the prompt opened the reasoning (worker/reasoning.py `prompt_opens`)."""
        self.budget = budget
        self.close_ids = tuple(close_ids)
        self.split = ReasoningSplit(inside)
        self.used = 0
        """Tokens generated inside the reasoning before the close was forced."""
        self.pending: list[int] = []
        """The rest of the close to force, next first."""
        self.closed = False
        """The close was begun: the budget forces nothing more."""
        self._check()

    @property
    def forced(self) -> int | None:
        """The token the sample must write next; None: it draws."""
        return self.pending[0] if self.pending else None

    def step(self, token: int, text: str) -> None:
        """Follow one generated token and its text (as the decoder gave it)."""
        if self.pending:
            if token == self.pending[0]:
                self.pending.pop(0)
            else:  # the grammar drew instead: it decides where the reasoning ends
                self.pending.clear()
        inside = self.split.reasoning
        self.split.feed(text)
        if inside and self.split.reasoning and not self.closed:
            self.used += 1
        self._check()

    def _check(self) -> None:
        if not self.closed and self.split.reasoning and self.used >= self.budget:
            self.closed = True
            self.pending = list(self.close_ids)
