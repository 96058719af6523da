"""The prefix cache on disk: written while serving and on drain, loaded at start.

A directory holds one safetensors file per tree node (its position keys and the K and V of its
pages, every layer) and `manifest.json`: what the cache was computed with (identity scheme
version, model revision, page size, block size, dtype, KV shape), then the nodes, parents
first, each with its namespace, its file and the file's XXH3-128 checksum.

    manifest.json                 {"format": 1, "identity": {...}, "nodes": [...]}
    <node name>.safetensors       keys [n] int64 (the uint64 keys' bits), k / v [layers, pages,
                                  page_size, kv_heads, head_dim]

A node's file name is a digest of its namespace, its parent's name and its keys, so a node that
did not change is not written again, and files that no manifest names are deleted. Loading
refuses a manifest computed with anything else, or malformed (one log line; the worker starts
cold), and drops a node whose file is missing, truncated or fails its checksum, with everything
below it: no KV is served that was not written for exactly that prefix of exactly that
namespace. A node goes back under its own namespace (tenant salt and adapter included), so a
reload cannot give one tenant's KV to another.

Disk use is bounded: the most recently used nodes are kept (a node only with its parent) until
the next would pass `max_bytes`.

While serving, the directory is also a disk tier: the store keeps a catalog of the nodes on
disk (their namespace and keys, a few bytes a position), and a prompt's saved nodes beyond what
the device and host tiers hold (`wanted`) are read back (`read`, on worker/disk_reads.py's
thread) and inserted (`attach_read`), so a prefix evicted from both tiers but saved earlier is
read back instead of recomputed. What is on disk is what the last save wrote.

Thread rules: `records` and `gather` run on the engine thread (or with the engine stopped);
`write_node` and `write_manifest` on any one thread at a time; `load` before the engine starts;
`wanted` and `attach_read` on the engine thread; `read` on any.
"""

from __future__ import annotations

import errno
import heapq
import json
import logging
import math
import os
import shutil
import struct
import threading
import time
from array import array
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy
import torch
from safetensors import safe_open
from safetensors.torch import save as save_tensors
from xxhash import xxh3_128_hexdigest

from cache import (
    IDENTITY_SCHEME_VERSION,
    CacheNamespace,
    Keys,
    Node,
)
from worker.kv_attach import attach_kv

if TYPE_CHECKING:
    from worker.disk_spill import DiskSpill
    from worker.engine import Engine

log = logging.getLogger(__name__)
FORMAT = 1
SALTED_FORMAT = 2
"""A manifest holding a salted node (vLLM's cache_salt): a release from before salts refuses
it whole, where it would have read the salted KV into the unsalted namespace."""
MANIFEST = "manifest.json"
DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
"""A write refused for want of room: the disk or the caller's quota is smaller than
`persist_max_bytes` says (the store then keeps what fits), or the file is over the process's
size limit (that node is left out): `KvStore._disk_full`."""
SUFFIX = ".safetensors"
_HEX_DIGITS = frozenset("0123456789abcdef")
_NAMESPACE_FIELDS = frozenset({"adapter", "tenant", "image_hash", "salt"})


@dataclass(frozen=True, slots=True)
class StoreIdentity:
    """What a saved cache was computed with; a load needs every field equal."""

    scheme_version: int
    model_revision: str
    page_size: int
    block_size: int
    dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, engine: Engine) -> StoreIdentity:
        k = engine.runner.kv[0][0]
        return cls(
            IDENTITY_SCHEME_VERSION,
            engine.config.model_revision,
            engine.config.page_size,
            engine.config.block_size,
            str(k.dtype).removeprefix("torch."),
            len(engine.runner.kv),
            k.shape[2],
            k.shape[3],
        )

    def differences(self, theirs: StoreIdentity) -> list[str]:
        """`field theirs (this worker: ours)` for each field that differs."""
        return [
            f"{k} {getattr(theirs, k)!r} (this worker: {getattr(self, k)!r})"
            for k in asdict(self)
            if getattr(theirs, k) != getattr(self, k)
        ]


