"""How fast the workers really are, learned from the streams the router proxies.

A routing cost adds seconds of waiting to seconds of prefill, and both come from two numbers:
the prefill rate (tokens/s) that turns uncached tokens into seconds, and what each request
already running on a worker adds to a new one's first token (its share of every engine step
the new request waits through). The configured rate is a guess for one kind of hardware; on a
CPU a 10M-parameter model prefills 8x faster than that guess while each running request costs
milliseconds, so a router that believes the guess keeps conversations on a busy worker to save
a prefill that takes less time than the decode it queues behind.

So the router observes, per request it serves:

    first token:  seconds from dispatch to the first token, the uncached tokens the worker
                  reported, and the requests running on that worker at dispatch. Only requests
                  dispatched to a worker with no prefill queued count (no queueing in them).
    each step:    seconds between two streamed responses of one request, and the requests
                  running on its worker then.

and fits, with exponentially decaying weights (recent behaviour wins):

    step(running)  = decode_s x running                          (a ratio estimate)
    first token    = decode_s x (running + 1) + uncached / prefill_rate

Both are ratio estimates, not regressions: they need no spread of running counts and never go
negative. Until `min_samples` of each have been seen the configured values stand, and the
learned rate is clamped to within `max_factor` of the configured one. Must never be trusted
for anything but routing costs; it is an estimate, not a measurement of record.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServiceRates:
    prefill_rate: float
    """Tokens per second of prefill on one worker."""
    decode_s: float
    """Seconds each running request adds to a new request's first token on its worker."""


class ServiceModel:
    def __init__(
        self,
        prefill_rate: float,
        half_life: int = 512,
        min_samples: int = 16,
        max_factor: float = 100.0,
    ) -> None:
        if prefill_rate <= 0 or half_life < 1 or min_samples < 1 or max_factor < 1:
            raise ValueError(
                "need prefill_rate > 0, half_life >= 1, min_samples >= 1, max_factor >= 1; got "
                f"{prefill_rate}, {half_life}, {min_samples}, {max_factor}"
            )
        self.configured_rate = prefill_rate
        self.max_factor = max_factor
        self.min_samples = min_samples
        self._decay = 0.5 ** (1.0 / half_life)
        self._step_seconds = 0.0
        self._step_running = 0.0
        self._steps = 0
        self._prefill_tokens = 0.0
        self._first_token_seconds = 0.0
        self._first_token_steps = 0.0
        self._first_tokens = 0

    def observe_step(self, running: int, seconds: float) -> None:
        """One decode step: `seconds` between two responses while `running` requests ran."""
        if running < 1 or not seconds >= 0:
            return
        d = self._decay
        self._step_seconds = self._step_seconds * d + seconds
        self._step_running = self._step_running * d + running
        self._steps += 1

    def observe_first_token(self, uncached_tokens: int, running: int, seconds: float) -> None:
        """A request dispatched to a worker with no prefill queued and `running` requests in
        flight (itself excluded) had its first token after `seconds`."""
        if uncached_tokens < 1 or running < 0 or not seconds >= 0:
            return
        d = self._decay
        self._prefill_tokens = self._prefill_tokens * d + uncached_tokens
        self._first_token_seconds = self._first_token_seconds * d + seconds
        self._first_token_steps = self._first_token_steps * d + running + 1
        self._first_tokens += 1

    @property
    def decode_s(self) -> float:
        if self._steps < self.min_samples or self._step_running <= 0:
            return 0.0
        return self._step_seconds / self._step_running

    @property
    def prefill_rate(self) -> float:
        """Uncached tokens over the first-token seconds left once the decode steps they
        waited through are taken out (with today's `decode_s`, so early samples are not
        skewed by a decode cost not yet learned)."""
        configured = self.configured_rate
        prefill_s = self._first_token_seconds - self.decode_s * self._first_token_steps
        if self._first_tokens < self.min_samples or prefill_s <= 0:
            return configured
        rate = self._prefill_tokens / prefill_s
        return min(max(rate, configured / self.max_factor), configured * self.max_factor)

    def rates(self) -> ServiceRates:
        return ServiceRates(self.prefill_rate, self.decode_s)
