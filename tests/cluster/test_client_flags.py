"""What every client command shares: the bearer token (or $RADIXMESH_TOKEN) and the TLS files,
refused with one line naming the flag when they cannot be read (no server needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import int64, main
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


def test_a_json_schema_file_that_is_not_utf8_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not text: one line naming --json-schema, exit 2 (it was a UnicodeDecodeError traceback)."""
    schema = tmp_path / "schema.json"
    schema.write_bytes(b"\xff\xfe{}")
    argv = ["generate", "hi", "--target", "127.0.0.1:1", "--json-schema", str(schema)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--json-schema: 'utf-8' codec can't decode" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["generate", "chat"])
@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_outside_int64_is_refused_by_the_parser(
    command: str, seed: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The wire's seed is an int64: a larger one was a protobuf ValueError traceback."""
    argv = [command, "--target", "127.0.0.1:1", "--seed", str(seed)]
    with pytest.raises(SystemExit) as exit_:
        main(argv + (["hi"] if command == "generate" else []))
    assert exit_.value.code == 2
    assert f"--seed: {seed} does not fit in 64 bits" in capsys.readouterr().err
    assert int64(str(2**63 - 1)) == 2**63 - 1 and int64(str(-(2**63))) == -(2**63)


@pytest.mark.parametrize("flag", [["--raw"], ["--suffix", "end"]])
def test_system_with_raw_or_suffix_is_refused(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """--raw and --suffix complete the text as is, with no chat template: a --system message
    with them was silently dropped. Refused before any call, naming both flags."""
    argv = ["generate", "hi", "--target", "127.0.0.1:1", *flag, "--system", "Be terse."]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--system: not with {flag[0]}" in err and "UNAVAILABLE" not in err
