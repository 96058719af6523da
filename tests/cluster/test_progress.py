"""cluster/progress.py: a live bar on a terminal, plain lines off one (a file, a pipe, a job's
log), where rich alone would show nothing while the work runs."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import Progress

from cluster.progress import LineProgress, progress_bar, track


def off_terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=40), out  # narrow: a line must not wrap


def lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_a_terminal_gets_rich_bar_and_anything_else_plain_lines() -> None:
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert type(progress_bar(console=terminal)) is Progress
    assert type(progress_bar(console=off_terminal()[0])) is LineProgress


def test_within_the_interval_only_the_end_is_told_on_one_line() -> None:
    console, out = off_terminal()
    with LineProgress(console=console, interval_s=3600.0) as progress:
        task = progress.add_task("requests", total=4, live="")
        for done in range(1, 5):
            progress.update(task, completed=done, live=f"{done * 10.0:.1f} tok/s  hit 40.0 %")
        progress.advance(task)  # past its end: nothing more
    assert lines(out) == ["requests: 4/4 (100 %), 0 s  40.0 tok/s  hit 40.0 %"]


def test_a_task_that_stalls_is_told_every_interval_and_where_it_stopped() -> None:
    console, out = off_terminal()
    with LineProgress(console=console, interval_s=0.05) as progress:
        task = progress.add_task("requests", total=10)
        progress.update(task, completed=3)
        time.sleep(0.3)  # nothing advances it: the lines come anyway
        told = lines(out)
        assert told and all(line.startswith("requests: 3/10 (30 %)") for line in told)
        progress.update(task, completed=6)
    assert lines(out)[-1].startswith("requests: 6/10 (60 %)")
    assert len(lines(out)) == len(set(lines(out))), "a line repeated"


def slowly(count: int) -> Iterator[int]:
    for item in range(count):
        time.sleep(0.02)
        yield item


def test_track_counts_every_item_of_a_slow_sequence() -> None:
    """rich's `track` advances from a thread that lives only while a live display runs: here
    it must advance on the caller's thread, or the count stops at the first tenth of a second."""
    console, out = off_terminal()
    assert list(track(slowly(15), "items", console)) == list(range(15))
    assert lines(out) == ["items: 15, 0 s"]  # no total: a generator has no length


def test_quiet_says_nothing_and_a_removed_task_is_told_where_it_stopped() -> None:
    console, out = off_terminal()
    with progress_bar(console=console, disable=True) as progress:
        progress.update(progress.add_task("quiet", total=1), completed=1)
    assert list(track(range(5), "items", console, quiet=True)) == [0, 1, 2, 3, 4]
    assert out.getvalue() == ""
    with LineProgress(console=console, interval_s=3600.0) as progress:
        task = progress.add_task("cells", total=8)
        progress.advance(task, 2)
        progress.remove_task(task)
    assert lines(out) == ["cells: 2/8 (25 %), 0 s"]
