"""Stop strings over streamed text, and the sampler's filters."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from worker.sampling import Sampler, SamplingParams, greedy, sample_seed
from worker.stop import StopChecker


def first_stop_cut(text: str, stops: list[str]) -> int | None:
    """Where the text is cut: before the first stop string to complete, the longest of those
    completing on that character (None: no stop string occurs)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end - max(map(len, ending))
    return None


def stream(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, bool]:
    checker = StopChecker(stops)
    emitted, stopped = "", False
    for piece in pieces:
        out, stopped = checker.feed(piece)
        emitted += out
        if stopped:
            return emitted, True
    return emitted + checker.flush(), False


@given(
    pieces=st.lists(st.text(alphabet="ab\nU:s", max_size=4), max_size=30),
    stops=st.lists(st.text(alphabet="ab\nU:s", min_size=1, max_size=5), max_size=4),
)
def test_streamed_text_is_the_text_cut_before_the_first_stop(
    pieces: list[str], stops: list[str]
) -> None:
    emitted, stopped = stream(pieces, tuple(stops))
    full = "".join(pieces)
    cut = first_stop_cut(full, stops)
    assert emitted == (full if cut is None else full[:cut])
    assert stopped == (cut is not None)


@given(
    text=st.text(alphabet="ab\nU:s", max_size=40),
    stops=st.lists(st.text(alphabet="ab\nU:s", min_size=1, max_size=5), max_size=4),
    data=st.data(),
)
def test_how_the_text_is_cut_into_tokens_does_not_change_the_output(
    text: str, stops: list[str], data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert stream(pieces, tuple(stops)) == stream([text], tuple(stops))


@given(
    pieces=st.lists(st.text(alphabet="ab\nU:s", max_size=4), max_size=30),
    stops=st.lists(st.text(alphabet="ab\nU:s", min_size=1, max_size=5), max_size=4),
)
def test_the_stop_string_that_ended_the_text_is_named(pieces: list[str], stops: list[str]) -> None:
    checker = StopChecker(tuple(stops))
    for piece in pieces:
        if checker.feed(piece)[1]:
            break
    full = "".join(pieces)
    cut = first_stop_cut(full, stops)
    if cut is None:
        assert checker.matched is None
        return
    assert checker.matched is not None
    end = cut + len(checker.matched)
    assert full[cut:end] == checker.matched
    assert checker.matched == max((s for s in stops if full[:end].endswith(s)), key=len)


def test_among_thousands_of_stop_strings_the_one_that_occurs_stops_the_text() -> None:
    stops = tuple(f"<stop{i}>" for i in range(4000))
    text = "the quick brown fox <stop12 is not one, but <stop3999> is; <stop7> comes too late"
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    assert stream(pieces, stops) == ("the quick brown fox <stop12 is not one, but ", True)
    assert first_stop_cut(text, list(stops)) == text.index("<stop3999>")


def test_text_that_may_start_a_stop_string_is_held_back() -> None:
    checker = StopChecker(("\n\nUser:",))
    assert checker.feed("Paris.\n") == ("Paris.", False)  # only "\n" could start the stop
    assert checker.feed("\nUs") == ("", False)
    assert checker.feed("er: hi") == ("", True)
    other = StopChecker(("\n\nUser:",))
    assert other.feed("a\n") == ("a", False)
    assert other.feed("b") == ("\nb", False)  # the held "\n" is released once it cannot match


def _draws(params: SamplingParams, logits: torch.Tensor, count: int) -> set[int]:
    sampler = Sampler.create(params, 0)
    return {sampler(logits, position) for position in range(count)}


def test_top_k_and_top_p_keep_only_the_head_of_the_distribution() -> None:
    logits = torch.tensor([4.0, 3.9, 3.8, 0.0, -1.0, -2.0])
    assert _draws(SamplingParams(temperature=1.0, top_k=2, seed=1), logits, 300) == {0, 1}
    probs = torch.softmax(logits, 0)
    assert probs[:3].sum() > 0.9 > probs[:2].sum()
    assert _draws(SamplingParams(temperature=1.0, top_p=0.9, seed=2), logits, 300) == {0, 1, 2}
    flat = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.2, 0.0])
    assert _draws(SamplingParams(temperature=1.0, seed=3), flat, 500) == set(range(6))
    assert _draws(SamplingParams(temperature=0.0), logits, 10) == {0}


def test_seeds_are_stable_and_distinct_per_sample() -> None:
    assert sample_seed(7, 0) == sample_seed(7, 0)
    assert len({sample_seed(7, i) for i in range(16)}) == 16
    assert sample_seed(None, 0) != sample_seed(None, 0)


@given(
    size=st.integers(1, 70_000),
    levels=st.integers(1, 5),
    nans=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_greedy_is_argmax_with_its_ties_and_nans(
    size: int, levels: int, nans: int, seed: int
) -> None:
    """The first of equal largest logits (few levels: many ties), the first NaN if any."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (size,), generator=gen).float()
    for at in torch.randint(0, size, (nans,), generator=gen).tolist():
        logits[at] = float("nan")
    assert greedy(logits) == int(torch.argmax(logits))
