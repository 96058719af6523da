"""What the load test records of each request, and of the whole run."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise


@dataclass
class RequestRecord:
    session: int
    turn: int
    request_id: str
    tenant: str
    adapter: str
    start: float
    """Seconds since the run began, when the request was sent."""
    first_token: float | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)
    """When each streamed message arrived (seconds since the run began), one per message."""
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    predicted_cached_tokens: int | None = 0
    """The router's prediction; None where the API does not report it (OpenAI's)."""
    worker: str = ""
    """The worker that served it; "" where the API does not say (OpenAI's)."""
    status: str = "OK"
    """"OK", or what failed: the gRPC status name, or over HTTP `HTTP_<status>`, `STREAM_ERROR`,
    `TIMEOUT`, `DISCONNECTED` (cluster/loadtest/openai_api.py)."""
    finish_reason: str = ""
    answer: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "OK"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.end is None or self.first_token is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    def inter_token(self) -> list[float]:
        return [b - a for a, b in pairwise(self.token_times)]

    def to_json(self) -> dict[str, object]:
        return {
            "session": self.session,
            "turn": self.turn,
            "request_id": self.request_id,
            "tenant": self.tenant,
            "adapter": self.adapter,
            "start": self.start,
            "ttft": self.ttft,
            "latency": self.latency,
            "tpot": self.tpot,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "worker": self.worker,
            "status": self.status,
            "finish_reason": self.finish_reason,
        }
