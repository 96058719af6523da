"""Write the config file that `radixmesh serve` reads in the head pod (the init container runs it).

    python render_config.py BASE OUT [--tokens TOKENS]

BASE is the chart's ConfigMap copy (no secrets in it). TOKENS, when given, is the `tokens.yaml` key
of a Secret: a YAML mapping of bearer token to tenant ("*": any tenant), merged into
security.auth_tokens, because radixmesh takes its tokens inline and a ConfigMap must not hold
them. OUT (on a memory-backed emptyDir) is written owner-read-only, then loaded with radixmesh's
own config loader: a config that `radixmesh serve` would refuse fails here, in this container's
log, before Ray places anything. Token values are never printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml


class RepeatedKey(yaml.YAMLError):
    pass


class UniqueKeys(yaml.SafeLoader):
    """safe_load's reading, but a key given twice in one mapping is an error: the last would
    silently win (a token given twice, bound to one tenant and then to every tenant)."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key_node.tag != "tag:yaml.org,2002:merge" and key in seen:
                raise RepeatedKey(f"line {key_node.start_mark.line + 1}: a key given twice")
            seen.add(key)
        return super().construct_mapping(node, deep)


def read_tokens(path: Path) -> dict[str, str]:
    try:
        tokens = yaml.load(path.read_text(), Loader=UniqueKeys)  # a SafeLoader
    except (OSError, yaml.YAMLError) as err:
        why = str(err) if isinstance(err, RepeatedKey) else type(err).__name__  # never a token
        raise SystemExit(f"{path}: cannot read the bearer tokens: {why}") from None
    if not isinstance(tokens, dict) or not tokens:
        raise SystemExit(f"{path}: expected a non-empty mapping of token to tenant")
    for token, tenant in tokens.items():
        if not isinstance(token, str) or not isinstance(tenant, str) or not token:
            raise SystemExit(
                f"{path}: every token and tenant must be a non-empty string (a tenant may be '*')"
            )
    return tokens


def render(base: Path, out: Path, tokens: Path | None) -> dict[str, Any]:
    config = yaml.load(base.read_text(), Loader=UniqueKeys) or {}  # a SafeLoader
    if tokens is not None:
        security = config.setdefault("security", {}) or {}
        security["auth_tokens"] = read_tokens(tokens)
        config["security"] = security
    out.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump(config, handle, sort_keys=False)
    return config


def check(out: Path) -> None:
    """Load OUT as `radixmesh serve --config OUT` will (skipped without radixmesh installed)."""
    try:
        from cluster.config import ClusterConfig, ConfigError  # noqa: PLC0415
    except ImportError:
        print("radixmesh is not importable here: the config was not checked", file=sys.stderr)
        return
    try:
        ClusterConfig.load(out)
    except ConfigError as err:
        raise SystemExit(f"radixmesh refuses the config: {err}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=Path, default=None)
    args = parser.parse_args(argv)
    config = render(args.base, args.out, args.tokens)
    check(args.out)
    tokens = len(config.get("security", {}).get("auth_tokens") or {})
    print(f"wrote {args.out} ({tokens} bearer token(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
