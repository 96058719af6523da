"""A request's prompt keys are made once, when it is submitted, and every admission of its
samples starts the cache from them (`RequestState.prompt_keys`, `SampleState.cache_keys`)."""

from __future__ import annotations

from cache import DEFAULT_NAMESPACE, to_cache_keys
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


def test_a_text_prompt_takes_the_routers_chain_without_the_scan_for_typed_keys() -> None:
    """The router hashes a prompt to route it and sends the chain along; the engine starts the
    sequence with it, telling the cache the keys are text (made from ids, which
    `to_cache_keys` checked), so the check skips its pass over every key. A chain that does
    not check out is still refused."""
    config = EngineConfig(num_pages=64, page_size=4, max_running=2)
    engine = Engine(tiny_model(LLAMA, seed=5), None, config)
    hasher = engine.cache.hasher
    calls: list[bool] = []
    accepts = hasher.accepts

    def spied(*args: object, text: bool = False) -> bool:
        calls.append(text)
        return accepts(*args, text=text)  # type: ignore[arg-type]

    hasher.accepts = spied  # type: ignore[method-assign]
    recorder = Recorder()
    prompt = list(range(3, 43))
    chain = hasher.hashes(prompt, DEFAULT_NAMESPACE)
    spoiled = (*chain[:-1], chain[-1] ^ 1)
    for request_id, hashes in (("spoiled", spoiled), ("routed", tuple(chain))):
        request = GenerateRequest(
            request_id,
            tuple(prompt),
            sampling=SamplingParams(max_tokens=2, temperature=0.0),
            prompt_block_hashes=hashes,
        )
        engine.submit(request, recorder.outputs.append)
        drain(engine)
        engine.cache.tree.clear()  # the next request finds nothing cached and checks the chain
    assert calls == [True, True]
    assert engine.cache.stats.given_blocks == len(chain) > 0
    assert recorder.tokens("routed") == recorder.tokens("spoiled")
    check_sequence_cache(engine.cache)
