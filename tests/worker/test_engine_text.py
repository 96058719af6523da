"""Text in, text out, on the built-in tiny checkpoint loaded from disk like any other model."""

from __future__ import annotations

import pytest

from tests.worker.helpers import Recorder, drain
from worker.engine import Engine, EngineConfig
from worker.errors import InvalidRequest
from worker.loader import LoadedModel
from worker.request import FINISH_LENGTH, FINISH_STOP, GenerateRequest
from worker.sampling_params import SamplingParams


def engine_for(loaded: LoadedModel) -> Engine:
    config = EngineConfig(num_pages=256, page_size=4, model_revision=loaded.revision)
    return Engine(loaded.model, loaded.tokenizer, config)


def run(engine: Engine, request: GenerateRequest) -> Recorder:
    recorder = Recorder()
    engine.submit(request, recorder.outputs.append)
    drain(engine)
    return recorder


def test_streamed_text_is_the_decoded_tokens(tiny: LoadedModel) -> None:
    assert tiny.tokenizer is not None
    engine = engine_for(tiny)
    sampling = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    recorder = run(engine, GenerateRequest("t", prompt="The cache remembers", sampling=sampling))
    tokens = recorder.tokens("t")
    assert len(tokens) == 40
    assert "".join(o.text for o in recorder.outputs) == tiny.tokenizer.decode(tokens)
    assert recorder.outputs[0].prompt_tokens == len(tiny.tokenizer.encode("The cache remembers"))


def test_a_stop_string_ends_generation_and_is_not_returned(tiny: LoadedModel) -> None:
    assert tiny.tokenizer is not None
    sampling = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    free = run(engine_for(tiny), GenerateRequest("free", prompt="Every worker", sampling=sampling))
    text = "".join(o.text for o in free.outputs)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"pick a visible stop string from {text!r}"
    stopped = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, stop=(stop,))
    recorder = run(engine_for(tiny), GenerateRequest("s", prompt="Every worker", sampling=stopped))
    assert "".join(o.text for o in recorder.outputs) == text[: text.index(stop)]
    assert recorder.final("s").finish_reason == FINISH_STOP
    assert len(recorder.tokens("s")) < len(free.tokens("free"))


def test_chat_messages_are_rendered_with_the_template(tiny: LoadedModel) -> None:
    assert tiny.tokenizer is not None
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    sampling = SamplingParams(max_tokens=5, temperature=0.0)
    recorder = run(engine_for(tiny), GenerateRequest("c", messages=messages, sampling=sampling))
    rendered = tiny.tokenizer.apply_chat_template(list(messages))
    assert rendered.endswith("<|im_start|>assistant\n")
    expected = len(tiny.tokenizer.encode(rendered, add_special_tokens=False))
    assert recorder.outputs[0].prompt_tokens == expected
    with pytest.raises(InvalidRequest, match=r"messages\[0\]"):
        engine_for(tiny).submit(GenerateRequest("bad", messages=({"role": "user"},)), print)
    not_a_message = ("hello",)
    with pytest.raises(InvalidRequest, match=r"messages\[0\]"):
        engine_for(tiny).submit(GenerateRequest("bad", messages=not_a_message), print)  # type: ignore[arg-type]


def test_eos_ends_the_sample_unless_ignored(tiny: LoadedModel) -> None:
    assert tiny.tokenizer is not None
    eos = tiny.tokenizer.eos_token_ids[0]
    prompt = tuple(tiny.tokenizer.encode("The router asks"))
    engine = engine_for(tiny)
    seen = run(
        engine,
        GenerateRequest(
            "a", prompt, sampling=SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
        ),
    )
    tokens = seen.tokens("a")
    stopping = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=(tokens[3],))
    recorder = run(engine, GenerateRequest("b", prompt, sampling=stopping))
    assert recorder.tokens("b") == tokens[: tokens.index(tokens[3]) + 1]
    assert recorder.final("b").finish_reason == FINISH_STOP
    if eos not in tokens:
        assert seen.final("a").finish_reason == FINISH_LENGTH
    assert recorder.final("b").cached_prompt_tokens == len(prompt) - 1  # same prompt: a full hit
