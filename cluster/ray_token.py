"""Ray's token authentication set up from nothing: the token file a cluster and its clients share.

Ray 2.60 turns token authentication on for `ray start` only when a token is already at hand
(`RAY_AUTH_TOKEN`, the file at `RAY_AUTH_TOKEN_PATH`, or `~/.ray/auth_token`); without one it
starts with authentication off. A driver sends the token only in `RAY_AUTH_MODE=token`. So
whoever starts a cluster creates the token file first and hands its path to every process of
the cluster, never counting on a token some earlier run left in the home directory.

An embedded cluster (`ray.init()` without an address) turns authentication on by itself and,
without a token, writes a new one to `~/.ray/auth_token` whatever `RAY_AUTH_TOKEN_PATH` says;
`embedded_cluster_token` gives it one first.

Never logs or prints the token itself.
"""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from pathlib import Path

PATH_ENV = "RAY_AUTH_TOKEN_PATH"
TOKEN_ENV = "RAY_AUTH_TOKEN"
MODE_ENV = "RAY_AUTH_MODE"
TOKEN_BYTES = 32


def default_token_path() -> Path:
    """Where Ray looks for a token when neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH is set."""
    return Path.home() / ".ray" / "auth_token"


def create_token_file(path: Path) -> Path:
    """The token file at `path`, created (owner-only, a fresh random token) if it is missing."""
    path = Path(path)
    if path.is_file() and path.read_text().strip():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # an empty file that was already there keeps no wider mode
    with os.fdopen(descriptor, "w") as out:
        out.write(secrets.token_hex(TOKEN_BYTES))
    return path


def token_environment(path: Path) -> dict[str, str]:
    """What a process needs in its environment to start, or join, a cluster with this token."""
    return {PATH_ENV: str(path), MODE_ENV: "token"}


def embedded_cluster_token() -> Path | None:
    """Make sure the embedded cluster this process is about to start has a token, and say where.

    The user's choice stands: none with RAY_AUTH_MODE other than token or with RAY_AUTH_TOKEN
    set; the file at RAY_AUTH_TOKEN_PATH (created if missing); an existing ~/.ray/auth_token.
    Otherwise a fresh token in a private temporary directory, removed when this process exits,
    is exported through RAY_AUTH_TOKEN_PATH to the cluster's processes.
    """
    if os.environ.get(MODE_ENV, "token") != "token" or os.environ.get(TOKEN_ENV):
        return None
    if os.environ.get(PATH_ENV):
        return create_token_file(Path(os.environ[PATH_ENV]))
    if default_token_path().is_file():
        return default_token_path()
    directory = tempfile.mkdtemp(prefix="radixmesh-ray-")
    atexit.register(shutil.rmtree, directory, True)
    path = create_token_file(Path(directory) / "auth_token")
    os.environ[PATH_ENV] = str(path)
    return path
