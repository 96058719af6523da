"""worker.tokenizer_spans: token ids with the character each ends at, CUT and SPLIT flags, and
the check that refuses tokenizers whose split tokenization is not exact.

Both real tokenizers (SmolLM2's and the tiny model's) against their own `encode` and `decode`;
small BPE tokenizers trained here, each with one feature that breaks split tokenization, must
get a reason (and the same tokenizer without it must not, so the reason is the feature's).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from tokenizers import Tokenizer as BackendTokenizer

from cache.text_index import CUT, SPLIT
from tests.worker.tokenizer_fixtures import TOKENIZERS, WITH_BARE, texts
from worker.tokenizer import Tokenizer
from worker.tokenizer_spans import Spans, TokenSpans

CORPUS = [
    "Hello world, hello there. The cat's hat is 123 years old!",
    "Ünïcödé 漢字 🙂 text\n\nwith  spaces and    tabs\tand more words",
    "def f(x):\n    return x + 1  # comment",
]


MARGINS = {"smollm2": len("<jupyter_output>"), "tiny": len("<|endoftext|>"), "bare": 1}
"""The longest special token of each."""


@pytest.fixture(scope="module", params=sorted(WITH_BARE))
def which(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@cache
def spans_of(which: str) -> TokenSpans:
    """Built once per tokenizer: it reads the whole tokenizer JSON (0.2 s for SmolLM2's)."""
    return TokenSpans(WITH_BARE[which]())


@pytest.fixture(scope="module")
def spans(which: str) -> TokenSpans:
    return spans_of(which)


def lossless(tokenizer: Tokenizer, text: str) -> bool:
    """Whether the tokenizer spells `text` back (SmolLM2's vocabulary lacks 21 of the 256 bytes,
    among them 0x04 and the first byte of U+40000: encoding drops them)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False) == text


def assert_spans_spell(tokenizer: Tokenizer, text: str, spans: Spans) -> None:
    """Every CUT token ends where the ids so far spell exactly the text so far (when the tokenizer
    can spell the text at all); SPLITs are CUTs; the last token ends the text on a CUT."""
    ids, ends, flags = list(spans.ids), list(spans.ends), list(spans.flags)
    assert len(ids) == len(ends) == len(flags)
    assert spans.spelled == lossless(tokenizer, text)
    if not ids:
        assert not spans.spelled or text == ""
        return
    assert ends == sorted(ends) and ends[-1] == len(text) and flags[-1] & CUT
    if not spans.spelled:  # no cut inside: the offsets are off
        assert not any(flag & CUT for flag in flags[:-1])
    for i, flag in enumerate(flags):
        assert not flag & SPLIT or flag & CUT, i
        if flag & CUT and spans.spelled:
            assert tokenizer.decode(ids[: i + 1], skip_special_tokens=False) == text[: ends[i]], i


def test_both_tokenizers_split_exactly(which: str, spans: TokenSpans) -> None:
    assert spans.reason is None
    assert spans.lead == [] == spans.tokenizer.encode("", add_special_tokens=True)
    assert spans.margin == MARGINS[which]


def test_texts_the_tokenizer_drops_have_no_tokens() -> None:
    tokenizer = TOKENIZERS["smollm2"]()
    spans = spans_of("smollm2")
    assert tokenizer.encode("\x04\x06") == []
    got = spans.spans("\x04\x06")
    assert len(got) == 0 and not got.spelled
    got = spans.spans("ab\x04")
    assert list(got.ids) == tokenizer.encode("ab") and list(got.ends) == [3] and not got.spelled
    # Offsets after a dropped byte inside a piece are shifted ("!" at (0, 1), not (1, 2)):
    # no cut is claimed inside such a text.
    got = spans.spans("\x04! !")
    assert list(got.ids) == tokenizer.encode("\x04! !") and not got.spelled
    assert list(got.flags) == [0, CUT | SPLIT] and list(got.ends) == [4, 4]
    assert spans.spans("! !").spelled and spans.spans("\U0003ffff").spelled


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "Hello  world\n\n  x!! 123.456 <|im_start|>user\nhi<|im_end|>\n",
        "café 漢字 🙂👍🏽 Grüße",
        "<|im_start|><|im_end|><|im_sta",
        " ",
        "\n\n\n",
    ],
)
def test_spans_are_the_tokenizers_ids(spans: TokenSpans, text: str) -> None:
    got = spans.spans(text)
    assert list(got.ids) == spans.tokenizer.encode(text, add_special_tokens=False)
    assert_spans_spell(spans.tokenizer, text, got)
    if text.isascii():  # every token ends a character: all are CUTs
        assert all(flag & CUT for flag in got.flags)


def test_split_points_are_piece_edges(spans: TokenSpans) -> None:
    text = "Hello world!! 12"
    got = spans.spans(text)
    split_ends = [end for end, flag in zip(got.ends, got.flags, strict=True) if flag & SPLIT]
    assert {5, 11}.issubset(split_ends)  # "Hello" | " world" | "!!"
    assert 3 not in split_ends and 8 not in split_ends  # never inside a word
    assert spans.spans("").ids.tolist() == []


def test_a_character_spelled_by_several_tokens_is_cut_only_after_the_last() -> None:
    tokenizer = TOKENIZERS["tiny"]()
    spans = spans_of("tiny")
    text = "a漢b"  # 漢 is three bytes the tiny vocabulary does not merge
    got = spans.spans(text)
    assert len(got) > 3
    cuts = [end for end, flag in zip(got.ends, got.flags, strict=True) if flag & CUT]
    assert cuts == [1, 2, 3]
    assert_spans_spell(tokenizer, text, got)


@settings(max_examples=150, deadline=None)
@given(text=texts(), which=st.sampled_from(sorted(WITH_BARE)))
def test_spans_of_any_text(text: str, which: str) -> None:
    tokenizer = WITH_BARE[which]()
    got = spans_of(which).spans(text)
    assert list(got.ids) == tokenizer.encode(text, add_special_tokens=False)
    assert_spans_spell(tokenizer, text, got)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), which=st.sampled_from(sorted(WITH_BARE)))
def test_generated_ids_spell_their_decoded_text(data: st.DataObject, which: str) -> None:
    tokenizer = WITH_BARE[which]()
    spans = spans_of(which)
    if data.draw(st.booleans()):  # any ids: special tokens, bytes of half a character
        ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=12))
    else:  # a text's ids, one piece at a time (not how the text tokenises)
        parts = data.draw(st.lists(texts(2), max_size=5))
        ids = [i for part in parts for i in tokenizer.encode(part, add_special_tokens=False)]
    text, got = spans.generated(ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=False)
    assert list(got.ids) == ids
    assert not any(flag & SPLIT for flag in got.flags)
    assert_spans_spell(tokenizer, text, got)


def test_generated_newlines_as_two_tokens() -> None:
    tokenizer = TOKENIZERS["smollm2"]()
    spans = spans_of("smollm2")
    newline, double = tokenizer.encode("\n"), tokenizer.encode("\n\n")
    assert len(newline) == len(double) == 1 and newline != double
    text, got = spans.generated(newline * 2)
    assert text == "\n\n" and list(got.ends) == [1, 2] and list(got.flags) == [CUT, CUT]
    assert spans.generated([]) == ("", Spans(got.ids[:0], got.ends[:0], got.flags[:0]))


# -- tokenizers whose split tokenization is not exact ----------------------------------------------
def trained(
    pre: pre_tokenizers.PreTokenizer | None = None,
    decoder: decoders.Decoder | None = None,
    normalizer: normalizers.Normalizer | None = None,
    lstrip: bool = False,
) -> Tokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre or pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoder or decoders.ByteLevel()
    if normalizer is not None:
        backend.normalizer = normalizer
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    backend.add_special_tokens([AddedToken("<|x|>", special=True, lstrip=lstrip, normalized=False)])
    return Tokenizer(backend, bos_token="<|x|>")


def with_post(processor: Callable[[int], processors.PostProcessor]) -> Tokenizer:
    tokenizer = trained()
    bos = tokenizer.bos_token_id
    assert bos is not None
    tokenizer.backend.post_processor = processor(bos)
    return tokenizer


def test_a_plain_byte_level_bpe_splits_exactly() -> None:
    """The control for the refusals below: the same training, none of their features."""
    spans = TokenSpans(trained())
    assert spans.reason is None and spans.margin == 5 and spans.lead == []
    text = "Hello  world <|x|>漢字 123\n\n"
    assert_spans_spell(spans.tokenizer, text, spans.spans(text))
    digits = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    assert TokenSpans(trained(pre=digits)).reason is None


def test_a_bos_before_the_text_is_the_lead() -> None:
    tokenizer = with_post(
        lambda bos: processors.TemplateProcessing("<|x|> $A", "<|x|> $A $B", [("<|x|>", bos)])
    )
    spans = TokenSpans(tokenizer)
    assert spans.reason is None and spans.lead == [tokenizer.bos_token_id]


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda: trained(normalizer=normalizers.NFKC()), r"normalizer \(NFKC\)"),
        (lambda: trained(normalizer=normalizers.Lowercase()), r"normalizer \(Lowercase\)"),
        (
            lambda: trained(pre=pre_tokenizers.Metaspace(), decoder=decoders.Metaspace()),
            "pre-tokenizer Metaspace may change text across a cut",
        ),
        (
            lambda: trained(pre=pre_tokenizers.ByteLevel(add_prefix_space=True)),
            "ByteLevel pre-tokenizer adds a prefix space",
        ),
        (
            lambda: trained(
                pre=pre_tokenizers.Sequence(
                    [pre_tokenizers.Digits(), pre_tokenizers.ByteLevel(add_prefix_space=True)]
                )
            ),
            "ByteLevel pre-tokenizer adds a prefix space",
        ),
        (lambda: trained(pre=pre_tokenizers.Whitespace()), "pre-tokenizer Whitespace"),
        (lambda: trained(lstrip=True), r"special token '<\|x\|>' strips"),
        (
            lambda: with_post(
                lambda bos: processors.TemplateProcessing(
                    "$A <|x|>", "$A $B <|x|>", [("<|x|>", bos)]
                )
            ),
            "add_special_tokens adds ids after the text",
        ),
        (
            lambda: with_post(
                lambda bos: processors.BertProcessing(("<|x|>", bos), ("<|x|>", bos))
            ),
            "post-processor BertProcessing",
        ),
    ],
)
def test_tokenizers_that_cannot_split_exactly_get_a_reason(
    build: Callable[[], Tokenizer], reason: str
) -> None:
    spans = TokenSpans(build())
    assert spans.reason is not None and re.search(reason, spans.reason), spans.reason
