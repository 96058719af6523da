"""Ray credentials made from nothing: token files, the embedded cluster's token, `make unit`'s HOME.

Nothing here may lean on what an earlier run left in the home directory (~/.ray/auth_token).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from cluster.cli import main as cli_main
from cluster.ray_token import (
    MODE_ENV,
    PATH_ENV,
    TOKEN_ENV,
    create_token_file,
    embedded_cluster_token,
    token_environment,
)
from tests.cluster.listening import LOOPBACK, listening_addresses
from worker.tiny_model import build_tiny_checkpoint

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]


def test_a_new_token_file_is_owner_only_and_random(tmp_path: Path) -> None:
    first = create_token_file(tmp_path / "a" / "token")
    second = create_token_file(tmp_path / "b" / "token")
    assert stat.S_IMODE(first.stat().st_mode) == 0o600
    token = first.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes, hex
    assert second.read_text() != token


def test_an_existing_token_is_kept_and_an_empty_file_is_filled(tmp_path: Path) -> None:
    path = create_token_file(tmp_path / "token")
    token = path.read_text()
    assert create_token_file(path).read_text() == token
    empty = tmp_path / "empty"
    empty.touch(mode=0o644)
    assert len(create_token_file(empty).read_text()) == 64
    assert stat.S_IMODE(empty.stat().st_mode) == 0o600


def test_token_environment_names_the_file_and_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "token"
    assert token_environment(path) == {PATH_ENV: str(path), MODE_ENV: "token"}


def test_the_ray_token_command_creates_the_file_and_prints_only_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ray" / "token"
    assert cli_main(["ray-token", str(path)]) == 0
    token = path.read_text()
    assert capsys.readouterr().out == f"{path}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert cli_main(["ray-token", str(path)]) == 0
    assert path.read_text() == token and token not in capsys.readouterr().out


def test_the_ray_token_command_names_a_path_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line and exit status 2, not a traceback: a parent that is a file, a file that is a
    directory, a file there that is not text."""
    (tmp_path / "plain").write_text("")
    (tmp_path / "binary").write_bytes(b"\xff\xfe")
    for path in (tmp_path / "plain" / "token", tmp_path, tmp_path / "binary"):
        assert cli_main(["ray-token", str(path)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and "Traceback" not in captured.err
        assert "radixmesh ray-token:" in captured.err and str(path) in captured.err


@pytest.fixture
def ray_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No Ray token configured, and an empty home directory."""
    for name in (MODE_ENV, PATH_ENV, TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def test_an_embedded_cluster_gets_a_private_token_when_none_is_configured(ray_env: Path) -> None:
    path = embedded_cluster_token()
    assert path is not None and os.environ[PATH_ENV] == str(path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(path.read_text()) == 64
        assert path.parent.name.startswith("radixmesh-ray-")
        assert not (ray_env / ".ray").exists()
    finally:
        shutil.rmtree(path.parent)


def test_an_embedded_cluster_keeps_the_users_token(
    ray_env: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    configured = tmp_path / "configured" / "token"
    monkeypatch.setenv(PATH_ENV, str(configured))
    assert embedded_cluster_token() == configured and configured.is_file()  # created there
    token = configured.read_text()
    assert embedded_cluster_token() == configured and configured.read_text() == token

    monkeypatch.delenv(PATH_ENV)
    home_token = create_token_file(ray_env / ".ray" / "auth_token")
    assert embedded_cluster_token() == home_token and PATH_ENV not in os.environ

    monkeypatch.setenv(TOKEN_ENV, "a-token-in-the-environment")
    assert embedded_cluster_token() is None and PATH_ENV not in os.environ
    monkeypatch.delenv(TOKEN_ENV)
    monkeypatch.setenv(MODE_ENV, "disabled")  # the user's choice; never ours
    assert embedded_cluster_token() is None and PATH_ENV not in os.environ


@pytest.mark.parametrize("kind", ["a directory", "not text"])
def test_serve_names_a_token_path_it_cannot_use_in_one_line(
    kind: str, ray_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`radixmesh serve` with RAY_AUTH_TOKEN_PATH a directory, or a file that is not UTF-8:
    one line naming it and exit 2, as `radixmesh ray-token` says, before Ray starts (it was
    a traceback from inside `connect`)."""
    import ray

    from cluster import serve

    path = tmp_path
    if kind == "not text":
        path = tmp_path / "token"
        path.write_bytes(b"\xff\xfe")
    monkeypatch.setenv(PATH_ENV, str(path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def no_ray(*_: object, **__: object) -> None:
        raise AssertionError("Ray started")

    monkeypatch.setattr(ray, "init", no_ray)
    assert serve.main(None) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"radixmesh serve: {PATH_ENV} {path}: "), err


PROBE = """
import os
from pathlib import Path

def test_records_home():
    home = Path.home()
    Path(os.environ["PROBE_REPORT"]).write_text(f"{home}\\n{sorted(os.listdir(home))}\\n")

def test_fails():
    assert False, "make must report this"
"""


@pytest.mark.slow
def test_make_unit_runs_pytest_in_a_new_empty_home_and_keeps_its_status(tmp_path: Path) -> None:
    """`make unit` (so `make test` and .ci/run) gives pytest a new, empty HOME, removes it after,
    and still fails when pytest fails."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(PROBE)
    report = tmp_path / "report"
    venv = Path(sys.prefix)
    # -o: the venv and helm are there already (this test runs in them); make must not rebuild them.
    command = [
        "make", "-s", "-C", str(ROOT), f"VENV={venv}", "-o", f"{venv}/.installed",
        "-o", f"{venv}/bin/helm", "unit", f"PYTEST_ARGS=-p no:cacheprovider -q {probe}",
    ]  # fmt: skip
    env = {**os.environ, "PROBE_REPORT": str(report)}
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert "1 failed, 1 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode != 0
    home, listing = report.read_text().splitlines()
    assert Path(home) != Path.home() and listing == "[]"
    assert not Path(home).exists(), "the temporary HOME was left behind"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_on_an_embedded_cluster_keeps_to_loopback_and_writes_no_token_to_home(
    tmp_path: Path,
) -> None:
    """Without a configured token, `radixmesh serve` gives its embedded cluster a private one
    (Ray would write ~/.ray/auth_token) and removes it on exit; a dead cluster's address left in
    Ray's temporary directory does not stop it from starting its own. Every socket it and the
    processes it started listen on is on loopback (Ray picks the machine's interface unless
    told not to)."""
    home = tmp_path / "home"
    home.mkdir()
    config = {
        "model": {"source": str(build_tiny_checkpoint(tmp_path / "tiny")), "device": "cpu"},
        "engine": {"num_pages": 64, "page_size": 4, "max_model_len": 128},
        "workers": {"count": 1},
        "router": {"port": free_port(), "http_port": 0},
        "metrics": {"enabled": False},
        "drain_timeout_s": 5,
    }
    config_file = tmp_path / "radixmesh.yaml"
    config_file.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in (MODE_ENV, PATH_ENV, TOKEN_ENV)}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)  # serve must keep Ray on loopback itself
    # A short private TMPDIR (Ray keeps its unix sockets there) holds Ray's files and our token.
    tmpdir = Path(tempfile.mkdtemp(prefix="rm-", dir="/tmp"))
    env.update(HOME=str(home), TMPDIR=str(tmpdir))
    # What a Ray head killed without `ray stop` leaves: the address of a cluster that is gone.
    (tmpdir / "ray").mkdir()
    (tmpdir / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}")
    try:
        serve = subprocess.Popen(
            [BIN / "radixmesh", "serve", "--config", str(config_file)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            line = serve.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith("radixmesh serving on"), serve.stderr.read()[-3000:]  # type: ignore[union-attr]
            tokens = list(tmpdir.glob("radixmesh-ray-*/auth_token"))
            assert len(tokens) == 1 and stat.S_IMODE(tokens[0].stat().st_mode) == 0o600
            assert not (home / ".ray").exists()
            listening = listening_addresses(serve.pid)
            time.sleep(3)  # and what opens a little later (Ray's agents)
            listening |= listening_addresses(serve.pid)
            assert listening and listening <= LOOPBACK, listening
        finally:
            serve.send_signal(signal.SIGTERM)
            try:
                code = serve.wait(timeout=120)
            except subprocess.TimeoutExpired:
                serve.kill()
                raise
        assert code == 0, serve.stderr.read()[-3000:]  # type: ignore[union-attr]
        assert not list(tmpdir.glob("radixmesh-ray-*")), "the token outlived serve"
        assert not (home / ".ray").exists()
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
