"""cluster.text_prompts: text prompts tokenised through the text index, without Ray or a cluster.

The claim under test: in `exact` mode the ids are those of tokenising the whole text, whatever
the index holds (texts that extend, edit or cut earlier ones, answers generated any way, anchored
turns in the same namespace, evictions). `anchored` mode reuses the ids the model generated even
where tokenising the text would give others. Each tokenizer's `TextPrompts` is built once (its
`TokenSpans` reads the whole tokenizer JSON) and each test takes a copy with a fresh index.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import normalizers

from cache.text_index import TextIndex
from cluster.text_prompts import OFF, TextIndexCounters, TextPrompts, TextTurn
from protos.radixmesh.v1 import serving_pb2
from tests.worker.tokenizer_fixtures import (
    FRAGMENTS,
    PREAMBLES,
    TOKENIZERS,
    WITH_BARE,
    long_texts,
    texts,
)
from worker.tokenizer import Tokenizer

EXACT, ANCHORED = "exact", "anchored"


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def built(request: pytest.FixtureRequest) -> TextPrompts:
    prompts = TextPrompts(TOKENIZERS[request.param]())
    assert prompts.spans.reason is None
    return prompts


@pytest.fixture(scope="module", params=sorted(WITH_BARE))
def any_built(request: pytest.FixtureRequest) -> TextPrompts:
    """Also SmolLM2's tokenizer without special tokens (a margin of 1 character)."""
    return TextPrompts(WITH_BARE[request.param]())


def fresh(
    built: TextPrompts, max_chars: int = 16_000_000, min_fraction: float = 0.8
) -> TextPrompts:
    prompts = copy.copy(built)
    prompts.index = TextIndex(max_chars, min_fraction)
    prompts.counters = TextIndexCounters()
    return prompts


def generated_ids(tokenizer: Tokenizer, answer: str, how: str, rng_ids: list[int]) -> list[int]:
    """Ids a model could have generated for `answer`: as it tokenises ("whole"), one character
    at a time ("chars": other ids for the same text), or any ids at all ("any")."""
    if how == "whole":
        return tokenizer.encode(answer, add_special_tokens=False)
    if how == "chars":
        return [i for c in answer for i in tokenizer.encode(c, add_special_tokens=False)]
    return rng_ids


# -- the exact claim -------------------------------------------------------------------------------
OPS = ["new", "extend", "extend", "edit", "truncate", "resume", "resume", "answer", "answer"]
CUT_SHORT = [
    *(t for t in FRAGMENTS if len(t) > 1),
    " " * 20,
    "\n" * 6,
    " \n \n  \t ",
    "1234567890",
    "!!!???...",
    "<|im_end|>\n<|im_start|>assistant\n",
    "abcdefghijklmnopqrstuvwxyz",
]
"""Texts a prompt may stop inside of (a special token, a whitespace run, a contraction, a long
word), for the next prompt to complete."""


