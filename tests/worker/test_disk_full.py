"""A disk smaller than `persist_max_bytes` says: the saves fill a real filesystem (a 256 KB
tmpfs in a mount namespace of the run's own, gone with it) and must keep what fits, newest
first, with nothing half-written or unlisted left to hold the room, so that the next engine
starts warm and later saves still land. tests/worker/disk_full_run.py is the run."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
MOUNT_AND_RUN = 'mount -t tmpfs -o size=256k radixmesh-full "$0" && exec "$@"'


@functools.cache
def unavailable() -> str | None:
    """Why a tmpfs cannot be mounted in a mount namespace here (None: it can)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return "needs unshare and mount (util-linux)"
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", MOUNT_AND_RUN, "/mnt", "true"],
        capture_output=True, text=True, check=False, timeout=30,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a mount namespace (root, CAP_SYS_ADMIN): {probe.stderr}"
    return None


def run_on_a_small_disk(tmp_path: Path) -> dict[str, Any]:
    root = tmp_path / "disk"
    root.mkdir()
    command = [sys.executable, "-m", "tests.worker.disk_full_run", str(root)]
    result = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", MOUNT_AND_RUN, str(root),
         *command],
        capture_output=True, text=True, check=False, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    seen: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    assert not any(root.iterdir()), "the tmpfs was mounted outside the run's namespace"
    return seen


def test_saves_to_a_full_disk_keep_what_fits_newest_first(tmp_path: Path) -> None:
    if why := unavailable():
        pytest.skip(why)
    seen = run_on_a_small_disk(tmp_path)
    assert seen["total"] == 256 * 1024
    # what the metrics say of it: the bytes held, under the bound the full disk set
    metrics = seen["first_metrics"]
    assert metrics["radixmesh_worker_disk_bytes"] == seen["first_file_bytes"]
    assert seen["first_file_bytes"] <= metrics["radixmesh_worker_disk_bytes_bound"] < 256 * 1024
    for save, worker in (("first", "w0"), ("second", "w0"), ("spills", "w1")):
        disk = seen[save]
        assert disk["listed"], f"the {save} save listed nothing"
        assert disk["files"] == disk["listed"], f"the {save} save left files it does not list"
        assert disk["free"] > 0
        (warning,) = disk["warnings"]  # once, however many writes found the disk full
        disk_dir = tmp_path / "disk" / worker
        assert f"the disk under {disk_dir} is full (No space left on device): keeping" in warning
    # both later engines start warm and answer the last prompt saved before them from disk,
    # as an engine that never saved answers it
    prompt_tokens = 48
    cold_first, cold_second = seen["cold_answers"]
    assert seen["second_loaded"] > 0 and seen["third_loaded"] > 0
    assert seen["second_answer"] == [cold_first, prompt_tokens - 1]
    assert seen["third_answer"] == [cold_second, prompt_tokens - 1]
    # what eviction wrote: the disk kept the most recently dropped, not the first
    first, _, last = seen["spills_cached"]
    assert first == 0 and last == prompt_tokens - 1
    # a disk full for a while (another tenant's file): nothing fits, then it all does, and no
    # node was given up for good on the way
    assert seen["while_full"] == 0 and seen["after_full"] > 0
    assert seen["after_full_unwritable"] == 0
    # the disk grows (remounted at 1 MB): the next save keeps more, under a higher bound
    (listed_before, bound_before), (listed_after, bound_after) = (
        seen["before_growing"], seen["after_growing"],
    )  # fmt: skip
    assert bound_before < 256 * 1024 < bound_after < 1024 * 1024, (bound_before, bound_after)
    assert listed_after > listed_before > 0


def test_a_node_over_the_file_size_limit_is_left_out_and_the_rest_saved(tmp_path: Path) -> None:
    """A process limit on file size (RLIMIT_FSIZE: a container's ulimit) refuses one node's
    file, not the disk: that node is left out, said once, and the others are saved and load."""
    command = [sys.executable, "-m", "tests.worker.disk_full_run", str(tmp_path), "100000"]
    result = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.splitlines()[-1])
    disk = seen["disk"]
    assert len(disk["listed"]) == 3 and disk["files"] == disk["listed"]
    (warning,) = disk["warnings"]
    assert "is over the file size limit" in warning and "it is not saved" in warning
    assert seen["cached"] == [47, 47, 47, 0]  # the short prompts from disk, the long one not
    assert seen["unwritable"] == 3, "the two nodes below the long one were tried too"
