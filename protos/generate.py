"""Compile the .proto files into Python modules (`make protos`; a test checks they are fresh).

Run from anywhere: `python protos/generate.py [--out DIR]`. The repository root is the include
path, so generated modules import each other as `protos.radixmesh.v1.*`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "protos" / "radixmesh" / "v1").glob("*.proto"))


def generate(out: Path) -> list[Path]:
    """Compile every .proto into `out` (mirroring protos/radixmesh/v1); returns the files."""
    include = str(Path(protoc.__file__).parent / "_proto")
    for source in SOURCES:
        args = [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"-I{include}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(source.relative_to(ROOT)),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {source}")
    return sorted((out / "protos" / "radixmesh" / "v1").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="root to write protos/... under")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
