"""SGLang's `GET /health_generate`: a probe that generates. `/health` says a worker is attached;
this one sends a generation of one token through the router, as SGLang's Kubernetes probes do,
so a probe fails when the cluster cannot generate (every worker wedged, the router's calls
failing) and not only when it has no worker.

The generation is SGLang's own: the prompt token id 0 and one greedy token. Probes that come
while one runs wait for the same generation, so a burst of probes is one generation. It has
`timeout_s` (SGLang's 20) to answer. A busy router passes, as SGLang's does: when the probe's
generation is refused for load (`router.max_in_flight`, the workers' queues) or has not
answered in time, the probe passes if any generation's message went to its client since the
probe began, waiting up to `timeout_s` for one. Otherwise (refused for another reason, failed,
or nothing streamed in time) it fails with the reason.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from cluster.http.errors import GenerationFailed, HttpError
from cluster.http.openai_responses import Responses, collect
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2

TIMEOUT_S = 20.0
"""How long the generation has (SGLang's HEALTH_CHECK_TIMEOUT)."""
WATCH_S = 0.05
"""How often a busy router is looked at for a message streamed since the probe began."""


class ProbeFailed(Exception):
    """The probe's generation did not answer; the message says why."""


@dataclass(frozen=True)
class ProbeAnswer:
    worker: str | None
    """The worker that answered the probe's generation (None: busy, another's answered)."""
    busy: str | None = None
    """Why the probe's own generation did not answer, when the router is busy."""


class GenerationProbe:
    """Runs the probe's generation, one at a time, every probe meanwhile waiting for it."""

    def __init__(
        self,
        start: Callable[[serving_pb2.GenerateRequest], Responses],
        forwarded_at: Callable[[], float] = lambda: 0.0,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.start = start
        """Starts a generation (the HTTP API's `start`, as an operator: any tenant)."""
        self.forwarded_at = forwarded_at
        """When the router last sent any generation's message (RouterService.forwarded_at)."""
        self.timeout_s = timeout_s
        self._running: asyncio.Future[ProbeAnswer] | None = None

    async def check(self) -> ProbeAnswer:
        """What answered; ProbeFailed when nothing did in time."""
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._probe())
            # read by the waiters; read here too, should every waiter have gone away
            self._running.add_done_callback(lambda done: done.cancelled() or done.exception())
        # a probe that goes away does not cancel the generation the others wait for
        return await asyncio.shield(self._running)

    async def _probe(self) -> ProbeAnswer:
        began = time.perf_counter()
        try:
            return ProbeAnswer(await self._generate())
        except TimeoutError:
            busy = f"no token in {self.timeout_s:g} s"
        except ServingError as err:
            if err.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ProbeFailed(err.message) from None
            busy = err.message
        except (GenerationFailed, HttpError) as err:
            raise ProbeFailed(err.message if isinstance(err, HttpError) else str(err)) from None
        while self.forwarded_at() <= began:  # busy: alive if anything streams meanwhile
            if time.perf_counter() - began >= self.timeout_s:
                raise ProbeFailed(f"{busy}, and no generation streamed since the probe began")
            await asyncio.sleep(WATCH_S)
        return ProbeAnswer(None, busy)

    async def _generate(self) -> str:
        """The worker that answered the probe's generation."""
        message = serving_pb2.GenerateRequest(request_id=f"health-generate-{uuid.uuid4().hex}")
        message.token_ids.ids.append(0)
        message.sampling.max_tokens = 1
        message.sampling.temperature = 0
        stream = self.start(message)
        async with asyncio.timeout(self.timeout_s):
            samples, counts = await collect(stream)
        sample = samples.get(0)
        if sample is None or not sample.token_ids or counts.first is None:
            raise ProbeFailed("the generation ended without a token")
        return counts.first.worker
