"""The committed gRPC modules are exactly what the .proto files compile to."""

from __future__ import annotations

from pathlib import Path

from protos.generate import ROOT, generate


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "nothing was generated"
    for path in fresh:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed.name} is not committed: run `make protos`"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run `make protos` and commit the result"
        )
