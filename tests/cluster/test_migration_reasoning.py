"""A thinking model's streams cut by a dying worker continue exactly (tests/cluster/
test_migration.py's fault, on the thinking tiny model): the reasoning and the answer apart, the
thinking budget's forced close, a JSON answer whose grammar waited for the reasoning, and the
reasoning token counts, all as the undisturbed run gives them, cut before or after the close."""

from __future__ import annotations

from cluster.client import Client, text_request
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import start_cluster
from tests.cluster.test_migration import Stream, kill_the_busiest, stream, undisturbed
from worker.loader import LoadedModel

ANSWER = '\\{"city": "[a-z ]{40,80}"\\}'
"""A JSON answer long enough to be cut in (a pattern, which waits for the reasoning as JSON
does)."""


def request(
    text: str, budget: int, *, json: bool = False, n: int = 1, seed: int | None = None
) -> serving_pb2.GenerateRequest:
    message = text_request(
        chat=[("user", text)], max_tokens=300, temperature=0.8 if seed is not None else 0.0,
        seed=seed, n=n,
    )  # fmt: skip
    message.sampling.ignore_eos = True
    message.sampling.separate_reasoning = True
    message.sampling.thinking_token_budget = budget
    if json:
        message.sampling.structured.regex = ANSWER
    return message


def seen(run: Stream, index: int) -> tuple[list[int], str, str, int, str]:
    """Sample `index`'s tokens, reasoning, answer, reasoning tokens and finish reason."""
    mine = [m for m in run.messages if m.index == index]
    return (
        [t for m in mine for t in m.token_ids],
        "".join(m.reasoning_text for m in mine),
        "".join(m.text for m in mine),
        sum(m.reasoning_tokens for m in mine),
        mine[-1].finish_reason if mine else "",
    )


def test_thinking_streams_cut_by_a_dying_worker_continue_exactly(thinking: LoadedModel) -> None:
    cluster = start_cluster(thinking, workers=3)
    try:
        requests = [
            request("Think long, then answer.", 60),  # cut inside the reasoning
            request("Answer in JSON.", 3, json=True),  # cut inside the JSON
            request("Seeded JSON.", 5, json=True, seed=3),
            request("Two samples.", 8, n=2, seed=4),
        ]
        expected = [undisturbed(cluster, r) for r in requests]
        for want in expected[1:3]:  # reasoned, closed by the budget, then JSON
            _, reasoning, answer, counted, _ = seen(want, 0)
            assert reasoning and answer.startswith('{"city": "') and counted > 0
            assert len(answer) > 40
        client = Client(cluster.target)
        streams = [stream(client, r) for r in requests]
        # 20 messages in: the first stream still reasons, the JSON ones are past their close
        moved = kill_the_busiest(cluster, streams, 20)

        for got, want, message in zip(streams, expected, requests, strict=True):
            assert got.error is None, got.error
            for index in range(message.sampling.n):
                assert seen(got, index) == seen(want, index), f"{message.chat} {index}"
        assert cluster.service.counters.migrated >= len(moved) > 0
        cluster.wait_idle()
    finally:
        cluster.close()
