"""Which checkpoint a benchmark's `--model` names: `tiny` (the built-in tiny checkpoint,
written to a fresh temporary directory), `default` (SmolLM2-135M-Instruct) or a path."""

from __future__ import annotations

import tempfile
from pathlib import Path

from worker.tiny_model import build_tiny_checkpoint


def model_source(name: str) -> str:
    """What `worker.loader.load_model` takes for `name`."""
    if name == "tiny":
        return str(build_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="radixmesh-tiny-"))))
    return name
