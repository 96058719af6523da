"""Penalties and logprobs cross the wire: sampling parameters both ways (logprobs 0 is not
None), and the logprobs of a streamed output into its GenerateResponse."""

from __future__ import annotations

import pytest

from protos.radixmesh.v1 import serving_pb2
from worker.request import RequestOutput, TokenLogprob
from worker.sampling_params import SamplingParams
from worker.wire import output_to_proto, sampling_from_proto, sampling_to_proto


def through_the_wire(params: SamplingParams) -> SamplingParams:
    data = sampling_to_proto(params).SerializeToString()
    return sampling_from_proto(serving_pb2.SamplingParams.FromString(data))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(presence_penalty=-1.5, frequency_penalty=0.25, repetition_penalty=1.75),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(seed=3, n=2, logprobs=20, presence_penalty=2.0),
        SamplingParams(prompt_logprobs=0),
        SamplingParams(logprobs=1, prompt_logprobs=20),
    ],
)
def test_penalties_and_logprobs_survive_the_round_trip(params: SamplingParams) -> None:
    assert through_the_wire(params) == params


def test_absent_fields_are_no_penalties_and_no_logprobs() -> None:
    got = sampling_from_proto(serving_pb2.SamplingParams())
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty) == (0, 0, 1)
    assert got.logprobs is None and not got.penalized
    assert not sampling_to_proto(SamplingParams()).HasField("logprobs")
    assert sampling_to_proto(SamplingParams(logprobs=0)).HasField("logprobs")
    assert got.prompt_logprobs is None
    assert sampling_to_proto(SamplingParams(prompt_logprobs=0)).HasField("prompt_logprobs")


def test_an_output_carries_its_logprobs_in_order() -> None:
    logprobs = (
        TokenLogprob(-0.5, ((7, -0.5), (3, -1.25))),
        TokenLogprob(-2.0, ((9, -0.75), (1, -1.5))),
    )
    output = RequestOutput("r", 1, (7, 1), "ab", 4, 0, logprobs=logprobs)
    sent = serving_pb2.GenerateResponse.FromString(
        output_to_proto(output, "w0").SerializeToString()
    )
    got = [(lp.logprob, list(lp.top_ids), list(lp.top_logprobs)) for lp in sent.logprobs]
    assert got == [(-0.5, [7, 3], [-0.5, -1.25]), (-2.0, [9, 1], [-0.75, -1.5])]
    bare = output_to_proto(RequestOutput("r", 0, (5,), "c", 4, 0), "w0")
    assert len(bare.logprobs) == 0


def test_an_output_carries_its_prompt_logprobs_with_their_ranks() -> None:
    scores = (TokenLogprob(-3.0, ((4, -0.25),), 6), TokenLogprob(-0.25, (), 1))
    output = RequestOutput(
        "r", 0, (7,), "a", 3, 0, prompt_logprobs=scores, prompt_token_ids=(5, 9, 4)
    )
    sent = serving_pb2.GenerateResponse.FromString(
        output_to_proto(output, "w0").SerializeToString()
    )
    got = [(lp.logprob, list(lp.top_ids), lp.rank) for lp in sent.prompt_logprobs]
    assert got == [(-3.0, [4], 6), (-0.25, [], 1)]
    assert list(sent.prompt_token_ids) == [5, 9, 4]
    assert len(sent.logprobs) == 0
