"""cluster/http/beam_search.py's search over a scripted distribution (the next tokens' logprobs
by the last token), where an end-of-sequence token ends beams and the length penalty decides
between beams of different lengths: the choices worked out by hand, as vLLM ranks them. (The
tiny model rarely ranks its end-of-sequence token high enough to end a beam, so the HTTP tests,
tests/cluster/test_http_beam_search.py, cannot pin these.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster.http.beam_search import Search, search
from cluster.http.openai_responses import Counts, Sample
from protos.radixmesh.v1 import serving_pb2

EOS = 9
NEXT = {  # last token -> its 4 (2 x 2 beams) most likely next tokens, most likely first
    0: [(1, -0.1), (EOS, -0.5), (2, -1.0), (3, -2.0)],
    1: [(EOS, -0.05), (2, -0.3), (1, -0.4), (3, -3.0)],
    2: [(3, -0.2), (EOS, -0.6), (1, -0.7), (2, -0.9)],
    3: [(1, -0.1), (2, -0.2), (3, -0.3), (EOS, -0.4)],
    EOS: [(1, -1.0), (2, -1.1), (3, -1.2), (EOS, -1.3)],  # with ignore_eos
}
"""The prompt is [0]."""


async def run(message: serving_pb2.GenerateRequest) -> tuple[dict[int, Sample], Counts]:
    """One greedy step of the scripted model, answered as a worker answers it."""
    ids = list(message.token_ids.ids) if message.HasField("token_ids") else [0]
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


def best(length_penalty: float, keep_eos: bool = False, ignore_eos: bool = False) -> list[Any]:
    asked = Search(
        width=2,
        max_tokens=3,
        length_penalty=length_penalty,
        ignore_eos=ignore_eos,
        keep_eos=keep_eos,
        top=2,
    )
    message = serving_pb2.GenerateRequest(request_id="r", text="x")
    beams, prompt, _ = asyncio.run(search(run, message, asked, frozenset({EOS}), 100))
    assert prompt == [0]
    return [(beam.tokens, beam.ended, round(beam.cumulative, 6)) for beam in beams]


@pytest.mark.parametrize(
    ("length_penalty", "expected"),
    [
        # ended: () -0.5, (1,) -0.15, (2,) -1.6, (1, 2) -1.0, (1, 1) -0.55; live at the end:
        # (1, 2, 3) -0.6, (1, 1, 2) -0.8; the score divides by 1 (the prompt) + the tokens
        (1.0, [((1,), True, -0.15), ((1, 2, 3), False, -0.6)]),
        (0.0, [((1,), True, -0.15), ((), True, -0.5)]),
    ],
)
def test_ended_and_live_beams_ranked_as_vllm_ranks_them(
    length_penalty: float, expected: list[Any]
) -> None:
    assert best(length_penalty) == expected


def test_an_ending_token_kept_in_the_output_does_not_count_in_the_length() -> None:
    assert best(1.0, keep_eos=True) == [((1, EOS), True, -0.15), ((1, 2, 3), False, -0.6)]


def test_with_ignore_eos_no_beam_ends() -> None:
    # (9,) and then (1, 9) live on as any token would; the best two all the way through
    assert best(1.0, ignore_eos=True) == [((1, 2, 3), False, -0.6), ((1, 2, EOS), False, -1.0)]
