"""Shared inputs of the loading tests: a tiny model written as GGUF, SmolLM2 converted once.

`write_tiny_gguf` writes a tiny checkpoint the way llama.cpp's converter does (q/k rows permuted
for its rotary layout, matrices quantised, norms kept float32, the tokenizer as GPT-2 BPE
metadata), with the permutation written here from llama.cpp's formula rather than imported
from the code under test. `smollm2_dir` converts the real default model once per test session
into a private cache directory that is removed at exit.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from functools import cache
from pathlib import Path

import gguf
import numpy as np
import torch

from worker.config import ModelConfig
from worker.default_model import converted_dir, default_gguf_path
from worker.tiny_model import CHATML_TEMPLATE, TINY_CONFIG, tiny_state_dict, tiny_tokenizer_json

Q = gguf.GGMLQuantizationType
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: half-split rotary rows -> interleaved pairs."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def _tokenizer_metadata(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    model = json.loads(tiny_tokenizer_json(vocab_size))["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML_TEMPLATE)


def write_tiny_gguf(
    path: Path,
    qtype: Q = Q.Q8_0,
    config: ModelConfig = TINY_CONFIG,
    seed: int = 0,
    embed_qtype: Q | None = None,
    replace: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Write a llama GGUF of the tiny model; return the HF-named float32 weights a faithful
    reader must produce (each matrix quantised with `qtype` and dequantised, unpermuted).
    `embed_qtype` stores the embedding table in another type (SmolLM2's file: Q4_1 matrices, a
    Q8_0 table); `replace` swaps in HF-named tensors of its own (a misshapen one, say)."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_theta)
    _tokenizer_metadata(writer, config.vocab_size)
    expected: dict[str, torch.Tensor] = {}
    tensors = {**tiny_state_dict(config, seed), **(replace or {})}
    for name, tensor in tensors.items():
        array = tensor.numpy()
        if tensor.ndim == 1:
            writer.add_tensor(gguf_name(name), array)
            expected[name] = tensor
            continue
        if name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, config.num_heads)
        elif name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, config.num_kv_heads)
        stored = embed_qtype if name == "model.embed_tokens.weight" and embed_qtype else qtype
        packed = gguf.quants.quantize(array, stored)
        writer.add_tensor(gguf_name(name), packed, raw_dtype=stored)
        # What the reader must produce: the quantisation error, but in Hugging Face's row order.
        roundtrip = gguf.quants.dequantize(packed, stored).reshape(array.shape)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            roundtrip = np.ascontiguousarray(roundtrip)
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            inverse = llama_cpp_permute(np.arange(array.shape[0]), heads).argsort()
            roundtrip = roundtrip[inverse]
        expected[name] = torch.from_numpy(np.array(roundtrip, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@cache
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted by `converted_dir` into a session-private cache."""
    cache_dir = Path(tempfile.mkdtemp(prefix="radixmesh-test-cache-"))
    atexit.register(shutil.rmtree, cache_dir, True)
    return converted_dir(default_gguf_path(), cache_dir)
