"""Bad requests get a clear error naming the field; the engine keeps serving; threads and aborts."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from cache.integrity import check_sequence_cache
from tests.worker.helpers import LLAMA, Recorder, drain, greedy
from worker.engine import Engine, EngineConfig
from worker.errors import ContextOverflow, EngineOverloaded, EngineStopped, InvalidRequest
from worker.penalties import Penalties
from worker.request import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateRequest,
    RequestOutput,
    Resume,
)
from worker.samples import RequestState
from worker.sampling_params import SamplingParams
from worker.tiny_model import tiny_model

MODEL = tiny_model(LLAMA, seed=5)


def make_engine(**overrides: object) -> Engine:
    config: dict[str, object] = dict(
        num_pages=128, page_size=4, max_running=4, max_model_len=64, max_waiting=4
    )
    config.update(overrides)
    return Engine(MODEL, None, EngineConfig(**config))  # type: ignore[arg-type]


def ids(*tokens: int) -> tuple[int, ...]:
    return tuple(tokens)


BAD = [
    (GenerateRequest("x", prompt_token_ids=()), "prompt", "empty"),
    (GenerateRequest("x", prompt_token_ids=tuple(range(1, 65))), "prompt", "64 tokens"),
    (GenerateRequest("x", prompt_token_ids=ids(1, 2, 512)), "prompt_token_ids", "512"),
    (GenerateRequest("x", prompt_token_ids=ids(1, -2)), "prompt_token_ids", "-2"),
    (GenerateRequest("x", prompt="hello"), "prompt", "no tokenizer"),
    (GenerateRequest("x", prompt_token_ids=ids(1), prompt="a"), "prompt", "exactly one"),
    (
        GenerateRequest("x", ids(1, 2), sampling=SamplingParams(temperature=-0.5)),
        "temperature",
        "-0.5",
    ),
    (
        GenerateRequest("x", ids(1, 2), sampling=SamplingParams(temperature=float("nan"))),
        "temperature",
        "nan",
    ),
    (GenerateRequest("x", ids(1, 2), sampling=SamplingParams(top_p=0.0)), "top_p", r"\(0, 1\]"),
    (GenerateRequest("x", ids(1, 2), sampling=SamplingParams(top_p=1.5)), "top_p", "1.5"),
    (GenerateRequest("x", ids(1, 2), sampling=SamplingParams(top_k=-1)), "top_k", "-1"),
    (GenerateRequest("x", ids(1, 2), sampling=SamplingParams(max_tokens=0)), "max_tokens", "got 0"),
    (
        GenerateRequest("x", ids(1, 2), sampling=SamplingParams(max_tokens=10**9)),
        "max_tokens",
        r"context length is 64 tokens\. However, you requested 1000000002 tokens \(2 in",
    ),
    (GenerateRequest("x", ids(1, 2), sampling=SamplingParams(n=0)), "n", "got 0"),
    (GenerateRequest("x", ids(1, 2), sampling=SamplingParams(n=2, temperature=0)), "n", "greedy"),
    (GenerateRequest("x", ids(1, 2), sampling=SamplingParams(seed=-1)), "seed", "-1"),
    (
        GenerateRequest("x", ids(1, 2), sampling=SamplingParams(stop_token_ids=(999,))),
        "stop_token_ids",
        "999",
    ),
    (GenerateRequest("x", ids(1, 2), sampling=SamplingParams(stop=("",))), "stop[0]", "non-empty"),
    (
        GenerateRequest("x", ids(1, 2), sampling=SamplingParams(stop=("a",) * 17)),
        "stop",
        "17 stop strings; at most 16",
    ),
    (
        GenerateRequest("x", ids(1, 2), sampling=SamplingParams(stop=("ok", "x" * 257))),
        "stop[1]",
        "257 characters; a stop string has at most 256",
    ),
    (
        GenerateRequest("x", ids(1, 2, 3), sampling=SamplingParams(n=2), resume=Resume(0, 1)),
        "sampling.n",
        "resumed alone",
    ),
    (GenerateRequest("x", ids(1, 2, 3), resume=Resume(0, 3)), "resume.generated", "3 of a 3"),
    (
        GenerateRequest(
            "x", ids(1, 2, 3), sampling=SamplingParams(max_tokens=2), resume=Resume(0, 2)
        ),
        "resume.generated",
        "reach max_tokens 2",
    ),
    (GenerateRequest("x", ids(1, 2, 3), resume=Resume(16, 1)), "resume.sample_index", "16"),
]


@pytest.mark.parametrize(
    ("request_", "field", "words"), BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)]
)
def test_bad_requests_name_the_field_and_the_engine_keeps_serving(
    request_: GenerateRequest, field: str, words: str
) -> None:
    engine = make_engine()
    recorder = Recorder()
    engine.submit(greedy("before", [1, 2, 3], 4), recorder.outputs.append)
    engine.step()
    with pytest.raises(InvalidRequest, match=words) as err:
        engine.submit(request_, recorder.outputs.append)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")
    engine.submit(greedy("after", [1, 2, 3, 4], 4), recorder.outputs.append)
    drain(engine)
    assert recorder.final("before").finish_reason == FINISH_LENGTH
    assert recorder.final("after").finish_reason == FINISH_LENGTH
    check_sequence_cache(engine.cache)


def test_the_context_is_cut_to_what_the_pool_holds(caplog: pytest.LogCaptureFixture) -> None:
    """A pool smaller than the context (64) cuts the context to its 8 pages of 4: a request
    past that overflows the context, as the router and the HTTP API are told (limits), and
    one that fills it is served."""
    with caplog.at_level(logging.WARNING, logger="worker.engine"):
        engine = make_engine(num_pages=9, page_size=4)
    assert engine.max_model_len == engine.limits.max_model_len == 32
    assert "the context is cut from 64 to 32 positions" in caplog.text
    with pytest.raises(
        ContextOverflow,
        match=r"max_tokens: .* 32 tokens. However, you requested 36 tokens \(30 in the prompt",
    ):
        engine.submit(greedy("big", list(range(1, 31)), 6), lambda o: None)
    recorder = Recorder()
    engine.submit(greedy("fills", list(range(1, 31)), 2), recorder.outputs.append)
    drain(engine)
    assert recorder.final("fills").finish_reason == FINISH_LENGTH
    assert make_engine(num_pages=64, page_size=4).max_model_len == 64  # the pool holds more


def test_duplicate_request_ids_and_overload_are_refused() -> None:
    engine = make_engine(max_running=1, max_waiting=1)
    engine.submit(greedy("a", [1, 2], 4), lambda o: None)
    with pytest.raises(InvalidRequest, match="already running"):
        engine.submit(greedy("a", [3, 4], 4), lambda o: None)
    engine.submit(greedy("b", [1, 2], 4), lambda o: None)
    with pytest.raises(EngineOverloaded, match="at most 2"):
        engine.submit(greedy("c", [1, 2], 4), lambda o: None)
    # a sample resumed from a dead worker is taken even now: the cluster admitted it already
    recorder = Recorder()
    resumed = GenerateRequest(
        "d", ids(1, 2, 7), sampling=SamplingParams(max_tokens=4, temperature=0), resume=Resume(0, 1)
    )
    engine.submit(resumed, recorder.outputs.append)
    drain(engine)
    assert len(recorder.tokens("d")) == 3 and recorder.final("d").finish_reason == FINISH_LENGTH
    engine.submit(greedy("a", [3, 4], 4), lambda o: None)  # finished ids can be reused
    drain(engine)
    check_sequence_cache(engine.cache)


def test_stop_token_ids_end_the_sample_and_max_tokens_and_context_bound_it() -> None:
    engine = make_engine(max_model_len=24)
    recorder = Recorder()
    engine.submit(greedy("free", [1, 2, 3], 12), recorder.outputs.append)
    drain(engine)
    free = recorder.tokens("free")
    assert len(free) == 12 and recorder.final("free").finish_reason == FINISH_LENGTH
    stopper = free[4]
    engine.submit(greedy("stop", [1, 2, 3], 12, stop_token_ids=(stopper,)), recorder.outputs.append)
    engine.submit(greedy("ctx", list(range(1, 21)), 4), recorder.outputs.append)
    drain(engine)
    stopped = recorder.tokens("stop")
    assert stopped == free[: free.index(stopper) + 1]
    assert recorder.final("stop").finish_reason == FINISH_STOP
    assert len(recorder.tokens("ctx")) == 4 and recorder.final("ctx").finish_reason == FINISH_LENGTH


def test_abort_mid_prefill_and_mid_decode_frees_everything() -> None:
    engine = make_engine(token_budget=8, max_prefill_chunk=8)
    recorder = Recorder()
    engine.submit(greedy("prefilling", list(range(1, 40)), 10), recorder.outputs.append)
    engine.submit(greedy("decoding", [5, 6, 7], 30), recorder.outputs.append)
    for _ in range(3):
        engine.step()
    engine.abort("prefilling")
    engine.step()
    for _ in range(5):
        engine.step()
    engine.abort("decoding")
    engine.abort("never-existed")
    drain(engine)
    for request_id in ("prefilling", "decoding"):
        assert recorder.final(request_id).finish_reason == FINISH_ABORT
    assert 0 < len(recorder.tokens("decoding")) < 30
    assert engine.cache.pool.num_private == 0
    check_sequence_cache(engine.cache)


def test_the_engine_thread_serves_concurrent_callers_and_aborts() -> None:
    engine = make_engine(max_running=4, max_waiting=16, max_model_len=200)
    engine.start()
    try:
        results: dict[int, list[int]] = {}

        def client(i: int) -> None:
            tokens = []
            for output in engine.generate(greedy(f"t{i}", [1 + i, 2, 3, 4], 20)):
                tokens.extend(output.token_ids)
            results[i] = tokens

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        slow = engine.generate(greedy("slow", [9, 9, 9], 150))
        first = next(slow)
        engine.abort("slow")
        rest = list(slow)
        for thread in threads:
            thread.join(timeout=30)
        assert all(len(results[i]) == 20 for i in range(6))
        assert first.token_ids and rest[-1].finish_reason == FINISH_ABORT
        deadline = time.monotonic() + 5
        while engine.stats().running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.stats().running == 0 and engine.cache.pool.num_private == 0
    finally:
        engine.stop()
    with pytest.raises(EngineStopped):
        engine.submit(greedy("late", [1, 2], 2), lambda o: None)


def test_a_failing_output_sink_does_not_stop_the_engine() -> None:
    engine = make_engine()
    recorder = Recorder()

    def broken(_: object) -> None:
        raise RuntimeError("client went away")

    engine.submit(greedy("broken", [1, 2, 3], 5), broken)
    engine.submit(greedy("fine", [1, 2, 3], 5), recorder.outputs.append)
    drain(engine)
    assert recorder.final("fine").finish_reason == FINISH_LENGTH
    assert engine.cache.pool.num_private == 0


class _FailingFirstDecoder:
    """A tokenizer whose first incremental decoder fails on its third token (as one whose
    vocabulary is smaller than the model's fails on an id it does not know)."""

    vocab_size = LLAMA.vocab_size
    eos_token_ids = LLAMA.eos_token_ids

    def __init__(self) -> None:
        self.decoders = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + ord(c) % 100 for c in text]

    def apply_chat_template(self, messages: list[dict[str, object]]) -> str:
        return " ".join(str(m["content"]) for m in messages)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> _FailingFirstDecoder.Decoder:
        self.decoders += 1
        return self.Decoder(fail_at=3 if self.decoders == 1 else None)

    class Decoder:
        def __init__(self, fail_at: int | None) -> None:
            self.fail_at, self.seen = fail_at, 0

        def step(self, token_id: int) -> str:
            self.seen += 1
            if self.seen == self.fail_at:
                raise ValueError(f"token id {token_id} is outside the vocabulary")
            return "x"

        def finish(self) -> str:
            return ""


