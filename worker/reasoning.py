"""A thinking model's reasoning, told apart from its answer (vLLM's and SGLang's reasoning
parsers for `<think>` models: Qwen3, QwQ, the DeepSeek-R1 distills). Imports no torch.

A sample asking for it (`SamplingParams.separate_reasoning`, which the chat APIs set) of a model
whose chat template closes a `</think>` streams its text in two parts:

    [<think>] reasoning </think> content          the tags themselves go to neither

- Whether the sample starts inside its reasoning is read from the prompt: a template that
  opens `<think>` for the model (DeepSeek-R1's, Qwen3.5's) ends the prompt with it; a template
  whose thinking is switched off (Qwen3's `enable_thinking: false`) leaves `<think></think>`
  closed, and the whole answer is content. An output constrained to an answer (JSON, a
  required tool call, a choice or pattern without the tag) of a prompt that opened the
  reasoning reasons freely first: its grammar waits for the reasoning's end
  (worker/thinking_tokens.py), as vLLM holds its grammar back.
- Otherwise a `<think>` the model writes first, after whitespace only, opens it (Qwen3's
  original template). Text that begins with anything else is content, all of it.
- After `</think>` everything is content, a later `<think>` included: an answer that quotes
  the tags is not read as more reasoning.
- A sample cut before its `</think>` (max_tokens) is reasoning to the end, as vLLM reads it.

Text is split, not tokens: the tags are found whether the model wrote them as one token or
several, and a tag cut across two messages is held back until it is whole or cannot be.
"""

from __future__ import annotations

import json
from enum import Enum

from worker.sampling_params import StructuredOutput

OPEN, CLOSE = "<think>", "</think>"


def template_thinks(chat_template: str | None) -> bool:
    """Whether a chat template is a thinking model's: it writes or strips a `</think>`."""
    return chat_template is not None and CLOSE in chat_template


def prompt_opens(prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves a `<think>` open for the model: its
    generation prompt ends with the tag. A tag quoted in a user's turn does not count, nor does
    one in a prefill the model continues (its continuation is read as a new answer)."""
    return prompt_tail.rstrip().endswith(OPEN)


def may_hold_reasoning(structured: StructuredOutput | None) -> bool:
    """Whether `structured` itself may write reasoning before its answer: free text, a tool
    call that free text may come before (tool_choice "auto"), or a choice, pattern or grammar
    that writes the `</think>` itself. Any other (JSON, a required call) is the answer alone:
    its grammar waits for a reasoning the prompt opened to end (worker/thinking_tokens.py)."""
    if structured is None:
        return True
    if structured.kind == "structural_tag":  # worker/tool_calls.py's "auto" triggers on a tag
        try:
            form = json.loads(structured.spec).get("format")
        except (ValueError, AttributeError):
            return False
        return isinstance(form, dict) and form.get("type") == "triggered_tags"
    if structured.kind == "choice":
        return any(CLOSE in choice for choice in structured.choices)
    return structured.kind in ("regex", "grammar") and CLOSE in structured.spec


class _State(Enum):
    START = "start"
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningSplit:
    """One sample's text, streamed into (reasoning, content) deltas whose concatenations are
    the same whatever pieces the text comes in (`feed` each piece, `flush` at the end)."""

    def __init__(self, inside: bool) -> None:
        """`inside`: the prompt opened the reasoning (`prompt_opens`)."""
        self.inside = inside
        self.state = _State.START
        self.held = ""
        self.waiting = 0
        """Tokens fed while it waits to see whether the text opens with `<think>`."""

    @property
    def reasoning(self) -> bool:
        """Whether text fed now goes to the reasoning (unless it closes it): inside, or at the
        start of a sample whose prompt opened it."""
        return self.state is _State.REASONING or (self.state is _State.START and self.inside)

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        if self.state is _State.START:
            head = self.held.lstrip()
            if head.startswith(OPEN):  # the model opened it (again, if the prompt had)
                self.held, self.state = head[len(OPEN) :], _State.REASONING
            elif OPEN.startswith(head):  # whitespace, or a tag begun: wait
                return "", ""
            else:
                self.state = _State.REASONING if self.inside else _State.CONTENT
        if self.state is _State.REASONING:
            at = self.held.find(CLOSE)
            if at < 0:  # all of it is reasoning but an end that may begin the tag
                cut = len(self.held) - _partial(self.held, CLOSE)
                reasoning, self.held = self.held[:cut], self.held[cut:]
                return reasoning, ""
            reasoning, self.held = self.held[:at], self.held[at + len(CLOSE) :]
            self.state = _State.CONTENT
        content, self.held = self.held, ""
        return reasoning, content

    def feed_token(self, text: str) -> tuple[str, str, int]:
        """`feed` one token's text; also how many tokens this one makes the reasoning's: 1
        if it is (in the reasoning before, or after: its open), with the tokens held at the
        start when they turn out to spell the model's own `<think>`; 0 for an answer's."""
        before, starting = self.reasoning, self.state is _State.START
        reasoning, content = self.feed(text)
        if self.state is _State.START:  # still undecided (a prompt's open counts them now)
            self.waiting += not before
            return reasoning, content, int(before)
        held, self.waiting = self.waiting, 0
        if starting and self.reasoning and not before:  # the model's own open, whole
            return reasoning, content, held + 1
        return reasoning, content, int(before or self.reasoning)

    def flush(self) -> tuple[str, str]:
        """What is still held, at the sample's end: a tag never finished is text."""
        held, self.held = self.held, ""
        if self.state is _State.REASONING or (self.state is _State.START and self.inside):
            return held, ""
        return "", held


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and is not all of it)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split_reasoning(text: str, inside: bool) -> tuple[str, str]:
    """A whole text's (reasoning, content)."""
    split = ReasoningSplit(inside)
    reasoning, content = split.feed(text)
    more_reasoning, more_content = split.flush()
    return reasoning + more_reasoning, content + more_content
