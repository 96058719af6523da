"""vLLM's beam search on the chat and text completions APIs (`use_beam_search`: `n` beams,
`length_penalty`), run by the router over its workers as vLLM's server runs it over its engine.

Each step sends every live beam's prompt and tokens so far as one request of one greedy token
with the `2 x n` most likely next tokens and their logprobs (the model's raw distribution); of
every beam's candidates, the `n` with the highest cumulative logprob live on, and one that ends
in an end-of-sequence token (unless `ignore_eos`) is set aside, finished. After `max_tokens`
steps, or once no beam lives, the finished and the live are ranked by vLLM's score, the
cumulative logprob over the length to the power `length_penalty` (the length counting the
prompt, as vLLM counts it), and the best `n` are the choices, best first.

The first step's request is the client's own (its chat template, truncation and namespace); the
later ones send token ids, so every step reads the prompt and the beam's earlier tokens from
the cache of the worker the cache-aware router sends it to: a step computes one position a beam.

What would change a token's logprob and so the search (penalties, biases, allowed or bad
tokens, min_tokens, a structured output, tools, a prediction) is refused by name, and so are
stop strings (an end-of-sequence token ends a beam) and images. Streamed, as vLLM streams it,
each choice comes whole in a chunk of its own once the search ends. The sampling
parameters that only shape a draw (temperature, top_p, top_k, min_p, seed) are accepted and
have no effect, as in vLLM: the search draws nothing.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc

from cluster.http.errors import HttpError
from cluster.http.openai_responses import Counts, Sample
from cluster.http.openai_schema import GenerationParams
from cluster.http.several_prompts import every
from cluster.requests import suffixed
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2
from worker.request import FINISH_ABORT

DEFAULT_MAX_TOKENS = 16
"""A text completion's steps without max_tokens (the legacy API's default, as the workers')."""
MAX_WIDTH = 10
"""The most beams: a step asks for 2 x n logprobs, at most 20 (the workers' bound)."""
STEPS_IN_FLIGHT = 16
"""A search's step requests at once, all its prompts' together, so that one request does not
take `router.max_in_flight` for itself."""
REFUSED = (
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "thinking_token_budget",
    "prompt_logprobs",
    "tools",
    "functions",
    "prediction",
    "echo",
    "suffix",
    "best_of",
)
"""Parameters refused with `use_beam_search` when set to more than their default."""
Run = Callable[[serving_pb2.GenerateRequest], Awaitable[tuple[dict[int, Sample], Counts]]]
"""Serve one request through the router, whole."""


@dataclass(frozen=True, slots=True)
class Beam:
    tokens: tuple[int, ...] = ()
    logprobs: tuple[serving_pb2.TokenLogprob, ...] = ()
    """One per token of `tokens`, with the step's alternatives."""
    cumulative: float = 0.0
    ended: bool = False
    """By an end-of-sequence token (in `tokens` only with include_stop_str_in_output)."""


@dataclass(frozen=True, slots=True)
class Search:
    """One prompt's search, as the request asked it."""

    width: int
    max_tokens: int | None
    """None: up to the end of the context (the chat API without max_tokens)."""
    length_penalty: float
    ignore_eos: bool
    keep_eos: bool
    """include_stop_str_in_output: an ending end-of-sequence token stays in the beam."""
    top: int
    """Alternatives each returned token's logprob shows (0: none asked)."""


def check(body: GenerationParams, images: bool) -> None:
    """Refuse, by name, what beam search does not do."""
    if images:
        raise HttpError.invalid("messages", "images are not searched: not with use_beam_search")
    for name in REFUSED:
        value = getattr(body, name, None)
        default = type(body).model_fields[name].default if name in type(body).model_fields else None
        if value is not None and value != default and value not in ([], {}, ""):
            raise HttpError.invalid(name, "not with use_beam_search")
    width = 1 if body.n is None else body.n
    if not 1 <= width <= MAX_WIDTH:
        raise HttpError.invalid("n", f"the beams: from 1 to {MAX_WIDTH} with use_beam_search")
    if not math.isfinite(body.length_penalty):
        raise HttpError.invalid(
            "length_penalty", f"must be a finite number, got {body.length_penalty}"
        )


def step_sampling(asked: Search) -> serving_pb2.SamplingParams:
    """One greedy token with the 2 x width most likely in its place (more when the client
    asked for more alternatives: only the first 2 x width are candidates)."""
    return serving_pb2.SamplingParams(
        max_tokens=1,
        temperature=0.0,
        n=1,
        ignore_eos=True,
        logprobs=max(2 * asked.width, asked.top),
    )


async def search(
    run: Run,
    message: serving_pb2.GenerateRequest,
    asked: Search,
    eos: frozenset[int],
    max_model_len: int,
) -> tuple[list[Beam], list[int], Counts]:
    """The best beams, best first; the prompt's ids; the first step's counts (its prompt and
    how much of it was cached). A max_tokens the context cannot hold after the prompt is
    refused by name, as without beam search."""
    first = serving_pb2.GenerateRequest()
    first.CopyFrom(message)
    first.sampling.CopyFrom(step_sampling(asked))
    first.sampling.return_prompt_token_ids = True
    if message.truncate_prompt_tokens == -1 and asked.max_tokens is not None:
        # -1 leaves room for max_tokens, not for the first step's one token
        first.truncate_prompt_tokens = max(1, max_model_len - asked.max_tokens)
    samples, counts = await run(first)
    prompt = list(_first(counts).prompt_token_ids)
    limit = max_model_len - len(prompt)
    if asked.max_tokens is not None and asked.max_tokens > limit:
        raise ServingError(  # as the core refuses it, and counted as its refusals are
            grpc.StatusCode.INVALID_ARGUMENT,
            f"max_tokens: {asked.max_tokens} tokens after the prompt's {len(prompt)}: the "
            f"context ({max_model_len}) leaves {limit}",
            field="max_tokens",
        )
    steps = limit if asked.max_tokens is None else asked.max_tokens
    live, ended = _next([Beam()], [samples[0]], asked, eos)
    tag = uuid.uuid4().hex[:8]  # the prompts of one request share a cut request id
    for step in range(1, steps):
        if not live:
            break
        requests = [
            _step(message, prompt, beam, asked, f"{tag}.{step}.{k}") for k, beam in enumerate(live)
        ]
        answers = await every([run(r) for r in requests])
        live, done = _next(live, [a[0][0] for a in answers], asked, eos)
        ended += done
    prompt_length = len(prompt)
    ranked = sorted(
        [*ended, *live],
        key=lambda beam: _score(beam, prompt_length, asked),
        reverse=True,
    )
    return ranked[: asked.width], prompt, counts


