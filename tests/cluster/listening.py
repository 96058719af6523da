"""What a process and every process under it listen on: the tests' check that radixmesh and the
Ray it starts or joins stay on loopback (Ray binds the machine's interfaces unless told not to)."""

from __future__ import annotations

import contextlib

import psutil

LOOPBACK = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})


def listening_addresses(*roots: int) -> set[str]:
    """The addresses the processes `roots`, and every process under them, listen on (TCP)."""
    found = set()
    for root in roots:
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile
            top = psutil.Process(root)
            for process in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    for connection in process.net_connections(kind="tcp"):
                        if connection.status == psutil.CONN_LISTEN:
                            found.add(connection.laddr.ip)
    return found
