"""worker/fill_in_middle.py and the suffix in worker/validation.py: a model's fill-in-the-middle
tokens found among its special tokens, a text prompt and token ids written in the same form,
and every request that cannot be filled in refused naming `suffix`."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.worker.fim_fixtures import QWEN, fim_checkpoint
from worker.errors import InvalidRequest
from worker.fill_in_middle import FIM_FORMS, FimTokens, fim_tokens
from worker.request import GenerateRequest
from worker.tiny_model import build_tiny_checkpoint
from worker.tokenizer import Tokenizer
from worker.validation import RequestLimits, prompt_ids

TEXT = st.characters(exclude_categories=("Cs",), exclude_characters="<|>")
"""Text as a request holds it (no lone surrogate: neither JSON's UTF-8 nor protobuf holds
one), without the special tokens' brackets."""
LIMITS = RequestLimits(vocab_size=512, max_model_len=256, max_prompt_chars=1_000)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(fim_checkpoint(tmp_path_factory.mktemp("fim")))


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("form", FIM_FORMS)
def test_a_form_is_found_only_with_all_three_of_its_tokens(form: FimTokens) -> None:
    tokens = [form.prefix, form.suffix, form.middle]
    assert fim_tokens(["<|endoftext|>", *tokens, "<|im_end|>"]) == form
    for missing in tokens:
        assert fim_tokens([t for t in tokens if t != missing]) is None
    assert fim_tokens([]) is None


def test_a_tokenizer_knows_its_form_from_its_special_tokens(
    tokenizer: Tokenizer, plain: Tokenizer, tmp_path: Path
) -> None:
    assert tokenizer.fim_tokens == QWEN
    assert [tokenizer.token_to_id(t) for t in (QWEN.prefix, QWEN.suffix, QWEN.middle)] == [3, 4, 5]
    assert plain.fim_tokens is None
    starcoder = FIM_FORMS[1]
    assert Tokenizer.from_dir(fim_checkpoint(tmp_path, starcoder)).fim_tokens == starcoder


@settings(max_examples=60, deadline=None)
@given(prefix=st.text(TEXT, max_size=40), suffix=st.text(TEXT, max_size=40))
def test_a_text_prompt_and_its_ids_make_the_same_prompt(
    tokenizer: Tokenizer, prefix: str, suffix: str
) -> None:
    """The form's tokens are read as tokens, and the text between them is tokenised by itself:
    a text prompt and the same prompt as ids give the same ids."""
    from_text = prompt_ids(GenerateRequest("t", prompt=prefix, suffix=suffix), tokenizer, LIMITS)
    ids = tuple(tokenizer.encode(prefix))
    from_ids = prompt_ids(
        GenerateRequest("i", prompt_token_ids=ids, suffix=suffix), tokenizer, LIMITS
    )
    apart = tokenizer.encode(suffix, add_special_tokens=False)
    assert from_text == from_ids == [3, *ids, 4, *apart, 5]


def test_what_cannot_be_filled_in_is_refused_naming_suffix(
    tokenizer: Tokenizer, plain: Tokenizer
) -> None:
    chat = ({"role": "user", "content": "hello"},)
    cases = [
        (GenerateRequest("a", messages=chat, suffix="x"), tokenizer, "not messages"),
        (GenerateRequest("b", prompt="def f(", suffix="x"), plain, "no fill-in-the-middle"),
        (GenerateRequest("c", prompt_token_ids=(7, 8), suffix="x"), plain, "<|fim_prefix|>"),
        (GenerateRequest("d", prompt_token_ids=(7, 8), suffix="x"), None, "leave suffix out"),
    ]
    for request, given_tokenizer, words in cases:
        with pytest.raises(InvalidRequest, match=words) as refused:
            prompt_ids(request, given_tokenizer, LIMITS)
        assert refused.value.field == "suffix"


def test_the_suffix_counts_toward_the_prompts_characters(tokenizer: Tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="1001 characters") as refused:
        prompt_ids(GenerateRequest("a", prompt="a" * 600, suffix="b" * 401), tokenizer, LIMITS)
    assert refused.value.field == "prompt"
    with pytest.raises(InvalidRequest, match="1001 characters") as refused:
        prompt_ids(
            GenerateRequest("b", prompt_token_ids=(7,), suffix="b" * 1_001), tokenizer, LIMITS
        )
    assert refused.value.field == "suffix"
    assert len(prompt_ids(GenerateRequest("c", prompt="a", suffix="b" * 999), tokenizer, LIMITS))
