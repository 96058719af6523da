"""Compile every Triton kernel for an H100 (sm_90) on a machine without a GPU; print resource use.

`python -m tests.kernels.compile_sm90` runs triton's real CUDA pipeline (TTIR -> TTGIR -> PTX ->
cubin with the ptxas bundled in the triton wheel) on the launchers' production configurations
(Llama-8B heads: 32 q / 8 kv, head_dim 128, bf16), with the specialisations a real launch gets
(16-byte aligned pointers, strides divisible by 16), and prints one JSON object: per kernel,
registers, spill stack bytes, shared memory, and whether its K/V loads became pipelined
asynchronous copies (cp.async) feeding tensor-core MMAs. It must run in a process where
TRITON_INTERPRET is unset: the interpreter replaces the compiler.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

BF16_ATTENTION = {"Q": "bf16", "K": "bf16", "V": "bf16", "PageTable": "i32"}


def kernel_specs() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int, int]]:
    """(name, kernel, pointer dtypes, constexprs, warps, stages), as the launchers use them."""
    from kernels import triton_decode, triton_prefill, triton_write_kv

    prefill = triton_prefill.tile_config(128)
    block_m, warps, stages = prefill["BLOCK_M"], prefill["num_warps"], prefill["num_stages"]
    specs = []
    for page_size in (1, 16):
        tile: dict[str, Any] = {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_M": block_m}
        tile |= {"BLOCK_N": prefill["BLOCK_N"], "PAGE_SIZE": page_size, "PRECISION": "tf32"}
        ptrs = BF16_ATTENTION | {"Out": "bf16", "CuSeqlensQ": "i32", "SeqLensK": "i32"}
        specs.append(
            (
                f"prefill_causal_p{page_size}",
                triton_prefill._prefill_causal_kernel,
                ptrs,
                tile,
                warps,
                stages,
            )
        )
        ptrs_lm = ptrs | {"Horizon": "i32"}
        specs.append(
            (
                f"prefill_prefix_lm_p{page_size}",
                triton_prefill._prefill_prefix_lm_kernel,
                ptrs_lm,
                tile,
                warps,
                stages,
            )
        )
        split: dict[str, Any] = {
            "GROUP": 4,
            "HEAD_DIM": 128,
            "BLOCK_D": 128,
            "BLOCK_H": 16,
            "NUM_SPLITS": 8,
        }
        split |= {"BLOCK_N": triton_decode.BLOCK_N, "PAGE_SIZE": page_size, "PRECISION": "tf32"}
        ptrs_d = BF16_ATTENTION | {"PartialOut": "fp32", "PartialLse": "fp32", "SeqLens": "i32"}
        specs.append(
            (f"decode_split_p{page_size}", triton_decode._decode_split_kernel, ptrs_d, split, 4, 3)
        )
    merge = {"HEAD_DIM": 128, "BLOCK_D": 128, "NUM_SPLITS": 8, "BLOCK_S": 8}
    specs.append(
        (
            "decode_merge",
            triton_decode._decode_merge_kernel,
            {"PartialOut": "fp32", "PartialLse": "fp32", "Out": "bf16"},
            merge,
            4,
            1,
        )
    )
    write = {"HEAD_DIM": 128, "ROW": 1024, "BLOCK_ROW": 1024, "BLOCK_T": 4}
    ptrs_w = {"K": "bf16", "V": "bf16", "KCache": "bf16", "VCache": "bf16", "SlotMapping": "i64"}
    specs.append(("write_kv", triton_write_kv._write_kv_kernel, ptrs_w, write, 4, 1))
    return specs + lora_specs() + quant_specs()


def lora_specs() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int, int]]:
    """SGMV shrink (plain and split-K) and expand at rank 16, bf16, unit strides specialised as a
    launch on contiguous tensors gets them."""
    from kernels import triton_lora

    segs = {"SegStarts": "i32", "SegSlots": "i32"}
    shrink: dict[str, Any] = {"stride_xk": 1, "stride_ak": 1, "stride_hr": 1, "BLOCK_R": 16}
    shrink |= {"BLOCK_K": triton_lora.SHRINK_BLOCK_K, "PRECISION": "tf32"}
    expand: dict[str, Any] = {"stride_hr": 1, "stride_br": 1, "stride_yo": 1, "BLOCK_N": 128}
    expand |= {"BLOCK_R": 16, "PRECISION": "tf32"}
    x_a = segs | {"X": "bf16", "A": "bf16"}
    h_b_y = segs | {"H": "bf16", "B": "bf16", "Y": "bf16"}
    kernel_s, kernel_e = triton_lora._shrink_kernel, triton_lora._expand_kernel
    return [
        (name, kernel, ptrs, constexprs, 4, 1)
        for name, kernel, ptrs, constexprs in [
            ("lora_shrink", kernel_s, x_a | {"H": "bf16"}, shrink | {"BLOCK_M": 64, "SPLIT_K": 1}),
            (
                "lora_shrink_split",
                kernel_s,
                x_a | {"H": "fp32"},
                shrink | {"BLOCK_M": 16, "SPLIT_K": 4},
            ),
            ("lora_expand_m16", kernel_e, h_b_y, expand | {"BLOCK_M": 16}),
            ("lora_expand_m64", kernel_e, h_b_y, expand | {"BLOCK_M": 64}),
        ]
    ]


def quant_specs() -> list[tuple[str, Any, dict[str, str], dict[str, Any], int, int]]:
    """The weight-only quantized matmul: the tile kernel (bf16 x, int4 in groups of 32 with
    zeros, int8 per channel) and the one-row kernel at its launch config, for groups of 32, a
    tile inside one group of 4,096 inputs, and one group a row of 96 (fewer than a tile)."""
    from kernels import triton_quant_matmul as qm

    tile: dict[str, Any] = {"BLOCK_M": 16, "BLOCK_N": qm.BLOCK_N, "BLOCK_K": qm.BLOCK_K}
    tile |= {"PRECISION": "tf32", "HAS_ZEROS": True}
    row: dict[str, Any] = {"BLOCK_N": qm.GEMV_BLOCK_N, "BLOCK_K": 256, "K_PER_SPLIT": 1024}
    int4 = {"X": "bf16", "Values": "u8", "Scales": "bf16", "Zeros": "bf16"}
    int8 = int4 | {"Values": "i8"}
    tile_kernel, row_kernel = qm._quant_matmul_kernel, qm._quant_gemv_kernel
    return [
        (name, kernel, ptrs, constexprs, warps, 1)
        for name, kernel, ptrs, constexprs, warps in [
            (
                "quant_tile_int4",
                tile_kernel,
                int4 | {"Y": "bf16"},
                tile | {"GROUP": 32, "INT4": True},
                4,
            ),
            (
                "quant_tile_int8",
                tile_kernel,
                int8 | {"Y": "bf16"},
                tile | {"GROUP": 4096, "INT4": False, "HAS_ZEROS": False},
                4,
            ),
            (
                "quant_row_int4_g32",
                row_kernel,
                int4 | {"Partial": "fp32"},
                row | {"GROUP": 32, "INT4": True, "HAS_ZEROS": True},
                qm.GEMV_WARPS,
            ),
            (
                "quant_row_int8_g4096",
                row_kernel,
                int8 | {"Partial": "fp32"},
                row | {"GROUP": 4096, "INT4": False, "HAS_ZEROS": False},
                qm.GEMV_WARPS,
            ),
            (
                "quant_row_int8_g96",
                row_kernel,
                int8 | {"Partial": "fp32"},
                row | {"GROUP": 96, "INT4": False, "HAS_ZEROS": False, "K_PER_SPLIT": 256},
                qm.GEMV_WARPS,
            ),
        ]
    ]


def compile_one(
    kernel: Any, ptrs: dict[str, str], constexprs: dict[str, Any], warps: int, stages: int
) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ptrs:
            signature[name] = "*" + ptrs[name]
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    aligned = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if name in ptrs or name.startswith("stride")
    }
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def resource_usage(cubin: bytes) -> dict[str, int]:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    assert found is not None, f"no resource line in cuobjdump output: {text[:300]}"
    reg, stack, _, local = (int(g) for g in found.groups())
    return {"registers": reg, "stack_bytes": stack, "local_bytes": local}


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") != "1", (
        "unset TRITON_INTERPRET: it replaces the compiler"
    )
    report = {}
    for name, kernel, ptrs, constexprs, warps, stages in kernel_specs():
        compiled = compile_one(kernel, ptrs, constexprs, warps, stages)
        ptx = compiled.asm["ptx"]
        report[name] = resource_usage(compiled.asm["cubin"]) | {
            "shared_bytes": compiled.metadata.shared,
            "cp_async": ptx.count("cp.async"),
            "tensor_core_mma": ptx.count("wgmma") + ptx.count("mma.sync"),
        }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
