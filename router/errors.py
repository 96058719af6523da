"""Typed errors of the router package; each carries the names and numbers that explain it.

Every error is raised before the policy's state is changed, so a driver that catches one finds
the policy exactly as it was. No error here may be raised after a partial change.
"""

from __future__ import annotations


class RouterError(Exception):
    """Base class of every error the router package raises on purpose."""


class UnknownWorker(RouterError, KeyError):
    """A call named a worker that is not (or no longer) a member."""

    def __init__(self, worker: str, members: int) -> None:
        self.worker = worker
        self.members = members
        super().__init__(f"worker {worker!r} is not a member ({members} workers are)")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class DuplicateWorker(RouterError, ValueError):
    """`add_worker` named a worker that is already a member."""

    def __init__(self, worker: str) -> None:
        self.worker = worker
        super().__init__(f"worker {worker!r} is already a member; remove it first")


class NoWorkers(RouterError):
    """`route` was called while the policy has no workers."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        super().__init__(f"no workers to route request {request_id!r} to")


class UnknownPolicy(RouterError, ValueError):
    """The registry has no policy of that name."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = known
        super().__init__(f"unknown routing policy {name!r}; known: {', '.join(known)}")
