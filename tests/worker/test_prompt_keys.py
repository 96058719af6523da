"""A request's prompt keys are made once, when it is submitted, and every admission of its
samples starts the cache from them (`RequestState.prompt_keys`, `SampleState.cache_keys`)."""

from __future__ import annotations

from cache import to_cache_keys
from cache.integrity import check_sequence_cache
from tests.worker.helpers import LLAMA, Recorder, drain
from worker.engine import Engine, EngineConfig
from worker.request import GenerateRequest
from worker.sampling_params import SamplingParams
from worker.tiny_model import tiny_model

PROMPTS = {"old": list(range(3, 23)), "young": list(range(40, 60))}


def _run(num_pages: int) -> tuple[Engine, Recorder]:
    config = EngineConfig(num_pages=num_pages, page_size=4, max_running=2)
    engine = Engine(tiny_model(LLAMA, seed=5), None, config)
    recorder = Recorder()
    for request_id, prompt in PROMPTS.items():
        request = GenerateRequest(
            request_id, tuple(prompt), sampling=SamplingParams(max_tokens=20, temperature=0.0)
        )
        engine.submit(request, recorder.outputs.append)
    return engine, recorder


def test_a_preempted_sample_comes_back_with_its_prompt_keys_and_its_tokens_since() -> None:
    roomy, expected = _run(num_pages=64)
    drain(roomy)
    tight, recorder = _run(num_pages=14)  # both prompts fit, not both of their growths
    states = {}
    while not tight.scheduler.preemptions:
        assert tight.step()
        states |= {s.request_id: s for s in tight._requests.values()}
    (waiting,) = tight.scheduler.waiting
    state = waiting.request
    assert waiting.generated > 0  # it comes back with tokens generated before it was preempted
    assert state.prompt_keys == to_cache_keys(PROMPTS[state.request_id])
    assert waiting.cache_keys() == to_cache_keys(waiting.tokens)
    drain(tight)
    for request_id, prompt in PROMPTS.items():
        assert recorder.tokens(request_id) == expected.tokens(request_id)
        # the sequences extended copies: the request's keys are still the prompt's
        assert states[request_id].prompt_keys == to_cache_keys(prompt)
    # nothing was shared between the two prompts: what the cache reused, the preempted sample
    # found again under the keys it came back with
    assert tight.cache.stats.reused_positions > 0
    check_sequence_cache(tight.cache)
