"""Progress of long work where people will see it: rich's live bar on a terminal (or in a
notebook), and plain lines elsewhere (a file, a pipe, a `ray job submit` log, CI), where rich
draws nothing until the work is over, or nothing at all when the bar is transient.

`progress_bar(...)` takes what `rich.progress.Progress` takes and returns one or the other;
`track(...)` is `rich.progress.track` on top of it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import Progress, ProgressColumn, TaskID

T = TypeVar("T")
LINE_INTERVAL_S = 10.0
"""Off a terminal, how often each task still running gets a line."""


def progress_bar(*columns: str | ProgressColumn, console: Console, **options: Any) -> Progress:
    """A rich Progress on a terminal; off one, a `LineProgress` that writes plain lines."""
    if (console.is_terminal and not console.is_dumb_terminal) or console.is_jupyter:
        return Progress(*columns, console=console, **options)
    return LineProgress(*columns, console=console, **options)


def track(
    sequence: Iterable[T], description: str, console: Console, quiet: bool = False
) -> Iterator[T]:
    """The items of `sequence`, showing how many are done (nothing when `quiet`)."""
    with progress_bar(console=console, transient=True, disable=quiet) as progress:
        yield from progress.track(sequence, description=description)


class LineProgress(Progress):
    """rich's Progress with no live display: every `interval_s`, a line for each task still
    running (also while nothing advances it), and one when it completes, or when it is removed
    or the progress stops before then. `transient` has nothing to erase here."""

    def __init__(
        self, *columns: str | ProgressColumn, interval_s: float = LINE_INTERVAL_S, **options: Any
    ) -> None:
        self.quiet = bool(options.pop("disable", False))
        options["auto_refresh"] = False  # `track` then advances on the caller's thread
        super().__init__(*columns, disable=True, **options)  # the live display: never
        self.interval_s = interval_s
        self._told: dict[TaskID, str] = {}
        """Task -> its last line (not written twice)."""
        self._ended: set[TaskID] = set()
        self._stopped = threading.Event()
        self._ticker: threading.Thread | None = None

    def start(self) -> None:
        super().start()
        if not self.quiet and self._ticker is None:
            self._stopped.clear()
            self._ticker = threading.Thread(target=self._tick, name="progress-lines", daemon=True)
            self._ticker.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        for task_id in list(self._tasks):
            self._tell(task_id, ending=True)
        super().stop()

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        self._tell(task_id, ending=False)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._tell(task_id, ending=False)

    def remove_task(self, task_id: TaskID) -> None:
        self._tell(task_id, ending=True)
        super().remove_task(task_id)

    def _tick(self) -> None:
        while not self._stopped.wait(self.interval_s):
            for task_id in list(self._tasks):
                self._tell(task_id, ending=False, running=True)

    def _tell(self, task_id: TaskID, ending: bool, running: bool = False) -> None:
        """A line for the task if it completed, or is `ending`, or (`running`) is due one."""
        if self.quiet:
            return
        with self._lock:
            task = self._tasks.get(task_id)
            if task is None or task_id in self._ended:
                return
            if not (ending or running or task.finished):
                return
            if ending or task.finished:
                self._ended.add(task_id)
            done = f"{task.completed:,.0f}" + (f"/{task.total:,.0f}" if task.total else "")
            share = f" ({task.percentage:.0f} %)" if task.total else ""
            extra = "  ".join(str(value) for value in task.fields.values() if value != "")
            line = f"{task.description}: {done}{share}, {task.elapsed or 0.0:.0f} s"
            line += f"  {extra}" if extra else ""
            if self._told.get(task_id) == line:
                return
            self._told[task_id] = line
            # under the lock: the ticker's line of a moment ago never follows the final one
            self.console.print(line, markup=False, highlight=False, soft_wrap=True)
