"""OpenAI's Files API, for batches: the files a client uploads (`purpose: batch`) and those its
batches write (`batch_output`), kept in the router's memory, each its tenant's.

One bound in bytes over every tenant's files (`router.files_bytes`): an upload that would pass
it, or MAX_UPLOAD_BYTES, is refused (413, naming the setting) before its body is read past
that, and deleting files makes room. A batch's output and error files are kept even past it
(refusing them would lose work already done); they count against it for the uploads that
follow, and no batch is created while the files fill it. Nothing survives a restart of the
router.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from cluster.http.errors import HttpError

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
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        """0: no Files API (and so no Batch API)."""
        self.held = 0
        """Bytes of every file kept, with ENTRY_BYTES each."""
        self._files: dict[tuple[str, str], StoredFile] = {}
        """(tenant, file id) -> the file, in the order added."""

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def full(self) -> bool:
        return self.held >= self.max_bytes

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
        return self.keep(tenant, filename, purpose, content)

    def keep(self, tenant: str, filename: str, purpose: str, content: bytes) -> FileObject:
        """Keep a file whatever the bound (a batch's output)."""
        card = FileObject(
            id=f"file-{uuid.uuid4().hex}",
            bytes=len(content),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        self._files[(tenant, card.id)] = StoredFile(card, content)
        self.held += len(content) + ENTRY_BYTES
        return card

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
        self.held -= found.card.bytes + ENTRY_BYTES

    def cards(self, tenant: str, purpose: str | None = None) -> list[FileObject]:
        """The tenant's files, oldest first (`purpose`: only those)."""
        self.require()
        return [
            f.card
            for (owner, _), f in self._files.items()
            if owner == tenant and (purpose is None or f.card.purpose == purpose)
        ]
