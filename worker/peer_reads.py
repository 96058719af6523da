"""`PeerReads`: a prompt's KV read from another worker instead of recomputed.

The router names, with a request it sends here, another worker whose cache holds more of the
prompt (`GenerateRequest.kv_peer`). At the request's first admission the engine asks `begin`:
if the peer holds whole pages past what this worker's device and host tiers hold, and reading
them is priced faster than recomputing them (worker/tier_costs.py, the `peer` rate, learned
from the reads made), they are read over gRPC (`ReadKv`, worker/kv_export.py) on a thread of
their own. The request stays queued (requests behind it are admitted meanwhile) and every
running request keeps stepping. When the read is in, `finish` inserts its chunks into the tree
on the engine thread (worker/kv_attach.py: fresh device pages and one copy each) and the request
starts, hitting them.

A read that fails (the peer gone, a layout that differs, a reply that does not fit, the
deadline, counted from `begin`) is logged and counted, and what it did not bring is recomputed:
the peer is a hint, never a dependency. A peer whose read failed (an error, the deadline, a
refusal; not one that held less than the router thought) is not asked again for a while (1 s,
doubling with each failure in a row up to a minute). A request that
ends while its read runs cancels the call, so the holder's lease on its pages ends too. Only
text prompts are read (an image prompt's keys carry its images), and never a scoring prompt (it
wants each position's logits).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
import numpy
import torch

from cache import CacheNamespace, Keys
from protos.radixmesh.v1 import worker_pb2, worker_pb2_grpc
from worker.kv_attach import attach_kv
from worker.kv_export import layout_to_proto
from worker.kv_persistence import KvStore, StoreIdentity, tensors_of
from worker.request import KvPeer
from worker.tier_costs import TierCosts
from worker.wire import namespace_to_proto

if TYPE_CHECKING:
    from worker.engine import Engine

log = logging.getLogger(__name__)
READ_TIMEOUT_S = 30.0
"""A read not done this long after it began is given up (its positions recomputed)."""
BACKOFF_S = (1.0, 60.0)
"""A peer whose read failed is not read from for the first; each failure in a row doubles it,
up to the second."""
MAX_MESSAGE_BYTES = 64 << 20
Chunk = tuple[int, torch.Tensor, torch.Tensor]
"""(first position, K, V) of a run of whole pages."""
Read = tuple[list[Chunk], float, bool]
"""The chunks a read brought, checked, the seconds it took, and whether it failed (an error
ended it: what came before it is good)."""


@dataclass(eq=False, slots=True)
class PendingPeerRead:
    keys: Keys
    namespace: CacheNamespace
    start: int
    """Positions of `keys` this worker held when the read began (whole pages)."""
    end: int
    address: str
    future: concurrent.futures.Future[Read | None] | None = None
    finished: bool = False
    """Let go of: finished, or its request ended first."""
    call: grpc.Call | None = None
    """The RPC once sent (the reader thread sets it), cancelled when the request lets go."""

    def done(self) -> bool:
        return self.future is None or self.future.done()


class PeerReads:
    def __init__(
        self,
        identity: StoreIdentity,
        costs: TierCosts,
        wake: Callable[[], None] = lambda: None,
        timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.layout = layout_to_proto(identity)
        self.page_size = identity.page_size
        self.shape = (identity.num_layers, identity.kv_heads, identity.head_dim)
        self.costs = costs
        self.timeout_s = timeout_s
        self._wake = wake
        """Called on the reader thread when a read ends (the engine's loop may be idle)."""
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kv-peer-read")
        self._channels: dict[str, grpc.Channel] = {}
        self._channels_lock = threading.Lock()
        self.pending = 0
        """Reads begun and not yet finished or released (the engine bounds them)."""
        self.read_tokens = 0
        """Prompt positions put into the cache from peers' KV."""
        self.failures = 0
        """Reads that failed (nothing or part of what they asked for came)."""
        self._backoff: dict[str, tuple[int, float]] = {}
        """A peer's address -> failed reads in a row, and until when it is not read from."""

    def begin(
        self,
        engine: Engine,
        keys: Keys,
        namespace: CacheNamespace,
        tokens: Sequence[int],
        peer: KvPeer,
    ) -> PendingPeerRead | None:
        """Start reading what `peer` holds of `keys` past this worker's tiers (engine thread);
        None when it holds no whole page more, or recomputing is priced faster."""
        ps = self.page_size
        if time.monotonic() < self._backoff.get(peer.address, (0, 0.0))[1]:
            return None
        start = KvStore.held(engine, keys, namespace) // ps * ps
        end = min(peer.positions, len(keys) - 1) // ps * ps  # the last is computed anyway
        if end <= start:
            return None
        config = engine.config
        chunk = min(config.token_budget, config.max_prefill_chunk)
        if not self.costs.read_pays(end - start, len(keys) - end, chunk, rate=self.costs.peer):
            return None
        request = worker_pb2.ReadKvRequest(
            token_ids=tokens[:end],
            namespace=namespace_to_proto(namespace),
            start=start,
            layout=self.layout,
        )
        pending = PendingPeerRead(keys, namespace, start, end, peer.address)
        deadline = time.monotonic() + self.timeout_s
        pending.future = self._pool.submit(self._read, pending, peer, request, deadline)
        pending.future.add_done_callback(lambda _: self._wake())
        self.pending += 1
        return pending

    def finish(self, engine: Engine, pending: PendingPeerRead) -> int:
        """Insert what `pending` read (engine thread, once `pending.done()`); returns the
        positions added to the cache."""
        began = time.perf_counter()
        self.release(pending)
        try:
            result = pending.future.result() if pending.future is not None else None
        except concurrent.futures.CancelledError:
            result = None
        chunks, seconds, failed = result if result is not None else ([], 0.0, True)
        self._judge(pending.address, failed)
        wanted = pending.end - pending.start
        added = 0
        for first, k, v in chunks:
            last = first + k.shape[1] * self.page_size
            keys = pending.keys
            if not attach_kv(engine, pending.namespace, keys[:first], keys[:last], k, v):
                break
            added += last - first
        if failed or added < wanted:
            self.failures += 1  # or the peer held less than it was said to, or no room here
        elif added:
            self.costs.observe_read(added, seconds + time.perf_counter() - began, self.costs.peer)
        self.read_tokens += added
        return added

    def release(self, pending: PendingPeerRead) -> None:
        """`pending`'s request no longer waits for it (engine thread): a read not begun is
        never sent, one under way is cancelled."""
        if not pending.finished:
            pending.finished = True
            self.pending -= 1
            if pending.future is not None:
                pending.future.cancel()
            call = pending.call  # set by the reader thread, which checks `finished` after
            if call is not None:
                call.cancel()

    def _judge(self, address: str, failed: bool) -> None:
        """After a read from `address`: whether it failed (engine thread)."""
        if not failed:
            self._backoff.pop(address, None)
            return
        times = self._backoff.get(address, (0, 0.0))[0] + 1
        first, most = BACKOFF_S
        self._backoff[address] = (times, time.monotonic() + min(most, first * 2 ** (times - 1)))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._channels_lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()

    def _stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        with self._channels_lock:
            channel = self._channels.get(address)
            if channel is None:
                options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
                channel = self._channels[address] = grpc.insecure_channel(address, options)
        return worker_pb2_grpc.WorkerStub(channel)

    def _read(
        self,
        pending: PendingPeerRead,
        peer: KvPeer,
        request: worker_pb2.ReadKvRequest,
        deadline: float,
    ) -> Read:
        """The chunks `peer` sends, checked, the seconds it took, whether a failure ended it
        (logged, but for the cancel of a read let go of). Reader thread."""
        began = time.perf_counter()
        chunks: list[Chunk] = []
        at = request.start
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("reading KV from %s (%s): not begun in time", peer.worker, peer.address)
            return chunks, 0.0, True
        try:
            call = self._stub(peer.address).ReadKv(request, timeout=left)
            pending.call = call
            if pending.finished:  # let go of before the call was set: `release` missed it
                call.cancel()
            for message in call:
                chunks.append(self._checked(message, at, pending.end))
                at += message.positions
        except (grpc.RpcError, ValueError, KeyError, TypeError) as err:
            detail = err.details() if isinstance(err, grpc.Call) else err
            level = logging.DEBUG if pending.finished else logging.WARNING
            log.log(level, "reading KV from %s (%s) failed: %s", peer.worker, peer.address, detail)
            return chunks, time.perf_counter() - began, True
        return chunks, time.perf_counter() - began, False

    def _checked(self, message: worker_pb2.KvPages, at: int, end: int) -> Chunk:
        ps = self.page_size
        positions = message.positions
        if message.start != at or positions <= 0 or positions % ps or at + positions > end:
            raise ValueError(
                f"a chunk of {positions} positions at {message.start}; expected whole pages "
                f"of {ps} from {at} to at most {end}"
            )
        tensors = tensors_of(numpy.frombuffer(bytearray(message.tensors), dtype=numpy.uint8))
        layers, heads, dim = self.shape
        want = (layers, message.positions // ps, ps, heads, dim)
        for name in ("k", "v"):
            if tuple(tensors[name].shape) != want or str(tensors[name].dtype) != (
                "torch." + self.layout.dtype
            ):
                raise ValueError(f"{name} is {tuple(tensors[name].shape)}, expected {want}")
        return at, tensors["k"], tensors["v"]
