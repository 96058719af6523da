"""Which LoRA adapters each worker holds, which sit in its device slots, and what a swap costs.

An adapter is known here by its identity ("name@digest", the adapter's part of the cache
namespace: `RouteRequest.namespace.adapter`). A worker reports (`report`) every adapter it
holds, resident in one of its `max_loras` device slots or waiting in host memory, and the
seconds it measured to bring one into a slot. Between reports the book follows its own routes:
a request routed to a worker makes its adapter resident there (`routed`), the worker's least
recently routed one leaving when its slots (the most it ever reported resident) are full.

    holders(identity) -> mask     workers that can serve the adapter at all (one bit each)
    swap_s(worker, identity)      0 where it is resident, else the worker's swap seconds

A worker that never measured a swap is priced at `default_swap_s` (RouterConfig.adapter_swap_s);
once it reports one, at its own (learned from the reports: the worker keeps an EWMA of its
swaps). Nothing here is thread-safe; the policy's one driver calls it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from router.config import DEFAULT_SWAP_S

WorkerId = str


@dataclass(frozen=True, slots=True)
class WorkerAdapters:
    """A worker's report of its adapters (identities)."""

    held: frozenset[str]
    """Every adapter it can serve: resident or in host memory."""
    resident: frozenset[str] = frozenset()
    """Those in a device slot now (a subset of `held`)."""
    swap_s: float = 0.0
    """Its measured seconds to bring an adapter into a slot (0: not measured yet)."""

    @classmethod
    def of(
        cls, held: Iterable[str], resident: Iterable[str] = (), swap_s: float = 0.0
    ) -> WorkerAdapters:
        resident = frozenset(resident)
        return cls(frozenset(held) | resident, resident, swap_s)


@dataclass(slots=True)
class _Worker:
    bit: int
    held: frozenset[str] = frozenset()
    resident: OrderedDict[str, None] = field(default_factory=OrderedDict)
    """Resident adapters, least recently routed first."""
    slots: int = 1
    swap_s: float = 0.0


class AdapterBook:
    def __init__(self, default_swap_s: float = DEFAULT_SWAP_S) -> None:
        if not default_swap_s >= 0:
            raise ValueError(f"default_swap_s must be >= 0, got {default_swap_s}")
        self.default_swap_s = default_swap_s
        self.workers: dict[WorkerId, _Worker] = {}
        self._holders: dict[str, int] = {}

    def add(self, worker: WorkerId, bit: int) -> None:
        self.workers[worker] = _Worker(bit)

    def remove(self, worker: WorkerId) -> None:
        state = self.workers.pop(worker, None)
        if state is not None:
            self._unhold(state)

    def report(self, worker: WorkerId, report: WorkerAdapters) -> None:
        """The worker's own view replaces the book's (resident order kept where both agree)."""
        state = self.workers[worker]
        self._unhold(state)
        state.held = report.held
        for identity in report.held:
            self._holders[identity] = self._holders.get(identity, 0) | 1 << state.bit
        kept = [i for i in state.resident if i in report.resident]
        state.resident = OrderedDict.fromkeys(kept + sorted(report.resident.difference(kept)))
        state.slots = max(state.slots, len(report.resident))
        if report.swap_s > 0:
            state.swap_s = report.swap_s

    def holders(self, identity: str) -> int:
        """The bit mask of workers holding `identity` (0: none)."""
        return self._holders.get(identity, 0)

    def swap_s(self, worker: WorkerId, identity: str) -> float:
        """Seconds before `worker` can run a request of `identity`: 0 if resident there."""
        state = self.workers[worker]
        if identity in state.resident:
            return 0.0
        return state.swap_s or self.default_swap_s

    def routed(self, worker: WorkerId, identity: str) -> None:
        """A request of `identity` went to `worker`: the adapter is resident there now."""
        state = self.workers.get(worker)
        if state is None or identity not in state.held:
            return
        state.resident[identity] = None
        state.resident.move_to_end(identity)
        while len(state.resident) > state.slots:
            state.resident.popitem(last=False)

    def _unhold(self, state: _Worker) -> None:
        clear = ~(1 << state.bit)
        for identity in state.held:
            mask = self._holders.get(identity, 0) & clear
            if mask:
                self._holders[identity] = mask
            else:
                self._holders.pop(identity, None)
