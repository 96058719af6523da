"""A prompt's logprobs in the two shapes clients read them:

- OpenAI's legacy completions with `echo: true` and `logprobs: k` (lm-evaluation-harness's
  loglikelihood requests): the prompt's tokens lead the choice's `logprobs`, the first with
  null (nothing comes before it), each with its k alternatives and itself;
- vLLM's `prompt_logprobs: k`: per prompt token (null for the first), token id -> logprob,
  rank and decoded text, for the token itself and its k most likely alternatives.

Both come from what the worker sends once, on the request's first message
(`GenerateResponse.prompt_logprobs` and `prompt_token_ids`).

`echo` with `max_tokens: 0` (OpenAI's legacy way to score a text, which vLLM serves) asks the
worker for one token and drops it: each choice is the prompt alone, `finish_reason` "length",
no completion tokens (`prompt_alone`; a failure is still a failure).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from itertools import accumulate

from cluster.http.openai_schema import CompletionLogprobs, PromptLogprob, PromptLogprobs
from cluster.http.token_texts import TokenTexts
from protos.radixmesh.v1 import serving_pb2

LEAST_LOGPROB = -9999.0
"""What OpenAI writes for -inf (JSON has no infinity); vLLM clamps to it too."""


@dataclass(frozen=True)
class ScoredPrompt:
    token_ids: list[int]
    scores: list[serving_pb2.TokenLogprob]
    """One per token after the first."""

    @classmethod
    def of(cls, response: serving_pb2.GenerateResponse) -> ScoredPrompt | None:
        if not response.prompt_token_ids:
            return None
        return cls(list(response.prompt_token_ids), list(response.prompt_logprobs))


def top_dict(texts: TokenTexts, token: int, entry: serving_pb2.TokenLogprob) -> dict[str, float]:
    """A completion's `top_logprobs` entry: the token itself, then its alternatives (OpenAI:
    "up to logprobs + 1 elements"), keyed by their text."""
    pairs = [(token, entry.logprob), *zip(entry.top_ids, entry.top_logprobs, strict=True)]
    return {texts.text(t): max(lp, LEAST_LOGPROB) for t, lp in pairs}


def echoed(texts: TokenTexts, prompt: ScoredPrompt) -> CompletionLogprobs:
    """The prompt's part of an echoing completion's logprobs."""
    ids, tokens = prompt.token_ids, [texts.text(t) for t in prompt.token_ids]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None, *(max(s.logprob, LEAST_LOGPROB) for s in prompt.scores)],
        top_logprobs=[
            None,
            *(top_dict(texts, t, s) for t, s in zip(ids[1:], prompt.scores, strict=True)),
        ],
        text_offset=[0, *accumulate(len(t) for t in tokens[:-1])],
    )


def joined(first: CompletionLogprobs | None, then: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return then
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def vllm_prompt_logprobs(texts: TokenTexts, prompt: ScoredPrompt) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`."""
    out: PromptLogprobs = [None]
    for token, entry in zip(prompt.token_ids[1:], prompt.scores, strict=True):
        ranked: Sequence[tuple[int, float, int]] = [
            (token, entry.logprob, entry.rank),
            *(
                (t, lp, rank)
                for rank, (t, lp) in enumerate(
                    zip(entry.top_ids, entry.top_logprobs, strict=True), 1
                )
            ),
        ]
        out.append(
            {
                str(t): PromptLogprob(
                    logprob=max(lp, LEAST_LOGPROB), rank=rank, decoded_token=texts.text(t)
                )
                for t, lp, rank in ranked
            }
        )
    return out


async def prompt_alone(
    stream: AsyncGenerator[serving_pb2.GenerateResponse, None],
) -> AsyncGenerator[serving_pb2.GenerateResponse, None]:
    """The stream with what was generated taken out of each message (`max_tokens: 0`)."""
    async with contextlib.aclosing(stream) as messages:
        async for message in messages:
            del message.token_ids[:], message.logprobs[:]
            message.text, message.stop_string = "", ""
            if message.finished and message.finish_reason == "stop":  # an error stays one
                message.finish_reason = "length"
            yield message
