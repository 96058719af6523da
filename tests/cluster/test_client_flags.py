"""What every client command shares: the bearer token (or $RADIXMESH_TOKEN) and the TLS files,
refused with one line naming the flag when they cannot be read (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import main
from cluster.client import Client
from cluster.client_auth import token_or_env
from cluster.client_tls import ClientTls, TlsOptionsError


def test_the_token_flag_wins_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXMESH_TOKEN", "from-env")
    assert token_or_env("from-flag") == "from-flag"
    assert token_or_env(None) == token_or_env("") == "from-env"
    assert Client("127.0.0.1:1").token == "from-env"
    monkeypatch.delenv("RADIXMESH_TOKEN")
    assert token_or_env(None) is None
    assert Client("127.0.0.1:1").metadata == []


@pytest.mark.parametrize("command", ["stats", "generate", "chat", "loadtest"])
@pytest.mark.parametrize("flag", ["--tls-ca", "--tls-cert", "--tls-key"])
def test_an_unreadable_tls_file_is_named(
    command: str, flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    present = tmp_path / "present.pem"
    present.write_text("-----BEGIN CERTIFICATE-----\n")
    files = {"--tls-ca": present, "--tls-cert": present, "--tls-key": present}
    files[flag] = tmp_path / "missing.pem"
    argv = [command, "--target", "127.0.0.1:1"] + [str(x) for f, p in files.items() for x in (f, p)]
    if command == "generate":
        argv.append("hello")
    code = main(argv + (["--output-dir", str(tmp_path / "out")] if command == "loadtest" else []))
    err = capsys.readouterr().err
    assert code == 2
    assert f"{flag} {tmp_path / 'missing.pem'}: cannot be read" in err
    assert "Traceback" not in err and "cannot reach" not in err


def test_a_directory_is_not_a_certificate(tmp_path: Path) -> None:
    with pytest.raises(TlsOptionsError, match=r"--tls-ca .*: cannot be read"):
        ClientTls(tmp_path)
