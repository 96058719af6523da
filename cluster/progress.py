"""Progress of long work where people will see it: rich's live bar on a terminal, and plain lines
elsewhere (a file, a pipe, a `ray job submit` log, CI), where rich draws nothing until the work
is over, or nothing at all when the bar is transient.

`progress_bar(...)` takes what `rich.progress.Progress` takes and returns one or the other;
`track(...)` is `rich.progress.track` on top of it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import Progress, ProgressColumn, TaskID

T = TypeVar("T")
LINE_INTERVAL_S = 10.0
"""Off a terminal, how often a task still running gets a line."""


def progress_bar(*columns: str | ProgressColumn, console: Console, **options: Any) -> Progress:
    """A rich Progress on a terminal; off one, a `LineProgress` that writes plain lines."""
    if console.is_terminal and not console.is_dumb_terminal:
        return Progress(*columns, console=console, **options)
    return LineProgress(*columns, console=console, **options)


def track(
    sequence: Iterable[T], description: str, console: Console, quiet: bool = False
) -> Iterator[T]:
    """The items of `sequence`, showing how many are done (nothing when `quiet`)."""
    with progress_bar(console=console, transient=True, disable=quiet) as progress:
        yield from progress.track(sequence, description=description)


class LineProgress(Progress):
    """rich's Progress with no live display: a line for each task every `interval_s` while it
    runs, and one when it completes (or when the progress stops, if it never did)."""

    def __init__(
        self, *columns: str | ProgressColumn, interval_s: float = LINE_INTERVAL_S, **options: Any
    ) -> None:
        self.quiet = bool(options.pop("disable", False))
        super().__init__(*columns, disable=True, **options)  # the live display: never
        self.interval_s = interval_s
        self._last_line: dict[TaskID, float] = {}
        """Task -> when its last line was written (its start until then)."""
        self._ended: set[TaskID] = set()

    def add_task(self, description: str, *args: Any, **kwargs: Any) -> TaskID:
        task_id = super().add_task(description, *args, **kwargs)
        self._last_line[task_id] = time.monotonic()
        return task_id

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        self._tell(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._tell(task_id)

    def stop(self) -> None:
        for task_id in list(self._last_line):
            if task_id not in self._ended and task_id in self._tasks:
                self._tell(task_id, force=True)
        super().stop()

    def _tell(self, task_id: TaskID, force: bool = False) -> None:
        if self.quiet or task_id in self._ended:
            return
        with self._lock:
            task = self._tasks[task_id]
            now = time.monotonic()
            if not (force or task.finished or now - self._last_line[task_id] >= self.interval_s):
                return
            self._last_line[task_id] = now
            if task.finished or force:
                self._ended.add(task_id)
            done = f"{task.completed:,.0f}" + (f"/{task.total:,.0f}" if task.total else "")
            share = f" ({task.percentage:.0f} %)" if task.total else ""
            extra = "  ".join(str(value) for value in task.fields.values() if value != "")
            line = f"{task.description}: {done}{share}, {task.elapsed or 0.0:.0f} s"
        self.console.print(line + (f"  {extra}" if extra else ""), markup=False, highlight=False)
