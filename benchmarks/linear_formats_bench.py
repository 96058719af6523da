"""Which CPU path each weight format's linear layer should take: every candidate, timed.

Two SmolLM2-135M matrices, the output head (49,152 x 576) and an MLP projection (1,536 x 576),
times one token (decode) and 256 tokens (a prefill chunk), for each way this torch build can
multiply by a weight kept in that format:

    float32          F.linear, float32
    bf16             F.linear in bf16 (x cast to bf16, the product cast back)
    bf16 cvt f32     the bf16 weight cast to float32 every call, then the float32 matmul
    int4 kernel      aten._weight_int4pack_mm_for_cpu (bf16 x, group 32)
    int4 deq bf16    dequantize the groups to bf16 every call, then the bf16 matmul
    int4 deq f32     dequantize to float32 every call (from plain levels), float32 matmul
    int8 kernel      aten._weight_int8pack_mm (per-channel scales), bf16 x
    int8 kernel f32  the same with float32 x
    int8 cvt bf16    q.to(bf16), bf16 matmul, times the per-channel scales (gpt-fast's form)
    int8 cvt f32     q.float() times the scales every call, float32 matmul
    int8 deq bf16    grouped int8 (group 32) dequantized to bf16 every call, then the matmul
    int8 dynamic     x quantized to int8 per row, torch._int_mm (int8 dot products: VNNI), the
                     int32 sums scaled (`int8_dynamic_matmul`, what an int8 head runs)

Decode reads weights that left the caches since their last use (a model is far larger than
the L3), so each candidate cycles through copies of its operands adding up to --cold-mb (128 MB,
four times this machine's 32 MB L3): a matrix that fits in the cache would otherwise be timed at
cache speed. Each round times every candidate once, in turn (alternating, so a shared machine's
drift hits all alike); the table shows the median over rounds of the per-call mean. Random
weights (the speed of these kernels does not depend on the values). Run:
`python benchmarks/linear_formats_bench.py [--threads 2] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

from worker.quantized_linear import int8_dynamic_matmul, pack_int4_cpu
from worker.quantized_weights import quantize

SHAPES = {"head 49152x576": (49152, 576), "mlp 1536x576": (1536, 576)}


def _dequantize(
    q: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    offset: int,
    group: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    out, inp = q.shape
    w = (q.view(out, inp // group, group).to(dtype) - offset) * scales[..., None]
    return (w + zeros[..., None]).view(out, inp)


Operands = tuple[torch.Tensor, ...]
Candidate = tuple[Operands, Callable[..., torch.Tensor]]
"""The tensors a path reads (copied to defeat the caches) and how it multiplies x by them."""


def candidates(out: int, inp: int, seed: int = 0) -> dict[str, Candidate]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen) / inp**0.5
    q4 = quantize(w, "int4")
    s4, z4 = q4.scales.to(torch.bfloat16), q4.zeros.to(torch.bfloat16)
    scales_and_zeros = torch.stack([s4.t(), z4.t()], -1).contiguous()
    q8g = quantize(w, "int8")
    q8c = quantize(w, "int8", inp)  # per channel
    s8c = q8c.scales.reshape(-1)
    bf16 = torch.bfloat16

    def int4_kernel(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(bf16), packed, 32, sz).float()

    def int4_deq(
        x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        return F.linear(x.to(dtype), _dequantize(q, s.to(dtype), z.to(dtype), 8, 32, dtype))

    def int8_kernel(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(s.dtype), q, s).float()

    def int8_cvt(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (F.linear(x.to(bf16), q.to(bf16)) * s).float()

    def int8_deq(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(bf16), _dequantize(q, s, torch.zeros_like(s), 0, 32)).float()

    return {
        "float32": ((w,), F.linear),
        "bf16": ((w.to(bf16),), lambda x, w: F.linear(x.to(bf16), w).float()),
        "bf16 cvt f32": ((w.to(bf16),), lambda x, w: F.linear(x, w.float())),
        "int4 kernel": ((pack_int4_cpu(q4.q), scales_and_zeros), int4_kernel),
        "int4 deq bf16": ((q4.q, s4, z4), lambda x, q, s, z: int4_deq(x, q, s, z, bf16).float()),
        "int4 deq f32": ((q4.q, s4, z4), lambda x, q, s, z: int4_deq(x, q, s, z, torch.float32)),
        "int8 kernel": ((q8c.q, s8c.to(bf16)), int8_kernel),
        "int8 kernel f32": ((q8c.q, s8c), int8_kernel),
        "int8 cvt bf16": ((q8c.q, s8c.to(bf16)), int8_cvt),
        "int8 cvt f32": ((q8c.q, s8c[:, None]), lambda x, q, s: F.linear(x, q.float() * s)),
        "int8 deq bf16": ((q8g.q, q8g.scales.to(bf16)), int8_deq),
        "int8 dynamic": ((q8c.q, s8c.to(bf16)), int8_dynamic_matmul),
    }


def copies(operands: Operands, cold_bytes: int) -> list[Operands]:
    """Enough copies of `operands` that cycling through them reads `cold_bytes` from memory
    (what decode does: a model's weights do not stay in the caches between two uses)."""
    size = sum(t.nbytes for t in operands)
    count = max(1, -(-cold_bytes // size))
    return [operands, *(tuple(t.clone() for t in operands) for _ in range(count - 1))]


def measure(rounds: int, budget_s: float, cold_bytes: int) -> dict[str, dict[str, float]]:
    """{"<shape> x <tokens>": {candidate: median ms}}."""
    results: dict[str, dict[str, float]] = {}
    for shape, (out, inp) in SHAPES.items():
        found = candidates(out, inp)
        sets = {name: copies(operands, cold_bytes) for name, (operands, _) in found.items()}
        for tokens in (1, 256):
            x = torch.randn(tokens, inp, generator=torch.Generator().manual_seed(1))
            reps = {}
            for name, (_, fn) in found.items():  # warm up, and size each candidate's repeats
                start = time.perf_counter()
                for operands in sets[name]:
                    fn(x, *operands)
                each = (time.perf_counter() - start) / len(sets[name])
                reps[name] = max(1, min(100, int(budget_s / max(each, 1e-6))))
            times: dict[str, list[float]] = {name: [] for name in found}
            for _ in range(rounds):
                for name, (_, fn) in found.items():
                    cycle = sets[name]
                    start = time.perf_counter()
                    for i in range(reps[name]):
                        fn(x, *cycle[i % len(cycle)])
                    times[name].append((time.perf_counter() - start) / reps[name] * 1e3)
            row = {name: statistics.median(t) for name, t in times.items()}
            results[f"{shape} x {tokens}"] = row
            print(
                f"{shape} x {tokens:>3} tokens: "
                + "  ".join(f"{name} {ms:.3f}" for name, ms in row.items())
                + "  (ms)",
                file=sys.stderr,
                flush=True,
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.05, help="seconds per timing")
    parser.add_argument(
        "--cold-mb", type=int, default=128, help="bytes each candidate cycles through (MB)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = measure(args.rounds, args.budget, args.cold_mb << 20)
    summary = {"threads": args.threads, "rounds": args.rounds, "cold_mb": args.cold_mb}
    print(json.dumps({**summary, "ms": results}))


if __name__ == "__main__":
    main()
