"""worker.gguf_quantized and worker.quantized_cache: a GGUF's own blocks as QuantizedWeight.

The oracle is the `gguf` library (llama.cpp's own Python package, not written here): its
`quantize` makes the blocks, its `GGUFWriter` writes the files, and its `dequantize` says what the
blocks mean. A repacked weight must dequantize to exactly that, in Hugging Face's row order.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from tests.worker.helpers import relative_error
from tests.worker.loading_fixtures import Q, llama_cpp_permute, smollm2_dir, write_tiny_gguf
from worker import quantized_linear
from worker.checkpoint import CheckpointError, load_checkpoint
from worker.default_model import CACHE_ENV, converted_dir, default_gguf_path
from worker.gguf_checkpoint import GGUFError, open_gguf
from worker.gguf_quantized import is_linear, read_gguf_weights, repack, repack_blocks
from worker.loader import load_model, model_revision
from worker.model import CausalLM
from worker.model_runner import Chunk, ModelRunner
from worker.quantized_cache import cache_path, load_quantized, native_quantized, save_quantized
from worker.quantized_linear import QuantizedLinear
from worker.quantized_weights import QuantizedWeight, dequantize
from worker.tiny_model import TINY_CONFIG, build_tiny_checkpoint, tiny_model

NATIVE = [(Q.Q4_0, "int4"), (Q.Q4_1, "int4"), (Q.Q8_0, "int8")]
ids = [q.name for q, _ in NATIVE]


def _matrix(rows: int, cols: int, seed: int) -> np.ndarray:
    """Weights of mixed scale per block (the block scales differ by orders of magnitude), a
    constant block (d = 0 for Q4_1) and an all-zero block."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-4, 1, size=(rows, cols // 32, 1))
    w = rng.standard_normal((rows, cols // 32, 32)) * scale + rng.normal(size=(rows, 1, 1))
    w[0, 0] = 0.25
    w[1, 0] = 0.0
    return w.reshape(rows, cols).astype(np.float32)


def _gguf_dequantized(blocks: np.ndarray, qtype: Any, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype).reshape(shape).copy())


@pytest.mark.parametrize(("qtype", "fmt"), NATIVE, ids=ids)
def test_repacked_blocks_dequantize_exactly_like_gguf(qtype: Any, fmt: str) -> None:
    weights = _matrix(24, 96, seed=int(qtype))
    blocks = gguf.quants.quantize(weights, qtype)
    repacked = repack_blocks("w", blocks, qtype, (24, 96))
    assert (repacked.format, repacked.group_size, repacked.shape) == (fmt, 32, (24, 96))
    assert torch.equal(dequantize(repacked), _gguf_dequantized(blocks, qtype, (24, 96)))
    if qtype != Q.Q4_1:
        assert not repacked.zeros.any()  # symmetric blocks: no zero point
    if fmt == "int4":
        assert int(repacked.q.min()) >= 0 and int(repacked.q.max()) <= 15


@pytest.mark.parametrize(("qtype", "fmt"), NATIVE, ids=ids)
def test_arbitrary_blocks_dequantize_like_gguf(qtype: Any, fmt: str) -> None:
    """Random bytes (any nibbles, any int8, scales and minimums of any finite float16 exponent):
    Q4_0 and Q8_0 exactly; Q4_1's folded zero m + 8 d may round in float32, so within 2 ulp of
    the largest term of d q + m."""
    rng = np.random.default_rng(7)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 16, 128
    raw = rng.integers(0, 256, size=(rows, cols // block_size * block_bytes), dtype=np.uint8)
    halves = 2 if qtype == Q.Q4_1 else 1
    blocks = raw.reshape(rows, cols // block_size, block_bytes)
    f16 = (
        rng.standard_normal((rows, cols // block_size, halves))
        * 10.0 ** rng.uniform(-6, 4, (rows, cols // block_size, halves))
    ).astype(np.float16)
    blocks[..., : 2 * halves] = f16.view(np.uint8).reshape(rows, cols // block_size, 2 * halves)
    repacked = repack_blocks("w", raw, qtype, (rows, cols))
    ours = dequantize(repacked)
    reference = _gguf_dequantized(raw, qtype, (rows, cols))
    if qtype != Q.Q4_1:
        assert torch.equal(ours, reference)
        return
    d = torch.from_numpy(f16[..., 0].astype(np.float32)).repeat_interleave(32, 1)
    m = torch.from_numpy(f16[..., 1].astype(np.float32)).repeat_interleave(32, 1)
    bound = 2 * torch.finfo(torch.float32).eps * (m.abs() + 16 * d.abs())
    assert ((ours - reference).abs() <= bound).all()


def test_nibble_order_is_low_then_high() -> None:
    """Byte j of a Q4_0 block holds element j low and j + 16 high (checked by hand, once)."""
    block = np.zeros((1, 18), dtype=np.uint8)
    block[0, :2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    block[0, 2] = 0x93  # element 0 -> 3, element 16 -> 9
    repacked = repack_blocks("w", block, Q.Q4_0, (1, 32))
    assert repacked.q[0, 0] == 3 and repacked.q[0, 16] == 9
    assert dequantize(repacked)[0, 0] == -5.0 and dequantize(repacked)[0, 16] == 1.0


@pytest.mark.parametrize(("qtype", "fmt"), NATIVE, ids=ids)
def test_gguf_file_round_trips(tmp_path: Path, qtype: Any, fmt: str) -> None:
    """A tiny llama written by gguf's own writer (q/k rows permuted as llama.cpp does): every
    matrix comes back repacked, unpermuted and exactly the dequantised weight; the rest float."""
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", qtype)
    weights = read_gguf_weights(tmp_path / "tiny.gguf", fmt)  # type: ignore[arg-type]
    assert weights.config == TINY_CONFIG
    linears = {name for name in expected if is_linear(name)}
    assert weights.quantized.keys() == linears
    assert weights.state_dict.keys() == expected.keys() - linears
    for name, weight in weights.quantized.items():
        assert weight.format == fmt
        assert torch.equal(dequantize(weight), expected[name]), name
    for name, tensor in weights.state_dict.items():
        assert torch.equal(tensor, expected[name]), name


def test_q_and_k_rows_move_whole(tmp_path: Path) -> None:
    """The file's q rows are in llama.cpp's order; repacked, values, scales and zeros are in
    Hugging Face's (undoing it on any one of them alone would not dequantize right)."""
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_1)
    reader = open_gguf(tmp_path / "tiny.gguf")
    stored = repack(next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight"))
    ours = read_gguf_weights(tmp_path / "tiny.gguf", "int4").quantized
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dequantize(stored), expected[name])
    order = torch.from_numpy(llama_cpp_permute(np.arange(stored.shape[0]), TINY_CONFIG.num_heads))
    for part in ("q", "scales", "zeros"):  # llama.cpp's order of ours is the file's
        assert torch.equal(getattr(ours[name], part)[order], getattr(stored, part)), part


@pytest.mark.parametrize("fmt", ["float32", "bf16", "int8"])
def test_other_formats_get_float_weights(tmp_path: Path, fmt: str) -> None:
    """A Q4_1 file asked for float weights, or for int8 (Q4_1 is no int8 block): all dequantised,
    as `read_gguf` does, for the loader to cast or quantize."""
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_1)
    weights = read_gguf_weights(tmp_path / "tiny.gguf", fmt)  # type: ignore[arg-type]
    assert weights.quantized == {}
    assert weights.state_dict.keys() == expected.keys()
    assert all(torch.equal(weights.state_dict[k], v) for k, v in expected.items())


@pytest.mark.parametrize(("fmt", "head_repacked"), [("int4", False), ("int8", True)])
def test_tied_head_from_a_q8_0_table(tmp_path: Path, fmt: str, head_repacked: bool) -> None:
    """SmolLM2's mix: Q4_1 matrices, a Q8_0 embedding table shared with the head. The table stays
    float (it is looked up); as int8 the head is the table's own blocks (under the table's name,
    worker/weight_formats.py's convention for a tied head), as int4 it is left to the loader to
    quantize (the file has no int4 blocks of it)."""
    tied = replace(TINY_CONFIG, tie_word_embeddings=True)
    expected = write_tiny_gguf(tmp_path / "t.gguf", Q.Q4_1, config=tied, embed_qtype=Q.Q8_0)
    weights = read_gguf_weights(tmp_path / "t.gguf", fmt)  # type: ignore[arg-type]
    assert torch.equal(
        weights.state_dict["model.embed_tokens.weight"], expected["model.embed_tokens.weight"]
    )
    assert ("model.embed_tokens.weight" in weights.quantized) == head_repacked
    if head_repacked:
        head = weights.quantized["model.embed_tokens.weight"]
        assert head.format == "int8"
        assert torch.equal(dequantize(head), expected["model.embed_tokens.weight"])
        assert len(weights.quantized) == 1
    else:
        assert len(weights.quantized) == 7 * tied.num_layers


# --- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("qtype", "shape", "cut", "message"),
    [
        (
            Q.Q4_1,
            (4, 64),
            1,
            r"tensor blk\.0\.w: Q4_1 \[4, 64\] takes 160 bytes, the file holds 159",
        ),
        (Q.Q8_0, (4, 64), 34, r"tensor blk\.0\.w: Q8_0 \[4, 64\] takes 272 bytes.*truncated"),
        (
            Q.Q4_0,
            (4, 48),
            0,
            r"tensor blk\.0\.w of shape \(4, 48\) is not a matrix of whole Q4_0 blocks",
        ),
        (Q.Q4_0, (256,), 0, r"tensor blk\.0\.w of shape \(256,\) is not a matrix"),
        (Q.Q5_0, (4, 64), 0, r"tensor blk\.0\.w is Q5_0, not one of Q4_0 / Q4_1 / Q8_0"),
    ],
)
def test_misshapen_blocks_are_refused_by_name(
    qtype: Any, shape: tuple[int, ...], cut: int, message: str
) -> None:
    raw = np.zeros(160 if qtype == Q.Q4_1 else 272, dtype=np.uint8)[: (None if not cut else -cut)]
    with pytest.raises(GGUFError, match=message):
        repack_blocks("blk.0.w", raw, qtype, shape)


def test_non_finite_scales_are_refused_by_name() -> None:
    blocks = gguf.quants.quantize(_matrix(2, 64, seed=1), Q.Q4_1).copy()
    blocks[1, 20 + 2 : 20 + 4] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # m of (1, 1)
    with pytest.raises(GGUFError, match=r"tensor blk\.3\.ffn_up\.weight has non-finite"):
        repack_blocks("blk.3.ffn_up.weight", blocks, Q.Q4_1, (2, 64))


def test_truncated_file_names_the_tensor(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_1)
    last = max(open_gguf(tmp_path / "tiny.gguf").tensors, key=lambda t: t.data_offset)
    data = (tmp_path / "tiny.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: last.data_offset + last.n_bytes - 7])
    with pytest.raises(GGUFError, match=rf"tensor {last.name} \(Q4_1, {last.n_bytes} bytes\) ends"):
        read_gguf_weights(tmp_path / "cut.gguf", "int4")


def test_misshapen_matrix_in_a_file_is_named(tmp_path: Path) -> None:
    """A q projection with half the rows the metadata's heads need, stored as Q4_1."""
    wrong = torch.randn(TINY_CONFIG.q_size // 2, TINY_CONFIG.hidden_size)
    name = "model.layers.1.self_attn.q_proj.weight"
    write_tiny_gguf(tmp_path / "bad.gguf", Q.Q4_1, replace={name: wrong})
    with pytest.raises(CheckpointError, match=rf"{name} is \(32, 64\), expected \(64, 64\)"):
        read_gguf_weights(tmp_path / "bad.gguf", "int4")


# --- the cache beside a converted checkpoint --------------------------------------------------


def test_cache_is_built_once_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_1)
    directory = converted_dir(tmp_path / "tiny.gguf", tmp_path / "cache")
    revision = model_revision(directory)
    built = native_quantized(directory, "int4")
    assert cache_path(directory, "int4").is_file()
    assert model_revision(directory) == revision  # the checkpoint's own files are unchanged

    def no_gguf(path: Path) -> None:
        raise AssertionError(f"read {path} again")

    monkeypatch.setattr("worker.quantized_cache.open_gguf", no_gguf)
    cached = native_quantized(directory, "int4")
    assert cached.keys() == built.keys() == {n for n in expected if is_linear(n)}
    for name, weight in cached.items():
        for part in ("q", "scales", "zeros"):
            assert torch.equal(getattr(weight, part), getattr(built[name], part)), name
        assert (weight.format, weight.group_size) == ("int4", 32)
        assert torch.equal(dequantize(weight), expected[name])


def test_cache_goes_with_its_conversion(tmp_path: Path) -> None:
    """A changed GGUF is converted again into a fresh directory: the old cache goes with the old
    directory, and the new one is built from the new file."""
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source, Q.Q4_1, seed=0)
    directory = converted_dir(source, tmp_path / "cache")
    first = native_quantized(directory, "int4")
    second_expected = write_tiny_gguf(source, Q.Q4_1, seed=1)
    os.utime(source, ns=(1, 1))
    assert converted_dir(source, tmp_path / "cache") == directory
    second = native_quantized(directory, "int4")
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(dequantize(first[name]), dequantize(second[name]))
    assert torch.equal(dequantize(second[name]), second_expected[name])


def test_a_stale_or_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    expected = write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q8_0)
    directory = converted_dir(tmp_path / "tiny.gguf", tmp_path / "cache")
    path = cache_path(directory, "int8")
    native_quantized(directory, "int8")
    weights, metadata = load_quantized(path)
    assert metadata["conversion"] == (directory / "radixmesh-conversion.json").read_text()
    save_quantized(path, {}, {"conversion": "another conversion"})
    assert native_quantized(directory, "int8").keys() == weights.keys()
    path.write_bytes(b"garbage")
    rebuilt = native_quantized(directory, "int8")
    assert all(torch.equal(dequantize(w), expected[n]) for n, w in rebuilt.items())
    assert load_quantized(path)[0].keys() == weights.keys()


def test_nothing_native_for_float_formats_or_plain_checkpoints(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf", Q.Q4_1)
    directory = converted_dir(tmp_path / "tiny.gguf", tmp_path / "cache")
    assert native_quantized(directory, "float32") == native_quantized(directory, "bf16") == {}
    assert not (directory / "quantized").exists()
    assert native_quantized(build_tiny_checkpoint(tmp_path / "plain"), "int4") == {}


def test_a_damaged_cache_file_is_a_named_error(tmp_path: Path) -> None:
    (tmp_path / "int4.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(
        CheckpointError, match=r"int4\.safetensors is not a readable quantized cache"
    ):
        load_quantized(tmp_path / "int4.safetensors")


# --- SmolLM2-135M-Instruct Q4_1, the default model -------------------------------------------


def test_smollm2_tensor_types() -> None:
    """What the default file holds: every projection Q4_1, the (tied) embedding table Q8_0, the
    norms F32, no output head of its own."""
    types: dict[str, set[str]] = {}
    for tensor in open_gguf(default_gguf_path()).tensors:
        kind = tensor.name.split(".")[-2] if tensor.name.startswith("blk.") else tensor.name
        types.setdefault(kind, set()).add(tensor.tensor_type.name)
    assert types == {
        **{name: {"Q4_1"} for name in ("attn_q", "attn_k", "attn_v", "attn_output")},
        **{name: {"Q4_1"} for name in ("ffn_gate", "ffn_up", "ffn_down")},
        "attn_norm": {"F32"},
        "ffn_norm": {"F32"},
        "output_norm.weight": {"F32"},
        "token_embd.weight": {"Q8_0"},
    }


def test_smollm2_int4_blocks_equal_the_converted_weights() -> None:
    """The 210 Q4_1 projections, repacked (and cached) from the file's blocks, dequantize exactly
    to the float32 checkpoint it was converted into, which the GGUF tests hold bit-identical to
    transformers' GGUF loader: same values, same row order."""
    directory = smollm2_dir()
    quantized = native_quantized(directory, "int4")
    assert len(quantized) == 7 * 30
    _, state = load_checkpoint(directory)
    for name, weight in quantized.items():
        assert weight.format == "int4"
        assert torch.equal(dequantize(weight), state[name]), name
    reread = native_quantized(directory, "int4")  # from the cache this time
    assert all(torch.equal(reread[n].q, w.q) for n, w in quantized.items())


# --- the int4 model from the file's own blocks, against the float32 load of the same file ------


def position_logits(model: CausalLM, tokens: list[int], prefill: int) -> torch.Tensor:
    """Logits after a prefill of `prefill` tokens, then after each later token fed as a decode
    step (the path decode speed is about), stacked [1 + len(tokens) - prefill, vocab]."""
    runner = ModelRunner(model, num_pages=len(tokens) + 2, page_size=1)
    pages = list(range(1, len(tokens) + 1))
    logits = [runner.run([Chunk(tokens[:prefill], 0, pages, True)])[0]]
    for i in range(prefill, len(tokens)):
        logits.append(runner.run([Chunk(tokens[i : i + 1], i, pages, True)])[0])
    return torch.stack(logits)


def check_layers_hold_the_blocks(model: CausalLM, native: dict[str, QuantizedWeight]) -> None:
    """Every natively stored matrix is multiplied as the file's values: the layer's q exactly,
    its scales and zeros as the kernel keeps them (bf16), so within 2^-8 of each |(q-8) d| + |z|."""
    modules = dict(model.named_modules())
    for name, weight in native.items():
        if name in ("lm_head.weight", "model.embed_tokens.weight"):  # the head is bf16 here
            head = modules["lm_head"] if name == "lm_head.weight" else None  # (no int8 dots)
            if head is None:  # tied: the bf16 table itself
                values = model.model.embed_tokens.weight
            else:
                assert isinstance(head, QuantizedLinear) and head.format == "bf16", name
                values = head.reference_weight(torch.bfloat16)
            assert torch.equal(values, dequantize(weight).to(torch.bfloat16)), name
            continue
        layer = modules[name[: -len(".weight")]]
        assert isinstance(layer, QuantizedLinear) and layer.format == weight.format == "int4", name
        g = weight.group_size
        q = weight.q.float().reshape(*weight.shape[:1], -1, g) - 8
        slack = (q.abs() * weight.scales[..., None].abs() + weight.zeros[..., None].abs()) * 2**-8
        gap = (layer.reference_weight() - dequantize(weight)).reshape(slack.shape).abs()
        assert (gap <= slack).all(), name


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_int4_from_the_blocks_is_the_float32_model_up_to_bf16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: Any
) -> None:
    """load_model(file.gguf, weights="int4") multiplies by the file's own blocks: every projection
    of the tiny model holds exactly the values the float32 load of the same file holds (the
    tied head is the bf16 table, the head off a CPU with int8 dot products, as here), so the
    logits differ only by bf16
    rounding: of the activations fed to each matmul, of the block scales and zeros, and of the
    embedding table. The bf16 model (every weight and the
    same activations rounded to bf16) carries the same kind and amount of rounding, measured in
    the same run: the int4 error must stay within twice it (observed ~1.1x), and far below the
    error the file's quantization itself carries (against the unquantized weights: ~30x)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(quantized_linear, "INT8_DYNAMIC_HEAD", False)  # the projections' test
    write_tiny_gguf(tmp_path / "tiny.gguf", qtype)
    models = {
        fmt: load_model(tmp_path / "tiny.gguf", weights=fmt) for fmt in ("float32", "bf16", "int4")
    }
    native = native_quantized(models["int4"].path, "int4")
    assert len(native) == 7 * TINY_CONFIG.num_layers + 1  # every projection and the head
    check_layers_hold_the_blocks(models["int4"].model, native)
    tokens = torch.randint(
        3, TINY_CONFIG.vocab_size, (40,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    logits = {fmt: position_logits(m.model, tokens, 24) for fmt, m in models.items()}
    reference = logits["float32"]
    int4_error = relative_error(logits["int4"], reference)
    bf16_error = relative_error(logits["bf16"], reference)
    quantization_error = relative_error(position_logits(tiny_model(), tokens, 24), reference)
    assert int4_error <= 2 * bf16_error, (int4_error, bf16_error)
    assert int4_error <= quantization_error / 10, (int4_error, quantization_error)


@pytest.mark.slow
def test_smollm2_int4_from_the_blocks_is_the_float32_model_up_to_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default model as int4: its 210 projections are the file's Q4_1 blocks (checked layer
    by layer); its head has no int4 blocks in the file (the tied table is Q8_0), so it is
    quantized at load, and the float32 reference gets that same head matrix. Then, as for the
    tiny model, the only difference left is bf16 rounding: within twice the bf16 model's error
    (observed ~1.0x: 1.1 % vs 1.1 %), and the greedy next token agrees almost everywhere."""
    directory = smollm2_dir()
    monkeypatch.setattr(quantized_linear, "INT8_DYNAMIC_HEAD", False)  # the bf16 head, as above
    int4 = load_model(directory, weights="int4")
    check_layers_hold_the_blocks(int4.model, native_quantized(directory, "int4"))
    float32 = load_model(directory, weights="float32").model
    bf16 = load_model(directory, weights="bf16").model
    assert int4.tokenizer is not None
    tokens = int4.tokenizer.encode(
        "The Declaration of Independence was adopted by the Continental Congress on July 4, "
        "1776. It explained why the thirteen colonies regarded themselves as independent "
        "states, no longer part of the British Empire."
    )
    assert isinstance(int4.model.lm_head, QuantizedLinear)
    head = nn.Linear(float32.config.hidden_size, float32.config.vocab_size, bias=False)
    head.weight = nn.Parameter(int4.model.lm_head.reference_weight(), requires_grad=False)
    float32.lm_head = head
    reference = position_logits(float32, tokens, 8)
    int4_logits = position_logits(int4.model, tokens, 8)
    int4_error = relative_error(int4_logits, reference)
    bf16_error = relative_error(position_logits(bf16, tokens, 8), reference)
    assert int4_error <= 2 * bf16_error, (int4_error, bf16_error)
    agree = (int4_logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree >= 0.9, agree
