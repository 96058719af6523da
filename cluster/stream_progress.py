"""What the router remembers of a stream it forwards, so that another worker can continue it.

Request migration: when the worker streaming a request dies, the router sends what is left of
the request to another worker, and the client sees one uninterrupted stream.

    before any token:  the request as the client sent it (a plain retry)
    after some tokens: one call per unfinished sample i, n = 1, resuming it:
        token_ids = prompt + the tokens of sample i the client already has
        resume    = (sample_index i, generated = how many those are)

The new worker replays those tokens through its decoder and stop strings, counts them against
max_tokens, and draws the next one with the randomness of sample i at that position
(worker/sampling.py), so greedy and seeded streams continue exactly as the uninterrupted ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.requests import PreparedRequest
from protos.radixmesh.v1 import serving_pb2, worker_pb2
from worker.request import Resume
from worker.wire import namespace_to_proto, pooling_to_proto, resume_to_proto, sampling_to_proto

_WORKER_CALLS = itertools.count()
"""Numbers the router's calls to workers, so that each runs there under an id of its own: a
worker still ending an earlier call of the same public id (its client gone, the Abort waiting
for the engine's next step) takes a new call of that id, where it would refuse the id as
already running."""


@dataclass
class SampleProgress:
    token_ids: list[int] = field(default_factory=list)
    """Tokens the client has received."""
    finished: bool = False


@dataclass
class StreamProgress:
    prepared: PreparedRequest
    samples: list[SampleProgress] = field(init=False)

    def __post_init__(self) -> None:
        self.samples = [SampleProgress() for _ in range(self.prepared.sampling.n)]

    @property
    def started(self) -> bool:
        """Whether the client has received anything: a failure now is a migration."""
        return any(s.token_ids or s.finished for s in self.samples)

    def record(self, response: serving_pb2.GenerateResponse) -> None:
        """A message on its way to the client."""
        sample = self.samples[response.index]
        sample.token_ids.extend(response.token_ids)
        sample.finished = sample.finished or response.finished

    def worker_requests(
        self,
        predicted_cached_tokens: int,
        prompt_block_hashes: Sequence[int] = (),
        kv_peer: worker_pb2.KvPeer | None = None,
    ) -> list[worker_pb2.WorkerGenerateRequest]:
        """The calls that serve what is left: the whole request, or one per unfinished sample.
        `prompt_block_hashes`, the prompt's chain as routed, goes with each (a resumed sample's
        ids start with the prompt, so its chain starts with the same hashes), but for an image
        prompt: its worker hashes image prompts itself. The images and `kv_peer` (a worker
        holding more of the prompt) go with every call."""
        p = self.prepared
        namespace = namespace_to_proto(p.namespace)
        namespace.adapter = p.adapter or ""  # workers know an adapter by its name
        if p.images:
            prompt_block_hashes = ()
        call = next(_WORKER_CALLS)
        if not self.started:
            return [
                worker_pb2.WorkerGenerateRequest(
                    request_id=f"{p.request_id}@{call}",
                    token_ids=p.token_ids,
                    namespace=namespace,
                    sampling=sampling_to_proto(p.sampling),
                    predicted_cached_tokens=predicted_cached_tokens,
                    prompt_block_hashes=prompt_block_hashes,
                    images=p.images,
                    priority=p.priority,
                    pooling=pooling_to_proto(p.pooling) if p.pooling is not None else None,
                    kv_peer=kv_peer,
                )
            ]
        alone = sampling_to_proto(p.sampling)
        alone.n = 1
        return [
            worker_pb2.WorkerGenerateRequest(
                request_id=f"{self.worker_request_id(index)}@{call}",
                token_ids=[*p.token_ids, *sample.token_ids],
                namespace=namespace,
                sampling=alone,
                predicted_cached_tokens=predicted_cached_tokens,
                resume=resume_to_proto(Resume(index, len(sample.token_ids))),
                prompt_block_hashes=prompt_block_hashes,
                images=p.images,
                priority=p.priority,
                kv_peer=kv_peer,
            )
            for index, sample in enumerate(self.samples)
            if not sample.finished
        ]

    def worker_request_id(self, index: int) -> str:
        """The id sample `index` runs under on a worker once resumed alone (n > 1 needs one
        per sample; a public id never contains '#'), before the call's number ('@')."""
        n = len(self.samples)
        return self.prepared.request_id if n == 1 else f"{self.prepared.request_id}#{index}"
