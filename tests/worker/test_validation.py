"""worker/validation.py on its own: the character cap, and a text far longer than the context
refused by its head without tokenising the rest."""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers

from worker.errors import ContextOverflow, InvalidRequest
from worker.request import GenerateRequest
from worker.sampling_params import SamplingParams
from worker.tiny_model import build_tiny_checkpoint
from worker.tokenizer import Tokenizer
from worker.validation import HEAD_CHARS_PER_TOKEN, RequestLimits, prompt_ids, validate

LIMITS = RequestLimits(vocab_size=512, max_model_len=64, max_prompt_chars=100_000)


class LengthRecorder:
    """The real tiny tokenizer, noting how many characters each encode was given."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.lengths.append(len(text))
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> str:
        return self.tokenizer.apply_chat_template(messages)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def test_a_text_over_the_character_cap_is_refused_before_any_tokenising(
    tokenizer: Tokenizer,
) -> None:
    recorder = LengthRecorder(tokenizer)
    with pytest.raises(InvalidRequest, match=r"prompt: 100001 characters; the limit is 100000"):
        prompt_ids(GenerateRequest("x", prompt="a" * 100_001), recorder, LIMITS)
    with pytest.raises(InvalidRequest, match=r"messages: 100001 characters"):
        chat = (
            {"role": "user", "content": "a" * 60_000},
            {"role": "user", "content": "b" * 40_001},
        )
        prompt_ids(GenerateRequest("x", messages=chat), recorder, LIMITS)
    assert recorder.lengths == []


def test_a_text_far_longer_than_the_context_is_refused_by_its_head(tokenizer: Tokenizer) -> None:
    recorder = LengthRecorder(tokenizer)
    text = "the router keeps on serving " * 3000  # 84,000 characters, some 12,000 tokens
    with pytest.raises(
        ContextOverflow,
        match=r"maximum context length is 64 tokens\. However, its 84000 characters",
    ) as err:
        prompt_ids(GenerateRequest("x", prompt=text), recorder, LIMITS)
    assert err.value.field == "prompt"
    assert recorder.lengths == [HEAD_CHARS_PER_TOKEN * 64]  # only the head was tokenised


def test_a_long_text_whose_head_fits_is_tokenised_whole() -> None:
    """Few tokens in many characters: the head does not decide, the whole text is tokenised.
    (A word-level tokenizer, where a long word is one token: the byte-level tiny one has no
    such text.)"""
    backend = BackendTokenizer(models.WordLevel({"[UNK]": 0, "word": 1, "end": 2}, "[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    recorder = LengthRecorder(Tokenizer(backend))
    text = "word " + "x" * 5000 + " end"
    assert prompt_ids(GenerateRequest("x", prompt=text), recorder, LIMITS) == [1, 0, 2]
    assert recorder.lengths == [HEAD_CHARS_PER_TOKEN * 64, len(text)]


def test_a_text_within_the_head_is_tokenised_once(tokenizer: Tokenizer) -> None:
    recorder = LengthRecorder(tokenizer)
    text = "short and sweet"
    assert prompt_ids(GenerateRequest("x", prompt=text), recorder, LIMITS) == tokenizer.encode(text)
    assert recorder.lengths == [len(text)]


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "refused", "field"),
    [
        (64, 1, ContextOverflow, "prompt"),  # the prompt fills the context
        (100, 1, ContextOverflow, "prompt"),
        (60, 5, ContextOverflow, "max_tokens"),  # 4 tokens of room, 5 asked
        (63, 2, ContextOverflow, "max_tokens"),
        (60, 0, InvalidRequest, "max_tokens"),  # a bad count, whatever the prompt
        (60, 4, None, None),
    ],
)
def test_what_overflows_the_context_is_told_apart(
    prompt: int, max_tokens: int, refused: type[InvalidRequest] | None, field: str | None
) -> None:
    """A prompt the context cannot hold, or with fewer tokens of room than max_tokens asks, is
    a ContextOverflow (clients drop old turns on it); a count below 1 is not."""
    request = GenerateRequest("x", sampling=SamplingParams(max_tokens=max_tokens))
    if refused is None:
        validate(request, [1] * prompt, LIMITS)
        return
    with pytest.raises(InvalidRequest) as err:
        validate(request, [1] * prompt, LIMITS)
    assert type(err.value) is refused and err.value.field == field
    assert err.value.reason == (ContextOverflow.reason if refused is ContextOverflow else None)
