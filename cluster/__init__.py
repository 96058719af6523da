"""Wiring: configuration, Ray bootstrap, the command line and the load-test harness.

Importing this package prepares the environment Ray reads when `ray` is imported (and that the
processes Ray starts inherit). A package's __init__ runs before any of its modules, so no import
order inside cluster/ can undo it:

- RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 unless set: Ray binds every network interface otherwise,
  even with node_ip_address=127.0.0.1.
- RAY_AUTH_MODE=token when joining a cluster (RAY_ADDRESS set) whose token is at hand
  (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) and no mode was chosen: a cluster
  started with `ray start` uses token authentication, and a driver sends the token only in that
  mode.
"""

import os
from pathlib import Path

from cluster.ray_token import MODE_ENV, PATH_ENV, TOKEN_ENV, default_token_path

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
if os.environ.get("RAY_ADDRESS") and MODE_ENV not in os.environ:
    token_file = Path(os.environ.get(PATH_ENV, default_token_path()))
    if os.environ.get(TOKEN_ENV) or token_file.is_file():
        os.environ[MODE_ENV] = "token"
