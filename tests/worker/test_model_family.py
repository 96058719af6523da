"""Every architecture variant against transformers on the same tiny checkpoint written to disk.

Covers what SmolLM2 does not: Qwen3 (per-head QK-norm, tied head, llama3 RoPE), Qwen2 (q/k/v
bias), Mistral, linear and dynamic RoPE scaling. transformers reads our config.json and
safetensors, so this also proves the files we write are the standard format.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.worker.helpers import relative_error
from worker.config import ModelConfig, RopeScaling
from worker.loader import load_model
from worker.model_runner import Chunk, ModelRunner
from worker.tiny_model import TINY_CONFIG, TINY_QWEN3_CONFIG, build_tiny_checkpoint

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = {
    "llama": TINY_CONFIG,
    "qwen3-qknorm-llama3": TINY_QWEN3_CONFIG,
    "qwen2-bias": replace(TINY_CONFIG, architecture="qwen2", attention_bias=True),
    "mistral": replace(TINY_CONFIG, architecture="mistral"),
    "llama-linear-rope": replace(TINY_CONFIG, rope_scaling=RopeScaling("linear", 2.0)),
    "llama-dynamic-rope": replace(
        TINY_CONFIG,
        rope_scaling=RopeScaling("dynamic", 2.0, original_max_position_embeddings=1024),
    ),  # within the original context: unscaled, as in transformers
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(name: str, tmp_path: Path) -> None:
    config: ModelConfig = VARIANTS[name]
    path = build_tiny_checkpoint(tmp_path / name, config, seed=4)
    ours = load_model(path)
    assert ours.config.architecture == config.architecture
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    ids = torch.randint(3, config.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs.eval()(ids[None]).logits[0].float()
    runner = ModelRunner(ours.model, num_pages=len(ids) // 16 + 2, page_size=16)
    got = runner.run([Chunk(ids.tolist(), 0, list(range(1, len(ids) // 16 + 2)), True)])[0]
    assert relative_error(got, expected[-1]) < 1e-5


@pytest.mark.parametrize(
    ("scaling", "max_positions"),
    [
        (RopeScaling("linear", 4.0), 1024),
        (RopeScaling("llama3", 8.0, 1.0, 4.0, 256), 2048),
        (RopeScaling("dynamic", 2.0, original_max_position_embeddings=512), 2048),
        (RopeScaling("dynamic", 4.0, original_max_position_embeddings=2048), 2048),
    ],
    ids=["linear", "llama3", "dynamic-extended", "dynamic-within"],
)
def test_rope_frequencies_match_transformers(scaling: RopeScaling, max_positions: int) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from worker.rope import inv_frequencies

    config = replace(TINY_CONFIG, rope_scaling=scaling, max_position_embeddings=max_positions)
    hf_config = transformers.LlamaConfig(**config.to_hf())
    seq_len = None
    if scaling.kind == "dynamic":  # transformers: max_position_embeddings is the original context
        hf_config.max_position_embeddings = scaling.original_max_position_embeddings
        seq_len = max_positions
    expected, _ = ROPE_INIT_FUNCTIONS[scaling.kind](hf_config, "cpu", seq_len=seq_len)
    got = inv_frequencies(config.head_dim, config.rope_theta, scaling, max_positions)
    assert torch.allclose(got, expected.float(), rtol=1e-6)
