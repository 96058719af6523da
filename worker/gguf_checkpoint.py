"""GGUF files (llama.cpp's format) read into what a Hugging Face checkpoint directory holds.

`read_gguf` dequantises every tensor to float32 with the `gguf` library, renames llama.cpp's
tensors to Hugging Face Llama names, undoes the row permutation llama.cpp's converter applies to
`attn_q` / `attn_k`, builds the `ModelConfig` from the metadata and a `tokenizers` tokenizer from
the vocabulary, merges and pre-tokenizer name stored in the file. `GGUFCheckpoint.save` writes it
all as a checkpoint directory. Only the `llama` architecture with a GPT-2 byte-level BPE tokenizer
is read; anything else is a `GGUFError` that names what is missing, never a silent guess.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from worker.checkpoint import CheckpointError, save_checkpoint, validate_state_dict
from worker.config import ModelConfig, RopeScaling

SUPPORTED_ARCHITECTURES = ("llama",)
CONTROL, USER_DEFINED = 3, 4
"""`tokenizer.ggml.token_type` values of special tokens and of plain added tokens."""

GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    # llama.cpp's `tokenizer.ggml.pre` -> the regexes it splits text with, in order
    # (llama-vocab.cpp).
    **dict.fromkeys(("default", "gpt2", "gpt-2", "mpt", "olmo"), (GPT2_SPLIT,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell"), (r"\p{N}", GPT2_SPLIT)
    ),
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe"), (LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (QWEN2_SPLIT,)),
}


class GGUFError(CheckpointError):
    """A GGUF file this loader cannot read faithfully; the message names the key or tensor."""


def _field_value(reader_field: Any) -> Any:
    """A metadata value as Python: int, float, bool, str, or a list of those."""
    types = list(reader_field.types)
    parts = [reader_field.parts[i] for i in reader_field.data]
    kind = types[-1]
    if kind == gguf.GGUFValueType.STRING:
        values: list[Any] = [bytes(part).decode("utf-8") for part in parts]
    else:
        values = [part.tolist()[0] for part in parts]
        if kind == gguf.GGUFValueType.BOOL:
            values = [bool(v) for v in values]
    return values if types[0] == gguf.GGUFValueType.ARRAY else values[0]


def read_metadata(reader: Any) -> dict[str, Any]:
    """Every metadata key of an open `gguf.GGUFReader`, except the tensor-layout header keys."""
    return {
        key: _field_value(value)
        for key, value in reader.fields.items()
        if not key.startswith("GGUF.")
    }


def _float32_decimal(value: float) -> float:
    """1e-5 stored as float32 reads back as 9.99999974e-06; return the 1e-05 it was written from."""
    return float(str(np.float32(value)))


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFError(f"GGUF metadata lacks {key!r}")
    return meta[key]


def _special_id(meta: dict[str, Any], key: str) -> int | None:
    """`tokenizer.ggml.<key>_token_id`, checked against the vocabulary; None when absent."""
    name = f"tokenizer.ggml.{key}_token_id"
    if name not in meta:
        return None
    vocab_size = len(_require(meta, "tokenizer.ggml.tokens"))
    token_id = int(meta[name])
    if not 0 <= token_id < vocab_size:
        raise GGUFError(f"{name} {token_id} is outside the vocabulary [0, {vocab_size})")
    return token_id


def _rope_scaling(meta: dict[str, Any], arch: str, max_positions: int) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return RopeScaling()
    if kind != "linear":
        raise GGUFError(f"rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported")
    return RopeScaling(
        kind="linear",
        factor=_float32_decimal(_require(meta, f"{arch}.rope.scaling.factor")),
        original_max_position_embeddings=int(
            meta.get(f"{arch}.rope.scaling.original_context_length", max_positions)
        ),
    )


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    """The `ModelConfig` a GGUF's metadata describes (`output.weight` absent: tied embeddings)."""
    arch = _require(meta, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not one of {SUPPORTED_ARCHITECTURES}")
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(
            "rope_freqs.weight (llama3 rope scaling stored as a tensor) is not supported"
        )
    hidden = int(_require(meta, f"{arch}.embedding_length"))
    heads = int(_require(meta, f"{arch}.attention.head_count"))
    head_dim = meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count"))
    max_positions = int(meta.get(f"{arch}.context_length", 2048))
    stop_ids = [_special_id(meta, k) for k in ("eos", "eot", "eom")]
    return ModelConfig(
        vocab_size=len(_require(meta, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=int(_require(meta, f"{arch}.feed_forward_length")),
        num_layers=int(_require(meta, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim) if head_dim is not None else hidden // heads,
        architecture=arch,
        rms_norm_eps=_float32_decimal(_require(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_float32_decimal(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, max_positions),
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=any(name.endswith("attn_q.bias") for name in tensor_names),
        bos_token_id=_special_id(meta, "bos"),
        eos_token_ids=tuple(dict.fromkeys(i for i in stop_ids if i is not None)),
        dtype="float32",
    )


def hf_name(gguf_name: str) -> str:
    """llama.cpp's tensor name -> Hugging Face's (`blk.3.attn_q.weight` -> `model.layers.3...`)."""
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in LAYER_TENSORS:
        raise GGUFError(f"GGUF tensor {gguf_name!r} has no Hugging Face Llama counterpart")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{kind}"


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows [x0, x1, y0, y1] <- [x0, y0, x1, y1].

    llama.cpp's converter reorders each head's rows from Hugging Face's half-split rotary layout
    (first half x, second half y) to interleaved pairs (x0 y0 x1 y1 ...), reshaping the rows to
    (heads, 2, d/2) and swapping the last two axes; this reshapes them to (heads, d/2, 2) and swaps
    back (transformers' `_reverse_permute_weights`). The key projection uses the KV head count.
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise GGUFError(f"{rows} rotary rows do not split into {num_heads} heads of even size")
    half = rows // num_heads // 2
    split = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return split.transpose(1, 2).reshape(weight.shape).contiguous()


def _tensor(reader_tensor: Any) -> torch.Tensor:
    try:
        array = gguf.quants.dequantize(np.asarray(reader_tensor.data), reader_tensor.tensor_type)
    except NotImplementedError as error:
        raise GGUFError(
            f"tensor {reader_tensor.name} is {reader_tensor.tensor_type.name}, which gguf "
            f"{importlib.metadata.version('gguf')} cannot dequantise"
        ) from error
    shape = tuple(int(n) for n in reversed(reader_tensor.shape))  # GGUF lists dims fastest first
    array = array.astype(np.float32, copy=False).reshape(shape)
    if not array.flags.writeable:
        array = array.copy()  # F32 tensors are views of the read-only memory map
    return torch.from_numpy(array)


def rotary_heads(gguf_name: str, config: ModelConfig) -> int | None:
    """The head count whose rows llama.cpp permuted in this tensor (q: query heads, k: KV heads),
    None for a tensor it left alone."""
    if ".attn_q." in gguf_name:
        return config.num_heads
    if ".attn_k." in gguf_name:
        return config.num_kv_heads
    return None


def dequantised_tensors(
    reader: Any, config: ModelConfig, skip: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """Every tensor but those named (HF names) in `skip`, dequantised and unpermuted."""
    state: dict[str, torch.Tensor] = {}
    for reader_tensor in reader.tensors:
        name = hf_name(reader_tensor.name)
        if name in skip:
            continue
        tensor = _tensor(reader_tensor)
        heads = rotary_heads(reader_tensor.name, config)
        state[name] = tensor if heads is None else unpermute_rotary_rows(tensor, heads)
    return state


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's splits as `tokenizers` pre-tokenizers, in the forms HF's tokenizer.json uses."""
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(
            f"pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not one of "
            f"{sorted(PRE_TOKENIZER_SPLITS)}"
        )
    *splits, last = PRE_TOKENIZER_SPLITS[pre]
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Digits(individual_digits=True)
        if pattern == r"\p{N}"
        else pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        for pattern in splits
    ]
    if last == GPT2_SPLIT:  # ByteLevel's own regex is GPT-2's
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(last), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def build_tokenizer(meta: dict[str, Any]) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from a GGUF's `tokenizer.ggml.*` metadata."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model {model!r} is not supported; only 'gpt2' (byte BPE)")
    tokens: list[str] = _require(meta, "tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"{len(types)} token types for {len(tokens)} tokens")
    merges = [tuple(m.split(" ", 1)) for m in _require(meta, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError(f"tokenizer.ggml.tokens repeats {len(tokens) - len(vocab)} token(s)")
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    backend.post_processor = _post_processor(meta, tokens)
    return backend


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    """Adds BOS / EOS around each sequence when the file asks for it; byte offsets otherwise."""
    ends = []
    for key, where in (("bos", "start"), ("eos", "end")):
        token_id = _special_id(meta, key)
        if meta.get(f"tokenizer.ggml.add_{key}_token") and token_id is not None:
            ends.append((where, tokens[token_id], token_id))
    if not ends:
        return processors.ByteLevel(trim_offsets=False)
    start = [f"{t}:0" for where, t, _ in ends if where == "start"]
    end = [f"{t}:0" for where, t, _ in ends if where == "end"]
    return processors.TemplateProcessing(
        single=[*start, "$A:0", *end],
        pair=[*start, "$A:0", *end, *start, "$B:1", *end],
        special_tokens=[(t, i) for _, t, i in ends],
    )


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    """The `tokenizer_config.json` of a GGUF: special tokens by text, flags, chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 2048)),
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = _special_id(meta, key)
        config[f"{name}_token"] = tokens[token_id] if token_id is not None else None
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return config


@dataclass
class GGUFCheckpoint:
    """Everything a GGUF file holds, in the shapes a Hugging Face checkpoint directory uses."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: BackendTokenizer
    tokenizer_config: dict[str, Any] = field(default_factory=dict)

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer_config.get("chat_template")

    def tokenizer_files(self) -> dict[str, str]:
        return {
            "tokenizer.json": self.tokenizer.to_str(pretty=True),
            "tokenizer_config.json": json.dumps(self.tokenizer_config, indent=2, sort_keys=True),
        }

    def save(self, path: Path, max_shard_bytes: int | None = None) -> Path:
        """Write a checkpoint directory: config.json, float32 safetensors, tokenizer files."""
        return save_checkpoint(
            path, self.config, self.state_dict, self.tokenizer_files(), max_shard_bytes
        )


class _CheckedReader(gguf.GGUFReader):
    """gguf's reader, but a tensor whose data runs past the end of the file is named (gguf's own
    reader fails on it with a bare numpy reshape error)."""

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        for tensor_field in fields:
            _, name, _, dims, raw_dtype, offset = tensor_field.parts
            qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(dims)) * block_bytes // block_size
            end = int(start_offs) + int(offset[0]) + n_bytes
            if end > len(self.data):
                raise GGUFError(
                    f"tensor {bytes(name).decode('utf-8', 'replace')} ({qtype.name}, "
                    f"{n_bytes} bytes) ends at byte {end}, past the end of the file "
                    f"({len(self.data)} bytes): the file is truncated"
                )
        super()._build_tensors(start_offs, fields)


def open_gguf(path: Path) -> Any:
    """An open `gguf.GGUFReader` (about 5 s for SmolLM2: it parses the 49k-token vocabulary)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} is missing")
    try:
        return _CheckedReader(path)
    except (ValueError, OSError) as error:
        if isinstance(error, GGUFError):
            raise
        raise GGUFError(f"{path} is not a readable GGUF file: {error}") from error


def read_gguf(path: Path) -> GGUFCheckpoint:
    """Read and dequantise a llama-architecture GGUF file (about 5 s for SmolLM2-135M on a CPU)."""
    reader = open_gguf(path)
    meta = read_metadata(reader)
    config = config_from_metadata(meta, {t.name for t in reader.tensors})
    state = dequantised_tensors(reader, config)
    validate_state_dict(config, state, source=str(path))
    return GGUFCheckpoint(config, state, build_tokenizer(meta), tokenizer_config(meta))
