"""Speculative decoding by n-gram lookup (worker/speculation.py): drafts change how many steps
a sample takes, never what it generates. Every test runs the same requests with speculation
off and on and compares token for token: greedy, seeded sampling, penalties, logprobs, n > 1,
stop tokens and strings, structured outputs, a pool tight enough to preempt; and checks that
drafts were actually verified and kept, within the step's budget, with every page accounted
for."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Sequence
from typing import Any

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cache.integrity import check_sequence_cache
from tests.worker.helpers import LLAMA, Recorder, drain
from worker.engine import Engine, EngineConfig
from worker.model_runner import Chunk
from worker.request import FINISH_LENGTH, FINISH_STOP, GenerateRequest
from worker.sampling_params import SamplingParams, StructuredOutput
from worker.speculation import CANDIDATES, NgramIndex, SpeculationConfig, draft_limit
from worker.tiny_model import tiny_model

MODEL = tiny_model(LLAMA, seed=11)
REPEATING = [5, 6, 7, 8, 9] * 4  # the tiny model soon repeats itself after it: drafts hit


def _engine(k: int, model: Any = MODEL, tokenizer: Any = None, **config: Any) -> Engine:
    settings = {"num_pages": 512, "page_size": 4, "max_running": 8} | config
    return Engine(model, tokenizer, EngineConfig(**settings, num_speculative_tokens=k))


def _run(engine: Engine, requests: Sequence[GenerateRequest]) -> tuple[Recorder, list[int]]:
    """Every output, and the chunks (one a running sample) of each forward pass."""
    recorder, passes = Recorder(), []
    engine.observe_logits = recorder.observe
    run = engine.runner.run

    def counted(chunks: Sequence[Chunk]) -> torch.Tensor:
        passes.append(len(chunks))
        return run(chunks)

    engine.runner.run = counted  # type: ignore[method-assign]
    for request in requests:
        engine.submit(request, recorder.outputs.append)
    drain(engine)
    check_sequence_cache(engine.cache)
    pool = engine.cache.pool
    assert pool.num_private == 0 and pool.num_free + pool.num_cached == pool.usable_pages
    return recorder, passes


def _streams(recorder: Recorder) -> dict[tuple[str, int], tuple[Any, ...]]:
    """Per sample: its tokens, each token's top logprob tokens, its text and how it finished
    (the logprobs' values: `_logprobs`)."""
    streams: dict[tuple[str, int], list[Any]] = {}
    for o in recorder.outputs:
        entry = streams.setdefault((o.request_id, o.index), [[], [], "", None])
        entry[0].extend(o.token_ids)
        entry[1].extend(tuple(t for t, _ in lp.top) for lp in o.logprobs)
        entry[2] += o.text
        if o.finished:
            entry[3] = (o.finish_reason, o.error)
    return {key: (*tuple(map(tuple, v[:2])), v[2], v[3]) for key, v in streams.items()}


def _requests(sampling: SamplingParams, count: int = 3) -> list[GenerateRequest]:
    return [
        GenerateRequest(f"r{i}", tuple([*REPEATING, i + 1]), sampling=sampling)
        for i in range(count)
    ]


SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=40, temperature=0.3, seed=5, ignore_eos=True),
    "penalties and logprobs": SamplingParams(
        max_tokens=40,
        temperature=0.0,
        frequency_penalty=0.2,
        repetition_penalty=1.05,
        logprobs=3,
        ignore_eos=True,
    ),
    "n=3": SamplingParams(max_tokens=30, temperature=0.3, seed=9, n=3, ignore_eos=True),
    "stop token": SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(306,)),
    "min_tokens": SamplingParams(max_tokens=25, temperature=0.0, min_tokens=20),
}


def _logprobs(recorder: Recorder) -> list[float]:
    ordered = sorted(recorder.outputs, key=lambda o: (o.request_id, o.index))  # stable
    return [lp.logprob for o in ordered for lp in o.logprobs]


