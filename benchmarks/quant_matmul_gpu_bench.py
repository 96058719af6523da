"""The quantized Triton matmul on a GPU, against cuBLAS in bf16 and a dequantize-then-matmul path.

For the linear layers of SmolLM2-135M and Llama-3-8B (q/k/v fused, gate/up fused, down, the
output head) at 1, 16, 64 and 256 rows, times, with CUDA events (`triton.testing.do_bench`,
medians), each way of multiplying by a weight kept in that format:

    bf16 cuBLAS      F.linear, bf16 weight and x
    int8 triton      kernels/triton_quant_matmul.py, per-channel int8, bf16 x
    int4 triton      the same, int4 in groups of 32 with a zero
    int4 deq+cuBLAS  the int4 weight dequantized to bf16 each call, then F.linear

Decode reads every weight once per token, so the weight bytes over the time (GB/s) against the
device's measured copy bandwidth (bytes read plus written, a 1 GiB device-to-device copy) says
how close a call runs to the memory floor. Each candidate runs once on each of several copies of
its operands adding up to 4 x the L2 cache (so a small matrix is not timed from L2), all captured
in one CUDA graph whose replays are timed: GPU time per call, without Python's launch overhead
(which an eager engine step pays on top). Random values (the speed
does not depend on them). Prints a table on stderr and one JSON object on stdout; exits 2 with
a message without CUDA. Run: `python benchmarks/quant_matmul_gpu_bench.py [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from kernels.quant_matmul import quant_matmul, unpack_values

console = Console(stderr=True)
GROUP = 32
SHAPES = {  # model -> [(name, out, in)]
    "smollm2-135m": [
        ("qkv", 960, 576),
        ("gate_up", 3072, 576),
        ("down", 576, 1536),
        ("head", 49152, 576),
    ],
    "llama-3-8b": [
        ("qkv", 6144, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
        ("head", 128256, 4096),
    ],
}  # fmt: skip
ROWS = (1, 16, 64, 256)


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy."""
    import triton.testing

    src = torch.empty(1 << 28, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.nbytes / (ms * 1e-3)


def operands(out: int, inp: int, copies: int) -> dict[str, list[tuple[torch.Tensor, ...]]]:
    """`copies` sets of each format's weight operands, random."""
    dev = "cuda"
    made: dict[str, list[tuple[torch.Tensor, ...]]] = {"bf16": [], "int8": [], "int4": []}
    for _ in range(copies):
        made["bf16"].append((torch.randn(out, inp, device=dev, dtype=torch.bfloat16) / inp**0.5,))
        q8 = torch.randint(-127, 128, (out, inp), device=dev, dtype=torch.int8)
        s8 = torch.rand(out, 1, device=dev, dtype=torch.bfloat16) / 127
        made["int8"].append((q8, s8))
        packed = torch.randint(0, 256, (out, inp // 2), device=dev, dtype=torch.uint8)
        s4 = torch.rand(out, inp // GROUP, device=dev, dtype=torch.bfloat16) / 16
        z4 = torch.randn(out, inp // GROUP, device=dev, dtype=torch.bfloat16) / 16
        made["int4"].append((packed, s4, z4))
    return made


def dequantized_int4(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
) -> torch.Tensor:
    """The bf16 weight of an int4 operand (level - 8, times scale, plus zero), computed in bf16
    as an on-the-fly dequantization would (`dequantize_reference` is float32)."""
    levels = unpack_values(packed, "int4")
    w = (levels.to(torch.bfloat16) - 8).view(packed.shape[0], -1, GROUP)
    return (w * scales[..., None] + zeros[..., None]).view(packed.shape[0], -1)


def candidates(x: torch.Tensor) -> dict[str, tuple[str, Callable[..., torch.Tensor]]]:
    """name -> (the operands' format, the call on one set of them)."""
    return {
        "bf16 cuBLAS": ("bf16", lambda w: F.linear(x, w)),
        "int8 triton": ("int8", lambda q, s: quant_matmul(x, q, s, None, "int8", q.shape[1])),
        "int4 triton": ("int4", lambda p, s, z: quant_matmul(x, p, s, z, "int4", GROUP)),
        "int4 deq+cuBLAS": ("int4", lambda p, s, z: F.linear(x, dequantized_int4(p, s, z))),
    }


def weight_bytes(ops: tuple[torch.Tensor, ...]) -> int:
    return sum(t.nbytes for t in ops)


def measure(
    model: str, name: str, out: int, inp: int, rows: int, bandwidth: float
) -> list[dict[str, object]]:
    import triton.testing

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    bf16_bytes = out * inp * 2
    copies = max(1, min(16, -(-4 * l2 // bf16_bytes)))
    made = operands(out, inp, copies)
    x = torch.randn(rows, inp, device="cuda", dtype=torch.bfloat16)
    result = []
    for label, (fmt, call) in candidates(x).items():
        sets = made[fmt]
        for one in sets:  # compiled and warm before the capture
            call(*one)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for one in sets:
                call(*one)
        ms = triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")
        ms /= len(sets)
        nbytes = weight_bytes(sets[0])
        result.append(
            {
                "model": model,
                "matrix": name,
                "out": out,
                "in": inp,
                "rows": rows,
                "candidate": label,
                "us": ms * 1e3,
                "weight_mb": nbytes / 1e6,
                "weight_gb_s": nbytes / (ms * 1e-3) / 1e9,
                "of_copy_bandwidth": nbytes / (ms * 1e-3) / bandwidth,
            }
        )
    return result


def table(rows: list[dict[str, object]], bandwidth: float) -> Table:
    out = Table(
        title=f"quantized matmul, {torch.cuda.get_device_name()}, copy {bandwidth / 1e12:.2f} TB/s"
    )
    for column in ("model", "matrix", "rows", "candidate", "us", "weight GB/s", "of copy bw"):
        out.add_column(column, justify="right")
    for r in rows:
        out.add_row(
            str(r["model"]),
            f"{r['matrix']} {r['out']}x{r['in']}",
            str(r["rows"]),
            str(r["candidate"]),
            f"{r['us']:.1f}",
            f"{r['weight_gb_s']:.0f}",
            f"{r['of_copy_bandwidth']:.0%}",
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="SmolLM2's shapes at 1 and 16 rows")
    parser.add_argument("--output", type=Path, help="also write the JSON object here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        console.print("needs a CUDA device: nothing was measured")
        return 2
    bandwidth = copy_bandwidth()
    models = ["smollm2-135m"] if args.quick else list(SHAPES)
    row_counts = (1, 16) if args.quick else ROWS
    rows: list[dict[str, object]] = []
    for model in models:
        for name, out, inp in SHAPES[model]:
            for count in row_counts:
                rows.extend(measure(model, name, out, inp, count, bandwidth))
    console.print(table(rows, bandwidth))
    report = {"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "rows": rows}
    text = json.dumps(report)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
