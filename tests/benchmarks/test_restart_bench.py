"""benchmarks/restart_bench.py on the tiny model: the restart really serves from the saved cache."""

from __future__ import annotations

import json

from benchmarks import restart_bench


def test_after_a_restart_the_turn_hits_as_much_as_a_warm_engine(capsys) -> None:  # type: ignore[no-untyped-def]
    code = restart_bench.main(
        ["--model", "tiny", "--prompt-len", "128", "--repeats", "1",
         "--cache-tokens", "4000", "--conversation", "512"]
    )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    cached = result["restart"]["cached_tokens"]
    assert cached["cold"] == 0
    assert cached["after restart"] == cached["warm"] == cached["from disk"] == 128
    saved = result["save_load"]
    assert saved["cached_tokens"] >= 3000 and saved["nodes"] > 1 and saved["bytes"] > 0
