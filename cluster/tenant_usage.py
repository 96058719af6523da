"""What each tenant's calls used: the calls served, their prompt tokens, those the workers served
from cache, and the tokens generated, as the router forwarded them. The share of a tenant's
prompts served from cache is what its prefixes save it; the totals are what it cost.

A call counts once it has its first message, however it ends (a client gone mid-stream used
the tokens forwarded to it). Its prompt and its cached tokens are those of the first message: a
worker that resumes the call after a failure computes more, which the client did not ask for.
The shared namespace (no tenant) is the tenant "". At most `max_tenants` tenants are kept (a
token for "*" may name any), the first served, until the router restarts: the calls of those
past it are counted together, by call only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TenantUsage:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0


class TenantUsageBook:
    def __init__(self, max_tenants: int) -> None:
        self.max_tenants = max_tenants
        """0: no tenant is kept (every call is counted in `uncounted_requests`)."""
        self.tenants: dict[str, TenantUsage] = {}
        """Tenant ("" for the shared namespace) -> its usage, in the order first served."""
        self.uncounted_requests = 0
        """Calls of tenants past `max_tenants`."""

    def add(self, tenant: str | None, prompt: int, cached: int, generated: int) -> None:
        name = tenant or ""
        usage = self.tenants.get(name)
        if usage is None:
            if len(self.tenants) >= self.max_tenants:
                self.uncounted_requests += 1
                return
            usage = self.tenants[name] = TenantUsage()
        usage.requests += 1
        usage.prompt_tokens += prompt
        usage.cached_tokens += cached
        usage.generated_tokens += generated
