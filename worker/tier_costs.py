"""`TierCosts`: what recomputing prompt positions costs this worker against reading them back
from its disk tier, learned from its own forward passes and reads, so that a disk hit is read
only when reading is the faster way to its KV.

A read is not always faster. On this 2-core CPU, as learned by an engine serving SmolLM2, a
recomputed position costs 1.76 ms (plus 54 ms a pass) and a read-back one 0.055 ms (57 ms for
the 47 MB of a 1,024-token turn), so reading wins about 30-fold; on the ninth session's H100
the same 1,024 tokens prefilled in 20 ms, less than this machine takes to read and check those
47 MB (LMCache's users report offload hits slower than recomputing). Both rates depend on
the model, the device and the disk, so they are learned, not configured:

    a pass:   seconds = overhead + tokens x slope       a line through the engine's passes
    a read:   seconds = positions x read_s              a ratio over the reads

Both are sums decayed by a half-life in observations (recent behaviour wins). Recomputing p
positions ahead of the prompt's r others costs p x slope plus the overhead of the passes it
adds: with at most c tokens a pass, ceil((p + r) / c) - ceil(r / c) of them. When the passes'
token counts spread too little to fit a line (a worker that only decodes), the ratio
seconds / tokens stands in for the slope, with no overhead (dearer per token: the overhead is
in it). A read is made when the positions of the files it reads (whole, though a hit may use
part of the last) x read_s are less than that. Until `min_passes`
passes and one read were seen, reads are made (a read is how its rate is learned); while
recomputing wins, every `probe_every`-th skipped read is made anyway, so a disk that became
faster (its files now in the page cache) is noticed.

A pass is timed from its start to its sampled tokens (on CUDA the sampling waits for the
device), so the slope carries a little sampling and streaming per token; a read is timed on
the reader thread plus its insert on the engine thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierCostsConfig:
    half_life: int = 64
    """Observations after which an old one weighs half."""
    min_passes: int = 8
    """Forward passes to see before recomputing is priced (reads are made until then)."""
    warmup_passes: int = 2
    """A worker's first passes, left out: they pay one-time costs (lazy set-up, allocator
    growth) that made the tiny model's first pass 100 times its later ones."""
    min_spread_tokens: float = 16.0
    """Standard deviation of the passes' token counts needed to fit a line."""
    probe_every: int = 16
    """While recomputing wins, one read in this many is made anyway (0: never)."""

    def __post_init__(self) -> None:
        if (
            self.half_life < 1
            or self.min_passes < 1
            or self.probe_every < 0
            or self.warmup_passes < 0
        ):
            raise ValueError(
                "need half_life >= 1, min_passes >= 1, probe_every >= 0, warmup_passes >= 0; "
                f"got {self.half_life}, {self.min_passes}, {self.probe_every}, "
                f"{self.warmup_passes}"
            )
        if not 0.0 <= self.min_spread_tokens < math.inf:
            raise ValueError(f"min_spread_tokens must be finite and >= 0: {self.min_spread_tokens}")


class ReadRate:
    """What reading positions back from one source costs: decayed sums over its reads, and
    the reads priced out (`TierCosts.read_pays`)."""

    def __init__(self, decay: float) -> None:
        self._decay = decay
        self._positions = 0.0
        self._seconds = 0.0
        self.reads = 0
        self.skips = 0
        self.skipped_positions = 0
        """Positions this source held that were recomputed because that was priced cheaper."""

    def observe(self, positions: int, seconds: float) -> None:
        if positions < 1 or not 0.0 <= seconds < math.inf:
            return  # a non-finite value would stay in the decayed sums for good
        d = self._decay
        self._positions = self._positions * d + positions
        self._seconds = self._seconds * d + seconds
        self.reads += 1

    @property
    def seconds_per_position(self) -> float | None:
        """None until one read was seen."""
        if self.reads == 0 or self._positions <= 0:
            return None
        return self._seconds / self._positions


