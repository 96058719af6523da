"""The files the router keeps in `router.state_dir`, so that the Files and Batch APIs outlive a
router restart: each written whole or not at all (a temporary file renamed over it), or a
journal appended a line at a time, whose last line a crash may have cut short (it is dropped
when read). Every file is the router's user's alone (mode 0600; a batch's object holds its
creator's credentials, which the router's config holds anyway).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def private(path: str, flags: int) -> int:
    """`open`'s opener for a file only the router's user may read."""
    return os.open(path, flags, 0o600)


def subdirectory(state_dir: str | None, name: str) -> Path | None:
    """`state_dir/name`, made if missing (None: no state_dir, nothing kept on disk)."""
    if state_dir is None:
        return None
    path = Path(state_dir) / name
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def write_whole(path: Path, data: bytes) -> None:
    """`data` at `path`, or the old file there untouched if writing fails."""
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb", opener=private) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, path)


def write_json(path: Path, value: Any) -> None:
    write_whole(path, json.dumps(value).encode())


def append_line(path: Path, value: Any) -> None:
    """One JSON line more at the end of a journal."""
    with open(path, "ab", opener=private) as f:
        f.write(_line(value))


def write_lines(path: Path, values: list[Any]) -> None:
    """A journal written whole, a JSON line a value."""
    write_whole(path, b"".join(map(_line, values)))


def _line(value: Any) -> bytes:
    return json.dumps(value).encode() + b"\n"


def journal(path: Path) -> list[Any]:
    """A journal's lines; one cut short by a crash (the last) is left out, and so is any that
    does not parse, each logged."""
    if not path.exists():
        return []
    lines = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        try:
            lines.append(json.loads(raw))
        except ValueError:
            log.warning("%s: line %d is not JSON (cut short by a crash?): left out", path, number)
    return lines


def remove(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)
