"""The worker's latency histograms (worker/latency_metrics.py), read as Prometheus scrapes them:
each request is timed once at each point it reaches, the parts add up to the wholes, every
observation lies within the wall time around it, and each step's tokens are the tokens the
requests computed."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.loadtest.server_metrics import Buckets
from tests.prometheus_text import histograms, series_labels
from tests.worker.helpers import Recorder, drain, greedy, run_all
from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel
from worker.metrics import EngineCollector
from worker.request import GenerateRequest, PoolingParams
from worker.sampling_params import SamplingParams

CONFIG = EngineConfig(
    num_pages=256, page_size=4, max_running=4, token_budget=32, max_prefill_chunk=16,
    max_model_len=128,
)  # fmt: skip


def scrape(engine: Engine, worker: str = "w0") -> dict[str, Buckets]:
    """The engine's histograms as its metrics endpoint writes them, parsed back; each one a
    single series, labelled with the worker."""
    collector = EngineCollector(engine, worker)
    for name, series in series_labels(collector).items():
        assert series == [{"worker": worker}], name
    return histograms(collector)


W = "radixmesh_worker_"
QUEUE, PREFILL = f"{W}request_queue_seconds", f"{W}request_prefill_seconds"
FIRST, DECODE = f"{W}time_to_first_token_seconds", f"{W}request_decode_seconds"
E2E, STEP_TOKENS = f"{W}e2e_request_latency_seconds", f"{W}step_tokens"
STEP_SECONDS = f"{W}step_seconds"


def test_each_generation_is_timed_once_and_its_parts_add_up(tiny: LoadedModel) -> None:
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    began = time.perf_counter()
    # five requests for four running slots: the fifth queues behind one of them; one token
    # only is a request whose first output is its last
    requests = [greedy(f"r{i}", range(3 + i, 40 + 5 * i), 6) for i in range(4)]
    run_all(engine, *requests, greedy("one", range(50, 70), 1))
    wall = time.perf_counter() - began
    seen = scrape(engine)
    for name in (QUEUE, PREFILL, FIRST, DECODE, E2E):
        assert seen[name].count == 5, name
        assert seen[name].cumulative[math.inf] == 5, name
        assert 0 <= seen[name].sum <= 5 * wall, name
    # time to first token = queue + prefill, end to end = time to first token + decode
    assert seen[FIRST].sum == pytest.approx(seen[QUEUE].sum + seen[PREFILL].sum, rel=1e-9)
    assert seen[E2E].sum == pytest.approx(seen[FIRST].sum + seen[DECODE].sum, rel=1e-9)
    # the engine ran with max_running 4 and a 32-token budget: not all were admitted at once
    assert seen[QUEUE].sum > 0
    assert seen[STEP_SECONDS].count == seen[STEP_TOKENS].count > 0
    assert 0 < seen[STEP_SECONDS].sum <= wall


def test_an_embedding_is_timed_to_its_output_and_an_abort_to_nothing_more(
    tiny: LoadedModel,
) -> None:
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    embedding = GenerateRequest("e", prompt_token_ids=tuple(range(9, 30)), pooling=PoolingParams())
    recorder = Recorder()
    engine.submit(embedding, recorder.outputs.append)
    engine.submit(greedy("aborted", range(5, 60), 50), recorder.outputs.append)
    engine.submit(greedy("never", range(70, 90), 5), recorder.outputs.append)
    engine.abort("never")  # before any step: never admitted, never timed
    while not any(o.request_id == "aborted" and o.token_ids for o in recorder.outputs):
        assert engine.step()
    engine.abort("aborted")
    drain(engine)
    assert {o.finish_reason for o in recorder.outputs if o.finished} == {"stop", "abort"}
    seen = scrape(engine)
    # both that produced an output were queued and prefilled; only the generation had a first
    # token, and neither ended by a stop or its length as a generation
    assert seen[QUEUE].count == seen[PREFILL].count == 2
    assert seen[FIRST].count == 1
    assert seen[DECODE].count == seen[E2E].count == 0


def test_the_histograms_are_labelled_with_the_worker_and_cumulative(tiny: LoadedModel) -> None:
    engine = Engine(tiny.model, tiny.tokenizer, CONFIG)
    run_all(engine, *(greedy(f"r{i}", range(i, i + 20), 3) for i in range(3)))
    seen = scrape(engine, worker="w7")  # scrape asserts the label of every series
    for name, h in seen.items():
        counts = [h.cumulative[le] for le in sorted(h.cumulative)]
        assert counts == sorted(counts), name
        assert counts[-1] == h.count, name


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # which of four prompt heads (shared heads hit the cache)
            st.integers(1, 40),  # the tail's length
            st.integers(1, 6),  # max_tokens
            st.integers(1, 3),  # n
        ),
        min_size=1,
        max_size=6,
    )
)
def test_steps_count_exactly_the_tokens_requests_computed(
    tiny: LoadedModel, specs: Sequence[tuple[int, int, int, int]]
) -> None:
    """Each step observes the positions it computed: every request's prompt past its cache hit,
    and every token a sample drew but its last (fed back to draw the next). Room for every
    sample at once: a sibling that cannot fork waits and computes its prompt's last position
    again."""
    engine = Engine(tiny.model, tiny.tokenizer, replace(CONFIG, num_pages=512, max_running=32))
    requests = [
        GenerateRequest(
            f"r{i}",
            prompt_token_ids=(*range(head * 20, head * 20 + 16), *range(200, 200 + tail)),
            sampling=SamplingParams(max_tokens=most, temperature=1.0, seed=i, n=n),
        )
        for i, (head, tail, most, n) in enumerate(specs)
    ]
    recorder = run_all(engine, *requests)
    expected = 0
    for request in requests:
        finals = [o for o in recorder.outputs if o.request_id == request.request_id and o.finished]
        assert len(finals) == request.sampling.n
        expected += len(request.prompt_token_ids) - finals[0].cached_prompt_tokens
        for final in finals:
            expected += len(recorder.tokens(request.request_id, final.index)) - 1
    seen = scrape(engine)
    assert engine.scheduler.preemptions == 0  # a preempted sample would compute twice
    assert seen[STEP_TOKENS].sum == expected
    assert seen[FIRST].count == seen[E2E].count == len(requests)
