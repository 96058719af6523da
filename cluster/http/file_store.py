"""OpenAI's Files API, for batches: the files a client uploads (`purpose: batch`) and those its
batches write (`batch_output`), kept in the router's memory, each its tenant's.

One bound in bytes over every tenant's files (`router.files_bytes`): an upload that would pass
it, or MAX_UPLOAD_BYTES, is refused (413, naming the setting) before its body is read past
that, and deleting files makes room. `router.files_bytes_per_tenant` bounds each tenant's share
too (checked once the body is read). A batch's output and error files are kept even past it
(refusing them would lose work already done); they count against it for the uploads that
follow, and no batch is created while the files fill it.

With `router.state_dir` set, each file is also written there (`files/<id>.bin`, then its card
`files/<id>.json`, which makes it whole) and read back when the router starts again; without it,
nothing survives a restart of the router.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ValidationError

from cluster.http.errors import HttpError
from cluster.http.list_places import ListPlaces
from cluster.http.state_files import remove, write_json, write_whole

log = logging.getLogger(__name__)

ENTRY_BYTES = 512
"""What Python takes to hold one file beside its content (the key, the entry, the strings)."""
MAX_UPLOAD_BYTES = 200 << 20
"""The largest file one upload may bring: OpenAI's limit for a batch's input file."""


class FileObject(BaseModel):
    """OpenAI's file object (`openai.types.FileObject`)."""

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


@dataclass(frozen=True, slots=True)
class StoredFile:
    card: FileObject
    content: bytes


