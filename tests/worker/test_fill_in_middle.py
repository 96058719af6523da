"""worker/fill_in_middle.py and the suffix in worker/validation.py: a model's fill-in-the-middle
tokens found among its added tokens, a text prompt and token ids written in the same form (a
BOS first where the tokenizer adds one), the tokens that end a middle added to the request's
stops, and every request that cannot be filled in refused naming `suffix`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import processors

from tests.worker.fim_fixtures import QWEN, fim_checkpoint
from tests.worker.helpers import run_to_end
from worker.engine import Engine, EngineConfig
from worker.errors import InvalidRequest, PromptTooLarge
from worker.fill_in_middle import FIM_FORMS, FimTokens, fim_tokens
from worker.loader import load_model
from worker.request import FINISH_LENGTH, FINISH_STOP, GenerateRequest
from worker.sampling_params import SamplingParams
from worker.tiny_model import build_tiny_checkpoint
from worker.tokenizer import Tokenizer
from worker.validation import RequestLimits, prompt_ids, with_fim_ends

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
    own = {form.prefix: 7, form.suffix: 8, form.middle: 9}
    found = fim_tokens({"<|endoftext|>": 0, **own, "<|im_end|>": 2})
    assert found == replace(form, ends=(7, 8, 9))
    for missing in own:
        assert fim_tokens({t: i for t, i in own.items() if t != missing}) is None
    assert fim_tokens({}) is None


def test_a_middle_also_ends_at_the_tokens_that_open_another_file() -> None:
    """The form's own three, then those of `FIM_ENDS` the vocabulary has, in that order."""
    added = {QWEN.prefix: 3, QWEN.suffix: 4, QWEN.middle: 5, "<|endoftext|>": 0}
    added |= {"<|fim_pad|>": 8, "<|file_sep|>": 9, "<|repo_name|>": 10, "<file_sep>": 11}
    found = fim_tokens(added)
    assert found is not None and found.ends == (3, 4, 5, 9, 11, 10, 8)


def test_a_tokenizer_knows_its_form_from_its_added_tokens(
    tokenizer: Tokenizer, plain: Tokenizer, tmp_path: Path
) -> None:
    """Qwen's tokens are not marked special (its tokenizer.json's), StarCoder's are."""
    assert tokenizer.fim_tokens == replace(QWEN, ends=(3, 4, 5))
    assert not {3, 4, 5} & tokenizer.special_token_ids
    assert plain.fim_tokens is None
    starcoder = FIM_FORMS[1]
    marked = Tokenizer.from_dir(fim_checkpoint(tmp_path, starcoder, special=True))
    assert marked.fim_tokens == replace(starcoder, ends=(3, 4, 5))
    assert {3, 4, 5} <= marked.special_token_ids


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
        (GenerateRequest("d", prompt_token_ids=(7, 8), suffix="x"), None, "no tokenizer"),
    ]
    for request, given_tokenizer, words in cases:
        with pytest.raises(InvalidRequest, match=words) as refused:
            prompt_ids(request, given_tokenizer, LIMITS)
        assert refused.value.field == "suffix"


def test_the_suffix_counts_toward_the_prompts_characters(tokenizer: Tokenizer) -> None:
    for request in (
        GenerateRequest("a", prompt="a" * 600, suffix="b" * 401),
        GenerateRequest("b", prompt_token_ids=(7,), suffix="b" * 1_001),
    ):
        with pytest.raises(PromptTooLarge, match="1001 characters together") as refused:
            prompt_ids(request, tokenizer, LIMITS)
        assert refused.value.field == "suffix"
    assert len(prompt_ids(GenerateRequest("c", prompt="a", suffix="b" * 999), tokenizer, LIMITS))


def test_a_bos_comes_before_the_form_from_text_and_from_ids(tokenizer: Tokenizer) -> None:
    """DeepSeek-Coder's and CodeGemma's tokenizers begin a text with BOS: the form gets it in
    front, and ids that begin with it (a client's encoding of the text) do not repeat it."""
    backend = BackendTokenizer.from_str(tokenizer.backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    with_bos = Tokenizer(backend, bos_token="<|im_start|>")
    prefix, suffix = "def f(x):\n    ", "\nprint(f(2))"
    inner = with_bos.encode(prefix, add_special_tokens=False)
    expected = [1, 3, *inner, 4, *with_bos.encode(suffix, add_special_tokens=False), 5]
    from_text = GenerateRequest("t", prompt=prefix, suffix=suffix)
    assert prompt_ids(from_text, with_bos, LIMITS) == expected
    for ids in (with_bos.encode(prefix), inner):
        from_ids = GenerateRequest("i", prompt_token_ids=tuple(ids), suffix=suffix)
        assert prompt_ids(from_ids, with_bos, LIMITS) == expected


def test_a_request_with_a_suffix_also_stops_at_the_forms_ends(tokenizer: Tokenizer) -> None:
    sampling = SamplingParams(stop_token_ids=(9, 4))
    request = GenerateRequest("a", prompt="x", suffix="y", sampling=sampling)
    assert with_fim_ends(request, tokenizer).sampling.stop_token_ids == (9, 4, 3, 5)
    plain = GenerateRequest("b", prompt="x", sampling=sampling)
    assert with_fim_ends(plain, tokenizer) is plain


def test_an_engine_given_a_suffix_fills_in_and_stops_at_the_forms_ends(tmp_path: Path) -> None:
    """In process, without the router: the engine writes the form and adds its ends too."""
    loaded = load_model(fim_checkpoint(tmp_path / "coder"))
    assert loaded.tokenizer is not None
    config = EngineConfig(num_pages=64, page_size=4, model_revision=loaded.revision)
    engine = Engine(loaded.model, loaded.tokenizer, config)
    pushed = SamplingParams(max_tokens=6, temperature=0.0, logit_bias=((3, 100.0),))
    filled = run_to_end(engine, GenerateRequest("f", prompt="a", suffix="b", sampling=pushed))
    form = [3, *loaded.tokenizer.encode("a"), 4, *loaded.tokenizer.encode("b"), 5]
    assert filled[0].prompt_tokens == len(form)
    assert filled[-1].finish_reason == FINISH_STOP and "".join(o.text for o in filled) == ""
    written = run_to_end(
        engine, GenerateRequest("w", prompt_token_ids=tuple(form), sampling=pushed)
    )
    assert written[-1].finish_reason == FINISH_LENGTH
