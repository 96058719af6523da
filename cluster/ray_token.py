"""Ray's token authentication set up from nothing: the token file a cluster and its clients share.

Ray 2.60 turns token authentication on for `ray start` only when a token is already at hand
(`RAY_AUTH_TOKEN`, the file at `RAY_AUTH_TOKEN_PATH`, or `~/.ray/auth_token`); without one it
starts with authentication off. A driver sends the token only in `RAY_AUTH_MODE=token`. So
whoever starts a cluster creates the token file first and hands its path to every process of
the cluster, never counting on a token some earlier run left in the home directory.

Never logs or prints the token itself.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

PATH_ENV = "RAY_AUTH_TOKEN_PATH"
MODE_ENV = "RAY_AUTH_MODE"
TOKEN_BYTES = 32


def create_token_file(path: Path) -> Path:
    """The token file at `path`, created (owner-only, a fresh random token) if it is missing."""
    path = Path(path)
    if path.is_file() and path.read_text().strip():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(secrets.token_hex(TOKEN_BYTES))
    return path


def token_environment(path: Path) -> dict[str, str]:
    """What a process needs in its environment to start, or join, a cluster with this token."""
    return {PATH_ENV: str(path), MODE_ENV: "token"}
