"""`radixmesh serve` with workers its Ray cluster can never hold: on its own embedded cluster,
which cannot grow, one line naming the keys and exit 2, where it used to wait forever behind a
spinner; on a cluster of the user's (an autoscaler may add nodes), a line saying what it waits
for (tests/cluster/test_ray_cluster.py)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from cluster.ray_token import MODE_ENV, PATH_ENV, TOKEN_ENV
from worker.tiny_model import build_tiny_checkpoint

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_workers_an_embedded_cluster_cannot_hold_are_refused_in_one_line(tmp_path: Path) -> None:
    cpus = os.cpu_count() or 1
    config = {
        "model": {"source": str(build_tiny_checkpoint(tmp_path / "tiny")), "device": "cpu"},
        "engine": {"num_pages": 64, "page_size": 4, "max_model_len": 128},
        "workers": {"count": 2, "cpus_per_worker": cpus},  # twice what the machine has
        "router": {"port": free_port(), "http_port": None},
        "metrics": {"enabled": False},
    }
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
        raise AssertionError("serve waited for workers its cluster can never hold") from None
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    assert serve.returncode == 2, stderr[-3000:]
    assert stdout == ""
    expected = (
        f"radixmesh serve: 2 workers of {cpus} CPUs (workers.count, workers.cpus_per_worker) "
        f"need {2 * cpus} CPUs; the Ray cluster has {cpus}: lower them, or serve on a Ray "
        "cluster with more"
    )
    assert expected in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
