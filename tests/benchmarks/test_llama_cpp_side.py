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
    result = against_llama_cpp("smollm2", 49152, parse_args(["--against", "llama.cpp"]))
    (reason,) = result.values()
    assert list(result) == ["skipped"]
    assert reason.startswith("llama-cpp-python is not installed") and "\n" not in reason


def test_the_measures_run_on_a_tiny_gguf_in_a_process_of_their_own(tmp_path: Path) -> None:
    if llama_cpp_side.unavailable() is not None:
        pytest.skip(llama_cpp_side.unavailable())
    from tests.worker.loading_fixtures import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    prompt = list(range(10, 60))
    turns = [prompt[:20], prompt[:30], prompt[:20] + prompt[30:40]]
    job = {"gguf": str(path), "threads": 1, "n_ctx": 256, "repeats": 2}
    job |= {"cold": [prompt[:16], prompt], "decode": {"prompt": prompt, "new_tokens": 6}}
    result = llama_cpp_side.measure_in_subprocess({**job, "chats": turns})
    assert result["gguf"] == "tiny.gguf"
    assert list(result["cold"]["ttft_ms"]) == ["16", "50"]
    assert len(result["decode"]["tokens"]) == 6 and result["decode"]["tokens_per_s"] > 0
    assert len(result["chats"]["ttft_ms"]) == 3
    again = llama_cpp_side.measure_in_subprocess({**job, "cold": [prompt[:16]]})
    assert again["decode"]["tokens"] == result["decode"]["tokens"]  # greedy: the same tokens


def test_a_failed_measurement_names_the_failure(tmp_path: Path) -> None:
    if llama_cpp_side.unavailable() is not None:
        pytest.skip(llama_cpp_side.unavailable())
    job = {"gguf": str(tmp_path / "missing.gguf"), "threads": 1, "n_ctx": 64, "repeats": 1}
    with pytest.raises(RuntimeError, match=r"llama\.cpp measurement failed"):
        llama_cpp_side.measure_in_subprocess(job)
