"""The cache's configuration: one frozen dataclass, validated once where it is built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheConfig:
    num_pages: int
    """Pages in the KV pool, page 0 included (it is reserved as the null page)."""
    page_size: int = 1
    """KV positions per page; a power of two. 1 behaves exactly as seed 000."""
    max_sequences: int = 256
    """Slots (rows) of the page table: how many sequences can hold pages at once."""
    block_size: int = 16
    """Positions per routing block: the unit of block hashes and KV events. A multiple of
    page_size, so that every block ends on a page boundary and one tree node owns it."""
    model_revision: str = ""
    """Identifies the weights; part of every block hash."""
    host_pages: int = 0
    """Pages of the host tier (evicted device pages are demoted there); 0 disables it."""

    def __post_init__(self) -> None:
        if self.num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {self.num_pages}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.max_sequences < 1:
            raise ValueError(f"max_sequences must be >= 1, got {self.max_sequences}")
        if self.host_pages < 0 or self.host_pages == 1:
            raise ValueError(
                f"host_pages must be 0 (no host tier) or >= 2 (page 0 is reserved), "
                f"got {self.host_pages}"
            )
        if self.block_size < 1 or self.block_size % self.page_size:
            raise ValueError(
                f"block_size must be a positive multiple of page_size ({self.page_size}), "
                f"got {self.block_size}"
            )