def cut_points(text: str) -> st.SearchStrategy[int]:
    """Anywhere in `text`, or where a piece may end: inside or after a run of whitespace or
    punctuation (where a tokenizer looks ahead)."""
    near = [i for i in range(1, len(text)) if not text[i - 1].isalnum() or not text[i].isalnum()]
    anywhere = st.integers(0, len(text))
    return st.one_of(anywhere, st.sampled_from(near)) if near else anywhere


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_exact_mode_ids_are_always_the_full_tokenization(
    any_built: TextPrompts, data: st.DataObject
) -> None:
    tokenizer = any_built.tokenizer
    prompts = fresh(
        any_built,
        max_chars=data.draw(st.sampled_from([0, 40, 300, 16_000_000]), label="max_chars"),
        min_fraction=data.draw(st.sampled_from([0.0, 0.5, 0.8, 1.0]), label="min_fraction"),
    )
    seen: list[str] = []
    turns: list[TextTurn] = []
    prompted = 0

    def check(namespace: Hashable, text: str) -> None:
        nonlocal prompted
        mode = data.draw(st.sampled_from([EXACT, EXACT, ANCHORED]), label="mode")
        special = data.draw(st.booleans(), label="add_special_tokens")
        ids, turn = prompts.encode(namespace, text, mode, special)
        expected = tokenizer.encode(text, add_special_tokens=special)
        if mode == EXACT:
            assert ids == expected
        else:  # anchored ids may differ, but they spell the same text
            assert tokenizer.decode(ids, skip_special_tokens=False) == tokenizer.decode(
                expected, skip_special_tokens=False
            )
        lead = prompts.spans.lead * special
        spelled = tokenizer.decode(expected, skip_special_tokens=False) == (
            tokenizer.decode(lead, skip_special_tokens=False) + text
        )
        if text and spelled:
            assert turn is not None and turn.text == text
            assert ids == lead + turn.spans.ids.tolist()
            turns.append(turn)
        else:  # nothing to index, or characters the tokenizer drops: kept out of the index
            assert turn is None
        prompted += bool(text)
        seen.append(text)
        prompts.index.check_integrity()

    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        op = data.draw(st.sampled_from(OPS), label="op") if seen else "new"
        namespace: Hashable = data.draw(st.sampled_from(["A", "A", "B"]), label="namespace")
        base = data.draw(st.sampled_from(seen), label="base") if seen else ""
        more = data.draw(texts(), label="more")
        if op == "new":
            text = data.draw(st.one_of(texts(12), long_texts()), label="new")
        elif op == "extend":  # with or without a separator: texts() may start with a letter
            text = base + more
        elif op == "edit":
            text = base[: data.draw(cut_points(base), label="cut")] + more
        elif op == "truncate":
            text = base[: data.draw(cut_points(base), label="cut")]
        elif op == "resume":  # a prompt stops inside a piece, the next one completes it
            piece = data.draw(st.sampled_from(CUT_SHORT), label="piece")
            check(namespace, base + piece[: data.draw(st.integers(1, len(piece) - 1))])
            text = base + piece + more
        else:
            if not turns:
                continue
            turn = data.draw(st.sampled_from(turns), label="turn")
            namespace = turn.namespace
            how = data.draw(st.sampled_from(["whole", "chars", "any"]), label="how")
            rng = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=8))
            answer_ids = generated_ids(tokenizer, data.draw(texts(5), label="answer"), how, rng)
            prompts.finished(turn, [answer_ids, []])
            answer = tokenizer.decode(answer_ids, skip_special_tokens=False)
            seen.append(turn.text + answer)
            text = turn.text + answer + more
        check(namespace, text)
    assert prompts.counters.prompts == prompted


TRAPS = [
    ("<|im_sta", "<|im_start|>user\n"),  # a special token completed
    ("<|im_start", "<|im_start|>"),
    ("<|im_start|", "<|im_start|>x"),
    ("hello  you", "hello  "),  # a whitespace run that no longer precedes a word
    ("hello  you", "hello  \n"),
    ("hello   you", "hello    you"),
    ("line\n\nnext", "line\n\n"),
    ("line\n\n", "line\n\nnext"),
    ("it 'l", "it 'll"),  # a contraction completed
    ("it's", "it'sy"),
    ("1234", "12345"),
    ("👍", "👍🏽 ok"),
    ("abc!!", "abc!!!?"),
    ("the café", "the cafés"),
]


@pytest.mark.parametrize(("first", "second"), TRAPS)
def test_exact_mode_where_a_stored_text_tokenises_otherwise_in_a_longer_one(
    any_built: TextPrompts, first: str, second: str
) -> None:
    """A stored text that the next one continues or cuts inside its last pieces, after an
    opening long enough to reuse: exact mode backs off far enough."""
    tokenizer = any_built.tokenizer
    for opening in PREAMBLES:
        prompts = fresh(any_built)
        for text in (opening + first, opening + second, opening + first):
            ids, _ = prompts.encode("n", text, EXACT, add_special_tokens=False)
            assert ids == tokenizer.encode(text, add_special_tokens=False), text
        assert prompts.counters.reused_chars > 0


# -- reuse -----------------------------------------------------------------------------------------
LONG_TURNS = [
    (
        "Tell me about radix trees. I have read that they store strings by sharing prefixes, "
        "and I would like to know how insertion and lookup work, step by step, with an example "
        "of three words that share a prefix, and what happens when one of them is removed.",
        "A radix tree stores each shared prefix once: every edge carries a run of characters. "
        "To look up a word, follow the edge whose label starts with the next character, compare "
        "the label, and continue from its end. Inserting splits an edge where the new word "
        "leaves it. Removing a word merges an edge with its only child again.",
    ),
    (
        "Thanks! Now compare that with a hash map of every prefix, in memory and in time, for a "
        "million prompts of ten thousand characters each, most of them sharing a long system "
        "prompt and the first turns of a conversation.",
        "A hash map of every prefix stores each prefix separately, so memory grows with the "
        "square of the length; the radix tree stores every character once. Lookups in the tree "
        "cost one comparison per character matched, the map one hash per prefix tried.",
    ),
    (
        "Last question: how would you evict entries when the tree grows past its budget, and "
        "what would you keep?",
        "Drop the least recently used leaves first: a shared prefix is a leaf's ancestor and "
        "stays while anything below it is still in use.",
    ),
]