def test_a_request_whose_tokens_cannot_be_decoded_ends_with_an_error_alone() -> None:
    engine = Engine(MODEL, _FailingFirstDecoder(), EngineConfig(num_pages=64, page_size=4))
    recorder = Recorder()
    engine.submit(greedy("bad", [1, 2, 3], 10), recorder.outputs.append)
    engine.submit(greedy("good", [4, 5, 6], 10), recorder.outputs.append)
    drain(engine)
    bad = recorder.final("bad")
    assert bad.finish_reason == "error"
    assert bad.error is not None and "outside the vocabulary" in bad.error
    assert len(recorder.tokens("bad")) == 2, "the tokens before the failure were streamed"
    assert recorder.final("good").finish_reason == FINISH_LENGTH
    assert len(recorder.tokens("good")) == 10
    assert engine.cache.pool.num_private == 0
    check_sequence_cache(engine.cache)


def test_eos_ends_a_sample_unless_ignored() -> None:
    engine = make_engine()
    recorder = Recorder()
    engine.submit(greedy("free", [1, 2, 3], 12, ignore_eos=True), recorder.outputs.append)
    drain(engine)
    free = recorder.tokens("free")
    engine.eos_token_ids = frozenset({free[3]})  # as if the model's EOS were that token
    engine.submit(greedy("eos", [1, 2, 3], 12), recorder.outputs.append)
    engine.submit(greedy("ignored", [1, 2, 3], 12, ignore_eos=True), recorder.outputs.append)
    drain(engine)
    assert recorder.tokens("eos") == free[: free.index(free[3]) + 1]
    assert recorder.final("eos").finish_reason == FINISH_STOP
    assert recorder.tokens("ignored") == free
    assert recorder.final("ignored").finish_reason == FINISH_LENGTH


