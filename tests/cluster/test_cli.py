"""The installed console script runs and reports the distribution's version."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path


def _script() -> str:
    found = shutil.which("radixmesh", path=str(Path(sys.executable).parent))
    assert found is not None, "the `radixmesh` console script is not installed beside python"
    return found


def test_console_script_prints_version() -> None:
    out = subprocess.run([_script(), "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"radixmesh {version('radixmesh')}"


def test_console_script_rejects_unknown_flag() -> None:
    out = subprocess.run(
        [_script(), "stats", "--no-such-flag"], check=False, capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "--no-such-flag" in out.stderr


def test_the_example_config_is_the_defaults() -> None:
    from cluster.config import ClusterConfig

    example = Path(__file__).resolve().parents[2] / "docs" / "radixmesh.example.yaml"
    assert ClusterConfig.load(example) == ClusterConfig()
