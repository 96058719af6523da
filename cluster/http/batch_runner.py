"""What every batch shares, OpenAI's (cluster/http/batches.py) and Anthropic's
(cluster/http/message_batches.py): its requests sent to this router's own HTTP app in the
process (httpx2's ASGI transport) with its creator's credentials, `router.batch_max_in_flight`
of all batches' requests at once, in `router.batch_order`, at `router.batch_priority` under the
`priority` scheduling policy, and a request refused for load (429) or for want of a worker (503
while none is attached) sent again after a pause, for up to OVERLOAD_WAIT_S.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Container
from itertools import chain
from typing import Any

import httpx2
from starlette.types import ASGIApp

from cluster.http.batch_schema import BatchLine, prefix_order
from cluster.http.embeddings import overload_pauses

log = logging.getLogger(__name__)

BASE_URL = "http://batch.internal"
"""What the in-process requests are addressed to (never resolved: the transport is the app)."""
CREDENTIALS = ("authorization", "x-api-key")
"""The creator's headers each of its batch's requests carries."""
OVERLOAD_WAIT_S = 600.0
"""How long a request refused for load (429: the router's or the workers' queues full) is
tried again before its line records the refusal: a batch is in no hurry."""

Record = Callable[[BatchLine, str, int | None, Any, str | None], None]
"""What a batch does with an answered request: (line, request id, status, body, failure); a
status and body when the app answered, else the failure (the app raised, or answered other
than JSON)."""


class BatchRunner:
    def __init__(
        self,
        max_in_flight: int,
        order: str,
        accepting: Callable[[], bool] = lambda: True,
        priority: int | None = None,
        workers: Callable[[], bool] = lambda: True,
    ) -> None:
        self.order = order
        self.priority = priority
        """The priority of the requests whose body sets none (None: leave them at 0)."""
        self.accepting = accepting
        """False once the router drains: no batch sends another request."""
        self.workers = workers
        """Whether a worker is attached: a 503 while none is, is waited out (`waits_out`)."""
        self.app: ASGIApp | None = None
        """The router's HTTP app, which runs each request (set once it is built)."""
        self._slots = asyncio.Semaphore(max_in_flight)

    async def run(
        self,
        name: str,
        lines: list[BatchLine],
        answered: Container[int],
        endpoint: str,
        headers: dict[str, str],
        record: Record,
    ) -> bool:
        """Send batch `name`'s lines not `answered` (by number) in order, as slots free up,
        each answer to `record`; True when the router drained before every one was sent (no
        more are). On a cancel, the requests running are ended (their worker calls closed,
        their pages freed) and it returns as if they had answered."""
        assert self.app is not None, "the app is attached when it is built"
        transport = httpx2.ASGITransport(app=self.app)
        sent: set[asyncio.Task[None]] = set()
        stopped = False
        async with httpx2.AsyncClient(transport=transport, base_url=BASE_URL, timeout=None) as c:
            try:
                prefix = self.order == "prefix"
                order = await asyncio.to_thread(prefix_order, lines) if prefix else lines
                for line in order:
                    if line.number in answered:  # answered before a restart
                        continue
                    await self._slots.acquire()  # released by the request as it ends
                    if not self.accepting():
                        self._slots.release()
                        stopped = True
                        break
                    one = self._one(c, name, endpoint, headers, line, record)
                    task = asyncio.ensure_future(one)
                    sent.add(task)
                    task.add_done_callback(sent.discard)
                while sent:
                    await asyncio.wait(set(sent))
            except asyncio.CancelledError:
                for task in sent:
                    task.cancel()
                await asyncio.gather(*sent, return_exceptions=True)
        return stopped

    async def _one(
        self,
        client: httpx2.AsyncClient,
        name: str,
        endpoint: str,
        headers: dict[str, str],
        line: BatchLine,
        record: Record,
    ) -> None:
        request_id = f"batch_req_{uuid.uuid4().hex}"
        headers = headers | {"x-request-id": request_id}
        sent = line.body
        if self.priority is not None and sent.get("priority") is None:
            sent = sent | {"priority": self.priority}
        try:
            for pause in chain(overload_pauses(OVERLOAD_WAIT_S), [None]):
                answer = await client.post(endpoint, json=sent, headers=headers)
                if not self.waits_out(answer.status_code) or pause is None:
                    break
                await asyncio.sleep(pause)  # full, or no worker yet: wait for room, or one
            status, body = answer.status_code, answer.json()
        except asyncio.CancelledError:
            raise
        except Exception as err:  # the app failed, or answered other than JSON: this line only
            log.exception("batch %s: line %d (%s) failed", name, line.number, request_id)
            record(line, request_id, None, None, f"{type(err).__name__}: {err}")
        else:
            record(line, request_id, status, body, None)
        finally:
            self._slots.release()

    def waits_out(self, status: int) -> bool:
        """Whether a batch's request answered `status` is sent again after a pause: refused
        for load (429: the router's or the workers' queues full), or for want of a worker
        (503 while none is attached: a router just restarted, its workers not back yet); not
        once the router drains, which sends nothing more."""
        if not self.accepting():
            return False
        return status == 429 or (status == 503 and not self.workers())