def test_a_long_conversation_reuses_almost_every_earlier_character(built: TextPrompts) -> None:
    prompts = fresh(built)
    tokenizer = prompts.tokenizer
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a patient tutor."}]
    previous = ""  # the previous prompt and its answer
    for question, answer in LONG_TURNS:
        messages.append({"role": "user", "content": question})
        text = tokenizer.apply_chat_template(messages)
        reused = prompts.counters.reused_chars
        ids, turn = prompts.encode("chat", text, EXACT, add_special_tokens=False)
        assert ids == tokenizer.encode(text, add_special_tokens=False)
        assert turn is not None
        assert text.startswith(previous)
        # backed off no more than a few pieces and the longest special token
        assert prompts.counters.reused_chars - reused >= len(previous) - 40
        generated = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        prompts.finished(turn, [generated])
        messages.append({"role": "assistant", "content": answer})
        previous = text + answer + "<|im_end|>"
    counters = prompts.counters
    assert counters.reused_chars > 0.9 * (counters.prompt_chars - len(text))
    assert counters.tokenized_chars == counters.prompt_chars - counters.reused_chars
    assert counters.backoff_tokens < 15 * (len(LONG_TURNS) - 1)
    assert counters.outcomes == {"miss": 1, "split": len(LONG_TURNS) - 1}


def test_exact_answers_let_the_next_turn_reuse_through_them(built: TextPrompts) -> None:
    prompts = fresh(built)
    tokenizer = prompts.tokenizer
    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    answer = "The capital of France is Paris, a city on the river Seine, famous for its museums."
    _, turn = prompts.encode("n", prompt, EXACT)
    assert turn is not None
    prompts.finished(turn, [generated_ids(tokenizer, answer, "chars", [])])  # ids that differ
    text = prompt + answer + "<|im_end|>\n<|im_start|>user\nAnd of Spain?<|im_end|>\n"
    ids, _ = prompts.encode("n", text, EXACT)
    assert ids == tokenizer.encode(text)
    assert prompts.counters.outcomes == {"miss": 1, "split": 1}
    reused = prompts.counters.reused_chars
    assert len(prompt) < reused <= len(prompt + answer)


@pytest.mark.parametrize("how", ["chars", "newlines"])
def test_anchored_mode_reuses_generated_ids_that_tokenising_would_not_give(
    built: TextPrompts, how: str
) -> None:
    tokenizer = built.tokenizer
    prompt = "<|im_start|>user\nWrite a short answer.<|im_end|>\n<|im_start|>assistant\n"
    if how == "chars":
        answer = "The capital of France is Paris."
        generated = generated_ids(tokenizer, answer, "chars", [])
    else:  # "\n" twice where "\n\n" before a special token tokenises as one token
        answer = "First line.\n\n"
        double = tokenizer.encode("\n\n", add_special_tokens=False)
        if len(double) != 1:
            pytest.skip("this vocabulary has no single token for a blank line")
        newline = tokenizer.encode("\n", add_special_tokens=False)
        generated = tokenizer.encode("First line.", add_special_tokens=False) + newline * 2
    assert generated != tokenizer.encode(answer, add_special_tokens=False)
    assert tokenizer.decode(generated, skip_special_tokens=False) == answer
    text = prompt + answer + "<|im_end|>\n<|im_start|>user\nThanks, and now?<|im_end|>\n"
    full = tokenizer.encode(text, add_special_tokens=False)

    anchored = fresh(built)
    prompt_ids, turn = anchored.encode("n", prompt, ANCHORED, add_special_tokens=False)
    assert turn is not None
    anchored.finished(turn, [generated])
    ids, _ = anchored.encode("n", text, ANCHORED, add_special_tokens=False)
    assert ids[: len(prompt_ids) + len(generated)] == prompt_ids + generated
    assert ids != full
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert anchored.counters.outcomes == {"miss": 1, "extend": 1}
    assert anchored.counters.reused_chars == len(prompt + answer)
    # The same text again in exact mode, in the same index: the full tokenization.
    ids, _ = anchored.encode("n", text, EXACT, add_special_tokens=False)
    assert ids == full
    # And an exact index given the same answer: full tokenizations only.
    exact = fresh(built)
    _, turn = exact.encode("n", prompt, EXACT, add_special_tokens=False)
    assert turn is not None
    exact.finished(turn, [generated])
    ids, _ = exact.encode("n", text, EXACT, add_special_tokens=False)
    assert ids == full


