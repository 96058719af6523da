"""Stop strings over streamed text, and the sampler's filters."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from worker.sampling import Sampler, SamplingParams, sample_seed
from worker.stop import StopChecker


@given(
    pieces=st.lists(st.text(alphabet="ab\nU:s", max_size=4), max_size=30),
    stops=st.lists(st.text(alphabet="ab\nU:s", min_size=1, max_size=5), max_size=3),
)
def test_streamed_text_is_the_text_cut_before_the_first_stop(
    pieces: list[str], stops: list[str]
) -> None:
    checker = StopChecker(tuple(stops))
    emitted, stopped = "", False
    for piece in pieces:
        out, stopped = checker.feed(piece)
        emitted += out
        if stopped:
            break
    if not stopped:
        emitted += checker.flush()
    full = "".join(pieces)
    cuts = [full.find(s) for s in stops if s in full]
    assert emitted == (full[: min(cuts)] if cuts else full)
    assert stopped == bool(cuts)


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
    return {sampler(logits) for _ in range(count)}


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
