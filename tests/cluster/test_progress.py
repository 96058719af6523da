"""cluster/progress.py: a live bar on a terminal, plain lines off one (a file, a pipe, a job's
log), where rich alone would show nothing while the work runs."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import Progress

from cluster.progress import LineProgress, progress_bar, track


def off_terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, width=200), out


def test_a_terminal_gets_rich_bar_and_anything_else_plain_lines() -> None:
    terminal = Console(file=io.StringIO(), force_terminal=True)
    assert type(progress_bar(console=terminal)) is Progress
    assert type(progress_bar(console=off_terminal()[0])) is LineProgress


def test_off_a_terminal_a_line_comes_every_interval_and_at_the_end() -> None:
    console, out = off_terminal()
    with LineProgress(console=console, transient=True, interval_s=0.0) as progress:
        task = progress.add_task("requests", total=4, live="")
        for done in range(1, 5):
            progress.update(task, completed=done, live=f"hit {done * 10} %")
    lines = out.getvalue().splitlines()
    assert [line.split(",")[0] for line in lines] == [
        "requests: 1/4 (25 %)", "requests: 2/4 (50 %)", "requests: 3/4 (75 %)",
        "requests: 4/4 (100 %)",
    ]  # fmt: skip
    assert lines[-1].endswith("hit 40 %")


def test_within_the_interval_only_the_end_is_told() -> None:
    console, out = off_terminal()
    with LineProgress(console=console, interval_s=3600.0) as progress:
        task = progress.add_task("cells", total=3)
        for _ in range(3):
            progress.advance(task)
        progress.advance(task)  # past its end: nothing more
    assert out.getvalue().splitlines() == ["cells: 3/3 (100 %), 0 s"]


def test_work_stopped_short_is_told_where_it_stopped() -> None:
    console, out = off_terminal()
    with LineProgress(console=console, interval_s=3600.0) as progress:
        task = progress.add_task("requests", total=10)
        progress.update(task, completed=6)
    assert out.getvalue().splitlines() == ["requests: 6/10 (60 %), 0 s"]


def test_quiet_says_nothing_and_track_yields_every_item() -> None:
    console, out = off_terminal()
    with progress_bar(console=console, disable=True) as progress:
        progress.update(progress.add_task("quiet", total=1), completed=1)
    assert out.getvalue() == ""
    assert list(track(range(5), "items", console)) == [0, 1, 2, 3, 4]
    assert out.getvalue().splitlines() == ["items: 5/5 (100 %), 0 s"]
    assert list(track(range(5), "items", console, quiet=True)) == [0, 1, 2, 3, 4]
    assert out.getvalue().count("\n") == 1
