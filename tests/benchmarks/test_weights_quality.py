"""The quality benchmark's parts on the tiny checkpoint: the held-in text, per-position
log-probabilities against transformers, agreement counting, and a smoke run (no timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.weights_quality import (
    HELD_IN,
    agreement,
    held_in_text,
    main,
    token_logprobs,
)
from worker.loader import load_model
from worker.tiny_model import build_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_the_held_in_text_is_the_file_without_its_header() -> None:
    text = held_in_text()
    raw = HELD_IN.read_text(encoding="utf-8")
    assert raw.startswith("#") and not text.startswith("#")
    assert "Provenance" in raw and "Provenance" not in text
    assert text.startswith("In Congress, July 4, 1776.")
    assert raw.endswith(text)
    assert len(text.split()) > 2500  # a few thousand tokens for any BPE vocabulary


def test_a_text_file_without_the_header_layout_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "text.txt"
    bad.write_text("# header\nno blank line after it\n")
    with pytest.raises(ValueError, match="blank line"):
        held_in_text(bad)


def test_logprobs_are_each_next_tokens_under_transformers(tiny_dir: Path) -> None:
    """Chunked prefill over the paged cache gives log p(t_i | t_<i) at every position: the
    same numbers as transformers' full-sequence forward, whatever the chunk size."""
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(3, 512, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    model = load_model(tiny_dir).model
    reference = transformers.LlamaForCausalLM.from_pretrained(tiny_dir).eval()
    with torch.no_grad():
        logits = reference(torch.tensor([ids])).logits[0, :-1].double()
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    for chunk in (7, 16, 128):
        got = token_logprobs(model, ids, chunk)
        assert got.shape == (len(ids) - 1,)
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)


def test_agreement_counts_the_first_divergence_and_identical_positions() -> None:
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [5, 0, 7, 0], [0, 9, 9, 9]]
    result = agreement(reference, other)
    assert result["first_divergence"] == [4, 1, 0]
    assert result["first_divergence_median"] == 1
    assert result["identical_prompts"] == 1
    assert result["identical_token_share"] == pytest.approx((1 + 0.5 + 0.75) / 3)


def test_smoke_run_on_the_tiny_checkpoint(tiny_dir: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = ["--source", str(tiny_dir), "--formats", "float32", "bf16", "int4"]
    argv += ["--max-text-tokens", "80", "--chunk", "32", "--prompts", "3", "--new-tokens", "5"]
    assert main([*argv, "--threads", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["text_tokens"] == 80 and result["prompts"] == 3
    rows = result["formats"]
    assert list(rows) == ["float32", "bf16", "int4"]
    reference = rows["float32"]
    assert reference["perplexity_increase"] == 0 and reference["identical_token_share"] == 1
    assert reference["first_divergence"] == [5, 5, 5] and reference["acceptable"]
    assert rows["int4"]["weight_mb"] < rows["bf16"]["weight_mb"] < reference["weight_mb"]
    for row in rows.values():
        assert row["perplexity"] > 1 and row["perplexity_increase_stderr"] >= 0
        limit = result["max_perplexity_increase"]
        assert row["acceptable"] == (row["perplexity_increase"] <= limit)


def test_the_reference_must_come_first(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="start with float32"):
        main(["--source", str(tiny_dir), "--formats", "int4", "float32"])
    with pytest.raises(ValueError, match="--formats"):
        main(["--source", str(tiny_dir), "--formats", "float32", "int3"])
