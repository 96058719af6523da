"""The router's stopwatch on the streams it forwards: what teaches the policy real speeds.

Every Generate call the router serves passes through here three ways: `dispatched` when the
policy has picked a worker, `responded` for each message the worker streams back, `ended` when
the call is over. From those it feeds router/service_model.py the first-token times of requests
that found no prefill queued on their worker, and the gaps between messages of sample 0 (one
engine step per token; with n > 1 the samples' messages interleave, so a gap between two of
different samples is no step) together with the requests running on that worker. Every `every`
observations, and at the first observation under a policy it has not taught yet (an admin call
switched it), it hands the learned rates to the policy (`calibrate`). Must never block or fail a
request: it only reads clocks and counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from router.interface import RoutingPolicy
from router.service_model import ServiceModel


@dataclass
class _WorkerCounts:
    running: int = 0
    """Requests dispatched to the worker and not ended."""
    prefilling: int = 0
    """Requests dispatched to the worker that have not had their first token."""


@dataclass
class Dispatch:
    """One request's timing on one worker."""

    worker: str
    began: float
    clean: bool
    """No prefill was queued on the worker when this request was dispatched."""
    running_before: int
    prompt_tokens: int
    last: float | None = None
    """When its previous message of sample 0 arrived (None before the first)."""


class StreamTiming:
    def __init__(
        self,
        policy_of: Callable[[], RoutingPolicy],
        prefill_rate: float,
        every: int = 16,
        clock: Callable[[], float] = time.perf_counter,
        host_rate: float | None = None,
        disk_rate: float | None = None,
        peer_rate: float | None = None,
    ) -> None:
        """`policy_of`: the policy in use now (an admin call may switch it);
        `prefill_rate` (and the tiers' rates, None: a multiple of the prefill rate): the
        configured guesses, which stand until enough was observed."""
        self._policy_of = policy_of
        self.model = ServiceModel(
            prefill_rate, host_rate=host_rate, disk_rate=disk_rate, peer_rate=peer_rate
        )
        self._every = every
        self._seen = 0
        self._taught: RoutingPolicy | None = None
        """The policy last calibrated."""
        self._workers: dict[str, _WorkerCounts] = {}
        self._clock = clock

    def dispatched(self, worker: str, prompt_tokens: int) -> Dispatch:
        counts = self._workers.setdefault(worker, _WorkerCounts())
        dispatch = Dispatch(
            worker, self._clock(), counts.prefilling == 0, counts.running, prompt_tokens
        )
        counts.running += 1
        counts.prefilling += 1
        return dispatch

    def responded(
        self,
        dispatch: Dispatch,
        index: int,
        tokens: int,
        cached_prompt_tokens: int,
        host_cached_tokens: int = 0,
        disk_cached_tokens: int = 0,
        peer_cached_tokens: int = 0,
    ) -> None:
        """A message of sample `index` carrying `tokens` new tokens."""
        if index:  # sample 0 starts first; the others' messages fall between its steps
            return
        now = self._clock()
        counts = self._workers[dispatch.worker]
        if dispatch.last is None:
            counts.prefilling -= 1
            if dispatch.clean:
                self.model.observe_first_token(
                    dispatch.prompt_tokens - cached_prompt_tokens,
                    dispatch.running_before,
                    now - dispatch.began,
                    host_cached_tokens,
                    disk_cached_tokens,
                    peer_cached_tokens,
                )
                self._observed()
        elif tokens > 0:
            self.model.observe_step(counts.running, (now - dispatch.last) / tokens)
            self._observed()
        dispatch.last = now

    def ended(self, dispatch: Dispatch) -> None:
        counts = self._workers[dispatch.worker]
        counts.running -= 1
        if dispatch.last is None:
            counts.prefilling -= 1

    def _observed(self) -> None:
        self._seen += 1
        policy = self._policy_of()
        if self._seen % self._every == 0 or policy is not self._taught:
            policy.calibrate(self.model.rates())
            self._taught = policy
