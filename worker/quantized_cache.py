"""A converted GGUF's own quantized blocks, cached as safetensors beside its checkpoint directory.

A GGUF (the default model included) is served from the float32 checkpoint directory it was
converted into (worker/default_model.py). For a quantized weight format the linear layers should
instead be the file's own blocks (worker/gguf_quantized.py), not a requantization of their
dequantised values. Opening a GGUF costs seconds (gguf's reader parses the whole vocabulary:
7 s for SmolLM2 on a shared 2-core machine), so the repacked weights are written once into

    <checkpoint dir>/quantized/<format>.safetensors     N.q, N.scales, N.zeros per linear weight N

and read from there afterwards (docs/models.md has the load times both ways). The file's metadata
records the conversion it was built from; it lives inside the converted directory, which a
changed GGUF replaces wholesale, so it is invalidated with it. It sits in a subdirectory so that
the checkpoint's own weight files, and so its model revision, are unchanged. The format and group
size of each weight are read back from its tensors (q's dtype; in / scale columns).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from worker.checkpoint import CheckpointError
from worker.default_model import MARKER, conversion_source, exclusive
from worker.gguf_checkpoint import config_from_metadata, open_gguf, read_metadata
from worker.gguf_quantized import native_weights
from worker.quantized_weights import QUANTIZED, QuantizedWeight, WeightFormat

CACHE_DIR = "quantized"
CACHE_VERSION = "1"
"""Bumped whenever the cached layout changes, so old caches are rebuilt."""
PARTS = ("q", "scales", "zeros")


def cache_path(checkpoint_dir: Path, fmt: WeightFormat) -> Path:
    return Path(checkpoint_dir) / CACHE_DIR / f"{fmt}.safetensors"


def native_quantized(checkpoint_dir: Path, fmt: WeightFormat) -> dict[str, QuantizedWeight]:
    """The linear weights that `checkpoint_dir`'s source GGUF stores natively in `fmt`, repacked
    from its blocks (cached); {} for a float format or a directory not converted from a GGUF."""
    checkpoint_dir = Path(checkpoint_dir)
    if fmt not in QUANTIZED:
        return {}
    source = conversion_source(checkpoint_dir)
    if source is None:
        return {}
    identity = (checkpoint_dir / MARKER).read_text()
    path = cache_path(checkpoint_dir, fmt)
    cached = _read_if_current(path, identity)
    if cached is not None:
        return cached
    path.parent.mkdir(exist_ok=True)
    with exclusive(path.parent / f".{fmt}.lock"):
        cached = _read_if_current(path, identity)  # built by another process while we waited
        if cached is not None:
            return cached
        reader = open_gguf(source)
        config = config_from_metadata(read_metadata(reader), {t.name for t in reader.tensors})
        weights = native_weights(reader, config, fmt)
        save_quantized(path, weights, {"conversion": identity})
    return weights


def save_quantized(
    path: Path, weights: dict[str, QuantizedWeight], metadata: dict[str, str]
) -> None:
    """Write `weights` to `path` atomically (a temporary sibling renamed into place)."""
    tensors = {f"{name}.{part}": getattr(w, part) for name, w in weights.items() for part in PARTS}
    meta = {**metadata, "version": CACHE_VERSION, "names": json.dumps(sorted(weights))}
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        save_file(tensors, staging, metadata=meta)
        os.replace(staging, path)
    finally:
        Path(staging).unlink(missing_ok=True)


def load_quantized(path: Path) -> tuple[dict[str, QuantizedWeight], dict[str, str]]:
    """The weights and metadata `save_quantized` wrote; a damaged file is a `CheckpointError`."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            names = json.loads(metadata.get("names", "[]"))
            weights = {name: _weight(handle, name) for name in names}
    except (SafetensorError, OSError, json.JSONDecodeError, ValueError) as error:
        raise CheckpointError(f"{path} is not a readable quantized cache: {error}") from error
    return weights, metadata


def _weight(handle: object, name: str) -> QuantizedWeight:
    q, scales, zeros = (handle.get_tensor(f"{name}.{part}") for part in PARTS)  # type: ignore[attr-defined]
    fmt: WeightFormat = "int8" if q.dtype.is_signed else "int4"
    if scales.ndim != 2 or scales.shape[1] == 0 or q.shape[1] % scales.shape[1]:
        raise ValueError(f"{name}: scales {tuple(scales.shape)} do not group q {tuple(q.shape)}")
    return QuantizedWeight(fmt, q, scales, zeros, q.shape[1] // scales.shape[1])


def _read_if_current(path: Path, identity: str) -> dict[str, QuantizedWeight] | None:
    """The cached weights, or None when there are none or they were built from another
    conversion or cache version (then they are rebuilt); a damaged file is rebuilt too."""
    if not path.is_file():
        return None
    try:
        weights, metadata = load_quantized(path)
    except CheckpointError:
        return None
    current = metadata.get("conversion") == identity and metadata.get("version") == CACHE_VERSION
    return weights if current else None