def _first(counts: Counts) -> serving_pb2.GenerateResponse:
    assert counts.first is not None, "a served request has a first message"
    return counts.first


def _step(
    message: serving_pb2.GenerateRequest,
    prompt: list[int],
    beam: Beam,
    asked: Search,
    suffix: str,
) -> serving_pb2.GenerateRequest:
    """A beam's step: its ids so far, in the client's namespace, at its priority; its id the
    request's and `suffix` (`suffixed`)."""
    request = serving_pb2.GenerateRequest(
        request_id=suffixed(message.request_id, f".{suffix}"),
        token_ids=serving_pb2.TokenIds(ids=[*prompt, *beam.tokens]),
        sampling=step_sampling(asked),
        priority=message.priority,
        text_match=message.text_match,
    )
    request.namespace.CopyFrom(message.namespace)
    return request


def _next(
    beams: Sequence[Beam], answers: Sequence[Sample], asked: Search, eos: frozenset[int]
) -> tuple[list[Beam], list[Beam]]:
    """The beams that live on (the `width` best of every beam's candidates) and those the
    candidates ended."""
    grown: list[Beam] = []
    ended: list[Beam] = []
    for beam, answer in zip(beams, answers, strict=True):
        if answer.finish_reason == FINISH_ABORT:  # as an aborted call is counted: CANCELLED
            raise ServingError(
                grpc.StatusCode.CANCELLED,
                "use_beam_search: a step of the search was aborted (an Abort, or its worker "
                "stopping)",
            )
        if not answer.logprobs:
            raise HttpError(500, f"a beam step came back without logprobs ({answer.finish_reason})")
        place = answer.logprobs[0]
        candidates = 2 * asked.width
        for rank, (token, logprob) in enumerate(
            zip(place.top_ids[:candidates], place.top_logprobs[:candidates], strict=True), start=1
        ):
            shown = serving_pb2.TokenLogprob(
                logprob=logprob,
                top_ids=place.top_ids[: asked.top],
                top_logprobs=place.top_logprobs[: asked.top],
                rank=rank,
            )
            cumulative = beam.cumulative + logprob
            if token in eos and not asked.ignore_eos:
                kept = (token,) if asked.keep_eos else ()
                logprobs = (shown,) if asked.keep_eos else ()
                ended.append(
                    Beam(beam.tokens + kept, beam.logprobs + logprobs, cumulative, ended=True)
                )
            else:
                grown.append(Beam((*beam.tokens, token), (*beam.logprobs, shown), cumulative))
    grown.sort(key=lambda each: each.cumulative, reverse=True)
    return grown[: asked.width], ended


def _score(beam: Beam, prompt_length: int, asked: Search) -> float:
    """What ranks the beams as vLLM's score does, the cumulative logprob over the length
    (prompt and beam, an ending end-of-sequence token not counted) to the power
    `length_penalty`, but taken in logs: `-log(-score)`, which orders as the score and cannot
    overflow whatever the penalty (a score of 0, a beam certain, ranks first)."""
    length = prompt_length + len(beam.tokens) - (1 if beam.ended and asked.keep_eos else 0)
    if beam.cumulative >= 0:
        return math.inf
    return asked.length_penalty * math.log(max(length, 1)) - math.log(-beam.cumulative)


async def responses(
    searches: Sequence[Callable[[], Awaitable[tuple[list[Beam], list[int], Counts]]]],
    decode: Callable[[list[int]], Awaitable[str]],
    width: int,
    prompt_ids: bool,
) -> AsyncGenerator[serving_pb2.GenerateResponse, None]:
    """Each prompt's best beams as the messages of its finished samples (sample p x width + i
    is prompt p's i-th best), as a generation's stream would end them."""
    found = await every([each() for each in searches])
    for p, (beams, prompt, counts) in enumerate(found):
        first = _first(counts)
        for i, beam in enumerate(beams):
            response = serving_pb2.GenerateResponse(
                request_id=first.request_id,
                index=p * width + i,
                token_ids=beam.tokens,
                text=await decode(list(beam.tokens)),
                finished=True,
                finish_reason="stop" if beam.ended else "length",
                prompt_tokens=first.prompt_tokens,
                cached_prompt_tokens=first.cached_prompt_tokens,
                predicted_cached_tokens=first.predicted_cached_tokens,
                worker=first.worker,
                logprobs=beam.logprobs,
            )
            if prompt_ids and i == 0:
                response.prompt_token_ids.extend(prompt)
            yield response


def asked_search(body: GenerationParams, max_tokens: int | None, top: int) -> Search:
    return Search(
        width=1 if body.n is None else body.n,
        max_tokens=max_tokens,
        length_penalty=body.length_penalty,
        ignore_eos=body.ignore_eos,
        keep_eos=body.include_stop_str_in_output,
        top=top,
    )
