"""The namespace of a cached prefix: what, besides the tokens, decides the KV values.

Two namespaces never share a tree. `tenant` is a cache salt: two tenants never share KV, so one
cannot learn another's prompts by timing. `salt` (vLLM's `cache_salt`) divides a tenant's cache
further: only requests of the same salt share KV. `image_hash` joins the namespace only for
models whose text positions attend to the image bidirectionally (seed 000's BOS); causal models
leave it None.
"""

from __future__ import annotations

from dataclasses import dataclass

from cache.errors import InvalidToken

_HASH_BITS = 128


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    adapter: str | None = None
    """LoRA adapter name; None is the base model (an empty string is a different adapter)."""
    tenant: str | None = None
    """Cache salt; None is the shared, unsalted namespace."""
    image_hash: int | None = None
    """128-bit content hash of the image the whole sequence depends on, or None."""
    salt: str | None = None
    """A request's own cache salt within its tenant (vLLM's `cache_salt`); None: unsalted, and
    the namespace's identity is what it was before salts."""

    def __post_init__(self) -> None:
        for name in ("adapter", "tenant", "salt"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidToken(f"CacheNamespace.{name} must be a str or None, got {value!r}")
        h = self.image_hash
        if h is not None and (
            not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < 1 << _HASH_BITS
        ):
            raise InvalidToken(f"CacheNamespace.image_hash must be a 128-bit int, got {h!r}")


DEFAULT_NAMESPACE = CacheNamespace()
