"""The radix prefix cache over a paged KV pool, in pure Python.

Works on integers (token keys, page ids, block hashes), never on tensors; imports nothing of
ours and neither torch nor Ray, so the router can reuse its hashing and every test runs anywhere.
"""

from cache.config import CacheConfig
from cache.errors import (
    CacheError,
    IdentityMismatch,
    InvalidPageState,
    InvalidToken,
    LengthMismatch,
    LockUnderflow,
    OutOfPages,
    OutOfSlots,
    PageMappingError,
    SequenceError,
    UnknownTokenType,
)
from cache.events import BlockSetIndex, KvEvent, KvEventKind, KvEventPublisher, KvSnapshot
from cache.identity import IDENTITY_SCHEME_VERSION, BlockHasher, IdentityScheme
from cache.namespace import DEFAULT_NAMESPACE, CacheNamespace
from cache.page_pool import PagePool
from cache.page_table import PageTable
from cache.radix_cache import RadixCache
from cache.radix_node import InsertResult, MatchResult, Node
from cache.sequences import CachedSequence, PageCopy, SequenceCache
from cache.tokens import (
    CacheKey,
    CacheToken,
    CoordToken,
    ImageToken,
    Keys,
    SizeToken,
    TextToken,
    to_cache_keys,
)

__all__ = [
    "DEFAULT_NAMESPACE",
    "IDENTITY_SCHEME_VERSION",
    "BlockHasher",
    "BlockSetIndex",
    "CacheConfig",
    "CacheError",
    "CacheKey",
    "CacheNamespace",
    "CacheToken",
    "CachedSequence",
    "CoordToken",
    "IdentityMismatch",
    "IdentityScheme",
    "ImageToken",
    "InsertResult",
    "InvalidPageState",
    "InvalidToken",
    "Keys",
    "KvEvent",
    "KvEventKind",
    "KvEventPublisher",
    "KvSnapshot",
    "LengthMismatch",
    "LockUnderflow",
    "MatchResult",
    "Node",
    "OutOfPages",
    "OutOfSlots",
    "PageCopy",
    "PageMappingError",
    "PagePool",
    "PageTable",
    "RadixCache",
    "SequenceCache",
    "SequenceError",
    "SizeToken",
    "TextToken",
    "UnknownTokenType",
    "to_cache_keys",
]
