"""The `radixmesh` command line. Subcommands arrive with the serving and load-test layers."""

from __future__ import annotations

import argparse
from importlib.metadata import version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixmesh",
        description="A cache-aware LLM serving cluster on Ray.",
    )
    parser.add_argument("--version", action="version", version=f"radixmesh {version('radixmesh')}")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
