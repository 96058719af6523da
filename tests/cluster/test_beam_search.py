"""cluster/http/beam_search.py's search over a scripted distribution (the next tokens' logprobs
by the last token), where an end-of-sequence token ends beams and the length penalty decides
between beams of different lengths: the choices worked out by hand, as vLLM ranks them. (The
tiny model rarely ranks its end-of-sequence token high enough to end a beam, so the HTTP tests,
tests/cluster/test_http_beam_search.py, cannot pin these.) Also: the context bound, a -1
truncation, and a failed step ending the search with nothing left running."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from cluster.http.beam_search import Search, search
from cluster.http.errors import HttpError
from cluster.http.openai_responses import Counts, Sample
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2

EOS = 9
NEXT = {  # last token -> its 4 (2 x 2 beams) most likely next tokens, most likely first
    0: [(1, -0.1), (EOS, -0.5), (2, -1.0), (3, -2.0)],
    1: [(EOS, -0.05), (2, -0.3), (1, -0.4), (3, -3.0)],
    2: [(3, -0.2), (EOS, -0.6), (1, -0.7), (2, -0.9)],
    3: [(1, -0.1), (2, -0.2), (3, -0.3), (EOS, -0.4)],
    EOS: [(1, -1.0), (2, -1.1), (3, -1.2), (EOS, -1.3)],  # with ignore_eos
}
Run = Callable[[serving_pb2.GenerateRequest], Awaitable[tuple[dict[int, Sample], Counts]]]


def scripted(prompt: list[int], asked: list[serving_pb2.GenerateRequest]) -> Run:
    """One greedy step of the scripted model, answered as a worker answers it; a text prompt
    is `prompt` (which ends in 0). Each request is kept in `asked`."""

    async def run(message: serving_pb2.GenerateRequest) -> tuple[dict[int, Sample], Counts]:
        asked.append(message)
        ids = list(message.token_ids.ids) if message.HasField("token_ids") else prompt
        assert message.sampling.logprobs == 4 and message.sampling.max_tokens == 1
        ranked = NEXT[ids[-1]]
        response = serving_pb2.GenerateResponse(
            request_id=message.request_id,
            token_ids=[ranked[0][0]],
            finished=True,
            finish_reason="length",
            prompt_tokens=len(ids),
            logprobs=[
                serving_pb2.TokenLogprob(
                    logprob=ranked[0][1],
                    top_ids=[token for token, _ in ranked],
                    top_logprobs=[logprob for _, logprob in ranked],
                )
            ],
        )
        if message.sampling.return_prompt_token_ids:
            response.prompt_token_ids.extend(ids)
        counts, sample = Counts(), Sample()
        counts.record(response)
        sample.take(response)
        return {0: sample}, counts

    return run


def asked_for(
    length_penalty: float = 1.0, keep_eos: bool = False, ignore_eos: bool = False, steps: int = 3
) -> Search:
    return Search(
        width=2,
        max_tokens=steps,
        length_penalty=length_penalty,
        ignore_eos=ignore_eos,
        keep_eos=keep_eos,
        top=2,
    )


def best(asked: Search, prompt: tuple[int, ...] = (0,), context: int = 100) -> list[Any]:
    message = serving_pb2.GenerateRequest(request_id="r", text="x")
    run = scripted(list(prompt), [])
    beams, ids, _ = asyncio.run(search(run, message, asked, frozenset({EOS}), context))
    assert ids == list(prompt)
    return [(beam.tokens, beam.ended, round(beam.cumulative, 6)) for beam in beams]


@pytest.mark.parametrize(
    ("length_penalty", "prompt", "expected"),
    [
        # ended: () -0.5, (1,) -0.15, (2,) -1.6, (1, 2) -1.0, (1, 1) -0.55; live at the end:
        # (1, 2, 3) -0.6, (1, 1, 2) -0.8; the score divides by the prompt's and the tokens'
        # length: with a prompt of 1, (1, 2, 3) scores -0.15, (1, 1) -0.183
        (1.0, (0,), [((1,), True, -0.15), ((1, 2, 3), False, -0.6)]),
        # with a prompt of 10, (1, 1) scores -0.0458 and (1, 2, 3) -0.0462
        (1.0, (5,) * 9 + (0,), [((1,), True, -0.15), ((1, 1), True, -0.55)]),
        (0.0, (0,), [((1,), True, -0.15), ((), True, -0.5)]),
    ],
)
def test_ended_and_live_beams_ranked_as_vllm_ranks_them(
    length_penalty: float, prompt: tuple[int, ...], expected: list[Any]
) -> None:
    assert best(asked_for(length_penalty), prompt) == expected


def test_an_ending_token_kept_in_the_output_does_not_count_in_the_length() -> None:
    expected = [((1, EOS), True, -0.15), ((1, 2, 3), False, -0.6)]
    assert best(asked_for(keep_eos=True)) == expected


def test_with_ignore_eos_no_beam_ends() -> None:
    # (9,) and then (1, 9) live on as any token would; the best two all the way through
    expected = [((1, 2, 3), False, -0.6), ((1, 2, EOS), False, -1.0)]
    assert best(asked_for(ignore_eos=True)) == expected


def test_each_tokens_logprob_shows_its_rank_and_the_steps_alternatives() -> None:
    message = serving_pb2.GenerateRequest(request_id="r", text="x")
    run = scripted([0], [])
    beams, _, _ = asyncio.run(search(run, message, asked_for(), frozenset({EOS}), 100))
    live = beams[1]  # (1, 2, 3): ranks 1 after 0, 2 after 1, 1 after 2
    assert [each.rank for each in live.logprobs] == [1, 2, 1]
    assert [list(each.top_ids) for each in live.logprobs] == [[1, EOS], [EOS, 2], [3, EOS]]


def test_the_context_bounds_the_steps() -> None:
    assert len(best(asked_for(steps=2), context=3)[1][0]) == 2  # the prompt's 1 and 2 more
    with pytest.raises(ServingError, match="max_tokens"):
        best(asked_for(steps=3), context=3)


def test_a_cut_to_the_context_leaves_room_for_max_tokens() -> None:
    asked: list[serving_pb2.GenerateRequest] = []
    message = serving_pb2.GenerateRequest(request_id="r", text="x", truncate_prompt_tokens=-1)
    asyncio.run(search(scripted([0], asked), message, asked_for(), frozenset({EOS}), 100))
    assert asked[0].truncate_prompt_tokens == 100 - 3
    assert all(not each.truncate_prompt_tokens for each in asked[1:])  # ids, cut already


def test_a_failed_step_ends_the_search_with_no_step_left_running() -> None:
    running: set[str] = set()
    inner = scripted([0], [])

    async def run(message: serving_pb2.GenerateRequest) -> tuple[dict[int, Sample], Counts]:
        if message.HasField("token_ids") and message.token_ids.ids[-1] == 2:
            raise HttpError(429, "the router's queue is full")
        if message.HasField("token_ids"):  # the other beam's step: would run on
            running.add(message.request_id)
            try:
                await asyncio.sleep(60)
            finally:
                running.discard(message.request_id)
        return await inner(message)

    async def searched() -> None:
        message = serving_pb2.GenerateRequest(request_id="r", text="x")
        with pytest.raises(HttpError, match="queue is full"):
            await search(run, message, asked_for(), frozenset({EOS}), 100)
        assert not running

    asyncio.run(asyncio.wait_for(searched(), 10))


def test_an_aborted_step_cancels_the_search() -> None:
    """A step aborted (an Abort, a worker stopping) comes back with no logprobs: the search
    ends CANCELLED, as an aborted call is counted, not as a server error."""
    inner = scripted([0], [])

    async def run(message: serving_pb2.GenerateRequest) -> tuple[dict[int, Sample], Counts]:
        if not message.HasField("token_ids"):
            return await inner(message)
        aborted = serving_pb2.GenerateResponse(
            request_id=message.request_id, finished=True, finish_reason="abort"
        )
        counts, sample = Counts(), Sample()
        counts.record(aborted)
        sample.take(aborted)
        return {0: sample}, counts

    message = serving_pb2.GenerateRequest(request_id="r", text="x")
    with pytest.raises(ServingError, match="aborted") as ended:
        asyncio.run(search(run, message, asked_for(), frozenset({EOS}), 100))
    assert ended.value.code == grpc.StatusCode.CANCELLED


@pytest.mark.parametrize("length_penalty", [1e300, -1e300])
def test_a_penalty_of_any_size_ranks_without_overflowing(length_penalty: float) -> None:
    """vLLM's score divides by the length to the penalty, which overflows (a 500) for a large
    one; ranked in logs, the longest (or, negative, the shortest) beams come first."""
    ranked = best(asked_for(length_penalty))
    lengths = [len(tokens) for tokens, _, _ in ranked]
    assert lengths == sorted(lengths, reverse=length_penalty > 0)