@dataclass(slots=True)
class NodeRecord:
    name: str
    parent: str | None
    namespace: dict[str, Any]
    start: int
    positions: int
    last_access: int
    checksum: str = ""
    nbytes: int = 0
    blocks: tuple[int, ...] = ()
    """The routing blocks whose last position lies in the node (as the tree had them)."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    nodes: int
    positions: int
    dropped: int
    refused: str = ""
    """Why the whole directory was ignored ('' when it was read)."""
    seconds: float = 0.0
    on_disk: int = 0
    """Nodes kept on disk alone (listed, read back on demand): the tiers had no room."""


def _namespace_fields(ns: CacheNamespace) -> dict[str, Any]:
    image = None if ns.image_hash is None else format(ns.image_hash, "x")
    fields = {"adapter": ns.adapter, "tenant": ns.tenant, "image_hash": image}
    return fields if ns.salt is None else fields | {"salt": ns.salt}


def _namespace(fields: dict[str, Any]) -> CacheNamespace:
    image = fields.get("image_hash")
    image_hash = None if image is None else int(image, 16)
    adapter, tenant, salt = fields.get("adapter"), fields.get("tenant"), fields.get("salt")
    return CacheNamespace(adapter, tenant, image_hash, salt)


def _is_hex(value: object, most: int = 32) -> bool:
    """A str of 1 to `most` lowercase hex digits (as `format(n, "x")` writes them)."""
    return isinstance(value, str) and 0 < len(value) <= most and set(value) <= _HEX_DIGITS


def _is_digest(value: object) -> bool:
    """An XXH3-128 hex digest: a node's name, its checksum."""
    return isinstance(value, str) and len(value) == 32 and _is_hex(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _namespace_error(fields: object) -> str:
    """What is wrong with a manifest's namespace fields ('' when they make a namespace)."""
    if not isinstance(fields, dict) or not fields.keys() <= _NAMESPACE_FIELDS:
        return "is not an object of " + ", ".join(sorted(_NAMESPACE_FIELDS))
    image = fields.get("image_hash")
    if image is not None and not _is_hex(image):
        return f"has image_hash {image!r}, not 1-32 hex digits"
    try:
        _namespace(fields)
    except ValueError as err:  # InvalidToken: an adapter, tenant or salt that is not a str
        return str(err)
    return ""


def _record(index: int, fields: Any) -> NodeRecord:
    """Node `index` of a manifest, every field's type and value checked: a manifest edited
    or written by something else must not reach the engine's start or a save (a null nbytes
    made every later save raise). ValueError / TypeError naming the node and the field."""
    record = NodeRecord(**fields)  # TypeError: not an object, a field missing or unknown
    checks = {
        "name": _is_digest(record.name),
        "parent": record.parent is None or _is_digest(record.parent),
        "start": _is_count(record.start),
        "positions": _is_count(record.positions),
        "last_access": _is_count(record.last_access),
        "checksum": _is_digest(record.checksum),
        "nbytes": _is_count(record.nbytes),
        "blocks": isinstance(record.blocks, list) and all(map(_is_count, record.blocks)),
    }
    for field, fits in checks.items():
        if not fits:
            raise ValueError(f"node {index}: {field} {getattr(record, field)!r}")
    problem = _namespace_error(record.namespace)
    if problem:
        raise ValueError(f"node {index}: namespace {problem}")
    record.blocks = tuple(record.blocks)
    return record


def _node_name(parent: str | None, ns: dict[str, Any], node: Node) -> str:
    return _name_of(parent, ns, node.start, node.keys.tobytes())


def _name_of(parent: str | None, ns: dict[str, Any], start: int, keys: bytes) -> str:
    head = json.dumps([parent, ns, start], sort_keys=True).encode()
    return xxh3_128_hexdigest(head + keys)


_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
    "I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
    "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


def tensors_of(data: numpy.ndarray) -> dict[str, torch.Tensor]:
    """The tensors of safetensors file bytes `data`, as views of `data` (the format: an 8-byte
    little-endian header length, a JSON header of dtype, shape and data offsets per tensor,
    then the data). Written here because the library offers no view of a buffer already read:
    `safetensors.torch.load(bytes)` copies while it holds the GIL (23-27 ms for 47 MB, a stall
    of the engine thread), and `safe_open` maps the file, which a damaged disk or a truncation
    after the checksum turns into a SIGBUS of the worker."""
    if len(data) < 8:
        raise ValueError("shorter than a header")
    (length,) = struct.unpack_from("<Q", data.data)
    if not 0 < length <= len(data) - 8:
        raise ValueError("bad header length")
    header = json.loads(bytes(data[8 : 8 + length]))
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (first, end) = _DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
        count = math.prod(shape)
        if not 0 <= first <= end <= len(data) - 8 - length or end - first != count * dtype.itemsize:
            raise ValueError(f"{name}: bad offsets")
        at = 8 + length + first
        tensors[name] = torch.from_numpy(data[at : at + end - first]).view(dtype).view(shape)
    return tensors


@dataclass(frozen=True, slots=True)
class DiskNode:
    """A node the manifest lists, as the catalog keeps it."""

    name: str
    record: NodeRecord
    namespace: CacheNamespace
    keys: array[int]
    """The node's own keys (positions [record.start, record.start + record.positions))."""


class KvStore:
    """One worker's cache directory."""

    def __init__(self, directory: Path | str, max_bytes: int) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        """The bound on the files' bytes: `persist_max_bytes`, lowered to what the disk holds
        when it is found full (`_disk_full`)."""
        self.configured_max_bytes = max_bytes
        self.written: dict[str, tuple[str, int]] = {}
        """Node name -> (checksum, bytes) of the files this store knows are on disk."""
        self._keys: dict[str, bytes] = {}
        """Node name -> its keys, for the files this store wrote or read."""
        self._children: dict[object, dict[bytes, list[DiskNode]]] = {}
        """The catalog: a parent's name (or a namespace, for the first nodes) -> its listed
        children by their first page of keys (cut to `page_size` by `lookup`): usually one;
        two when the tree cut a saved node (an eviction's trim, a split) and saved the head
        anew while the whole one stays listed."""
        self._page = 1
        """Positions per page of what the catalog lists (from the identity saved or read)."""
        self.disk_hit_tokens = 0
        """Prompt positions read back from disk by `attach_read`."""
        self._listed: dict[str, NodeRecord] = {}
        """The records the current manifest lists, in its order."""
        self._bad: set[str] = set()
        """Nodes whose file failed a read while serving (until a save writes them anew)."""
        self.disk_blocks: frozenset[int] = frozenset()
        """The routing blocks of the nodes the manifest lists (replaced whole, like the
        catalog): what the worker's KV events say its disk holds."""
        self._spilled: dict[str, NodeRecord] = {}
        """Nodes eviction dropped that were written (worker/disk_spill.py) and not listed yet,
        in the order they were dropped."""
        self.full = False
        """A write found the disk full since the last manifest, which must be written to make
        room (it drops what the lowered bound leaves out)."""
        self.unwritable: set[str] = set()
        """Nodes no room could take (past the file size limit, larger than the disk), and
        those below them: never tried again."""
        self._kept_room = 0
        """The bytes of the write that last found the disk full and lowered the bound: room
        kept for one like it (0: no full disk lowered it)."""
        self._quota = False
        """A quota, not the disk, refused a write: the disk's free space says nothing."""

    # -- saving --------------------------------------------------------------------------------
    def records(self, engine: Engine) -> tuple[list[NodeRecord], dict[str, Node]]:
        """The tree as records, most recently used first, a node only after its parent, and
        the nodes by name (engine thread; walks the tree, copies nothing)."""
        records: list[NodeRecord] = []
        nodes: dict[str, Node] = {}
        frontier: list[tuple[int, int, Node, str | None, dict[str, Any]]] = []
        count = 0
        for namespace, root in engine.cache.tree.roots.items():
            ns = _namespace_fields(namespace)
            for child in root.children.values():
                count += 1
                heapq.heappush(frontier, (-child.last_access, count, child, None, ns))
        while frontier:
            _, _, node, parent, ns = heapq.heappop(frontier)
            name = _node_name(parent, ns, node)
            nodes[name] = node
            records.append(
                NodeRecord(
                    name, parent, ns, node.start, len(node.keys), node.last_access,
                    blocks=tuple(node.blocks),
                )
            )  # fmt: skip
            for child in node.children.values():
                count += 1
                heapq.heappush(frontier, (-child.last_access, count, child, name, ns))
        return records, nodes

    @staticmethod
    def gather(
        engine: Engine, node: Node, record: NodeRecord, first: int, end: int
    ) -> tuple[bytes, torch.Tensor, torch.Tensor] | None:
        """The keys of `node` and the K and V of its pages [first, end), on the CPU (engine
        thread); None if the node left the tree or changed shape since `record` named it (a
        demotion moves the pages, not what they hold: that is fine)."""
        if node.parent is None or (node.start, len(node.keys)) != (record.start, record.positions):
            return None
        k, v = engine.runner.read_pages(node.tier, node.pages[first:end])
        return node.keys.tobytes(), k, v

    def write_node(self, name: str, keys: bytes, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Write one node's file. False when the disk is full: nothing of it is left behind,
        the bound is lowered so that the next manifest makes room for it (`_disk_full`), and
        the caller stops writing until that manifest is written. A node that can never be
        written (past the file size limit, larger than the disk) is left out, once said, and
        True lets the caller go on with the next."""
        tensors = {
            "keys": torch.frombuffer(bytearray(keys), dtype=torch.int64),
            "k": k.contiguous(),
            "v": v.contiguous(),
        }
        data = save_tensors(tensors)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{name}{SUFFIX}"
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_bytes(data)
        except OSError as err:
            tmp.unlink(missing_ok=True)  # a partial file must not keep the room it took
            if err.errno not in DISK_FULL:
                raise
            return self._disk_full(name, len(data), err.errno)
        os.replace(tmp, path)
        self.written[name] = (xxh3_128_hexdigest(data), len(data))
        self._keys[name] = keys
        self._bad.discard(name)
        return True

    def _disk_full(self, name: str | None, wanted: int, errno_: int | None) -> bool:
        """A write of `wanted` bytes (of node `name`, or of the manifest: None) was refused
        for room (`errno_`, one of DISK_FULL). From now on keep at most what this store holds
        plus what is free, less those bytes and the next manifest's, so that the manifest
        drops the least recent nodes to make room for the newer one: the disk, not
        `persist_max_bytes`, is then the bound, lowered at each such write (and raised when
        room comes back: `regain_room`). Under a quota (EDQUOT) the disk may show room it will
        not give: the bound is then what this store holds, less those bytes. When even that
        is negative, others fill the disk for now: nothing is lowered. Returns False (stop
        writing until the manifest), or True for a node that can never fit (past the file
        size limit, larger than the disk): it is left out."""
        if name is not None and errno_ == errno.EFBIG:  # the file size limit: not the disk
            return self._never_fits(name, wanted, "is over the file size limit")
        if name is not None and wanted > shutil.disk_usage(self.directory).total:
            return self._never_fits(name, wanted, "is larger than the disk")
        bound = self._room(wanted)
        if errno_ == errno.EDQUOT:  # a quota: the disk's free space says nothing of it
            bound, self._quota = bound - shutil.disk_usage(self.directory).free, True
        if bound < 0:  # not even with all this store holds gone: others hold the room, for now
            self.full = True
            return False
        if bound < self.max_bytes:
            first = self.max_bytes == self.configured_max_bytes
            (log.warning if first else log.debug)(
                "the disk under %s is full (%s): keeping at most %.1f MB of KV there "
                "(persist_max_bytes: %.1f MB)",
                self.directory, os.strerror(errno_ or 0), bound / 1e6,
                self.configured_max_bytes / 1e6,
            )  # fmt: skip
            self.max_bytes, self._kept_room = bound, wanted
        self.full = True
        return False

    def _room(self, wanted: int) -> int:
        """The most the node files may hold with `wanted` bytes more written: what this store
        holds plus what the disk has free, less those bytes, the next manifest's and each
        file's partly empty last block."""
        block = os.statvfs(self.directory).f_frsize
        manifest = self.directory / MANIFEST
        listing = manifest.stat().st_size if manifest.exists() else 0
        reserve = wanted + listing + block * (len(self.written) + 2)
        return self.held_bytes() + shutil.disk_usage(self.directory).free - reserve

    def regain_room(self) -> None:
        """Raise a bound a full disk lowered as far as the disk now gives room again (another
        tenant freed it, the volume grew), keeping room for a node like the one that found it
        full, and never past `persist_max_bytes`; not under a quota, whose room the disk does
        not show. Called before each save."""
        if not self._kept_room or self._quota or self.max_bytes >= self.configured_max_bytes:
            return  # no full disk lowered it (or a quota did)
        bound = min(self._room(self._kept_room), self.configured_max_bytes)
        if bound > self.max_bytes:
            log.info(
                "the disk under %s has room again: keeping up to %.1f MB of KV there",
                self.directory, bound / 1e6,
            )  # fmt: skip
            self.max_bytes = bound

    def left_out(self, record: NodeRecord) -> bool:
        """Whether a save skips `record`: no room can take it, or its parent (records come
        parents first; a node below one never saved could never be listed)."""
        if record.parent is not None and record.parent in self.unwritable:
            self.unwritable.add(record.name)
        return record.name in self.unwritable

    def held_bytes(self) -> int:
        """Bytes of the node files this store has on disk (any thread)."""
        return sum(nbytes for _, nbytes in list(self.written.values()))  # a copy: atomic

    def _never_fits(self, name: str, wanted: int, why: str) -> bool:
        """Leave a node, and what is below it, out of every save from now on (True: the
        caller goes on)."""
        if not self.unwritable:
            log.warning(
                "a cached node of %.1f MB %s under %s: it is not saved (nor any like it)",
                wanted / 1e6, why, self.directory,
            )  # fmt: skip
        self.unwritable.add(name)
        return True

    def write_spilled(
        self, record: NodeRecord, keys: bytes, k: torch.Tensor, v: torch.Tensor
    ) -> bool:
        """Write a node eviction dropped, or an ancestor of it (worker/disk_spill.py); the next
        manifest lists it. As `write_node`: False, writing nothing, when the disk is full."""
        if not self.write_node(record.name, keys, k, v):
            return False
        if record.name in self.written:  # not a node no room can take
            self._spilled[record.name] = record
        return True

    def write_manifest(
        self, records: list[NodeRecord] | None, identity: StoreIdentity, room_first: bool = False
    ) -> int:
        """Name the written nodes (a node only with its parent, within `max_bytes`) in a new
        manifest, atomically; delete files it does not name. First the tree's (`records`, most
        recently used first; None: not walked, after spills), then the nodes eviction dropped
        and spilled since, most recently dropped first, then those the last manifest listed
        that the tree no longer holds, in their order: what both tiers evicted stays on disk
        until newer KV needs its bytes. A node whose parent comes later waits for it. Returns
        the nodes it lists.

        A disk too full for the manifest lowers the bound by its bytes, and the files the new
        one leaves out are deleted before it is written (`room_first`): the manifest on disk
        may then name a missing file for a moment, which a load drops as it would a damaged
        one."""
        tree = records if records is not None else []
        in_tree = {record.name for record in tree}
        spilled = [r for r in reversed(self._spilled.values()) if r.name not in in_tree]
        evicted = [r for name, r in self._listed.items() if name not in in_tree]
        kept = self._place([*tree, *spilled, *evicted])
        placed = {record["name"] for record in kept}
        self.directory.mkdir(parents=True, exist_ok=True)
        salted = any("salt" in record["namespace"] for record in kept)
        form = SALTED_FORMAT if salted else FORMAT
        manifest = {"format": form, "identity": asdict(identity), "nodes": kept}
        if room_first:
            self._delete_unplaced(placed)
        tmp = self.directory / f"{MANIFEST}.tmp"
        text = json.dumps(manifest)
        try:
            tmp.write_text(text)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            if err.errno not in DISK_FULL or room_first:
                raise
            self._disk_full(None, len(text), err.errno)
            return self.write_manifest(records, identity, room_first=True)
        os.replace(tmp, self.directory / MANIFEST)
        self._spilled = {}  # listed or left out: not before the manifest is in place
        self.full = False
        for path in self.directory.glob("*.tmp"):  # a write that failed midway
            path.unlink(missing_ok=True)
        self._delete_unplaced(placed)
        self._page = identity.page_size
        self._catalog([NodeRecord(**r) for r in kept])
        return len(kept)

    def _delete_unplaced(self, placed: set[str]) -> None:
        """Delete every node file but those of `placed`."""
        for path in self.directory.glob(f"*{SUFFIX}"):
            if path.stem not in placed:
                path.unlink(missing_ok=True)
                self.written.pop(path.stem, None)
                self._keys.pop(path.stem, None)

    def _place(self, candidates: list[NodeRecord]) -> list[dict[str, Any]]:
        """The written, unbroken `candidates` that fit `max_bytes` in this order of preference,
        each after its parent (one whose parent comes later is placed right after it; one whose
        parent is never placed is left out), as manifest entries."""
        kept: list[dict[str, Any]] = []
        placed: set[str] = set()
        waiting: dict[str, list[NodeRecord]] = {}
        total = 0
        for candidate in candidates:
            if candidate.parent is not None and candidate.parent not in placed:
                waiting.setdefault(candidate.parent, []).append(candidate)
                continue
            stack = [candidate]
            while stack:
                record = stack.pop()
                on_disk = self.written.get(record.name)
                if on_disk is None or record.name in placed or record.name in self._bad:
                    continue
                if total + on_disk[1] > self.max_bytes:
                    continue
                record.checksum, record.nbytes = on_disk
                total += on_disk[1]
                placed.add(record.name)
                kept.append(asdict(record))
                stack.extend(reversed(waiting.pop(record.name, [])))
        return kept

    def _catalog(self, records: list[NodeRecord]) -> None:
        """Rebuild the catalog from the manifest's records (parents first)."""
        children: dict[object, dict[bytes, list[DiskNode]]] = {}  # replaced whole: no lock
        for record in records:
            keys = self._keys.get(record.name)
            if keys is None:
                continue
            ns = _namespace(record.namespace)
            node = DiskNode(record.name, record, ns, array("Q", keys))
            parent: object = record.parent if record.parent is not None else ns
            children.setdefault(parent, {}).setdefault(keys[: 8 * self._page], []).append(node)
        self._children = children
        self._listed = {record.name: record for record in records}
        self.disk_blocks = frozenset(b for r in records if r.name in self._keys for b in r.blocks)

    def save(self, engine: Engine) -> int:
        """Everything at once, with the engine stopped (drain) or on its thread; returns the
        nodes saved."""
        self.regain_room()
        records, nodes = self.records(engine)
        identity = StoreIdentity.of(engine)
        dropped: set[str] = set()
        """Nodes a manifest of this save left out for room: not written again."""
        while True:
            wrote: list[str] = []
            full = False
            for record in records:
                if record.name in self.written or record.name in dropped:
                    continue
                if self.left_out(record):
                    continue
                node = nodes[record.name]
                got = self.gather(engine, node, record, 0, len(node.pages))
                assert got is not None
                if not self.write_node(record.name, *got):
                    full = True  # the disk is full: list what fits, which drops older nodes
                    break
                if record.name in self.written:
                    wrote.append(record.name)
            held = set(self.written)
            listed = self.write_manifest(records, identity)
            freed = held - self.written.keys()
            dropped |= freed
            # go on while the manifest keeps what was written (or, when nothing could be,
            # made room): the next nodes are less recent, and once one no longer displaces
            # anything, none after it will
            kept = any(name in self.written for name in wrote)
            if not full or not (kept or (not wrote and freed)):
                return listed

    # -- loading -------------------------------------------------------------------------------
    def load(self, engine: Engine) -> LoadReport:
        """Put the saved cache into `engine`'s cache (before it starts): most recently used
        nodes first, while the device and host tiers have room."""
        began = time.perf_counter()
        ours = StoreIdentity.of(engine)
        records = self._manifest(ours)
        if isinstance(records, LoadReport):
            return records
        cache = engine.cache
        room = cache.pool.usable_pages + (cache.host_pool.usable_pages if cache.host_pool else 0)
        ps = engine.config.page_size
        keys_of: dict[str, array[int]] = {}
        """The nodes put into the cache: their whole keys."""
        listed: set[str] = set()
        """Those and the ones kept on disk alone (no room, or a parent on disk alone)."""
        loaded = positions = dropped = 0
        for record in records:
            if record.parent is not None and record.parent not in listed:
                dropped += 1  # its parent was dropped: nothing below it may be served
                continue
            own: bytes | None = None
            fits = record.positions // ps <= room - positions // ps
            if fits and (record.parent is None or record.parent in keys_of):
                tensors = self._read(record, ps, ours)
                if tensors is None:
                    dropped += 1
                    continue
                own = tensors["keys"].numpy().tobytes()
                prefix = keys_of[record.parent] if record.parent is not None else array("Q")
                keys = prefix + array("Q", own)
                k, v = tensors["k"], tensors["v"]
                if attach_kv(engine, _namespace(record.namespace), prefix, keys, k, v):
                    keys_of[record.name] = keys
                    loaded += 1
                    positions += record.positions
            if own is None:  # on disk alone: its keys for the catalog; its KV checked when read
                own = self._peek_keys(record)
                if own is None:
                    dropped += 1
                    continue
            listed.add(record.name)
            self.written[record.name] = (record.checksum, record.nbytes)
            self._keys[record.name] = own
        self._page = ours.page_size
        self._catalog([r for r in records if r.name in listed])
        seconds = time.perf_counter() - began
        on_disk = len(listed) - loaded
        log.info(
            "loaded %d cached nodes (%d positions) from %s in %.2f s; %d kept on disk alone, "
            "%d dropped",
            loaded, positions, self.directory, seconds, on_disk, dropped,
        )  # fmt: skip
        return LoadReport(loaded, positions, dropped, seconds=seconds, on_disk=on_disk)

    def lookup(self, keys: array[int], namespace: CacheNamespace) -> list[tuple[DiskNode, int]]:
        """The saved nodes along `keys` from the root, each with where its use ends: its own
        end where `keys` holds all of it, else (the last) the end of the whole pages it
        shares with `keys` (a prefix of a node's KV is the KV of that prefix). Where two
        listed nodes start alike, the path that reaches furthest along `keys` counting what
        lies below each (the trimmed head's children may pass the whole node's end)."""
        children, ps, bad = self._children, self._page, self._bad
        # every listed node along `keys` (a whole match goes on into its children, a partial
        # one ends there), then the furthest end among them, fewest nodes on a tie
        Link = tuple[DiskNode, int, int, Any]  # node, its end, nodes up to it, the one above
        best: Link | None = None
        stack: list[tuple[object, int, Link | None]] = [(namespace, 0, None)]
        while stack:
            parent, at, above = stack.pop()
            depth = 1 if above is None else above[2] + 1
            for node in children.get(parent, {}).get(keys[at : at + ps].tobytes(), ()):
                if node.name in bad:
                    continue
                if keys[at : at + len(node.keys)] == node.keys:
                    end, full = at + len(node.keys), True
                else:
                    shared = ps  # the first page matched the catalog's key
                    while keys[at + shared : at + shared + ps] == node.keys[shared : shared + ps]:
                        shared += ps  # whole pages only; a short slice at either end differs
                    end, full = at + shared, False
                link = (node, end, depth, above)
                if best is None or (end, -depth) > (best[1], -best[2]):
                    best = link
                if full and end < len(keys):
                    stack.append((node.name, end, link))
        path: list[tuple[DiskNode, int]] = []
        while best is not None:
            path.append((best[0], best[1]))
            best = best[3]
        path.reverse()
        return path

    def wanted(
        self, engine: Engine, keys: Keys, namespace: CacheNamespace
    ) -> tuple[list[tuple[DiskNode, int]], int]:
        """The saved nodes that continue `keys` (a sample's cache keys) past what the tree
        holds in either tier, each with where its use ends (`lookup`), and how many positions
        of `keys` the tiers hold (engine thread): what a disk hit reads, and where its new
        positions begin."""
        if not self._children:
            return [], 0
        path = self.lookup(keys, namespace)
        if not path:
            return [], 0
        held = self.held(engine, keys, namespace)
        return [(node, end) for node, end in path if end > held], held

    @staticmethod
    def held(engine: Engine, keys: Keys, namespace: CacheNamespace) -> int:
        """Positions of `keys` the device and host tiers hold (engine thread)."""
        match = engine.cache.tree.match(keys, namespace)
        return match.length + match.host_length

    def read(self, record: NodeRecord, identity: StoreIdentity) -> dict[str, torch.Tensor] | None:
        """A saved node's tensors, checked (any thread: it touches only the node's file); None
        when the file is missing, damaged or does not fit (logged; the node is not looked up
        again, and the next save drops it)."""
        tensors = self._read(record, identity.page_size, identity)
        if tensors is None:
            self._bad.add(record.name)
        return tensors

    def attach_read(
        self,
        engine: Engine,
        keys: Keys,
        namespace: CacheNamespace,
        tensors: dict[str, dict[str, torch.Tensor] | None],
    ) -> int:
        """Insert the saved nodes along `keys` whose tensors were read (`tensors` by node
        name; None: the read failed), from the first one past what the tree holds now, up to
        the first that is missing or failed (engine thread). Returns the positions added."""
        have = self.held(engine, keys, namespace)
        read = 0
        prefix = array("Q")
        ps = engine.config.page_size
        for node, end in self.lookup(keys, namespace):
            if end > have:
                got = tensors.get(node.name)
                if got is None:
                    break
                pages = (end - node.record.start) // ps
                if pages < node.record.positions // ps:  # a prefix of the node's pages
                    got = {"k": got["k"][:, :pages], "v": got["v"][:, :pages]}
                if not attach_kv(engine, namespace, prefix, keys[:end], got["k"], got["v"]):
                    break
                read += end - max(node.record.start, have)
            prefix = keys[:end]
        self.disk_hit_tokens += read
        return read

    def _manifest(self, ours: StoreIdentity) -> list[NodeRecord] | LoadReport:
        """The manifest's records, or why none are loaded (none saved; refused)."""
        path = self.directory / MANIFEST
        if not path.exists():
            return LoadReport(0, 0, 0)
        try:
            manifest = json.loads(path.read_text())
            saved = StoreIdentity(**manifest["identity"])
            records = [_record(i, fields) for i, fields in enumerate(manifest["nodes"])]
        except (OSError, ValueError, TypeError, KeyError) as err:
            return self._refuse(f"its {MANIFEST} is unreadable ({err})")
        if manifest.get("format") not in (FORMAT, SALTED_FORMAT):
            read = f"{FORMAT} and {SALTED_FORMAT}"
            return self._refuse(f"format {manifest.get('format')!r}, this worker reads {read}")
        diffs = ours.differences(saved)
        if diffs:
            return self._refuse("it was saved with " + ", ".join(diffs))
        return records

    def _peek_keys(self, record: NodeRecord) -> bytes | None:
        """A saved node's keys, read without its KV (its checksum is checked when it is read);
        None when the file is missing, not of its listed size, unreadable or does not fit."""
        path = self.directory / f"{record.name}{SUFFIX}"
        try:
            if path.stat().st_size != record.nbytes:
                log.warning("dropping cached node %s: not of its listed size", record.name)
                return None
            with safe_open(str(path), "pt") as f:
                keys = f.get_tensor("keys")
        except Exception as err:  # OSError, and safetensors' own error types
            log.warning("dropping cached node %s: unreadable (%s)", record.name, err)
            return None
        if keys.dtype != torch.int64 or tuple(keys.shape) != (record.positions,):
            log.warning("dropping cached node %s: its keys do not fit", record.name)
            return None
        own = bytes(keys.numpy().tobytes())
        if _name_of(record.parent, record.namespace, record.start, own) != record.name:
            log.warning("dropping cached node %s: its keys are not the ones named", record.name)
            return None  # the name is a digest of the keys: a damaged key cannot be listed
        return own

    def _refuse(self, why: str) -> LoadReport:
        log.warning("not loading the KV cache in %s: %s; starting cold", self.directory, why)
        return LoadReport(0, 0, 0, refused=why)

    def _read(
        self, record: NodeRecord, ps: int, identity: StoreIdentity
    ) -> dict[str, torch.Tensor] | None:
        path = self.directory / f"{record.name}{SUFFIX}"
        try:
            with path.open("rb", buffering=0) as file:
                size = os.fstat(file.fileno()).st_size
                data = numpy.empty(size, dtype=numpy.uint8)  # not zeroed first, as bytearray is
                if file.readinto(data.data) != size:
                    raise OSError("shorter than its size")
        except OSError as err:
            log.warning("dropping cached node %s: %s", record.name, err)
            return None
        if xxh3_128_hexdigest(data.data) != record.checksum:
            log.warning("dropping cached node %s: its file fails its checksum", record.name)
            return None
        try:
            # views of the very bytes checksummed (no copy, no mapping of the file: nothing a
            # concurrent save or a damaged disk can change or fault under them afterwards)
            tensors = tensors_of(data)
        except (ValueError, KeyError, TypeError, RuntimeError) as err:
            log.warning("dropping cached node %s: unreadable (%s)", record.name, err)
            return None
        pages = record.positions // ps
        want = (identity.num_layers, pages, ps, identity.kv_heads, identity.head_dim)
        if (
            record.positions % ps
            or not {"keys", "k", "v"} <= tensors.keys()
            or tensors["keys"].dtype != torch.int64
            or tuple(tensors["keys"].shape) != (record.positions,)
            or any(tuple(tensors[t].shape) != want for t in ("k", "v"))
        ):
            log.warning("dropping cached node %s: its tensors do not fit", record.name)
            return None
        return tensors


class BackgroundSaver:
    """Saves the cache every `interval` seconds while the engine serves (`math.inf`: never;
    the drain saves): the tree walk and each copy of at most `max_bytes_per_call` of KV run on
    the engine thread between steps (`Engine.call`), the files are written here. With `spill`
    (worker/disk_spill.py) it also writes the nodes eviction drops as they come, and lists
    them in the manifest after each batch, then rests `list_interval` seconds or ten times what
    the manifest took, whichever is longer (a manifest of thousands of nodes takes tens of ms:
    listing then stays under a tenth of this thread's time)."""

    def __init__(
        self,
        engine: Engine,
        store: KvStore,
        interval: float,
        spill: DiskSpill | None = None,
        max_bytes_per_call: int = 4 << 20,
        list_interval: float = 0.05,
    ) -> None:
        self.engine, self.store, self.interval = engine, store, interval
        self.spill, self.list_interval = spill, list_interval
        self.pages_per_call = max(1, max_bytes_per_call // engine.runner.page_bytes)
        self.saves = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="radixmesh-kv-saver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.spill is not None:
            self.spill.wake()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        due = time.monotonic() + self.interval
        failing: str | None = None  # the last failure, told once until a pass succeeds
        while not self._stop.is_set():
            left = due - time.monotonic()
            try:
                if left <= 0:
                    due = time.monotonic() + self.interval
                    self.save_once()
                elif self.spill is None:
                    self._stop.wait(left)
                    continue
                elif not self.list_spills(min(left, 60.0)):
                    continue
            except Exception as err:  # a vanished disk, a stopped engine: keep serving
                if repr(err) != failing:
                    log.exception("background save of the KV cache failed")
                failing = repr(err)
                self._stop.wait(1.0)  # not a busy loop on a spill that fails at once
                continue
            if failing is not None:
                log.warning("background save of the KV cache works again")
                failing = None

    def list_spills(self, timeout: float) -> int:
        """Write the nodes eviction dropped (waiting up to `timeout` s for the first), list
        them, publish what that changed on disk, then rest; returns the nodes written."""
        assert self.spill is not None
        written = self.spill.write_queued(timeout)
        if written or self.store.full:  # a full disk: the manifest makes room
            engine = self.engine
            began = time.perf_counter()
            self.store.write_manifest(None, StoreIdentity.of(engine))
            took = time.perf_counter() - began
            engine.call(engine.publish_disk_blocks)  # the events go out on the engine thread
            self._stop.wait(max(self.list_interval, 10 * took))
        return written

    def save_once(self) -> int:
        """One pass: copy and write every node not on disk yet, then the manifest."""
        engine, store = self.engine, self.store
        store.regain_room()
        records, nodes = engine.call(lambda: store.records(engine)).result()
        for record in records:
            if self._stop.is_set():
                break
            if record.name in store.written or store.left_out(record):
                continue
            node = nodes[record.name]
            parts: list[tuple[bytes, torch.Tensor, torch.Tensor]] = []
            total = record.positions // engine.config.page_size
            for first in range(0, total, self.pages_per_call):
                end = min(first + self.pages_per_call, total)
                gather = partial(store.gather, engine, node, record, first, end)
                part = engine.call(gather).result()
                if part is None:  # it changed meanwhile: the next pass names it anew
                    break
                parts.append(part)
            else:
                k = torch.cat([p[1] for p in parts], dim=1)
                v = torch.cat([p[2] for p in parts], dim=1)
                if not store.write_node(record.name, parts[0][0], k, v):
                    break  # the disk is full: list what fits
        self.saves += 1
        listed = store.write_manifest(records, StoreIdentity.of(engine))
        engine.call(engine.publish_disk_blocks)  # the events go out on the engine thread
        return listed
