"""worker/weight_quality.py: the threshold's edge, the refusal and what it names, no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from worker import weight_quality
from worker.weight_quality import (
    DEFAULT_CHECKPOINT,
    MAX_PERPLEXITY_INCREASE,
    MEASURED,
    FormatQuality,
    WeightFormatRefused,
    acceptable,
    check_format_quality,
)


def test_the_threshold_is_inclusive_and_nothing_past_it_passes() -> None:
    assert acceptable(0.0) and acceptable(-0.01)  # a format may even do better on one text
    assert acceptable(MAX_PERPLEXITY_INCREASE)
    assert not acceptable(MAX_PERPLEXITY_INCREASE + 1e-9)


def test_a_measured_format_past_the_threshold_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = {
        "bf16": FormatQuality(perplexity_increase=0.001, identical_token_share=0.99),
        "int4": FormatQuality(perplexity_increase=0.031, identical_token_share=0.6),
    }
    monkeypatch.setitem(MEASURED, "some-model", table)
    check_format_quality("some-model", "bf16")
    with pytest.raises(WeightFormatRefused) as refused:
        check_format_quality("some-model", "int4")
    message = str(refused.value)
    assert "'int4'" in message and "some-model" in message and "+3.1%" in message
    assert "float32, bf16" in message  # what the operator can choose instead
    assert isinstance(refused.value, ValueError)


def test_unmeasured_checkpoints_and_formats_pass() -> None:
    check_format_quality("a-checkpoint-nobody-measured", "int4")
    for fmt in ("float32", "bf16", "int8", "int4"):
        if fmt not in MEASURED[DEFAULT_CHECKPOINT]:
            check_format_quality(DEFAULT_CHECKPOINT, fmt)


def test_the_shipped_table_refuses_exactly_the_formats_past_the_threshold() -> None:
    for checkpoint, formats in MEASURED.items():
        for fmt, quality in formats.items():
            if acceptable(quality.perplexity_increase):
                check_format_quality(checkpoint, fmt)
            else:
                with pytest.raises(WeightFormatRefused):
                    check_format_quality(checkpoint, fmt)


def test_it_imports_no_torch() -> None:
    """The router process may validate a config with it, and must not import torch."""
    code = f"import sys; import {weight_quality.__name__}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_default_checkpoint_is_named_as_the_default_model_converts_it() -> None:
    from pathlib import Path

    from worker.default_model import GGUF_NAME

    assert Path(GGUF_NAME).stem == DEFAULT_CHECKPOINT


def test_a_cluster_config_with_a_refused_format_does_not_load(
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    from cluster.config import ClusterConfig, ConfigError

    table = {"int8": FormatQuality(perplexity_increase=0.05, identical_token_share=0.3)}
    monkeypatch.setitem(MEASURED, "my-model", table)
    path = tmp_path / "radixmesh.yaml"
    for source in ("/models/my-model", "/models/my-model/", "/models/my-model.gguf"):
        path.write_text(f"model: {{source: {source}, weights: int8}}\n")
        refused = r"model\.weights: weight format 'int8' on my-model: perplexity"
        with pytest.raises(ConfigError, match=refused):
            ClusterConfig.load(path)
        path.write_text(f"model: {{source: {source}, weights: bf16}}\n")
        assert ClusterConfig.load(path).model.weights == "bf16"
