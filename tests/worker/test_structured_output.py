"""Structured outputs on the tiny checkpoint: its weights are random, so whatever its text
obeys, the grammar made it obey. Each kind is checked on seeded samples against an independent
judge (json + jsonschema, re, the choice list), a refused constraint leaves the engine serving
with every page back, and a structured sample resumed on another engine goes on exactly."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest
import torch

from tests.worker.helpers import Recorder, run_all
from tests.worker.test_engine_resume import resumed, seen
from worker.engine import Engine, EngineConfig
from worker.errors import InvalidRequest
from worker.loader import LoadedModel
from worker.request import FINISH_LENGTH, FINISH_STOP, GenerateRequest, RequestOutput
from worker.sampling import Sampler
from worker.sampling_params import MAX_STRUCTURED_CHARS, SamplingParams, StructuredOutput
from worker.structured_output import GRAMMAR_CACHE_BYTES, Constraint, GrammarRefused
from worker.wire import sampling_from_proto, sampling_to_proto

PROMPT = "The router moves a stream to another worker"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tier": {"enum": ["device", "host", "disk"]},
        "pages": {"type": "integer", "minimum": 0, "maximum": 999},
        "hit": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "tier", "pages", "hit", "tags"],
    "additionalProperties": False,
}
CALL_TAG = {
    "type": "tag",
    "begin": '<call name="lookup">',
    "content": {"type": "json_schema", "json_schema": SCHEMA},
    "end": "</call>",
}
CALLS_ONLY = {
    "type": "structural_tag",
    "format": {
        "type": "tags_with_separator",
        "tags": [CALL_TAG],
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": True,
    },
}
CHOICES = ("yes", "no", 'say "maybe"', "été", "日本")


def engine_for(loaded: LoadedModel) -> Engine:
    config = EngineConfig(num_pages=512, page_size=4, model_revision=loaded.revision)
    return Engine(loaded.model, loaded.tokenizer, config)


def texts(recorder: Recorder, request_id: str, n: int) -> list[str]:
    return [
        "".join(o.text for o in recorder.by_request()[request_id] if o.index == i) for i in range(n)
    ]


def structured(
    kind: str, spec: str = "", choices: tuple[str, ...] = (), **more: object
) -> SamplingParams:
    fields: dict[str, object] = {"max_tokens": 120, "temperature": 1.0, "seed": 7, "n": 4}
    fields.update(more)
    return SamplingParams(
        structured=StructuredOutput(kind, spec, choices),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )


def assert_all_stopped(recorder: Recorder, request_id: str, n: int) -> None:
    for i in range(n):
        final = recorder.final(request_id, i)
        assert final.finish_reason == FINISH_STOP, (i, final)


def test_a_json_schema_is_obeyed_by_every_sample(tiny: LoadedModel) -> None:
    sampling = structured("json_schema", json.dumps(SCHEMA))
    recorder = run_all(engine_for(tiny), GenerateRequest("s", prompt=PROMPT, sampling=sampling))
    assert_all_stopped(recorder, "s", 4)
    values = [json.loads(text) for text in texts(recorder, "s", 4)]
    for value in values:
        jsonschema.validate(value, SCHEMA)
    assert len({json.dumps(v) for v in values}) > 1, "four seeded samples all alike"
    # the end-of-sequence token ended each sample and is not in its text
    assert tiny.tokenizer is not None
    eos = set(tiny.tokenizer.eos_token_ids)
    for i in range(4):
        assert recorder.tokens("s", i)[-1] in eos


def test_without_the_constraint_the_random_model_writes_no_json(tiny: LoadedModel) -> None:
    """What makes the test above able to fail: the same draws unconstrained are not JSON."""
    free = SamplingParams(max_tokens=40, temperature=1.0, seed=7, n=4)
    recorder = run_all(engine_for(tiny), GenerateRequest("f", prompt=PROMPT, sampling=free))
    for text in texts(recorder, "f", 4):
        with pytest.raises(ValueError):
            json.loads(text)


def test_json_object_is_an_object(tiny: LoadedModel) -> None:
    recorder = run_all(
        engine_for(tiny),
        GenerateRequest("o", prompt=PROMPT, sampling=structured("json_object", max_tokens=400)),
    )
    for i, text in enumerate(texts(recorder, "o", 4)):
        if recorder.final("o", i).finish_reason == FINISH_LENGTH:
            # an object the random model never closed within 400 tokens: a prefix of one
            assert text.startswith("{")
            continue
        assert isinstance(json.loads(text), dict), text
    assert any(recorder.final("o", i).finish_reason == FINISH_STOP for i in range(4))


def test_a_regex_matches_the_whole_text(tiny: LoadedModel) -> None:
    pattern = r"[a-c]{3}-\d{2}( ok| no)?"
    recorder = run_all(
        engine_for(tiny), GenerateRequest("r", prompt=PROMPT, sampling=structured("regex", pattern))
    )
    assert_all_stopped(recorder, "r", 4)
    outputs = texts(recorder, "r", 4)
    assert all(re.fullmatch(pattern, text) for text in outputs), outputs


def test_a_choice_is_one_of_them_exactly(tiny: LoadedModel) -> None:
    sampling = structured("choice", choices=CHOICES, n=8)
    recorder = run_all(engine_for(tiny), GenerateRequest("c", prompt=PROMPT, sampling=sampling))
    assert_all_stopped(recorder, "c", 8)
    outputs = texts(recorder, "c", 8)
    assert set(outputs) <= set(CHOICES), outputs
    assert len(set(outputs)) > 1


def test_an_ebnf_grammar(tiny: LoadedModel) -> None:
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"'
    recorder = run_all(
        engine_for(tiny),
        GenerateRequest("g", prompt=PROMPT, sampling=structured("grammar", grammar)),
    )
    assert_all_stopped(recorder, "g", 4)
    outputs = texts(recorder, "g", 4)
    assert all(re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", text) for text in outputs), outputs


def test_a_structural_tag_shapes_the_tagged_part(tiny: LoadedModel) -> None:
    sampling = structured("structural_tag", json.dumps(CALLS_ONLY))
    recorder = run_all(engine_for(tiny), GenerateRequest("t", prompt=PROMPT, sampling=sampling))
    assert_all_stopped(recorder, "t", 4)
    for text in texts(recorder, "t", 4):
        found = re.fullmatch(r'<call name="lookup">(.*)</call>', text, re.S)
        assert found, text
        jsonschema.validate(json.loads(found.group(1)), SCHEMA)


def test_a_complete_text_ends_the_sample_even_with_ignore_eos(tiny: LoadedModel) -> None:
    sampling = structured("choice", choices=("alpha", "beta"), ignore_eos=True, n=2)
    recorder = run_all(engine_for(tiny), GenerateRequest("i", prompt=PROMPT, sampling=sampling))
    assert_all_stopped(recorder, "i", 2)
    assert set(texts(recorder, "i", 2)) <= {"alpha", "beta"}


def test_penalties_and_logprobs_go_with_a_constraint(tiny: LoadedModel) -> None:
    sampling = structured(
        "json_schema", json.dumps(SCHEMA), presence_penalty=1.0, repetition_penalty=1.3, logprobs=2
    )
    recorder = run_all(engine_for(tiny), GenerateRequest("p", prompt=PROMPT, sampling=sampling))
    for text in texts(recorder, "p", 4):
        jsonschema.validate(json.loads(text), SCHEMA)
    outputs = recorder.by_request()["p"]
    assert all(len(o.logprobs) == len(o.token_ids) for o in outputs)


def test_logprobs_are_the_raw_distributions_not_the_masked_ones(tiny: LoadedModel) -> None:
    """The mask works on a copy: the first position's top log-probabilities are those of the
    same prompt unconstrained, tokens the grammar forbids included."""
    tops = []
    for constraint in (None, StructuredOutput("json_object")):
        sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, structured=constraint)
        recorder = run_all(engine_for(tiny), GenerateRequest("l", prompt=PROMPT, sampling=sampling))
        tops.append(recorder.outputs[0].logprobs[0].top)
    assert [t for t, _ in tops[0]] == [t for t, _ in tops[1]]
    assert tiny.tokenizer is not None
    assert any(not tiny.tokenizer.decode([t]).startswith("{") for t, _ in tops[1])


def test_free_requests_in_the_same_batch_are_unchanged(tiny: LoadedModel) -> None:
    free = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = run_all(engine_for(tiny), GenerateRequest("free", prompt=PROMPT, sampling=free))
    mixed = run_all(
        engine_for(tiny),
        GenerateRequest(
            "json", prompt=PROMPT, sampling=structured("json_schema", json.dumps(SCHEMA))
        ),
        GenerateRequest("free", prompt=PROMPT, sampling=free),
    )
    assert mixed.tokens("free") == alone.tokens("free")
    assert len(mixed.tokens("free")) == 20


@pytest.mark.parametrize(
    ("kind", "spec", "says"),
    [
        ("json_schema", '{"type": "nonsense"}', 'Unsupported type "nonsense"'),
        ("json_schema", '{"$ref": "#/nowhere"}', "nowhere"),
        ("regex", "a(b", "parenthesis is not closed"),
        ("grammar", 'start ::= "a"', 'root rule with name "root" is not found'),
        ("grammar", 'root ::= "a" |', "EBNF parser error"),
        (
            "structural_tag",
            '{"type": "structural_tag", "format": {"type": "nope"}}',
            "Invalid structural tag error: Format type not recognized: nope",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_by_name(
    tiny: LoadedModel, kind: str, spec: str, says: str
) -> None:
    engine = engine_for(tiny)
    free_pages = engine.cache.pool.num_free
    sampling = structured(kind, spec, n=1)
    with pytest.raises(InvalidRequest) as refused:
        engine.submit(GenerateRequest("bad", prompt=PROMPT, sampling=sampling), print)
    assert refused.value.field == f"sampling.structured.{kind}"
    assert says in str(refused.value)
    message = str(refused.value)
    assert "[" not in message.partition(": does not compile: ")[2][:1]  # no compiler timestamp
    assert "Check failed" not in message
    assert engine.cache.pool.num_free == free_pages
    # the engine serves on, and the id is free again
    ok = run_all(
        engine,
        GenerateRequest("bad", prompt=PROMPT, sampling=structured("choice", choices=("a",), n=1)),
    )
    assert texts(ok, "bad", 1) == ["a"]


@pytest.mark.parametrize(
    ("structured_output", "says"),
    [
        (StructuredOutput("json_schema", "{not json"), "is not JSON"),
        (StructuredOutput("json_schema", "[1, 2]"), "an object or a boolean, got list"),
        (StructuredOutput("regex", ""), "is empty"),
        (StructuredOutput("choice"), "0 choices"),
        (StructuredOutput("choice", choices=("a", "")), "empty string"),
        (
            StructuredOutput("grammar", "x" * (MAX_STRUCTURED_CHARS + 1)),
            f"at most {MAX_STRUCTURED_CHARS:,}",
        ),
        (StructuredOutput("structural_tag", "[1]"), "a structural tag is an object, got list"),
        (StructuredOutput("xml", "x"), "is not one of"),  # type: ignore[arg-type]
    ],
)
def test_what_no_compiler_could_take_is_refused_before_the_worker(
    structured_output: StructuredOutput, says: str
) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(says)):
        SamplingParams(structured=structured_output).validate(512, 100)


@pytest.mark.parametrize(
    "structured_output",
    [
        StructuredOutput("json_schema", json.dumps(SCHEMA)),
        StructuredOutput("json_object"),
        StructuredOutput("regex", r"\d+"),
        StructuredOutput("choice", choices=CHOICES),
        StructuredOutput("grammar", 'root ::= "a"'),
        StructuredOutput("structural_tag", json.dumps(CALLS_ONLY)),
    ],
)
def test_the_wire_carries_each_kind(structured_output: StructuredOutput) -> None:
    params = SamplingParams(structured=structured_output)
    assert sampling_from_proto(sampling_to_proto(params)) == params


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_resumed_structured_sample_continues_exactly(
    tiny: LoadedModel, temperature: float
) -> None:
    """The router resends a cut stream's tokens (cluster/stream_progress.py): the new worker's
    matcher follows them before drawing, so the rest is what the uninterrupted sample drew."""
    sampling = SamplingParams(
        max_tokens=120,
        temperature=temperature,
        seed=3,
        structured=StructuredOutput("json_schema", json.dumps(SCHEMA)),
    )
    whole = run_all(
        engine_for(tiny), GenerateRequest("whole", prompt=PROMPT, sampling=sampling)
    ).outputs
    expected = seen(whole)
    assert expected[2] == FINISH_STOP
    jsonschema.validate(json.loads(expected[1]), SCHEMA)
    for cut in (1, 5, len(whole) - 2):
        assert seen(resumed(tiny, whole, cut, sampling)) == expected, f"cut after {cut}"


def test_resumed_tokens_the_grammar_refuses_end_the_request_with_an_error(
    tiny: LoadedModel,
) -> None:
    assert tiny.tokenizer is not None
    sampling = SamplingParams(
        max_tokens=50, structured=StructuredOutput("choice", choices=("yes", "no"))
    )
    forged = [RequestOutput("x", 0, tuple(tiny.tokenizer.encode("maybe")), "maybe", 0, 0)]
    outputs = resumed(tiny, forged, 1, sampling)[1:]
    assert outputs[-1].finish_reason == "error"
    assert "structured output" in (outputs[-1].error or "")


def test_the_compiled_grammars_kept_are_bounded(tiny: LoadedModel) -> None:
    """xgrammar keeps every grammar it compiled unless told a bound: a worker serving a new
    schema per request would grow without end."""
    engine = engine_for(tiny)
    engine.grammars.compile(StructuredOutput("regex", "a+"))
    compiler = engine.grammars._compiler
    assert compiler is not None and compiler.cache_limit_bytes == GRAMMAR_CACHE_BYTES


def test_a_sampler_whose_allowed_tokens_are_all_minus_infinity_refuses(tiny: LoadedModel) -> None:
    engine = engine_for(tiny)
    grammar = engine.grammars.compile(StructuredOutput("choice", choices=("yes",)))
    sampler = Sampler.create(SamplingParams(temperature=0.0), 0, None, Constraint(grammar))
    logits = torch.full((engine.vocab_size,), float("-inf"))
    with pytest.raises(GrammarRefused):
        sampler(logits, 10)


@pytest.mark.gpu
def test_on_cuda_the_mask_is_applied_on_the_device(tiny: LoadedModel) -> None:
    """The logits stay on the GPU and xgrammar's Triton kernel masks them there; the samples
    obey the schema as on the CPU."""
    model = copy.deepcopy(tiny.model).to("cuda")
    config = EngineConfig(num_pages=512, page_size=4, model_revision=tiny.revision)
    engine = Engine(model, tiny.tokenizer, config)
    sampling = structured("json_schema", json.dumps(SCHEMA))
    recorder = run_all(engine, GenerateRequest("cuda", prompt=PROMPT, sampling=sampling))
    assert_all_stopped(recorder, "cuda", 4)
    for text in texts(recorder, "cuda", 4):
        jsonschema.validate(json.loads(text), SCHEMA)