@pytest.mark.parametrize("name", SAMPLINGS)
def test_speculation_changes_the_steps_not_the_tokens(name: str) -> None:
    requests = _requests(SAMPLINGS[name])
    plain, plain_passes = _run(_engine(0), requests)
    engine = _engine(4)
    drafted, drafted_passes = _run(engine, requests)
    assert _streams(drafted) == _streams(plain)
    assert _logprobs(drafted) == pytest.approx(_logprobs(plain), abs=1e-3)
    stats = engine.stats()
    assert stats.generated_tokens == sum(len(v[0]) for v in _streams(plain).values())
    if name != "stop token":  # it stops at the first repeat, before a draft can be kept
        assert stats.accepted_draft_tokens > 0, stats
        assert sum(drafted_passes) < sum(plain_passes)
    assert 0 <= stats.accepted_draft_tokens <= stats.draft_tokens
    # the logits each token was drawn from are those of decoding one token a step
    for key, logits in drafted.logits.items():
        torch.testing.assert_close(logits, plain.logits[key], rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["greedy", "seeded", "n=3"])
def test_on_cuda_drafts_verified_by_the_prefill_kernel_give_the_decode_kernels_tokens(
    name: str,
) -> None:
    """On a GPU a step with drafts runs the append-prefill kernel (its chunks are longer than
    one token), a step without them the decode kernel: the same tokens."""
    model = tiny_model(LLAMA, seed=11).to("cuda")
    requests = _requests(SAMPLINGS[name])
    plain, _ = _run(_engine(0, model), requests)
    engine = _engine(4, model)
    drafted, _ = _run(engine, requests)
    assert _streams(drafted) == _streams(plain)
    assert engine.stats().accepted_draft_tokens > 0


def test_a_draft_is_cut_at_max_tokens_and_the_length_finish_is_exact() -> None:
    for max_tokens in (1, 2, 3, 7):
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt = [*REPEATING, 1, 360, 124, 491, 77, 399, 159, 306, 336, 399, 306, 336, 399]
        request = GenerateRequest("m", tuple(prompt), sampling=sampling)
        plain, _ = _run(_engine(0), [request])
        engine = _engine(8)
        verified = _spy_on_verify(engine)
        drafted, _passes = _run(engine, [request])
        assert _streams(drafted) == _streams(plain)
        assert len(drafted.tokens("m")) == max_tokens
        assert drafted.final("m").finish_reason == FINISH_LENGTH
        # no draft runs past what may still be generated: it and the token after it fit
        assert all(at + draft + 1 <= max_tokens for at, _, _, draft in verified), verified
        if max_tokens == 7:  # the draft was cut to end exactly there
            assert any(at + draft + 1 == max_tokens for at, _, _, draft in verified), verified


def test_drafts_take_only_the_budget_the_plan_leaves() -> None:
    """A prompt admitted beside decoding samples gets the chunk it gets without speculation;
    no pass computes more than the step's budget."""
    budget = 24
    first = GenerateRequest("a", tuple([*REPEATING, 1]), sampling=SAMPLINGS["greedy"])
    late = GenerateRequest("b", tuple(range(30, 90)), sampling=SAMPLINGS["greedy"])
    chunks: dict[int, list[list[int]]] = {}
    drafted: dict[int, int] = {}
    for k in (0, 6):
        engine = _engine(k, token_budget=budget, max_prefill_chunk=budget)
        recorder = Recorder()
        engine.submit(first, recorder.outputs.append)
        for _ in range(8):  # "a" is decoding (and drafting) when "b" arrives
            engine.step()
        engine.submit(late, recorder.outputs.append)
        seen: list[list[int]] = []
        run = engine.runner.run

        def spy(step: Sequence[Chunk], seen: list[list[int]] = seen, run: Any = run) -> Any:
            seen.append([len(c.token_ids) for c in step])
            return run(step)

        engine.runner.run = spy  # type: ignore[method-assign,assignment]
        drain(engine)
        chunks[k], drafted[k] = seen, engine.stats().draft_tokens
        assert all(sum(step) <= budget for step in seen)
    # "b"'s prefill: the same chunks in the same steps
    assert [step[-1] for step in chunks[6][:3]] == [step[-1] for step in chunks[0][:3]]
    assert drafted == {0: 0, 6: drafted[6]} and drafted[6] > 0