# -- namespaces, off, counters ---------------------------------------------------------------------
TEXT = (
    "<|im_start|>system\nYou answer briefly.<|im_end|>\n<|im_start|>user\n"
    "Name three rivers of Europe, and say which one is the longest.<|im_end|>\n"
)


def test_namespaces_never_give_each_other_reuse(built: TextPrompts) -> None:
    prompts = fresh(built)
    prompts.encode(("tenant", "a"), TEXT, EXACT)
    prompts.encode(("tenant", "a"), TEXT + "More.", ANCHORED)
    assert prompts.counters.reused_chars == len(TEXT)  # tenant A's own texts do match
    for mode in (EXACT, ANCHORED):
        ids, _ = prompts.encode(("tenant", "b"), TEXT + "More?", mode)
        assert ids == prompts.tokenizer.encode(TEXT + "More?")
    assert prompts.counters.outcomes == {"miss": 2, "extend": 1, "exact": 1}
    assert prompts.counters.reused_chars == len(TEXT) + len(TEXT + "More?")  # B's own text


def test_off_tokenises_in_full_and_keeps_nothing(built: TextPrompts) -> None:
    prompts = fresh(built)
    for _ in range(2):
        ids, turn = prompts.encode("n", TEXT, OFF)
        assert ids == prompts.tokenizer.encode(TEXT) and turn is None
    assert prompts.index.stats().chars == 0 and prompts.counters.prompts == 0
    assert prompts.encode("n", "", EXACT) == (prompts.tokenizer.encode(""), None)
    assert prompts.counters.prompts == 0


def test_counters_follow_each_prompt(built: TextPrompts) -> None:
    prompts = fresh(built)
    tokenizer = prompts.tokenizer
    ids, _ = prompts.encode("n", TEXT, EXACT)
    c = prompts.counters
    assert (c.prompts, c.prompt_chars, c.reused_chars, c.reused_tokens) == (1, len(TEXT), 0, 0)
    assert (c.tokenized_chars, c.backoff_tokens) == (len(TEXT), 0)
    again, _ = prompts.encode("n", TEXT, EXACT)  # all matched, backed off, the rest tokenised
    assert again == ids
    assert c.prompts == 2 and c.prompt_chars == 2 * len(TEXT)
    assert 0 < c.reused_chars < len(TEXT) - built.spans.margin
    assert c.tokenized_chars == 2 * len(TEXT) - c.reused_chars
    assert c.backoff_tokens == len(ids) - c.reused_tokens > 2
    assert (
        tokenizer.decode(ids[: c.reused_tokens], skip_special_tokens=False)
        == (TEXT[: c.reused_chars])
    )
    ids, _ = prompts.encode("n", TEXT, ANCHORED)  # the stored text itself
    assert ids == tokenizer.encode(TEXT)
    assert c.outcomes == {"miss": 1, "split": 1, "exact": 1}
    assert c.backoff_tokens == len(ids) - (c.reused_tokens - len(ids))
    assert c.seconds > 0


def test_a_tokenizer_that_cannot_split_exactly_is_off_in_every_mode() -> None:
    tokenizer = copy.copy(TOKENIZERS["tiny"]())
    tokenizer.backend = copy.deepcopy(tokenizer.backend)
    tokenizer.backend.normalizer = normalizers.Lowercase()
    prompts = TextPrompts(tokenizer)
    assert prompts.spans.reason is not None
    modes = [serving_pb2.TEXT_MATCH_EXACT, serving_pb2.TEXT_MATCH_ANCHORED, 0]
    assert {prompts.mode(m) for m in modes} == {OFF}
    ok = TextPrompts(TOKENIZERS["tiny"](), mode=ANCHORED)
    assert [ok.mode(m) for m in modes] == [EXACT, ANCHORED, ANCHORED]