class FileStore:
    def __init__(
        self, max_bytes: int, directory: Path | None = None, tenant_bytes: int = 0
    ) -> None:
        self.max_bytes = max_bytes
        """0: no Files API (and so no Batch API)."""
        self.tenant_bytes = tenant_bytes
        """The most one tenant's files may take (router.files_bytes_per_tenant; 0: no bound of
        its own)."""
        self.held = 0
        """Bytes of every file kept, with ENTRY_BYTES each."""
        self._held_by: dict[str, int] = {}
        """Tenant -> the bytes of its files, with ENTRY_BYTES each."""
        self._files: dict[tuple[str, str], StoredFile] = {}
        """(tenant, file id) -> the file, in the order added."""
        self.places = ListPlaces()
        """Each file's place in that order, and those of the files deleted last."""
        self.directory = directory
        """Where each file is written too, and read back from at the start (None: nowhere)."""
        if directory is not None:
            self._read_back(directory)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def full(self, tenant: str) -> str | None:
        """What the tenant's files or every file fill, if either: a batch would keep its output
        past it (None: neither)."""
        if self.tenant_bytes and self.held_by(tenant) >= self.tenant_bytes:
            return (
                f"this tenant's files take {self.held_by(tenant)} bytes of {self.tenant_bytes} "
                "(router.files_bytes_per_tenant)"
            )
        if self.held >= self.max_bytes:
            return f"the files kept take {self.held} bytes of {self.max_bytes} (router.files_bytes)"
        return None

    def held_by(self, tenant: str) -> int:
        return self._held_by.get(tenant, 0)

    def room(self) -> int:
        """The most bytes an upload may have now: MAX_UPLOAD_BYTES, or what the bound leaves."""
        return max(0, min(MAX_UPLOAD_BYTES, self.max_bytes - self.held - ENTRY_BYTES))

    def require(self) -> None:
        """404 when this router keeps no files: the Files and Batch APIs are off."""
        if not self.enabled:
            raise HttpError(404, "this router keeps no files (router.files_bytes is 0)")

    def upload(self, tenant: str, filename: str, purpose: str, content: bytes) -> FileObject:
        """Keep a client's file; 413 when it would pass the bound."""
        self.require()
        size = len(content) + ENTRY_BYTES
        if self.held + size > self.max_bytes:
            raise HttpError(
                413,
                f"the file is {len(content)} bytes and the files kept take {self.held} of "
                f"{self.max_bytes} (router.files_bytes); delete files to make room",
            )
        if self.tenant_bytes and self.held_by(tenant) + size > self.tenant_bytes:
            raise HttpError(
                413,
                f"the file is {len(content)} bytes ({size} with what keeping it takes) and this "
                f"tenant's files take {self.held_by(tenant)} of {self.tenant_bytes} "
                "(router.files_bytes_per_tenant); delete files to make room",
            )
        return self.keep(tenant, filename, purpose, content)

    def keep(
        self,
        tenant: str,
        filename: str,
        purpose: str,
        content: bytes,
        file_id: str | None = None,
    ) -> FileObject:
        """Keep a file whatever the bound (a batch's output); `file_id`: its id (replacing
        the tenant's file of that id), else a new one."""
        if file_id is not None and (tenant, file_id) in self._files:
            self.delete(tenant, file_id)
        card = FileObject(
            id=file_id or f"file-{uuid.uuid4().hex}",
            bytes=len(content),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        self._files[(tenant, card.id)] = StoredFile(card, content)
        self.places.add(tenant, card.id)
        self._count(tenant, len(content) + ENTRY_BYTES)
        return card

    def _count(self, tenant: str, size: int) -> None:
        """Count `size` bytes more (or fewer) against the bound and the tenant's."""
        self.held += size
        held = self._held_by.get(tenant, 0) + size
        if held:
            self._held_by[tenant] = held
        else:
            self._held_by.pop(tenant, None)

    async def save(self, tenant: str, file_id: str, refuse: bool = True) -> None:
        """Write a file kept to `directory` (on a thread: an upload may be 200 MiB). One that
        cannot be written is let go and refused (507: it would not outlive a restart), or,
        not `refuse` (a batch's output), kept in memory only and logged."""
        if self.directory is None:
            return
        stored = self._files[(tenant, file_id)]
        try:
            await asyncio.to_thread(self._write, self.directory, tenant, stored)
        except OSError as err:
            if not refuse:
                log.exception("file %s not written to router.state_dir", file_id)
                return
            if (tenant, file_id) in self._files:
                self.delete(tenant, file_id)
            raise HttpError(
                507, f"the file could not be written to router.state_dir: {err}"
            ) from err
        if self._files.get((tenant, file_id)) is not stored:  # deleted while it was written
            remove(self.directory / f"{file_id}.json", self.directory / f"{file_id}.bin")

    def find(self, tenant: str, file_id: str) -> StoredFile | None:
        return self._files.get((tenant, file_id))

    @staticmethod
    def _write(directory: Path, tenant: str, stored: StoredFile) -> None:
        write_whole(directory / f"{stored.card.id}.bin", stored.content)
        write_json(
            directory / f"{stored.card.id}.json",
            {"tenant": tenant, "card": stored.card.model_dump()},
        )

    def _read_back(self, directory: Path) -> None:
        """The files a router before this one kept, oldest first; a file whose card or content
        is missing or unreadable is left out (and removed), logged."""
        kept = []
        for partial in directory.glob("*.partial"):  # a write a crash cut short
            remove(partial)
        for card_path in directory.glob("*.json"):
            content_path = card_path.with_suffix(".bin")
            try:
                saved = json.loads(card_path.read_bytes())
                card = FileObject.model_validate(saved["card"])
                content = content_path.read_bytes()
                if len(content) != card.bytes:
                    raise ValueError(f"{len(content)} bytes, its card says {card.bytes}")
                kept.append((card.created_at, str(saved["tenant"]), StoredFile(card, content)))
            except (OSError, ValueError, KeyError, TypeError, ValidationError) as err:
                log.error("file %s left out: %s", card_path.stem, err)
                remove(card_path, content_path)
        for _, tenant, stored in sorted(kept, key=lambda k: (k[0], k[2].card.id)):
            self._files[(tenant, stored.card.id)] = stored
            self.places.add(tenant, stored.card.id)
            self._count(tenant, stored.card.bytes + ENTRY_BYTES)
        for orphan in directory.glob("*.bin"):  # written, its card never: an upload cut short
            if not orphan.with_suffix(".json").exists():
                remove(orphan)

    def get(self, tenant: str, file_id: str) -> StoredFile:
        """404 for a file never kept, deleted, or another tenant's."""
        self.require()
        found = self._files.get((tenant, file_id))
        if found is None:
            raise HttpError(404, f"no file {file_id!r}", "file_id")
        return found

    def delete(self, tenant: str, file_id: str) -> None:
        found = self.get(tenant, file_id)
        del self._files[(tenant, file_id)]
        self.places.remove(tenant, file_id)
        self._count(tenant, -(found.card.bytes + ENTRY_BYTES))
        if self.directory is not None:  # the card first: a file without one is no file
            remove(self.directory / f"{file_id}.json", self.directory / f"{file_id}.bin")

    def every(self) -> list[tuple[str, FileObject]]:
        """Every tenant's files: (tenant, card), oldest first."""
        return [(owner, f.card) for (owner, _), f in self._files.items()]

    def cards(self, tenant: str, purpose: str | None = None) -> list[FileObject]:
        """The tenant's files, oldest first (`purpose`: only those)."""
        self.require()
        return [
            f.card
            for (owner, _), f in self._files.items()
            if owner == tenant and (purpose is None or f.card.purpose == purpose)
        ]