def test_a_pool_too_small_for_every_draft_still_gives_the_same_tokens() -> None:
    """Drafts grow a sequence only where pages are free: with a pool this tight some are
    dropped and samples are preempted, and every token is still the one decoding gives."""
    rng = random.Random(3)
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    requests = [
        GenerateRequest(f"t{i}", tuple(rng.choice(REPEATING) for _ in range(12)), sampling=sampling)
        for i in range(6)
    ]
    plain, _ = _run(_engine(0, num_pages=40, max_running=6), requests)
    engine = _engine(5, num_pages=40, max_running=6)
    drafted, _ = _run(engine, requests)
    assert _streams(drafted) == _streams(plain)
    assert engine.stats().preemptions > 0 and engine.stats().accepted_draft_tokens > 0


def test_drafts_take_free_pages_only() -> None:
    """A pool full of cached prompts: decoding evicts for its pages, a draft never does (it is
    cut to the pages the sequence has and the free ones)."""
    engine = _engine(6, num_pages=40, page_size=4)
    warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    rng = random.Random(5)
    prompts = [tuple(rng.randrange(3, 300) for _ in range(28)) for _ in range(5)]
    _run(engine, [GenerateRequest(f"w{i}", p, sampling=warm) for i, p in enumerate(prompts)])
    assert engine.cache.pool.num_free < 8
    evicted_by_drafts = []
    draft = engine._draft

    def spy(plan: list[Any]) -> None:
        before = engine.cache.tree.evicted_pages
        draft(plan)
        evicted_by_drafts.append(engine.cache.tree.evicted_pages - before)

    engine._draft = spy  # type: ignore[method-assign]
    sampling = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    _run(engine, [GenerateRequest("d", (*REPEATING, 3), sampling=sampling)])
    assert engine.cache.tree.evicted_pages > 0  # decoding evicted
    assert not any(evicted_by_drafts) and engine.stats().accepted_draft_tokens > 0


def test_between_steps_a_drafted_sample_holds_the_pages_decoding_would() -> None:
    """A rejected draft's pages go back to the pool after its step: a running sample holds
    no page past its next position."""
    engine = _engine(6, page_size=2)
    for request in _requests(SAMPLINGS["seeded"]):
        engine.submit(request, lambda o: None)
    ps, grown = engine.config.page_size, 0
    while engine.step():
        for sample in engine.scheduler.running:
            if sample.prefilled and sample.seq is not None:
                held = len(engine.cache.table.row(sample.seq.slot))
                assert held <= max(-(-(sample.computed + 1) // ps), sample.seq.cached_pages)
        grown = max(grown, engine.stats().draft_tokens - engine.stats().accepted_draft_tokens)
    assert grown > 0, "no draft was rejected"
    check_sequence_cache(engine.cache)


def test_a_structured_output_and_stop_strings_come_out_the_same(tiny: Any) -> None:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["aa", "bb"]}}},
        "required": ["tags"],
    }
    free = GenerateRequest(
        "stop",
        prompt="one two one two one two one two",
        sampling=SamplingParams(max_tokens=40, temperature=0.0),
    )
    (text,) = {
        v[2] for v in _streams(_run(_engine(0, tiny.model, tiny.tokenizer), [free])[0]).values()
    }
    stop = text[-8:]  # the tiny model ends repeating itself: its first time comes mid-stream
    assert text.index(stop) + len(stop) < len(text)
    requests = [
        GenerateRequest(
            "json",
            prompt="tags tags tags aa bb aa bb aa bb",
            sampling=SamplingParams(
                max_tokens=60,
                temperature=1.0,
                seed=1,
                n=3,
                structured=StructuredOutput("json_schema", json.dumps(schema)),
            ),
        ),
        dataclasses.replace(free, sampling=dataclasses.replace(free.sampling, stop=(stop,))),
    ]
    plain, _ = _run(_engine(0, tiny.model, tiny.tokenizer), requests)
    engine = _engine(4, tiny.model, tiny.tokenizer)
    drafted, _ = _run(engine, requests)
    assert _streams(drafted) == _streams(plain)
    assert engine.stats().accepted_draft_tokens > 0
    assert drafted.final("stop").finish_reason == FINISH_STOP
    assert (
        "".join(o.text for o in drafted.outputs if o.request_id == "stop")
        == text[: text.index(stop)]
    )
    for index in range(3):
        out = "".join(
            o.text for o in drafted.outputs if o.request_id == "json" and o.index == index
        )
        jsonschema.validate(json.loads(out), schema)


