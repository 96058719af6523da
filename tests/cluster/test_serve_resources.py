"""`radixmesh serve` with actors its Ray cluster can never hold (workers over its CPUs, a
router pinned to a resource no node offers): on its own embedded cluster, which cannot grow,
one line naming the keys and exit 2, where it used to wait forever behind a spinner; on a
cluster of the user's (nodes may join), a line saying what it waits for
(tests/cluster/test_ray_cluster.py)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from cluster.ray_token import MODE_ENV, PATH_ENV, TOKEN_ENV
from worker.tiny_model import build_tiny_checkpoint

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


REFUSED = {
    "workers": (
        {"workers": {"count": 2, "cpus_per_worker": 4096}},  # more than any machine here
        r"radixmesh serve: 2 workers of 4096 CPUs \(workers\.count, workers\.cpus_per_worker\) "
        r"need 8192 CPUs; the Ray cluster has \d+: lower them, or serve on a Ray cluster with "
        r"more\n",  # Ray's count of CPUs may be a container's limit, not os.cpu_count()
    ),
    "router": (
        {"router": {"resource": "radixmesh-router"}},  # the chart's, on a laptop
        r"radixmesh serve: router.resource 'radixmesh-router': no node of the embedded Ray "
        r"cluster offers it; unset it, or serve on a Ray cluster whose head offers it\n",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(("change", "expected"), REFUSED.values(), ids=REFUSED.keys())
def test_actors_an_embedded_cluster_cannot_hold_are_refused_in_one_line(
    tmp_path: Path, change: dict[str, dict[str, object]], expected: str
) -> None:
    config: dict[str, dict[str, object]] = {
        "model": {"source": str(build_tiny_checkpoint(tmp_path / "tiny")), "device": "cpu"},
        "engine": {"num_pages": 64, "page_size": 4, "max_model_len": 128},
        "workers": {"count": 1},
        "router": {"port": free_port(), "http_port": None},
        "metrics": {"enabled": False},
    }
    for section, keys in change.items():
        config[section].update(keys)
    config_file = tmp_path / "radixmesh.yaml"
    config_file.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in (MODE_ENV, PATH_ENV, TOKEN_ENV)}
    env.pop("RAY_ADDRESS", None)
    tmpdir = Path(tempfile.mkdtemp(prefix="rm-", dir="/tmp"))  # short: Ray's unix sockets
    env.update(HOME=str(tmp_path), TMPDIR=str(tmpdir))
    serve = subprocess.Popen(
        [BIN / "radixmesh", "serve", "--config", str(config_file)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its embedded Ray goes with it if it hangs
    )  # fmt: skip
    try:
        stdout, stderr = serve.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait(timeout=60)
        raise AssertionError("serve waited for actors its cluster can never hold") from None
    finally:
        left = list(tmpdir.glob("radixmesh-ray-*"))
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert serve.returncode == 2, stderr[-3000:]
    assert stdout == ""
    assert re.search(expected, stderr), stderr[-3000:]
    assert "Traceback" not in stderr
    assert not left, "the embedded cluster's token outlived serve"
    deadline = time.monotonic() + 20
    while (alive := live_members(serve.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"processes of serve's session (its embedded Ray) outlived it: {alive}"


def live_members(group: int) -> list[str]:
    """The processes of process group `group` still running (zombies aside)."""
    found = []
    for process in psutil.process_iter(["name", "status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(process.pid) == group and process.info["status"] != "zombie":
                found.append(process.info["name"])
    return found
