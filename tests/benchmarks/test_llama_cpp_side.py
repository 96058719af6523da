"""benchmarks/llama_cpp_side.py: skipped in one line without llama-cpp-python; with it, the three
measures run on a tiny GGUF written the way llama.cpp writes them (no timings asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import llama_cpp_side
from benchmarks.prefill_bench import against_llama_cpp, parse_args


def test_smollm2_is_skipped_with_the_reason_before_anything_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what an absent module imports as
    result = against_llama_cpp("smollm2", parse_args(["--against", "llama.cpp"]))
    (reason,) = result.values()
    assert list(result) == ["skipped"]
    assert reason.startswith("llama-cpp-python is not installed") and "\n" not in reason


def test_the_measures_run_on_a_tiny_gguf(tmp_path: Path) -> None:
    if llama_cpp_side.unavailable() is not None:
        pytest.skip(llama_cpp_side.unavailable())
    from tests.worker.loading_fixtures import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    llm = llama_cpp_side.LlamaCpp(path, threads=1, n_ctx=256)
    prompt = list(range(10, 60))
    assert llm.cold_ttft(prompt) > 0
    first = llm.decode(prompt, 6)
    assert len(first["tokens"]) == 6 and first["tokens_per_s"] > 0
    assert llm.decode(prompt, 6)["tokens"] == first["tokens"]  # greedy, nothing carried over
    turns = [prompt[:20], prompt[:30], prompt[:20] + prompt[30:40]]
    assert len(llm.chat_ttfts(turns)) == 3
