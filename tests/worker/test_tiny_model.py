"""worker.tiny_model: complete, loadable, deterministic tiny checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.checkpoint import load_checkpoint
from worker.config import ModelConfig
from worker.model_runner import Chunk, ModelRunner
from worker.tiny_model import (
    TINY_CONFIG,
    TINY_QWEN3_CONFIG,
    build_tiny_checkpoint,
    tiny_model,
    tiny_state_dict,
    tiny_tokenizer_json,
)
from worker.tokenizer import Tokenizer

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def _files(path: Path) -> dict[str, bytes]:
    return {file.name: file.read_bytes() for file in sorted(path.iterdir())}


@pytest.mark.parametrize("config", [TINY_CONFIG, TINY_QWEN3_CONFIG], ids=["llama", "qwen3"])
def test_checkpoint_loads_as_built(tmp_path: Path, config: ModelConfig) -> None:
    path = build_tiny_checkpoint(tmp_path, config, seed=11)
    assert sorted(p.name for p in path.iterdir()) == sorted(FILES)
    loaded_config, state = load_checkpoint(path)
    assert loaded_config == config
    expected = tiny_state_dict(config, seed=11)
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.vocab_size == config.vocab_size
    assert tokenizer.bos_token_id == config.bos_token_id
    assert tokenizer.eos_token_ids == config.eos_token_ids
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]).endswith(
        "<|im_start|>assistant\n"
    )


def test_qwen3_config_exercises_gqa_qk_norm_tying_and_scaling() -> None:
    config = TINY_QWEN3_CONFIG
    assert config.num_heads // config.num_kv_heads == 4
    assert config.qk_norm and config.tie_word_embeddings
    assert config.q_size != config.hidden_size
    assert config.rope_scaling.kind == "llama3"
    # Wavelengths 2*pi*theta^(2i/d): some below original/high (kept), some between (blended),
    # some above original/low (scaled), so all three llama3 branches run.
    scaling = config.rope_scaling
    dims = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
    wavelengths = 2 * torch.pi * config.rope_theta**dims
    low = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high = scaling.original_max_position_embeddings / scaling.high_freq_factor
    assert (wavelengths < high).any()
    assert ((wavelengths >= high) & (wavelengths <= low)).any()
    assert (wavelengths > low).any()


@pytest.mark.parametrize("config", [TINY_CONFIG, TINY_QWEN3_CONFIG], ids=["llama", "qwen3"])
def test_weights_are_scaled_like_a_real_init(config: ModelConfig) -> None:
    state = tiny_state_dict(config)
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    hidden = torch.randn(256, config.hidden_size, generator=torch.Generator().manual_seed(0))
    logits = hidden @ head.T  # what the head sees after the final RMSNorm (unit scale)
    assert 0.5 < logits.std().item() < 2.0
    up = state["model.layers.0.mlp.up_proj.weight"]
    assert abs(up.std().item() * up.shape[1] ** 0.5 - 1.0) < 0.1  # N(0, 1/fan_in)
    norm = state["model.layers.0.input_layernorm.weight"]
    assert abs(norm.mean().item() - 1.0) < 0.05 and norm.std().item() > 0.05


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path) -> None:
    first = _files(build_tiny_checkpoint(tmp_path / "a", seed=0))
    again = _files(build_tiny_checkpoint(tmp_path / "b", seed=0))
    other = _files(build_tiny_checkpoint(tmp_path / "c", seed=1))
    assert first == again
    assert other["model.safetensors"] != first["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in first.items() if k != "model.safetensors"
    }


def test_bytes_are_identical_in_a_fresh_process(tmp_path: Path) -> None:
    """No per-process state (hash seeds, Rust HashMap order in the BPE trainer) leaks into files."""
    code = (
        "import sys; from worker.tiny_model import build_tiny_checkpoint, TINY_QWEN3_CONFIG; "
        "build_tiny_checkpoint(sys.argv[1], TINY_QWEN3_CONFIG, seed=5)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "child")], check=True)
    here = build_tiny_checkpoint(tmp_path / "here", TINY_QWEN3_CONFIG, seed=5)
    assert _files(tmp_path / "child") == _files(here)


def test_tokenizer_training_is_deterministic_and_sized() -> None:
    trained = tiny_tokenizer_json.__wrapped__(512)
    assert trained == tiny_tokenizer_json.__wrapped__(512) == tiny_tokenizer_json(512)
    assert tiny_tokenizer_json(400) != trained  # a different size trains a different vocabulary
    with pytest.raises(ValueError, match=r"trains \d+ tokens, not the 200000"):
        tiny_tokenizer_json(200_000)


def test_configs_survive_config_json() -> None:
    for config in (TINY_CONFIG, TINY_QWEN3_CONFIG):
        assert ModelConfig.from_hf(config.to_hf()) == config


@pytest.mark.parametrize("config", [TINY_CONFIG, TINY_QWEN3_CONFIG], ids=["llama", "qwen3"])
def test_the_tiny_model_does_not_just_repeat_its_input(config: ModelConfig) -> None:
    model = tiny_model(config)
    runner = ModelRunner(model, num_pages=64, page_size=1)
    tokens = [5, 17, 99, 300]
    for _ in range(24):
        pages = list(range(1, len(tokens) + 1))
        tokens.append(int(runner.run([Chunk(tokens, 0, pages, True)])[0].argmax()))
    generated = tokens[4:]
    assert len(set(generated)) >= 6, generated
