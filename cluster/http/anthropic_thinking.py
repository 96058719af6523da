"""Anthropic's extended thinking (`thinking`), served by a thinking model (worker/reasoning.py:
one whose chat template closes a `</think>`).

    absent               the answer alone, the reasoning left out (as before `thinking` existed)
    {"type": "enabled", "budget_tokens": N}
                         the reasoning as a `thinking` block before the answer, closed after N
                         tokens (SamplingParams.thinking_token_budget: `</think>` is forced)
    {"type": "adaptive"} the reasoning as a `thinking` block, as long as the model wants
    {"type": "disabled"} the answer alone; the template is asked not to think
                         (`enable_thinking: false`, which Qwen3's reads; others ignore it)
    "display": "omitted" the `thinking` block comes with its text left empty

Anthropic requires `budget_tokens` >= 1,024; radixmesh takes any budget from 1 (a small model's
reasoning is short) but keeps Anthropic's other rule, a budget under `max_tokens`: the thinking
counts against it. A model that does not think answers as it always does, with no `thinking`
block. A block's `signature` is a digest of its text: Anthropic's SDKs require one, and clients
send it back with the block; radixmesh checks none it receives (it has no secret to sign with,
and a turn's reasoning is the template's to use or drop).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from cluster.http.anthropic_schema import ThinkingConfig
from cluster.http.errors import HttpError
from protos.radixmesh.v1 import serving_pb2


@dataclass(frozen=True)
class Thinking:
    shown: bool = False
    """The reasoning comes back as a `thinking` block."""
    omitted: bool = False
    """The block's text is left empty (`display: "omitted"`)."""
    budget: int | None = None
    """The reasoning's budget of tokens; None: none."""
    enable: bool | None = None
    """The template's `enable_thinking`; None: the template's default."""

    def apply(self, message: serving_pb2.GenerateRequest) -> None:
        """Ask the serving core for it."""
        if self.budget is not None:
            message.sampling.thinking_token_budget = self.budget
        message.chat_template_kwargs = self.template_kwargs()

    def template_kwargs(self) -> str:
        """The chat template's variables it sets, as GenerateRequest.chat_template_kwargs."""
        return "" if self.enable is None else json.dumps({"enable_thinking": self.enable})


def read_thinking(config: ThinkingConfig | None, max_tokens: int | None = None) -> Thinking:
    """What `thinking` asks for (`max_tokens`: the request's; None: a token count's, which has
    none), refused by name where Anthropic's API would refuse it."""
    if config is None:
        return Thinking()
    budget = config.budget_tokens
    if config.type != "enabled":
        if budget is not None:
            raise HttpError.invalid("thinking.budget_tokens", 'is only for type "enabled"')
        if config.type == "disabled":
            if config.display is not None:
                raise HttpError.invalid("thinking.display", 'is not for type "disabled"')
            return Thinking(enable=False)
        return Thinking(shown=True, omitted=config.display == "omitted", enable=True)
    if budget is None:
        raise HttpError.invalid("thinking.budget_tokens", 'is required with type "enabled"')
    if budget < 1:
        raise HttpError.invalid("thinking.budget_tokens", f"must be >= 1, got {budget}")
    if max_tokens is not None and budget >= max_tokens:
        raise HttpError.invalid(
            "max_tokens",
            f"`max_tokens` must be greater than `thinking.budget_tokens`: {max_tokens} <= {budget}",
        )
    return Thinking(True, config.display == "omitted", budget, enable=True)


def signature(thinking: str) -> str:
    """A `thinking` block's signature: a digest of its text."""
    return hashlib.blake2b(thinking.encode(), digest_size=24).hexdigest()