@pytest.mark.parametrize("field", ["token_budget", "max_prefill_chunk"])
def test_a_budget_of_zero_is_refused_at_construction(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
        make_engine(**{field: 0})


def test_when_a_client_hears_the_end_the_pages_and_the_id_are_already_free() -> None:
    """The sink runs on the engine thread, as the last output is handed out: at that moment the
    request holds no private page and its id may be used again (a client that checks the pool,
    or resubmits, right after its stream ends must not find them taken)."""
    engine = make_engine()
    seen: list[tuple[str, int, bool]] = []

    def sink(output: RequestOutput) -> None:
        if output.finished:
            held = output.request_id in engine.active_requests
            seen.append((output.finish_reason or "", engine.cache.pool.num_private, held))

    engine.submit(greedy("ends", [1, 2, 3, 4, 5], 6), sink)
    drain(engine)
    engine.submit(greedy("aborted", [1, 2, 3, 4, 5], 40), sink)
    engine.step()
    engine.step()
    engine.abort("aborted")
    drain(engine)
    assert seen == [(FINISH_LENGTH, 0, False), (FINISH_ABORT, 0, False)]


def test_kv_tiers_past_the_machines_memory_are_refused_before_any_allocation() -> None:
    """CPU memory is committed as KV is written: a pool past the machine's memory would start
    and be killed once serving filled it. The refusal names the keys and the sizes."""
    page = make_engine().runner.page_bytes
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    fits = memory // page // 64
    assert make_engine(num_pages=fits).runner.page_bytes == page  # a 64th of it starts
    words = rf"engine\.num_pages and engine\.host_pages: \d+ pages of {page:,} bytes need"
    with pytest.raises(ValueError, match=words + r" .* GB of KV, more than this machine's"):
        make_engine(num_pages=memory // page + 2)
    with pytest.raises(ValueError, match=words):
        make_engine(host_pages=memory // page)  # the host tier counts too


def test_a_submit_that_fails_after_its_checks_leaves_its_id_free() -> None:
    """A submit that raises once its request has passed every check (a fault injected where
    the prompt's reasoning is read) queues nothing and holds nothing: its id is not left
    running, so a retry with it is served and it never counts against the engine's limit."""
    engine = make_engine(max_running=1, max_waiting=1)

    def failing(*_: object) -> None:
        raise RuntimeError("injected")

    engine._reasoning_opened = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        engine.submit(greedy("a", [1, 2, 3], 3), lambda _: None)
    assert not engine.active_requests
    del engine._reasoning_opened
    recorder = Recorder()
    engine.submit(greedy("a", [1, 2, 3], 3), recorder.outputs.append)
    engine.submit(greedy("b", [4, 5, 6], 3), recorder.outputs.append)  # 2 of 2: not overloaded
    drain(engine)
    assert recorder.final("a").finish_reason == recorder.final("b").finish_reason == FINISH_LENGTH
    assert not engine.active_requests and engine.cache.pool.num_private == 0
    check_sequence_cache(engine.cache)


def test_a_request_whose_second_sample_cannot_be_made_ends_with_an_error() -> None:
    """A fault while a request's samples are made (here the second's penalties) ends that
    request alone: each of its n samples with one error output naming the fault, none twice,
    its id freed and no page held; the engine goes on serving the request beside it."""
    engine = make_engine()
    made: list[object] = []
    real = engine._penalties

    def failing_second(state: RequestState) -> Penalties | None:
        made.append(state)
        if len(made) == 2:
            raise RuntimeError("injected")
        return real(state)

    engine._penalties = failing_second  # type: ignore[method-assign]
    recorder = Recorder()
    sampling = SamplingParams(max_tokens=3, temperature=0.5, n=2)
    engine.submit(GenerateRequest("x", ids(5, 6, 7), sampling=sampling), recorder.outputs.append)
    engine.submit(greedy("beside", [1, 2, 3], 3), recorder.outputs.append)
    drain(engine)
    failed = [o for o in recorder.outputs if o.request_id == "x"]
    assert sorted(o.index for o in failed) == [0, 1] and all(o.finished for o in failed)
    assert {(o.finish_reason, o.error, o.token_ids) for o in failed} == {
        (FINISH_ERROR, "RuntimeError: injected", ())
    }
    assert recorder.final("beside").finish_reason == FINISH_LENGTH
    assert not engine.active_requests and engine.cache.pool.num_private == 0
    check_sequence_cache(engine.cache)