def test_a_follow_up_turn_reads_only_kept_draft_kv() -> None:
    """The next turn's prompt is the first turn's prompt and answer: it reuses the KV the
    drafted turn cached, which must hold the answer's tokens, not a rejected draft's. Its
    logits equal those of the same turns served without drafts."""
    sampling = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompt = [*REPEATING, 2]
    runs = []
    for k in (0, 4):
        engine = _engine(k)
        first, _ = _run(engine, [GenerateRequest("t1", tuple(prompt), sampling=sampling)])
        follow = (*prompt, *first.tokens("t1"), 7, 8)
        second, _ = _run(engine, [GenerateRequest("t2", follow, sampling=sampling)])
        assert second.final("t2").cached_prompt_tokens > len(prompt)  # the answer's KV, reused
        runs.append((first, second, engine.stats().accepted_draft_tokens))
    assert runs[1][2] > 0
    assert _streams(runs[1][1]) == _streams(runs[0][1])
    for key, logits in runs[1][1].logits.items():
        torch.testing.assert_close(logits, runs[0][1].logits[key], rtol=1e-4, atol=1e-4)


def _spy_on_verify(engine: Engine) -> list[tuple[int, int, bool, int]]:
    """Per verification: how many tokens its sample had generated before it, how many it
    drew, whether its sample ended there, and the draft's length."""
    verified: list[tuple[int, int, bool, int]] = []
    verify = engine._verify

    def spy(sample: Any, chunk: Chunk, rows: torch.Tensor) -> None:
        before = sample.generated
        verify(sample, chunk, rows)
        drawn = sample.generated - before
        verified.append((before, drawn, sample.seq is None, chunk.drafted))

    engine._verify = spy  # type: ignore[method-assign]
    return verified


def test_a_stop_token_drawn_after_a_kept_draft_token_ends_the_sample_mid_draft() -> None:
    """Find a prompt whose answer meets a new token right after a kept draft token (the
    second or later draw of a step), stop on that token, and the sample ends there, mid-step,
    with the tokens decoding gives."""
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    for _ in range(40):
        prompt = tuple(rng.randrange(3, 60) for _ in range(6)) * 3
        engine = _engine(4)
        verified = _spy_on_verify(engine)
        answer = _run(engine, [GenerateRequest("s", prompt, sampling=sampling)])[0].tokens("s")
        after_kept = {at + row for at, drawn, _, _ in verified for row in range(1, drawn)}
        found = [p for p, t in enumerate(answer) if p in after_kept and t not in answer[:p]]
        if found:
            break
    else:
        pytest.fail("no answer met a new token after a kept draft token")
    stop = dataclasses.replace(sampling, stop_token_ids=(answer[found[0]],))
    requests = [GenerateRequest("s", prompt, sampling=stop)]
    plain, _ = _run(_engine(0), requests)
    engine = _engine(4)
    verified = _spy_on_verify(engine)
    drafted, _ = _run(engine, requests)
    assert _streams(drafted) == _streams(plain)
    assert drafted.tokens("s") == answer[: found[0] + 1]
    assert drafted.final("s").finish_reason == FINISH_STOP
    _, drawn, ended, _ = verified[-1]
    assert ended and drawn >= 2, verified


