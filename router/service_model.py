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

    step(running)  = decode_s x running                                     (a ratio)
    first token    = overhead + decode_s x (running + 1) + uncached / prefill_rate

The first-token fit is a least-squares line in the uncached tokens once they spread over at
least `min_spread_tokens` (standard deviation): its slope is the marginal prefill cost, and
`overhead` (the hops, the scheduling, the tokenizer: the same on every worker, so it never
decides a route) is kept out of it. On a 2-layer CPU model the overhead is most of a first
token, and a ratio would price each uncached token at 6x its real cost. With less spread, and
whenever the slope is not positive, it falls back to the ratio (uncached tokens over the
seconds left after decode). Until `min_samples` of each kind were seen the configured values
stand, and the learned rate stays within `max_factor` of the configured one. Must never be
trusted for anything but routing costs; it is an estimate, not a measurement of record.

Host tiers: a first token whose prompt was partly copied back from a worker's host tier
(`host_tokens`, reported by the worker) is kept out of the prefill fit. What it took beyond
that fit's prediction for its uncached tokens, over its host tokens, is the host tier's cost per
token: `host_rate` is host tokens over those excess seconds, both decayed sums, once
`min_samples` such first tokens were seen (the configured rate until then), within
`max_factor` of the configured one. Saved caches the same way: a first token with `disk_tokens`
read back from a worker's disk gives `disk_rate`, its excess less what its host tokens (if any)
cost at the host rate of the moment. And reads from another worker's cache (`peer_tokens`):
`peer_rate`, its excess less what its host and disk tokens cost; learned always (those first
tokens stay out of the prefill fit), handed to the policy only when a rate was configured
(`router.peer_kv_rate`: the policy then prices moves as reads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.config import default_disk_rate, default_host_rate


@dataclass(frozen=True, slots=True)
class ServiceRates:
    prefill_rate: float
    """Tokens per second of prefill on one worker."""
    decode_s: float
    """Seconds each running request adds to a new request's first token on its worker."""
    host_rate: float | None = None
    """Tokens per second copied back from a host tier; None: keep the configured rate."""
    disk_rate: float | None = None
    """Tokens per second read back from a saved cache; None: keep the configured rate."""
    peer_rate: float | None = None
    """Tokens per second read from another worker's cache; None: keep the configured rate."""

    def __post_init__(self) -> None:
        # a policy divides by the rate and multiplies the decode cost into every score: a
        # zero, negative or non-finite value would surface later as a crash or a NaN cost
        tier_bad = any(
            rate is not None and not 0.0 < rate < math.inf
            for rate in (self.host_rate, self.disk_rate, self.peer_rate)
        )
        if (
            tier_bad
            or not 0.0 < self.prefill_rate < math.inf
            or not 0.0 <= self.decode_s < math.inf
        ):
            raise ValueError(
                "need 0 < prefill_rate < inf tokens/s and 0 <= decode_s < inf s, got "
                f"{self.prefill_rate}, {self.decode_s}"
            )


class ServiceModel:
    def __init__(
        self,
        prefill_rate: float,
        half_life: int = 512,
        min_samples: int = 16,
        max_factor: float = 100.0,
        min_spread_tokens: float = 32.0,
        host_rate: float | None = None,
        disk_rate: float | None = None,
        peer_rate: float | None = None,
    ) -> None:
        if (
            not 0.0 < prefill_rate < math.inf
            or half_life < 1
            or min_samples < 1
            or not max_factor >= 1
            or not min_spread_tokens >= 0
        ):
            raise ValueError(
                "need 0 < prefill_rate < inf, half_life >= 1, min_samples >= 1, max_factor >= 1, "
                "min_spread_tokens >= 0; got "
                f"{prefill_rate}, {half_life}, {min_samples}, {max_factor}, {min_spread_tokens}"
            )
        self.configured_rate = prefill_rate
        self._host_configured = host_rate
        self._disk_configured = disk_rate
        self._peer_configured = peer_rate
        self.max_factor = max_factor
        self.min_samples = min_samples
        self.min_spread_tokens = min_spread_tokens
        self._decay = 0.5 ** (1.0 / half_life)
        self._step_seconds = 0.0
        self._step_running = 0.0
        self._steps = 0
        # first tokens: decayed sums of 1, x (uncached), x^2, y (seconds), x y, r (steps waited
        # through: running + 1) and x r, so the line can be fitted with any later decode_s
        self._first = [0.0] * 7
        self._first_tokens = 0
        self._host = _TierFit()
        self._disk = _TierFit()
        self._peer = _TierFit()

    def observe_step(self, running: int, seconds: float) -> None:
        """One decode step: `seconds` between two responses while `running` requests ran."""
        if running < 1 or not 0.0 <= seconds < math.inf:
            return  # one non-finite value would stay in the decayed sums for good
        d = self._decay
        self._step_seconds = self._step_seconds * d + seconds
        self._step_running = self._step_running * d + running
        self._steps += 1

    def observe_first_token(
        self,
        uncached_tokens: int,
        running: int,
        seconds: float,
        host_tokens: int = 0,
        disk_tokens: int = 0,
        peer_tokens: int = 0,
    ) -> None:
        """A request dispatched to a worker with no prefill queued and `running` requests in
        flight (itself excluded) had its first token after `seconds`; `host_tokens` of its
        cached prompt came back from the host tier, `disk_tokens` from its saved cache,
        `peer_tokens` from another worker's cache."""
        if running < 0 or not 0.0 <= seconds < math.inf:
            return
        if host_tokens > 0 or disk_tokens > 0 or peer_tokens > 0:
            tiers = (host_tokens, disk_tokens, peer_tokens)
            self._observe_tiers(max(uncached_tokens, 0), running, seconds, *tiers)
            return
        if uncached_tokens < 1:
            return
        x, y, r, d = float(uncached_tokens), seconds, running + 1.0, self._decay
        for i, value in enumerate((1.0, x, x * x, y, x * y, r, x * r)):
            self._first[i] = self._first[i] * d + value
        self._first_tokens += 1

    @property
    def decode_s(self) -> float:
        if self._steps < self.min_samples or self._step_running <= 0:
            return 0.0
        return self._step_seconds / self._step_running

    @property
    def prefill_rate(self) -> float:
        """The learned rate, clamped; the configured one until enough was seen."""
        configured = self.configured_rate
        if self._first_tokens < self.min_samples:
            return configured
        rate = self._fitted_rate()
        if rate is None:
            return configured
        return min(max(rate, configured / self.max_factor), configured * self.max_factor)

    def _fitted_rate(self) -> float | None:
        n, sx, sxx, sy, sxy, sr, sxr = self._first
        decode = self.decode_s
        sy, sxy = sy - decode * sr, sxy - decode * sxr  # seconds left once decode is out
        variance = sxx / n - (sx / n) ** 2
        if variance >= self.min_spread_tokens**2:
            slope = (sxy / n - (sx / n) * (sy / n)) / variance  # seconds per uncached token
            if slope > 0:
                return 1.0 / slope
        if sy <= 0:
            return None
        return sx / sy

    def _observe_tiers(
        self, uncached: int, running: int, seconds: float, host: int, disk: int, peer: int = 0
    ) -> None:
        fit = self._fit() if self._first_tokens >= self.min_samples else None
        if fit is None:  # no prefill fit to subtract yet
            return
        slope, intercept = fit
        excess = seconds - intercept - self.decode_s * (running + 1) - slope * uncached
        if peer > 0:  # what its host and disk tokens cost is not the read's
            self._peer.observe(
                peer, excess - host / self.host_rate - disk / self.disk_rate, self._decay
            )
        elif disk > 0:  # what its host tokens cost at the host rate of the moment is not disk's
            self._disk.observe(disk, excess - host / self.host_rate, self._decay)
        else:
            self._host.observe(host, excess, self._decay)

    def _fit(self) -> tuple[float, float] | None:
        """(seconds per uncached token, seconds of overhead) of the first-token fit."""
        n, sx, _, sy, _, sr, _ = self._first
        rate = self._fitted_rate()
        if rate is None or n <= 0:
            return None
        slope = 1.0 / rate
        return slope, max(0.0, (sy - self.decode_s * sr - slope * sx) / n)

    @property
    def configured_host_rate(self) -> float:
        """The configured host rate; unset, the default multiple of the prefill rate as now
        learned (a guess fixed at the configured prefill rate would price a fast GPU's host
        hits against a prefill 10 times slower than the one it has)."""
        return self._host_configured or default_host_rate(self.prefill_rate)

    @property
    def configured_disk_rate(self) -> float:
        """The configured disk rate; unset, the default multiple of the prefill rate now."""
        return self._disk_configured or default_disk_rate(self.prefill_rate)

    @property
    def host_rate(self) -> float:
        """The learned host tier rate (tokens/s), clamped; the configured one until enough."""
        return self._host.rate(self.configured_host_rate, self.min_samples, self.max_factor)

    @property
    def disk_rate(self) -> float:
        """The learned saved-cache rate (tokens/s), clamped; the configured one until enough."""
        return self._disk.rate(self.configured_disk_rate, self.min_samples, self.max_factor)

    @property
    def peer_rate(self) -> float | None:
        """The learned rate of reads from other workers (tokens/s), clamped around the
        configured one; None while none is configured (the policy does not price reads)."""
        configured = self._peer_configured
        if configured is None:
            return None
        return self._peer.rate(configured, self.min_samples, self.max_factor)

    def rates(self) -> ServiceRates:
        return ServiceRates(
            self.prefill_rate, self.decode_s, self.host_rate, self.disk_rate, self.peer_rate
        )


class _TierFit:
    """Decayed sums of a tier's tokens and the seconds they took beyond the prefill fit."""

    def __init__(self) -> None:
        self.tokens = 0.0
        self.seconds = 0.0
        self.samples = 0

    def observe(self, tokens: int, excess: float, decay: float) -> None:
        self.tokens = self.tokens * decay + tokens
        self.seconds = self.seconds * decay + max(excess, 0.0)
        self.samples += 1

    def rate(self, configured: float, min_samples: int, max_factor: float) -> float:
        if self.samples < min_samples:
            return configured
        if self.seconds <= 0:
            return configured * max_factor
        rate = self.tokens / self.seconds
        return min(max(rate, configured / max_factor), configured * max_factor)
