"""Wiring: configuration, Ray bootstrap, the command line and the load-test harness.

Importing this package sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 unless already set: Ray binds
every network interface otherwise, even with node_ip_address=127.0.0.1, and it reads the
variable when `ray` is imported (the processes Ray starts inherit it). A package's __init__ runs
before any of its modules, so no import order inside cluster/ can undo it.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