def test_the_prompt_encoder_keeps_its_turn(built: TextPrompts) -> None:
    prompts = fresh(built)
    encoder = prompts.encoder("n", EXACT)
    ids = encoder.encode(TEXT, add_special_tokens=False)
    assert encoder.turn is not None and encoder.turn.text == TEXT
    assert ids == prompts.tokenizer.encode(TEXT, add_special_tokens=False)


UNSPELLABLE: list[tuple[str, Callable[[str], str]]] = [
    ("alone", lambda stored: "\x04"),
    ("after a stored text", lambda stored: stored + "\x04\x06"),
    ("inside", lambda stored: stored[:20] + "\x04" + stored[20:]),
]


@pytest.mark.parametrize(("name", "make"), UNSPELLABLE, ids=[n for n, _ in UNSPELLABLE])
@pytest.mark.parametrize("mode", [EXACT, ANCHORED])
def test_characters_the_tokenizer_drops(
    built: TextPrompts, name: str, make: Callable[[str], str], mode: str
) -> None:
    """SmolLM2's vocabulary has no token for some bytes (0x04, 0x06): encoding drops them (a
    text of only such characters has no ids at all) and shifts the offsets after them, so such
    a text is tokenised (past what the index reuses) but never joins the index."""
    prompts = fresh(built)
    prompts.encode("n", TEXT, mode)
    stored = prompts.index.stats()
    text = make(TEXT)
    spelled = prompts.tokenizer.decode(prompts.tokenizer.encode(text), False) == text
    assert spelled == (built.tokenizer is TOKENIZERS["tiny"]())
    for _ in range(2):
        ids, turn = prompts.encode("n", text, mode)
        assert ids == prompts.tokenizer.encode(text)
        assert (turn is not None) == spelled
    if not spelled:
        assert prompts.index.stats() == stored
    prompts.index.check_integrity()


def test_a_text_the_index_refuses_is_left_out_and_the_request_still_gets_its_ids(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("DEBUG", logger="cluster.text_prompts")
    prompts = TextPrompts(TOKENIZERS["tiny"]())

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("refused for the test")

    prompts.index.insert = refuse  # type: ignore[method-assign]
    text = "The router keeps the text of every conversation."
    ids, turn = prompts.encode("t", text, "exact")
    assert ids == prompts.tokenizer.encode(text)
    assert turn is not None and prompts.index.stats().chars == 0
    prompts.finished(turn, [prompts.tokenizer.encode(" More.", add_special_tokens=False)])
    assert "left out: refused for the test" in caplog.text


def test_prepare_indexes_whole_accepted_prompts_only() -> None:
    """Validation's size check of a long text's head goes around the index (anchored mode then
    extended the head: a first prompt's ids differed from a full tokenization), and a refused
    prompt leaves nothing behind."""
    from cluster.requests import prepare
    from worker.errors import InvalidRequest
    from worker.validation import RequestLimits

    tokenizer = TOKENIZERS["smollm2"]()
    prompts = TextPrompts(tokenizer)
    limits = RequestLimits(tokenizer.vocab_size, 64)  # a head of 16 x 64 characters
    text = "Dear reader, " + "-" * 1500 + " The Supercalifragilisticexpialidocious word"
    message = serving_pb2.GenerateRequest(request_id="long", text=text)
    message.text_match = serving_pb2.TEXT_MATCH_ANCHORED
    prepared = prepare(message, tokenizer, limits, text_prompts=prompts)
    assert list(prepared.token_ids) == tokenizer.encode(text)
    assert prompts.counters.outcomes == {"miss": 1} and prompts.index.stats().chars == len(text)
    refused = serving_pb2.GenerateRequest(request_id="big", text="hello world " * 200)
    with pytest.raises(InvalidRequest, match="maximum context length is 64 tokens"):
        prepare(refused, tokenizer, limits, text_prompts=prompts)
    assert prompts.index.stats().chars == len(text)


def test_an_unknown_text_match_is_refused_by_name() -> None:
    from cluster.requests import prepare
    from worker.errors import InvalidRequest
    from worker.validation import RequestLimits

    tokenizer = TOKENIZERS["tiny"]()
    prompts = TextPrompts(tokenizer)
    message = serving_pb2.GenerateRequest(request_id="odd", text="hello there")
    message.text_match = 7  # proto3 keeps an enum value it does not know
    with pytest.raises(InvalidRequest, match="text_match: 7 is not one of"):
        prepare(message, tokenizer, RequestLimits(tokenizer.vocab_size, 64), text_prompts=prompts)
    assert prompts.index.stats().chars == 0
