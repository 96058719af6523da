"""cache.text_index: the character radix tree of texts with token boundaries, with no tokenizer.

A toy tokenizer stands in for a real one: one token per pre-tokenizer piece (`Toy.words`, the
GPT-2 shape: a word with its leading space, a punctuation run, a whitespace run that leaves its
last space to the next word), every token a CUT and a SPLIT. Anchored ids are any segmentation
of the text into chunks (`Toy.chunks`), some chunks spelled by two tokens of which the first is
not a CUT (as a multi-byte character generated in two tokens). Every id spells one fixed string,
so the ids a match hands back can be spelled and compared with the text.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from cache.text_index import (
    CUT,
    SPLIT,
    TextIndex,
    TextIndexStats,
    TextMatch,
    TextMatchMode,
    TextOutcome,
)

EXACT, ANCHORED = TextMatchMode.EXACT, TextMatchMode.ANCHORED
PIECES = re.compile(r" ?[a-z]+| ?[^a-z\s]+|\s+(?!\S)|\s+")


@dataclass(frozen=True)
class Tokens:
    ids: list[int]
    ends: list[int]
    flags: list[int]


class Toy:
    """Ids for strings: each id spells one string; a `half` id spells nothing (the first token of
    a chunk generated in two), its `whole` partner the chunk."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, str], int] = {}
        self._spelled: list[str] = []

    def _id(self, kind: str, piece: str) -> int:
        key = (kind, piece)
        if key not in self._ids:
            self._ids[key] = len(self._spelled) + 100
            self._spelled.append("" if kind == "half" else piece)
        return self._ids[key]

    def spell(self, ids: Sequence[int]) -> str:
        return "".join(self._spelled[i - 100] for i in ids)

    def words(self, text: str, drop_splits: Sequence[int] = ()) -> Tokens:
        """A full tokenization: one token per piece, each a CUT and a SPLIT (except the SPLITs
        at the token indices in `drop_splits`, fewer split points being always allowed)."""
        ids, ends, flags = [], [], []
        for i, piece in enumerate(PIECES.finditer(text)):
            ids.append(self._id("word", piece.group()))
            ends.append(piece.end())
            flags.append(CUT if i in drop_splits else CUT | SPLIT)
        return Tokens(ids, ends, flags)

    def chunks(
        self,
        text: str,
        cuts: Sequence[int],
        halves: Sequence[int] = (),
        splits: Sequence[int] = (),
    ) -> Tokens:
        """Anchored ids: `text` cut at `cuts` into chunks, each one token (a CUT; a SPLIT too if
        its index is in `splits`, which exact matches must not believe); the chunks whose index
        is in `halves` are two tokens, the first no CUT."""
        bounds = sorted({c for c in cuts if 0 < c < len(text)} | {len(text)}) if text else []
        ids, ends, flags, start = [], [], [], 0
        for i, end in enumerate(bounds):
            chunk = text[start:end]
            if i in halves:
                ids.append(self._id("half", chunk))
                ends.append(start)
                flags.append(0)
            ids.append(self._id("whole", chunk))
            ends.append(end)
            flags.append(CUT | SPLIT if i in splits else CUT)
            start = end
        return Tokens(ids, ends, flags)


def joined(head: Tokens, tail: Tokens) -> Tokens:
    """`tail`'s tokens after `head`'s (their ends moved past head's text)."""
    offset = head.ends[-1] if head.ends else 0
    return Tokens(
        head.ids + tail.ids, head.ends + [e + offset for e in tail.ends], head.flags + tail.flags
    )


def insert(index: TextIndex, namespace: str, text: str, tokens: Tokens, exact: bool) -> None:
    index.insert(namespace, text, tokens.ids, tokens.ends, tokens.flags, exact)