def test_drafts_stop_short_of_the_context() -> None:
    """A request that fills the context to its last position (more is refused at submit)."""
    sampling = SamplingParams(max_tokens=48 - 21, temperature=0.0, ignore_eos=True)
    requests = [GenerateRequest("c", tuple([*REPEATING, 4]), sampling=sampling)]
    plain, _ = _run(_engine(0, max_model_len=48), requests)
    engine = _engine(8, max_model_len=48)
    drafted, _ = _run(engine, requests)
    assert _streams(drafted) == _streams(plain)
    assert len(drafted.tokens("c")) == 48 - 21 and drafted.final("c").finish_reason == FINISH_LENGTH
    assert engine.stats().accepted_draft_tokens > 0


@pytest.mark.parametrize(
    ("k", "generated", "max_tokens", "room", "expected"),
    [(4, 0, 100, 1000, 4), (4, 95, 100, 1000, 4), (4, 96, 100, 1000, 3), (4, 99, 100, 1000, 0),
     (4, 0, 100, 3, 2), (4, 0, 100, 1, 0), (0, 0, 100, 1000, 0)],
)  # fmt: skip
def test_a_draft_leaves_room_for_the_token_drawn_after_it(
    k: int, generated: int, max_tokens: int, room: int, expected: int
) -> None:
    assert draft_limit(k, generated, max_tokens, room) == expected


def test_the_settings_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int in"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int in"):
        EngineConfig(num_speculative_tokens=65)
    with pytest.raises(ValueError, match="prompt_lookup_max must be an int >= prompt_lookup_min"):
        EngineConfig(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="prompt_lookup_min must be an int >= 1"):
        SpeculationConfig(1, 4, 0)
    assert not SpeculationConfig().enabled


# -- the n-gram index ---------------------------------------------------------------------------


def _reference(tokens: Sequence[int], lo: int, hi: int, limit: int) -> list[int]:
    """What `propose` proposes, by brute force: the latest `CANDIDATES` earlier occurrences of
    the last `lo` tokens, each extended backwards to at most `hi`; the longest, the latest of
    equals; what followed it."""
    size = len(tokens)
    if limit <= 0 or size <= lo:
        return []
    suffix = list(tokens[size - lo :])
    ends = [e for e in range(lo, size) if list(tokens[e - lo : e]) == suffix][-CANDIDATES:]
    best, longest = None, 0
    for end in reversed(ends):
        n = lo
        while n < hi and end > n and tokens[end - n - 1] == tokens[size - n - 1]:
            n += 1
        if n > longest:
            best, longest = end, n
    return [] if best is None else list(tokens[best : best + limit])


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=80),
    cuts=st.lists(st.integers(0, 80), max_size=6),
    lo=st.integers(1, 3),
    extra=st.integers(0, 3),
    limit=st.integers(0, 6),
)
def test_an_index_grown_step_by_step_proposes_what_brute_force_finds(
    tokens: list[int], cuts: list[int], lo: int, extra: int, limit: int
) -> None:
    index = NgramIndex(lo, lo + extra)
    for cut in sorted(cuts):  # proposals along the way, as a sample's tokens grow
        assert index.propose(tokens[:cut], limit) == _reference(tokens[:cut], lo, lo + extra, limit)
    twin = index.copy()
    assert index.propose(tokens, limit) == _reference(tokens, lo, lo + extra, limit)
    assert twin.propose(tokens, limit) == _reference(tokens, lo, lo + extra, limit)


def test_the_longest_match_wins_and_then_the_latest() -> None:
    index = NgramIndex(1, 3)
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    assert index.propose(tokens, 2) == [40, 9]  # "1 2 3" matched at 3 beats "2 3" at 7
    index = NgramIndex(1, 3)
    assert index.propose([7, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3], 1) == [50]  # equals: the latest
    assert NgramIndex(1, 3).propose([1, 2, 3], 4) == []  # the suffix is no earlier occurrence