class TierCosts:
    """Engine thread only. `disk` is the saved cache's rate, `peer` that of reading another
    worker's KV over gRPC (worker/peer_reads.py); both are priced against the same passes."""

    def __init__(self, config: TierCostsConfig | None = None) -> None:
        self.config = config or TierCostsConfig()
        self._decay = 0.5 ** (1.0 / self.config.half_life)
        self._passes = [0.0] * 5  # decayed sums of 1, tokens, tokens^2, seconds, tokens x seconds
        self._pass_count = 0
        self._warmup = self.config.warmup_passes
        self.disk = ReadRate(self._decay)
        self.peer = ReadRate(self._decay)

    @property
    def skipped_positions(self) -> int:
        """Positions found on disk and recomputed because that was priced cheaper."""
        return self.disk.skipped_positions

    def observe_pass(self, tokens: int, seconds: float) -> None:
        """A forward pass computed `tokens` new positions in `seconds`."""
        if tokens < 1 or not 0.0 <= seconds < math.inf:
            return  # a non-finite value would stay in the decayed sums for good
        if self._warmup:
            self._warmup -= 1
            return
        x, y, d = float(tokens), seconds, self._decay
        for i, value in enumerate((1.0, x, x * x, y, x * y)):
            self._passes[i] = self._passes[i] * d + value
        self._pass_count += 1

    def observe_read(self, positions: int, seconds: float, rate: ReadRate | None = None) -> None:
        """Files of `positions` positions were read back from disk (or `rate`'s source), and
        what a hit used of them put into the cache, in `seconds`."""
        (rate or self.disk).observe(positions, seconds)

    @property
    def recompute_s(self) -> float | None:
        """Seconds a recomputed position adds to a pass; None until `min_passes` were seen."""
        line = self._line()
        return None if line is None else line[0]

    def _line(self) -> tuple[float, float] | None:
        """(seconds a position, seconds of overhead a pass), None until `min_passes`."""
        if self._pass_count < self.config.min_passes:
            return None
        n, sx, sxx, sy, sxy = self._passes
        variance = sxx / n - (sx / n) ** 2
        if variance >= self.config.min_spread_tokens**2:
            slope = (sxy / n - (sx / n) * (sy / n)) / variance
            if slope > 0:
                return slope, max(0.0, (sy - slope * sx) / n)
        return (sy / sx, 0.0) if sx > 0 else None

    def recompute_seconds(self, positions: int, rest: int, chunk: int) -> float | None:
        """Seconds recomputing `positions` ahead of the `rest` of a prompt adds, passes of at
        most `chunk` tokens; None until `min_passes` were seen."""
        line = self._line()
        if line is None:
            return None
        slope, overhead = line
        rest = max(rest, 1)  # the prompt's last position is computed whatever is read
        passes = -(-(positions + rest) // chunk) - -(-rest // chunk)
        return positions * slope + passes * overhead

    @property
    def read_s(self) -> float | None:
        """Seconds a position takes to read back from disk; None until one read was seen."""
        return self.disk.seconds_per_position

    def read_pays(
        self,
        positions: int,
        rest: int = 1,
        chunk: int = 1 << 30,
        files: int | None = None,
        rate: ReadRate | None = None,
    ) -> bool:
        """Whether to read `positions` saved positions back (from disk, or `rate`'s source)
        rather than recompute them ahead of the `rest` of their prompt in passes of `chunk`
        tokens, reading files of `files` positions in all (default `positions`: a hit may use
        part of a file it reads whole). Counts the positions when not."""
        rate = rate or self.disk
        recompute = self.recompute_seconds(positions, rest, max(chunk, 1))
        read = rate.seconds_per_position
        read_positions = positions if files is None else files
        if recompute is None or read is None or read_positions * read < recompute:
            return True
        rate.skips += 1
        probe = self.config.probe_every
        if probe and rate.skips % probe == 0:
            return True
        rate.skipped_positions += positions
        return False
