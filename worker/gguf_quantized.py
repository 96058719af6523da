"""GGUF Q4_0 / Q4_1 / Q8_0 tensors repacked straight from llama.cpp's blocks into `QuantizedWeight`.

A block holds 32 consecutive weights of a row (gguf.constants.GGML_QUANT_SIZES):

    Q4_0  d:f16 | 16 bytes of nibbles             w = d (q - 8)
    Q4_1  d:f16 | m:f16 | 16 bytes of nibbles     w = d q + m = d (q - 8) + (m + 8 d)
    Q8_0  d:f16 | 32 int8                         w = d q

Byte j of the nibbles holds element j in its low four bits and element j + 16 in its high four.
That is our canonical form with group 32 (worker/quantized_weights.py): Q4_0 -> int4, scales d,
zeros 0; Q4_1 -> int4, scales d, zeros m + 8 d; Q8_0 -> int8, scales d, zeros 0. The values are
taken from the bytes as they are (numpy over all blocks at once, no loop, no float matrix on the
way), so `dequantize(repack(t))` equals `gguf.quants.dequantize(t)`: exactly for Q4_0 and Q8_0,
and for Q4_1 up to float32 rounding of the folded zero (m + 8 d). Any other tensor type has no
native form here: the reader dequantises it and the loader quantizes it (worker/weight_formats.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from worker.checkpoint import validate_state_dict
from worker.config import ModelConfig
from worker.gguf_checkpoint import (
    GGUFError,
    config_from_metadata,
    dequantised_tensors,
    hf_name,
    open_gguf,
    read_metadata,
    rotary_heads,
    unpermute_rotary_rows,
)
from worker.quantized_weights import QUANTIZED, QuantizedWeight, WeightFormat

Q = gguf.GGMLQuantizationType
NATIVE_FORMAT: dict[Q, WeightFormat] = {Q.Q4_0: "int4", Q.Q4_1: "int4", Q.Q8_0: "int8"}
"""The GGUF block types whose values are our quantized form as stored."""
BLOCK = 32


def native_format(qtype: Q) -> WeightFormat | None:
    """The weight format a GGUF tensor type repacks into without a float detour, or None."""
    return NATIVE_FORMAT.get(qtype)


def repack_blocks(name: str, data: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> QuantizedWeight:
    """`data`, the raw blocks of an [out, in] matrix of type `qtype`, as a `QuantizedWeight`.

    Refuses, naming `name`: a type with no native form, a shape that is not a matrix of whole
    blocks, a byte count other than the shape needs, and non-finite block scales or minimums."""
    if qtype not in NATIVE_FORMAT:
        raise GGUFError(f"tensor {name} is {qtype.name}, not one of Q4_0 / Q4_1 / Q8_0")
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if len(shape) != 2 or shape[1] % block_size:
        raise GGUFError(
            f"tensor {name} of shape {tuple(shape)} is not a matrix of whole {qtype.name} blocks "
            f"of {block_size}"
        )
    rows, cols = int(shape[0]), int(shape[1])
    needed = rows * (cols // block_size) * block_bytes
    raw = np.asarray(data)
    if raw.dtype != np.uint8 or raw.size != needed:
        raise GGUFError(
            f"tensor {name}: {qtype.name} [{rows}, {cols}] takes {needed} bytes, the file holds "
            f"{raw.size * raw.itemsize} (truncated or misshapen)"
        )
    blocks = raw.reshape(rows, cols // block_size, block_bytes)
    d = _f16(blocks, 0)
    if qtype == Q.Q8_0:
        q = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows, cols))
        return _checked(name, QuantizedWeight("int8", q, d, torch.zeros_like(d), block_size))
    nibbles = blocks[..., 4:] if qtype == Q.Q4_1 else blocks[..., 2:]
    values = np.concatenate([nibbles & np.uint8(0x0F), nibbles >> np.uint8(4)], axis=-1)
    q = torch.from_numpy(values.reshape(rows, cols))
    zeros = _f16(blocks, 2) + 8 * d if qtype == Q.Q4_1 else torch.zeros_like(d)
    return _checked(name, QuantizedWeight("int4", q, d, zeros, block_size))


def repack(reader_tensor: Any) -> QuantizedWeight:
    """A `gguf.ReaderTensor` of type Q4_0 / Q4_1 / Q8_0 as a `QuantizedWeight` in torch's row
    order (GGUF lists dimensions fastest first)."""
    shape = tuple(int(n) for n in reversed(reader_tensor.shape))
    return repack_blocks(reader_tensor.name, reader_tensor.data, reader_tensor.tensor_type, shape)


def _f16(blocks: np.ndarray, at: int) -> torch.Tensor:
    """The float16 stored at byte `at` of every block, as float32 [rows, blocks]."""
    halves = np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0]
    return torch.from_numpy(halves.astype(np.float32))


def _checked(name: str, weight: QuantizedWeight) -> QuantizedWeight:
    if not (torch.isfinite(weight.scales).all() and torch.isfinite(weight.zeros).all()):
        raise GGUFError(f"tensor {name} has non-finite block scales or minimums")
    return weight


def permute_rows(weight: QuantizedWeight, order: torch.Tensor) -> QuantizedWeight:
    """`weight` with its rows (values, scales and zeros together: a row is whole) reordered."""
    return QuantizedWeight(
        weight.format,
        weight.q[order].contiguous(),
        weight.scales[order].contiguous(),
        weight.zeros[order].contiguous(),
        weight.group_size,
    )


EMBED = "model.embed_tokens.weight"


@dataclass
class GGUFWeights:
    """A GGUF's weights for one weight format: the linear layers it stores natively in that format
    as `QuantizedWeight`s, everything else dequantised to float32, by Hugging Face name. A tied
    head whose table is stored natively is `model.embed_tokens.weight` in `quantized` (the head's
    weight; worker/weight_formats.py's convention) and also, float, in `state_dict` (the table:
    embeddings are looked up, not multiplied)."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    quantized: dict[str, QuantizedWeight]


