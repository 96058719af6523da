"""The prefill benchmark's FLOP model and a smoke run on the tiny model (no timings asserted)."""

from __future__ import annotations

import itertools
import json

import pytest
from rich.console import Console

from benchmarks.prefill_bench import BIG, main, prefill_flops
from worker.tiny_model import TINY_CONFIG


def test_flop_model_counts_the_uncached_suffix() -> None:
    full = prefill_flops(BIG, 0, 1024)
    assert prefill_flops(BIG, 512, 1024) / full == pytest.approx(0.5, abs=0.05)
    assert prefill_flops(BIG, 993, 1024) / full < 0.05
    ratios = [prefill_flops(TINY_CONFIG, p, 200) for p in range(0, 200, 20)]
    assert ratios == sorted(ratios, reverse=True)


def test_smoke_run_reports_every_section(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["--models", "tiny", "--prompt-len", "64", "--decode-tokens", "6", "--repeats", "1"]
    assert main([*argv, "--decode-prompt-len", "8", "--fractions", "0.5", "0.9"]) == 0
    (result,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["models"]
    ttft = result["ttft"]
    assert [row["cached_tokens"] for row in ttft["cached"]] == [32, 48]  # whole 16-token pages
    assert all(0 < row["flop_ratio"] < 1 for row in ttft["cached"])
    decode = result["decode"]
    assert decode["new_tokens"] == 6 and decode["speedup"] > 0
    assert "transformers_generate" not in decode  # only for the real checkpoint
    assert "host_tier" not in result  # not in the default sections


def test_host_tier_section_serves_the_prompt_from_promoted_pages(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["--models", "tiny", "--prompt-len", "64", "--repeats", "2", "--sections", "host-tier"]
    assert main(argv) == 0
    (result,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["models"]
    assert "ttft" not in result and "decode" not in result
    host = result["host_tier"]
    # the whole prompt but its last position, from 4 pages of 16 demoted then promoted back
    assert host["device_cached_tokens"] == host["host_cached_tokens"] == 63
    assert host["demoted_pages"] == host["promoted_pages"] == [4, 4]
    assert host["host_hit_tokens"] == [63, 63]
    assert host["same_first_token"]
    assert len(host["ttft_ms"]["host"]) == 2 and host["host_hit_ratio"] > 0
    assert host["within_target"] == (host["host_hit_ratio"] <= host["target_ratio"])


def test_weights_axis_measures_each_format_in_turn(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["--models", "tiny", "--weights", "float32", "int8", "int4", "--repeats", "1"]
    argv += ["--sections", "cold", "decode", "--cold-lens", "16", "40", "--no-uncached"]
    assert main([*argv, "--decode-tokens", "4", "--decode-prompt-len", "8"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["models"]
    assert [r["weights"] for r in results] == ["float32", "int8", "int4"]
    sizes = [r["weight_mb"] for r in results]
    assert sizes == sorted(sizes, reverse=True)  # fewer bytes a weight, fewer bytes in all
    for result in results:
        assert list(result["cold"]["ttft_ms"]) == ["16", "40"]
        assert result["decode"]["new_tokens"] == 4 and "without_cache" not in result["decode"]
        assert "tokens" not in result["decode"]  # compared, then dropped from the output


def test_interleaved_chats_hit_their_own_history() -> None:
    """Each turn extends its own conversation's last prompt; the two share only the system
    prompt; the engine serves every later turn's history from the cache (whole pages)."""
    from benchmarks.prefill_bench import chat_turns, chats, parse_args
    from worker.tiny_model import tiny_model

    args = parse_args(["--chat-turns", "3", "--chat-system-tokens", "16"])
    args.chat_user_tokens, args.chat_reply_tokens = 10, 22
    turns = chat_turns(TINY_CONFIG.vocab_size, args)
    assert len(turns) == 6
    a, b = turns[0::2], turns[1::2]
    for chat in (a, b):
        for earlier, later in itertools.pairwise(chat):
            assert later[: len(earlier)] == earlier
            assert len(later) == len(earlier) + 22 + 10
    assert a[0][:16] == b[0][:16] and a[0][16:] != b[0][16:]
    result = chats(tiny_model(TINY_CONFIG, seed=0), turns)
    assert result["cached_tokens"][:2] == [0, 16]  # B1 finds the shared system prompt's page
    assert result["cached_tokens"][2:] == [16 * (len(t) // 16) for t in turns[:-2]]
    assert result["sum_ttft_s"] == pytest.approx(sum(result["ttft_ms"]) / 1000)


def test_against_llama_cpp_skips_in_one_line_without_it(
    capsys,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what an absent module imports as
    from benchmarks import llama_cpp_side

    assert "llama-cpp-python is not installed" in (llama_cpp_side.unavailable() or "")
    argv = ["--models", "tiny", "--sections", "cold", "--cold-lens", "16", "--repeats", "1"]
    assert main([*argv, "--against", "llama.cpp"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["llama_cpp"]["tiny"] == {"skipped": "tiny has no GGUF file (only smollm2 does)"}
    skipped = [line for line in captured.err.splitlines() if "skipped" in line]
    assert skipped == ["llama.cpp comparison skipped: tiny has no GGUF file (only smollm2 does)"]
    assert "against" not in out["models"][0]


def test_rounds_alternate_the_sides_round_by_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round measures decode and the cold TTFTs once on each side, the side going first
    alternating; llama.cpp's side stands in for llama-cpp-python (not a dependency:
    test_llama_cpp_side.py runs it where it is installed), answering with how many
    measurements it has seen."""
    from benchmarks import llama_cpp_side, prefill_bench

    order: list[str] = []

    def theirs(job: dict) -> dict:
        order.append("llama.cpp")
        assert job["decode"]["new_tokens"] == 3 and len(job["decode"]["prompt"]) == 8
        assert [len(p) for p in job["cold"]] == [16, 40] and job["repeats"] == 1
        n = 10.0 * len(order)
        return {"decode": {"tokens_per_s": n}, "cold": {"ttft_ms": {"16": n, "40": 2 * n}}}

    real = prefill_bench.decode_with_cache

    def ours(*args: object) -> dict:
        order.append("ours")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(llama_cpp_side, "measure_in_subprocess", theirs)
    monkeypatch.setattr(prefill_bench, "decode_with_cache", ours)
    argv = ["--rounds", "3", "--decode-tokens", "3", "--decode-prompt-len", "8"]
    argv += ["--sections", "decode", "cold", "--cold-lens", "16", "40"]
    with pytest.raises(SystemExit):  # rounds alternate with llama.cpp's side: without, refused
        prefill_bench.parse_args(argv)
    args = prefill_bench.parse_args([*argv, "--against", "llama.cpp"])
    mine = [{"weights": "int4", "vocab_size": TINY_CONFIG.vocab_size}]
    rounds = prefill_bench.alternated_rounds("tiny", mine, args)
    assert order == ["ours", "llama.cpp", "llama.cpp", "ours", "ours", "llama.cpp"]
    assert rounds["llama.cpp"]["decode"] == [20.0, 30.0, 60.0]
    assert rounds["llama.cpp"]["cold"] == {"16": [20.0, 30.0, 60.0], "40": [40.0, 60.0, 120.0]}
    assert len(rounds["int4"]["decode"]) == 3
    assert all(len(ms) == 3 and min(ms) > 0 for ms in rounds["int4"]["cold"].values())
    ratios = prefill_bench.rounds_ratios(rounds, "int4")
    assert list(ratios) == ["decode", "cold 16", "cold 40"]
    expected = [
        a / b for a, b in zip(rounds["int4"]["cold"]["40"], [40.0, 60.0, 120.0], strict=True)
    ]
    assert ratios["cold 40"]["ratios"] == expected
    for ratio in ratios.values():
        assert ratio["min"] <= ratio["median"] <= ratio["max"]
    result = {"weights": "int4", "weight_mb": 1.0, "rounds": rounds["int4"]}
    result["against"] = {"rounds": ratios}
    console = Console(record=True, width=200)
    console.print(prefill_bench.against_table([result], {"rounds": rounds["llama.cpp"]}))
    rows = [line for line in console.export_text().splitlines() if line.count("│") >= 3]
    lines = {line.split("│")[1].strip(): line for line in rows}
    decode = ratios["decode"]
    assert (
        f"{decode['median']:.2f}x, {decode['min']:.2f}-{decode['max']:.2f}"
        in lines["decode, 3 rounds alternated"]
    )
    assert "0.03 s" in lines["cold 16, 3 rounds alternated"]  # llama.cpp's median, 30 ms
