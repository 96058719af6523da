"""A kept store's objects on disk, so that they outlive a restart of the router: with
`router.state_dir`, each object of the stored responses, chat completions and conversations is a
JSON file of its own under `state_dir/<store>/`, written whole (cluster/http/state_files.py) and
removed when the object is deleted or dropped.

One thread encodes and writes them, apart from the event loop: a store's `put` only hands over
the object and how to encode it (the objects are immutable, replaced rather than changed). What
waits is the latest state of each object and no more (a second write of one object replaces the
first in its place in the queue, a removal replaces both), so a slow disk holds back at most one
state of each object kept. A router that stops writes out what waits first (`close`); what comes
after that is written at once by its caller; a router that crashes loses what had not been
written, as a journal loses its last line.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from hashlib import blake2b
from pathlib import Path
from typing import Any

from cluster.http.state_files import remove, write_whole

log = logging.getLogger(__name__)

Encode = Callable[[], dict[str, Any]]
"""An object as JSON, made when it is written (on the writer's thread)."""


class KeptFiles:
    """The files of one store's objects in `directory`, one writer thread behind them."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._waiting: dict[Path, tuple[str, str, int, Encode] | None] = {}
        """File -> what to write there (tenant, id, order, encoding; None: remove the file),
        the latest of each, in the order first handed over."""
        self._changed = threading.Condition()
        self._closing = False
        self._writer = threading.Thread(target=self._write, name=f"kept {directory.name}")
        self._writer.daemon = True  # close() writes what waits; a crash loses it anyway
        self._writer.start()

    def path(self, tenant: str, key: str) -> Path:
        """The object's file: named by a digest, as a tenant or an id may hold any character."""
        name = blake2b(f"{tenant}\0{key}".encode(), digest_size=16, person=b"radixmesh-kept")
        return self.directory / f"{name.hexdigest()}.json"

    def write(self, tenant: str, key: str, order: int, encode: Encode) -> None:
        """Write the object (`encode`d) with its tenant, id and place in the order kept, once
        the writer gets to it."""
        self._hand_over(self.path(tenant, key), (tenant, key, order, encode))

    def remove(self, tenant: str, key: str) -> None:
        self._hand_over(self.path(tenant, key), None)

    def _hand_over(self, path: Path, change: tuple[str, str, int, Encode] | None) -> None:
        with self._changed:
            if not self._closing:
                self._waiting[path] = change
                self._changed.notify()
                return
        # a request that outlived the router's stop (its grace): written here and now, so
        # that a deletion is not undone by the next router
        self._apply(path, change)

    def _write(self) -> None:
        while True:
            with self._changed:
                while not self._waiting and not self._closing:
                    self._changed.wait()
                if not self._waiting:
                    return
                path = next(iter(self._waiting))
                change = self._waiting.pop(path)
            self._apply(path, change)

    @staticmethod
    def _apply(path: Path, change: tuple[str, str, int, Encode] | None) -> None:
        try:
            if change is None:
                remove(path)
                return
            tenant, key, order, encode = change
            record = {"tenant": tenant, "key": key, "order": order, "value": encode()}
            write_whole(path, json.dumps(record).encode())
        except Exception:  # the object stays kept in memory; logged, and the writer goes on
            log.exception("%s: not written", path)

    def read_back(self) -> list[dict[str, Any]]:
        """The records written before (`tenant`, `key`, `order`, `value`), in the order kept; a
        file that cannot be read as one is left out and removed, logged (and so is a write a
        crash cut short)."""
        for partial in self.directory.glob("*.partial"):
            remove(partial)
        records = []
        for path in self.directory.glob("*.json"):
            try:
                record = json.loads(path.read_bytes())
                if path != self.path(record["tenant"], record["key"]):
                    raise ValueError("not the record its name says")
                if not isinstance(record["order"], int) or not isinstance(record["value"], dict):
                    raise ValueError("no order or value")
                records.append(record)
            except Exception as err:  # whatever it holds: left out, not fatal
                log.error("%s left out: %s", path, err)
                remove(path)
        return sorted(records, key=lambda record: record["order"])

    def close(self) -> None:
        """Write what waits, then stop the writer (blocks: call it off the event loop)."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._writer.join()


def json_text(item: Any) -> bytes:
    """A saved item (JSON text) as a store keeps it (JSON bytes); TypeError or ValueError if it
    is not JSON text."""
    if not isinstance(item, str):
        raise TypeError(f"a saved item is {type(item).__name__}, not JSON text")
    json.loads(item)
    return item.encode()
