"""SGLang's `GET /health_generate`: a probe that generates. `/health` says a worker is attached;
this one sends a generation of one token through the router, as SGLang's Kubernetes probes do,
so a probe fails when the cluster cannot generate (every worker wedged, the router's calls
failing) and not only when it has no worker.

The generation is SGLang's own: the prompt token id 0 and one greedy token. Probes that come
while one runs wait for the same generation, so a burst of probes is one generation. It has
`timeout_s` (SGLang's 20) to answer; past that, or refused, or failed, the probe is 503 with
the reason.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

from cluster.http.errors import GenerationFailed, HttpError
from cluster.http.openai_responses import Responses, collect
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2

TIMEOUT_S = 20.0
"""How long the generation has (SGLang's HEALTH_CHECK_TIMEOUT)."""


class ProbeFailed(Exception):
    """The probe's generation did not answer; the message says why."""


class GenerationProbe:
    """Runs the probe's generation, one at a time, every probe meanwhile waiting for it."""

    def __init__(
        self,
        start: Callable[[serving_pb2.GenerateRequest], Responses],
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        self.start = start
        """Starts a generation (the HTTP API's `start`, as an operator: any tenant)."""
        self.timeout_s = timeout_s
        self._running: asyncio.Future[str] | None = None

    async def check(self) -> str:
        """The worker that answered the generation; ProbeFailed when none did in time."""
        if self._running is None or self._running.done():
            self._running = asyncio.ensure_future(self._generate())
        # a probe that goes away does not cancel the generation the others wait for
        return await asyncio.shield(self._running)

    async def _generate(self) -> str:
        message = serving_pb2.GenerateRequest(request_id=f"health-generate-{uuid.uuid4().hex}")
        message.token_ids.ids.append(0)
        message.sampling.max_tokens = 1
        message.sampling.temperature = 0
        try:
            stream = self.start(message)
            async with asyncio.timeout(self.timeout_s):
                samples, counts = await collect(stream)
        except TimeoutError:
            raise ProbeFailed(f"no token in {self.timeout_s:g} s") from None
        except (ServingError, GenerationFailed, HttpError) as err:
            reason = err.message if isinstance(err, ServingError | HttpError) else str(err)
            raise ProbeFailed(reason) from None
        sample = samples.get(0)
        if sample is None or not sample.token_ids or counts.first is None:
            raise ProbeFailed("the generation ended without a token")
        return counts.first.worker
