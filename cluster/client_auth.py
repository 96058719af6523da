"""How a client presents its bearer token: the `--token` flag, or else $RADIXMESH_TOKEN.

Every client command (`generate`, `chat`, `stats`, `loadtest`) takes the token this way, so a
token exported once serves them all.
"""

from __future__ import annotations

import argparse
import os

TOKEN_ENV = "RADIXMESH_TOKEN"


def add_token_argument(parser: argparse.ArgumentParser, note: str = "") -> None:
    """`--token`; `note` is added to its help (what the command needs the token for)."""
    help_text = f"bearer token (or ${TOKEN_ENV})" + (f"; {note}" if note else "")
    parser.add_argument("--token", default=None, help=help_text)


def token_or_env(token: str | None) -> str | None:
    """The token given, or else $RADIXMESH_TOKEN; None when neither is set (or both are empty)."""
    return token or os.environ.get(TOKEN_ENV) or None