def common(a: str, b: str) -> int:
    """Characters `a` and `b` start with alike."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def assert_consistent(toy: Toy, text: str, match: TextMatch) -> None:
    """The ids spell the reused text, ends say where each spelled token ends, the last is a CUT."""
    ids, ends, flags = list(match.ids), list(match.ends), list(match.flags)
    assert len(ids) == len(ends) == len(flags)
    assert 0 <= match.reused_chars <= match.matched_chars <= len(text)
    assert toy.spell(ids) == text[: match.reused_chars]
    for i in range(len(ids)):
        assert ends[i] == len(toy.spell(ids[: i + 1]))
    if ids:
        assert ends[-1] == match.reused_chars and flags[-1] & CUT
    else:
        assert match.reused_chars == 0
    assert match.exact == (match.outcome in (TextOutcome.SPLIT, TextOutcome.MISS))


# -- exact matches --------------------------------------------------------------------------------
TEXT = "aa bb cc dd ee"  # pieces end at 2, 5, 8, 11, 14


def test_toy_pieces() -> None:
    toy = Toy()
    assert toy.words(TEXT).ends == [2, 5, 8, 11, 14]
    assert [toy.spell([i]) for i in toy.words("a  b!!  ").ids] == ["a", " ", " b", "!!", "  "]


@pytest.mark.parametrize(
    ("text", "margin", "reused"),
    [
        (TEXT + "X", 1, 5),  # matched 14: splits 11 and 8 follow the one at 5
        (TEXT, 1, 5),  # the stored text itself: never reused whole
        (TEXT + "X", 3, 5),  # bound 11: 11 still counts
        (TEXT + "X", 4, 2),  # bound 10: 8 and 5 follow 2
        (TEXT + "X", 7, 0),  # bound 7: 5 and 2, nothing before them
        ("aa bb cc dd e", 1, 5),  # matched 13 inside the last token, bound 12
        ("aa bb cc d", 1, 2),  # matched 10, bound 9: 8 and 5 follow 2
        ("aa bb cc", 1, 0),  # bound 7: only two splits
        ("aa bb cX dd ee", 1, 0),
        ("zz", 1, 0),
    ],
)
def test_exact_backs_off_to_a_split_followed_by_two_more_before_the_margin(
    text: str, margin: int, reused: int
) -> None:
    toy, index = Toy(), TextIndex(1000)
    stored = toy.words(TEXT)
    insert(index, "t", TEXT, stored, exact=True)
    match = index.match("t", text, EXACT, margin)
    assert match.reused_chars == reused
    assert match.matched_chars == common(text, TEXT)
    assert match.outcome is (TextOutcome.SPLIT if reused else TextOutcome.MISS)
    assert match.exact
    assert list(match.ids) == stored.ids[: len(match.ids)]
    assert_consistent(toy, text, match)
    index.check_integrity()


def test_exact_matches_never_use_anchored_nodes() -> None:
    toy, index = Toy(), TextIndex(1000, min_fraction=0.9)
    insert(index, "t", TEXT, toy.words(TEXT), exact=False)
    match = index.match("t", TEXT + "X", EXACT)
    assert match.outcome is TextOutcome.MISS and match.matched_chars == 0
    # Nor anchored mode's fall-back to the exact rule, whatever SPLIT flags anchored ids carry.
    match = index.match("t", "aa bb cc dX", ANCHORED)  # 10 < 0.9 * 14
    assert match.outcome is TextOutcome.MISS and match.matched_chars == 10
    # Anchored mode does use them, and a full tokenization of the same text then makes them exact.
    assert index.match("t", TEXT, ANCHORED).outcome is TextOutcome.EXACT
    insert(index, "t", TEXT, toy.words(TEXT), exact=True)
    assert index.match("t", TEXT + "X", EXACT).reused_chars == 5
    # An anchored text continuing an exact one: exact matches stop where the exact nodes do.
    longer = TEXT + " ff gg hh"
    insert(index, "t", longer, joined(toy.words(TEXT), toy.chunks(" ff gg hh", [3, 6])), False)
    assert index.nodes == 2
    match = index.match("t", longer + "X", EXACT)
    assert match.matched_chars == 14 and match.reused_chars == 5
    assert index.match("t", longer, ANCHORED).reused_chars == len(longer)
    index.check_integrity()


def test_split_points_are_those_every_exact_insertion_agreed_on() -> None:
    toy, index = Toy(), TextIndex(1000)
    insert(index, "t", TEXT, toy.words(TEXT), exact=True)
    assert index.match("t", TEXT + "X", EXACT).reused_chars == 5
    insert(index, "t", TEXT, toy.words(TEXT, drop_splits=[2]), exact=True)  # no SPLIT at 8
    match = index.match("t", TEXT + "X", EXACT)
    assert match.reused_chars == 2  # 11 and 5 follow 2
    assert match.flags[-1] == CUT | SPLIT
    # A later insertion with every split back does not restore the one lost.
    insert(index, "t", TEXT, toy.words(TEXT), exact=True)
    assert index.match("t", TEXT + "X", EXACT).reused_chars == 2
    # Nor does an anchored one through the same nodes change the exact flags.
    insert(index, "t", TEXT, toy.words(TEXT), exact=False)
    assert index.match("t", TEXT + "X", EXACT).reused_chars == 2
    index.check_integrity()


def test_a_split_lost_in_a_shared_head_applies_to_every_text_through_it() -> None:
    toy, index = Toy(), TextIndex(1000)
    first, second = TEXT + " xx", TEXT + " yy"
    insert(index, "t", first, toy.words(first), exact=True)
    insert(index, "t", second, toy.words(second, drop_splits=[1]), exact=True)  # none at 5
    match = index.match("t", first + "X", EXACT)  # bound 16: 14, 11 follow 8
    assert match.reused_chars == 8
    match = index.match("t", "aa bb cc dd X", EXACT)  # bound 11: 11, 8 follow 5 (lost): 2
    assert match.reused_chars == 2
    index.check_integrity()


# -- anchored matches ------------------------------------------------------------------------------
def test_anchored_exact_and_extend_reuse_every_stored_id() -> None:
    toy, index = Toy(), TextIndex(1000)
    stored = toy.chunks(TEXT, [1, 4, 9], halves=[1])
    insert(index, "t", TEXT, stored, exact=False)
    match = index.match("t", TEXT, ANCHORED)
    assert match.outcome is TextOutcome.EXACT
    assert (match.matched_chars, match.reused_chars) == (14, 14)
    assert list(match.ids) == stored.ids and list(match.ends) == stored.ends
    assert not match.exact
    match = index.match("t", TEXT + " ff", ANCHORED)
    assert match.outcome is TextOutcome.EXTEND
    assert (match.matched_chars, match.reused_chars) == (14, 14)
    assert list(match.ids) == stored.ids
    assert_consistent(toy, TEXT + " ff", match)


def test_anchored_diverge_reuses_up_to_the_last_cut_when_enough_matched() -> None:
    toy, index = Toy(), TextIndex(1000, min_fraction=0.8)
    stored = toy.chunks(TEXT, [1, 4, 9], halves=[3])  # chunk 9..14 spelled by two tokens
    insert(index, "t", TEXT, stored, exact=False)
    text = "aa bb cc dd eX"  # matched 13 >= 0.8 * 14, inside the last chunk
    match = index.match("t", text, ANCHORED)
    assert match.outcome is TextOutcome.DIVERGE
    assert (match.matched_chars, match.reused_chars) == (13, 9)
    assert list(match.ids) == stored.ids[:3]  # the half token (no CUT) is not reused
    assert_consistent(toy, text, match)
    match = index.match("t", "aa bb cc dX", ANCHORED)  # matched 10 < 11.2
    assert match.outcome is TextOutcome.MISS  # nothing exact to fall back to
    assert match.matched_chars == 10 and len(match.ids) == 0 and match.exact


def test_anchored_mode_diverges_through_exact_nodes_or_falls_back_to_the_exact_rule() -> None:
    toy, index = Toy(), TextIndex(1000, min_fraction=0.9)
    stored = toy.words(TEXT)
    insert(index, "t", TEXT, stored, exact=True)
    match = index.match("t", "aa bb cc dd eX", ANCHORED)  # 13 >= 0.9 * 14: up to the last CUT
    assert match.outcome is TextOutcome.DIVERGE and not match.exact
    assert match.reused_chars == 11 and list(match.ids) == stored.ids[:4]
    match = index.match("t", "aa bb cc dX", ANCHORED)  # 10 < 12.6: the exact rule, bound 9
    assert match.outcome is TextOutcome.SPLIT and match.exact
    assert match.reused_chars == 2 and list(match.ids) == stored.ids[:1]


def test_anchored_diverge_below_the_fraction_falls_back_to_a_shorter_stored_text() -> None:
    toy, index = Toy(), TextIndex(1000, min_fraction=0.8)
    head, long = "aa bb", "aa bb cc dd ee ff gg"
    insert(index, "t", long, toy.chunks(long, [2, 5, 8, 11]), exact=False)
    insert(index, "t", head, toy.chunks(head, [2]), exact=False)
    text = "aa bb cc dX"  # matched 10 of a 20-character text
    match = index.match("t", text, ANCHORED)
    assert match.outcome is TextOutcome.EXTEND
    assert (match.matched_chars, match.reused_chars) == (10, 5)
    assert list(match.ids) == toy.chunks(head, [2]).ids
    assert_consistent(toy, text, match)


@pytest.mark.parametrize("anchored_first", [True, False])
def test_anchored_mode_prefers_anchored_nodes_on_a_tie(anchored_first: bool) -> None:
    toy, index = Toy(), TextIndex(1000)
    text = "xy z"
    exact, anchored = toy.words(text), toy.chunks(text, [1])  # [xy, " z"] / [x, "y z"]
    pairs = [(anchored, False), (exact, True)]
    for tokens, is_exact in pairs if anchored_first else pairs[::-1]:
        insert(index, "t", text, tokens, is_exact)
    assert index.nodes == 2  # two siblings spelling the same text
    match = index.match("t", text, ANCHORED)
    assert match.outcome is TextOutcome.EXACT and list(match.ids) == anchored.ids
    match = index.match("t", text + " w", ANCHORED)
    assert match.outcome is TextOutcome.EXTEND and list(match.ids) == anchored.ids
    match = index.match("t", text + " w", EXACT)  # exact mode sees the exact sibling only
    assert match.matched_chars == 4 and match.outcome is TextOutcome.MISS
    index.check_integrity()


def test_a_longer_sibling_match_wins_over_an_anchored_one() -> None:
    toy, index = Toy(), TextIndex(1000)
    insert(index, "t", "xy z", toy.chunks("xy z", [1]), exact=False)
    insert(index, "t", "xy zw", toy.words("xy zw"), exact=True)
    match = index.match("t", "xy zw", ANCHORED)
    assert match.outcome is TextOutcome.EXACT and list(match.ids) == toy.words("xy zw").ids
    match = index.match("t", "xy z", ANCHORED)
    assert match.outcome is TextOutcome.EXACT and list(match.ids) == toy.chunks("xy z", [1]).ids


# -- namespaces and eviction -----------------------------------------------------------------------
def test_namespaces_never_share() -> None:
    toy, index = Toy(), TextIndex(25, min_fraction=0.5)
    insert(index, "A", TEXT, toy.words(TEXT), exact=True)
    for mode in (EXACT, ANCHORED):
        match = index.match("B", TEXT + " ff gg", mode)
        assert match.outcome is TextOutcome.MISS and match.matched_chars == 0
    other = "aa bb qq"
    insert(index, "B", other, toy.words(other), exact=False)
    assert index.stats().namespaces == 2
    match = index.match("B", TEXT, ANCHORED)  # B's own text only: "aa bb " of 8
    assert match.outcome is TextOutcome.DIVERGE
    assert match.matched_chars == 6 and list(match.ids) == toy.words(other).ids[:2]
    # 22 > 25 - 8: more in B evicts A's text (least recently used), B still sees none of A.
    third = "qq rr ss tt"
    insert(index, "B", third, toy.words(third), exact=True)
    assert index.stats().namespaces == 1 and index.evicted_chars == 14
    assert index.match("A", TEXT, ANCHORED).outcome is TextOutcome.MISS
    assert index.match("B", TEXT, ANCHORED).matched_chars == 6
    # A again, with B's texts: no node of B's is used (A's ids are its own).
    insert(index, "A", other, toy.chunks(other, [4]), exact=False)
    match = index.match("A", other, ANCHORED)
    assert list(match.ids) == toy.chunks(other, [4]).ids
    match = index.match("B", other, ANCHORED)
    assert list(match.ids) == toy.words(other).ids
    index.check_integrity()


def test_lru_eviction_by_characters() -> None:
    toy, index = Toy(), TextIndex(30)
    texts = ["aaaa bbbbb", "cccc ddddd", "eeee fffff"]
    for text in texts:
        insert(index, "t", text, toy.words(text), exact=True)
    assert index.chars == 30 and index.evicted_chars == 0
    assert index.match("t", texts[0], ANCHORED).outcome is TextOutcome.EXACT  # touched
    insert(index, "t", "gggg hhhhh", toy.words("gggg hhhhh"), exact=True)
    assert index.chars == 30 and index.evicted_chars == 10
    assert index.match("t", texts[1], ANCHORED).outcome is TextOutcome.MISS  # untouched: gone
    for kept in (texts[0], texts[2], "gggg hhhhh"):
        assert index.match("t", kept, ANCHORED).outcome is TextOutcome.EXACT
    index.check_integrity()


def test_eviction_drops_leaves_first_and_keeps_shared_heads() -> None:
    toy, index = Toy(), TextIndex(40, min_fraction=0.4)
    first, second = "aa bb cc dd", "aa bb xx yy zz"
    insert(index, "t", first, toy.words(first), exact=False)
    insert(index, "t", second, toy.words(second), exact=False)  # head "aa bb" shared
    assert index.chars == 20 and index.nodes == 3
    index.match("t", second, ANCHORED)
    third = "qqqqqqqqqqqqqqqqqqqqqqqqq"  # 25 characters: 45 > 40
    insert(index, "t", third, toy.words(third), exact=False)
    assert index.evicted_chars == 6 and index.chars == 39  # " cc dd" went, not the head
    match = index.match("t", first, ANCHORED)
    # matched "aa bb " (6) >= 0.4 * 14, the stored text it runs into: the head's ids
    assert match.outcome is TextOutcome.DIVERGE and match.reused_chars == 5
    index.check_integrity()


def test_a_text_longer_than_the_index_is_not_kept_and_zero_keeps_nothing() -> None:
    toy, index = Toy(), TextIndex(10)
    insert(index, "t", TEXT, toy.words(TEXT), exact=True)
    assert index.chars <= 10 and index.evicted_chars == 14
    assert index.stats().namespaces == 0
    empty = TextIndex(0)
    insert(empty, "t", TEXT, toy.words(TEXT), exact=True)
    assert empty.stats() == TextIndexStats(0, 0, 0, 0)
    assert empty.match("t", TEXT, ANCHORED).outcome is TextOutcome.MISS
    empty.check_integrity()


# -- bad input -------------------------------------------------------------------------------------
BAD_INSERTS = [
    ("ab", [1, 2], [1, 2], [CUT], "differ in length"),
    ("ab", [1, 2], [1, 1], [CUT, CUT], "last token must end the text"),
    ("ab", [1, 2], [1, 2], [CUT, 0], "last token must end the text"),
    ("ab", [1, 2], [1, 2], [SPLIT, CUT], "SPLIT point but not a CUT"),
    ("ab", [1, 2], [2, 2], [CUT, CUT | SPLIT], "no character since the cut"),
    ("ab", [1, 2], [0, 2], [CUT, CUT], "no character since the cut at 0"),
    ("abc", [1, 2, 3], [2, 1, 3], [0, 0, CUT], "before token 0"),
    ("abc", [], [], [], "3 characters with no tokens"),
]


@pytest.mark.parametrize(("text", "ids", "ends", "flags", "message"), BAD_INSERTS)
def test_bad_inserts_are_refused_and_change_nothing(
    text: str, ids: list[int], ends: list[int], flags: list[int], message: str
) -> None:
    toy, index = Toy(), TextIndex(100)
    insert(index, "t", TEXT, toy.words(TEXT), exact=True)
    before = index.stats()
    for namespace in ("t", "fresh"):
        with pytest.raises(ValueError, match=message):
            index.insert(namespace, text, ids, ends, flags, exact=True)
    assert index.stats() == before
    assert index.match("fresh", text, ANCHORED).outcome is TextOutcome.MISS
    index.check_integrity()


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_chars must be >= 0, got -1"):
        TextIndex(-1)
    for fraction in (-0.1, 1.5):
        with pytest.raises(
            ValueError, match=f"min_fraction must be within \\[0, 1\\], got {fraction}"
        ):
            TextIndex(10, fraction)
    toy, index = Toy(), TextIndex(100)
    insert(index, "t", TEXT, toy.words(TEXT), exact=True)
    before = index.stats()
    for margin in (0, -3):
        with pytest.raises(ValueError, match=f"margin must be >= 1, got {margin}"):
            index.match("t", TEXT, EXACT, margin)
    assert index.stats() == before
    index.check_integrity()


def test_empty_texts() -> None:
    toy, index = Toy(), TextIndex(100)
    insert(index, "t", "", toy.words(""), exact=True)
    assert index.stats().namespaces == 0
    insert(index, "t", TEXT, toy.words(TEXT), exact=True)
    assert index.match("t", "", ANCHORED).outcome is TextOutcome.MISS


# -- random runs -----------------------------------------------------------------------------------
NAMESPACES = ["A", "B", "C"]
PIECES_OF_TEXT = ["a", "b", "ab", "ba", " a", " b", " ", "  ", "!", "!!", "\n", "a!"]
texts = st.lists(st.sampled_from(PIECES_OF_TEXT), max_size=10).map("".join)


class TextIndexMachine(RuleBasedStateMachine):
    """Random inserts (full tokenizations and anchored segmentations) and matches in three
    namespaces of an index small enough to evict all the time."""

    def __init__(self) -> None:
        super().__init__()
        self.toy = Toy()
        self.index = TextIndex(48, min_fraction=0.6)
        self.stored: dict[str, dict[str, set[tuple[int, ...]]]] = {n: {} for n in NAMESPACES}
        self.outcomes: set[TextOutcome] = set()

    @initialize(text=texts.filter(lambda t: len(t) > 8), data=st.data())
    def some_texts(self, text: str, data: st.DataObject) -> None:
        """A text stored both ways in the first namespace, so matches find something."""
        self.insert_exact("A", text, data)
        self.insert_anchored("A", text + "!", data)

    def _remember(self, namespace: str, text: str, tokens: Tokens) -> None:
        if text:
            self.stored[namespace].setdefault(text, set()).add(tuple(tokens.ids))

    @rule(namespace=st.sampled_from(NAMESPACES), text=texts, data=st.data())
    def insert_exact(self, namespace: str, text: str, data: st.DataObject) -> None:
        drop = data.draw(st.lists(st.integers(0, 12), max_size=3))
        tokens = self.toy.words(text, drop)
        insert(self.index, namespace, text, tokens, exact=True)
        self._remember(namespace, text, tokens)

    @rule(namespace=st.sampled_from(NAMESPACES), text=texts, data=st.data())
    def insert_anchored(self, namespace: str, text: str, data: st.DataObject) -> None:
        head = data.draw(st.integers(0, len(text)))  # a prompt's own ids, then generated ones
        cuts = data.draw(st.lists(st.integers(1, 23), max_size=6))
        halves = data.draw(st.lists(st.integers(0, 6), max_size=2))
        splits = data.draw(st.lists(st.integers(0, 6), max_size=4))
        generated = self.toy.chunks(text[head:], cuts, halves, splits)
        tokens = joined(self.toy.words(text[:head]), generated)
        insert(self.index, namespace, text, tokens, exact=False)
        self._remember(namespace, text, tokens)

    @rule(namespace=st.sampled_from(NAMESPACES), text=texts, data=st.data())
    def match_exact(self, namespace: str, text: str, data: st.DataObject) -> None:
        self.match(namespace, text, EXACT, data.draw(st.integers(1, 3)), data)

    @rule(namespace=st.sampled_from(NAMESPACES), text=texts, data=st.data())
    def match_anchored(self, namespace: str, text: str, data: st.DataObject) -> None:
        self.match(namespace, text, ANCHORED, data.draw(st.integers(1, 3)), data)

    def match(
        self, namespace: str, text: str, mode: TextMatchMode, margin: int, data: st.DataObject
    ) -> None:
        stored = self.stored[namespace]
        how = data.draw(st.sampled_from(["new", "stored", "extend", "cut"]))
        if stored and how != "new":  # a stored text: itself, continued, or cut and continued
            base = data.draw(st.sampled_from(sorted(stored)))
            cut = len(base) if how != "cut" else data.draw(st.integers(0, len(base)))
            text = base[:cut] + (text if how != "stored" else "")
        match = self.index.match(namespace, text, mode, margin)
        self.outcomes.add(match.outcome)
        assert_consistent(self.toy, text, match)
        reused = text[: match.reused_chars]
        ids = tuple(match.ids)
        assert match.matched_chars <= max((common(text, t) for t in stored), default=0)
        if match.exact:  # a full tokenization's ids, cut where tokenising the rest apart is exact
            full = self.toy.words(text).ids
            assert list(ids) + self.toy.words(text[len(reused) :]).ids == full
        if mode is EXACT:
            assert match.outcome in (TextOutcome.SPLIT, TextOutcome.MISS)
        elif match.outcome is TextOutcome.EXACT:
            assert match.reused_chars == match.matched_chars == len(text)
            assert ids in stored[text]
        elif match.outcome is TextOutcome.EXTEND:
            assert match.reused_chars <= match.matched_chars and len(reused) < len(text)
            assert ids in stored[reused]
        elif match.outcome is TextOutcome.DIVERGE:
            assert any(s[: len(ids)] == ids for seqs in stored.values() for s in seqs)

    @invariant()
    def consistent(self) -> None:
        self.index.check_integrity()
        assert self.index.chars <= 48


def test_random_inserts_and_matches_keep_the_index_consistent() -> None:
    outcomes: set[TextOutcome] = set()

    class Machine(TextIndexMachine):
        def teardown(self) -> None:
            outcomes.update(self.outcomes)

    run_state_machine_as_test(
        Machine, settings=settings(max_examples=150, stateful_step_count=40, deadline=None)
    )
    assert outcomes == set(TextOutcome)  # every outcome came up in the run


def test_ids_stored_with_other_characters_are_refused_not_filed() -> None:
    index = TextIndex(100)
    index.insert("t", "abc", [1, 2], [1, 3], [CUT | SPLIT, CUT | SPLIT], exact=True)
    before = index.stats()
    with pytest.raises(ValueError, match="the same ids must spell the same characters"):
        index.insert("t", "abcd", [1, 2, 3], [2, 3, 4], [CUT, CUT, CUT], exact=False)
    assert index.stats() == before
    assert index.match("t", "abc", ANCHORED).ids.tolist() == [1, 2]
    index.check_integrity()
