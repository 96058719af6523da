"""Two network namespaces joined by a veth pair: two "machines" on one host, for multi-node tests.

    with joined_namespaces() as (a, b):       # a.address 10.213.x.y+1, b.address 10.213.x.y+2
        subprocess.run(a.command(["ss", "-tlnp"]))
        b.kill_all()                          # every process whose network namespace is b

Each namespace holds only `lo` and its end of the veth (a /30 of 10.213.0.0/16 that exists only
inside the pair): a process started in one reaches the other's address and its own loopback, and
nothing else, nor does anything outside reach it. Both ends of the veth are created directly
inside their namespaces, never in the root one. The names carry this process's pid, so parallel
runs do not clash, and `remove_stale` deletes pairs whose creating process is gone (a run killed
with SIGKILL cannot clean up after itself).

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and `ip` from iproute2: `unavailable()` says why a
test must be skipped.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

PREFIX = "rmn"
"""Namespace and interface names: rmn<pid>-<n>a / rmn<pid>-<n>b (at most 15 characters, the
limit of an interface name)."""
NAME = re.compile(rf"^{PREFIX}(\d+)-(\d+[ab]|probe)$")
SUBNET = (10, 213)
_counter = itertools.count()


def _ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=timeout, check=check
    )


@dataclass(frozen=True)
class Namespace:
    name: str
    """The namespace's name, also the name of its end of the veth."""
    address: str
    """Its veth address (a /30 shared with its peer)."""

    def command(self, argv: Sequence[str | os.PathLike[str]]) -> list[str]:
        """`argv` run inside this namespace (the same filesystem, users and pids as the host)."""
        return ["ip", "netns", "exec", self.name, *map(str, argv)]

    def pids(self) -> list[int]:
        """Every live process whose network namespace is this one."""
        out = _ip("netns", "pids", self.name, check=False)
        return [int(p) for p in out.stdout.split()]

    def kill_all(self, timeout: float = 30) -> list[int]:
        """SIGKILL every process in the namespace until none is left (a dying parent may fork);
        the pids killed."""
        killed: list[int] = []
        deadline = time.monotonic() + timeout
        while pids := self.pids():
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {pids} in {self.name} survive SIGKILL")
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)
        return killed

    def listening(self) -> str:
        """`ss -tlnpH` inside the namespace: its listening TCP sockets and their processes."""
        return subprocess.run(
            self.command(["ss", "-tlnpH"]), capture_output=True, text=True, timeout=30, check=True
        ).stdout


def unavailable() -> str | None:
    """Why two joined namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None or shutil.which("ss") is None:
        return "iproute2 (ip, ss) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    added = _ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"ip netns add is refused here: {added.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _addresses(index: int) -> tuple[str, str]:
    block = index % (1 << 14)  # a /30 of the /16: 16384 of them
    third, fourth = divmod(block * 4, 256)
    base = f"{SUBNET[0]}.{SUBNET[1]}.{third}"
    return f"{base}.{fourth + 1}", f"{base}.{fourth + 2}"


def create_pair() -> tuple[Namespace, Namespace]:
    """Two new namespaces, each with `lo` and one end of a veth pair, both up and addressed."""
    pid, n = os.getpid(), next(_counter)
    first, second = _addresses(pid * 4 + n)
    a = Namespace(f"{PREFIX}{pid}-{n}a", first)
    b = Namespace(f"{PREFIX}{pid}-{n}b", second)
    try:
        for ns in (a, b):
            _ip("netns", "add", ns.name)
        _ip("link", "add", a.name, "netns", a.name, "type", "veth", "peer", "name", b.name,
            "netns", b.name)  # fmt: skip
        for ns in (a, b):
            _ip("-n", ns.name, "addr", "add", f"{ns.address}/30", "dev", ns.name)
            _ip("-n", ns.name, "link", "set", "lo", "up")
            _ip("-n", ns.name, "link", "set", ns.name, "up")
    except subprocess.CalledProcessError as err:
        remove(a, b)
        raise RuntimeError(f"{' '.join(err.cmd)}: {err.stderr.strip()}") from err
    return a, b


def remove(*namespaces: Namespace) -> None:
    """Kill every process in each namespace, then delete it (its veth end goes with it, and the
    peer end with that). Safe to call on namespaces that are partly made or already gone."""
    errors = []
    for ns in namespaces:
        try:
            ns.kill_all()
        except RuntimeError as err:
            errors.append(str(err))
        _ip("netns", "del", ns.name, check=False)
    left = set(_ip("netns", "list", check=False).stdout.split()) & {ns.name for ns in namespaces}
    if left or errors:
        raise RuntimeError(f"namespaces not removed: {sorted(left)} {errors}")


def remove_stale() -> list[str]:
    """Delete the pairs this module made in processes that no longer exist; their names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = NAME.match(name)
        if match is None or os.path.exists(f"/proc/{match.group(1)}"):
            continue
        with contextlib.suppress(RuntimeError):
            remove(Namespace(name, ""))
            removed.append(name)
    return removed


@contextlib.contextmanager
def joined_namespaces() -> Iterator[tuple[Namespace, Namespace]]:
    """Two joined namespaces, removed (every process in them killed first) on the way out, even
    when the body fails; at interpreter exit at the latest (an interrupted run)."""
    remove_stale()
    a, b = create_pair()

    def cleanup() -> None:
        remove(b, a)

    atexit.register(cleanup)
    try:
        yield a, b
    finally:
        atexit.unregister(cleanup)
        cleanup()
