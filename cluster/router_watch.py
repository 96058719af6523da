"""`radixmesh serve`'s eye on the router actor: restarting is fine, dead for good ends serving.

Ray restarts a killed router (`router.max_restarts`), and a call made while it restarts waits
for it. A call in flight when it died fails with ActorDiedError, and so does every call once Ray
has given up on it (restarts used up, or its constructor raised: it could not bind its port,
say). So the watch pings it about once a second, never more than one ping at a time, and calls
it dead after `dead_after` pings in a row failed, each sent after the previous one failed: the
first may be the call the death cut, the ones after it would have waited for a restart.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError


def first_line(err: BaseException) -> str:
    """Ray's actor errors run to many lines; their first says what happened."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class RouterWatch:
    def __init__(self, router: Any, period_s: float = 1.0, dead_after: int = 3) -> None:
        self.router = router
        self.period_s = period_s
        self.dead_after = dead_after
        self.failures = 0
        self.reason = ""
        self._ping = router.describe.remote()
        self._sent = time.monotonic()

    def dead(self) -> str | None:
        """None while the router lives (or is being restarted); once Ray has given up on it,
        why. Never blocks."""
        if self.failures >= self.dead_after:
            return self.reason
        ready, _ = ray.wait([self._ping], timeout=0)
        if not ready:
            return None
        try:
            ray.get(self._ping)
            self.failures = 0
        except ActorUnavailableError:  # unreachable for a moment: not a death
            pass
        except RayActorError as err:
            self.failures += 1
            self.reason = first_line(err)
        if self.failures >= self.dead_after:
            return self.reason
        if self.failures or time.monotonic() - self._sent >= self.period_s:
            self._ping = self.router.describe.remote()
            self._sent = time.monotonic()
        return None