def is_linear(name: str) -> bool:
    """A matrix the model multiplies by (a projection or the output head), by Hugging Face name."""
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def native_weights(
    reader: Any, config: ModelConfig, fmt: WeightFormat
) -> dict[str, QuantizedWeight]:
    """Every linear weight of an open GGUF (a tied head's table included) whose block type is
    `fmt` natively, repacked and, for q / k, unpermuted like the float weights (values, scales
    and zeros together: rows move whole)."""
    if fmt not in QUANTIZED:
        return {}
    found: dict[str, QuantizedWeight] = {}
    for reader_tensor in reader.tensors:
        name = hf_name(reader_tensor.name)
        head = is_linear(name) or (name == EMBED and config.tie_word_embeddings)
        if not head or native_format(reader_tensor.tensor_type) != fmt:
            continue
        weight = repack(reader_tensor)
        heads = rotary_heads(reader_tensor.name, config)
        if heads is not None:
            rows = unpermute_rotary_rows(torch.arange(weight.shape[0]), heads)
            weight = permute_rows(weight, rows)
        found[name] = weight
    return found


def read_gguf_weights(path: Path, fmt: WeightFormat) -> GGUFWeights:
    """A llama GGUF's weights for `fmt` ("int4" / "int8": the natively stored linears repacked;
    "float32" / "bf16": all dequantised, as `read_gguf` does). Every tensor is checked by name and
    shape against the config its metadata describes, the quantized ones included."""
    reader = open_gguf(path)
    config = config_from_metadata(read_metadata(reader), {t.name for t in reader.tensors})
    quantized = native_weights(reader, config, fmt)
    state = dequantised_tensors(reader, config, skip=frozenset(quantized) - {EMBED})
    stand_ins = {
        name: torch.empty(weight.shape, device="meta")
        for name, weight in quantized.items()
        if name != EMBED
    }
    validate_state_dict(config, {**stand_ins, **state}, source=str(path))
    return GGUFWeights(config, state, quantized)
