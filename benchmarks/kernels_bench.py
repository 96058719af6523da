"""GPU benchmark of the paged attention kernels against flash-attn and the device's own peaks.

For Llama-8B attention (32 query / 8 KV heads, head_dim 128, bf16) over shuffled pages of size 1,
16 and 256:

- append prefill (prefix 0-32k, suffix 16-2k, batch 1-64): our Triton kernel, next to FA2 on the
  page-256 cache (the only page size FA2 reads) and FA2's varlen function on the same data laid
  out contiguously (what a dense prefill costs with no paging at all);
- decode (batch 1-64, context 1k-32k): our split-K kernel, next to `flash_attn_with_kvcache` on the
  page-256 cache and on a contiguous cache.

Each row reports time, achieved TFLOP/s and GB/s, the floor (the larger of FLOP time at the
measured bf16 matmul peak and byte time at the measured copy bandwidth, both measured here with
torch), the fraction of the floor reached, and the fraction of the fastest flash-attn time on
the same shape. LoRA (`--lora`, or always with the rest): SGMV shrink + expand of rank 16 over
SmolLM2-135M's projections (576 -> 576, 576 -> 1536, 1536 -> 576) for decode (64 rows, 1 / 4 / 16
slots) and prefill (2048 rows, 1 / 4 slots), rows grouped by slot as the engine orders them;
Triton next to the per-segment torch path and the base projection itself (`x @ W.T`, cuBLAS). In
those rows `batch` is the number of slots, `prefix` / `suffix` the projection's in / out features,
and `of flash` the base projection's time over LoRA's (its inverse: the share LoRA adds).
Times are medians of CUDA-graph replays (kernel time without Python launch overhead; the
torch LoRA path, which reads its segments on the host, eagerly; `--eager` times plain calls, L2
flushed). Prints the human table on stderr and one JSON
object on stdout. Needs CUDA; without it, says so and exits with status 2.
Run: `python benchmarks/kernels_bench.py [--quick] [--eager] [--lora] [--output FILE]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 32, 8, 128, 2
PREFILL_SHAPES = [  # (batch, prefix, suffix)
    (1, 0, 2048), (1, 1024, 1024), (1, 8192, 2048), (1, 32768, 512), (4, 4096, 512),
    (16, 2048, 128), (8, 16384, 64), (64, 1024, 16),
]  # fmt: skip
DECODE_SHAPES = [(1, 32768), (8, 8192), (16, 32768), (64, 1024), (64, 8192)]  # (batch, context)
QUICK_PREFILL = [(2, 256, 128)]
QUICK_DECODE = [(4, 1024)]
LORA_RANK = 16
LORA_FEATURES = [(576, 576), (576, 1536), (1536, 576)]  # SmolLM2-135M: q/o, gate/up, down
LORA_SHAPES = [(64, 1), (64, 4), (64, 16), (2048, 1), (2048, 4)]  # (rows, distinct slots)
QUICK_LORA = [(64, 4)]


@dataclass
class Row:
    kernel: str
    backend: str
    page_size: int
    batch: int
    prefix: int
    suffix: int
    ms: float
    tflops: float
    gbs: float
    floor_ms: float
    of_floor: float  # floor_ms / ms: 1.0 would be the roofline
    of_flash: float | None = None  # fastest flash-attn ms / ms on this shape: 1.0 = as fast


def relate_to_flash(rows: list[Row]) -> list[Row]:
    """Fill `of_flash` on one shape's rows from the fastest flash-attn row among them."""
    flash_ms = [r.ms for r in rows if r.backend.startswith("flash")]
    for r in rows:
        r.of_flash = min(flash_ms) / r.ms if flash_ms else None
    return rows


TIMING = {"graphs": True}
"""CUDA-graph replay (kernel time, no Python launch overhead) unless --eager."""


def bench_ms(fn: Callable[[], object]) -> float:
    import triton.testing

    if TIMING["graphs"]:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure_peaks() -> dict[str, float]:
    """bf16 matmul TFLOP/s and device-to-device copy GB/s (bytes read + written)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    matmul_ms = bench_ms(lambda: a @ b)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    return {
        "matmul_tflops": 2 * n**3 / matmul_ms / 1e9,
        "copy_gbs": 2 * src.numel() / copy_ms / 1e6,
    }


def paged_cache(
    lens: list[int], page_size: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache, page_table) holding `lens` tokens per sequence on shuffled pages."""
    pages = [-(-n // page_size) for n in lens]
    num_pages = 1 + sum(pages)
    shape = (num_pages, page_size, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    order = torch.randperm(num_pages - 1, generator=gen) + 1
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[used : used + n]
        used += n
    return k_cache, v_cache, table.cuda()


def contiguous_kv(k_cache: torch.Tensor, table: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """The same K (or V) as one [sum(lens), kv_heads, head_dim] tensor, sequence after sequence."""
    page_size = k_cache.shape[1]
    rows = [
        k_cache[table[i, : -(-n // page_size)].long()].flatten(0, 1)[:n] for i, n in enumerate(lens)
    ]
    return torch.cat(rows)


def prefill_cost(batch: int, prefix: int, suffix: int) -> tuple[float, float]:
    """(FLOPs, bytes) of one append prefill: QK^T and PV over the visible pairs; Q, O, K, V once."""
    pairs = batch * (suffix * prefix + suffix * (suffix + 1) / 2)
    flops = 4 * Q_HEADS * HEAD_DIM * pairs
    kv_bytes = 2 * batch * (prefix + suffix) * KV_HEADS * HEAD_DIM * DTYPE_BYTES
    qo_bytes = 2 * batch * suffix * Q_HEADS * HEAD_DIM * DTYPE_BYTES
    return flops, kv_bytes + qo_bytes


def make_row(
    kernel: str,
    backend: str,
    page_size: int,
    shape: tuple[int, int, int],
    ms: float,
    cost: tuple[float, float],
    peaks: dict[str, float],
) -> Row:
    flops, nbytes = cost
    floor_ms = max(flops / peaks["matmul_tflops"] / 1e9, nbytes / peaks["copy_gbs"] / 1e6)
    return Row(
        kernel, backend, page_size, *shape, ms=ms, tflops=flops / ms / 1e9, gbs=nbytes / ms / 1e6,
        floor_ms=floor_ms, of_floor=floor_ms / ms,
    )  # fmt: skip


def backends_for(page_size: int) -> list[str]:
    """Ours always; FA2 only where it reads a paged cache (page_size % 256 == 0)."""
    from kernels import flash

    fits = flash.why_not(torch.device("cuda"), torch.bfloat16, page_size, HEAD_DIM, False) is None
    return ["triton", "flash"] if fits else ["triton"]


def bench_prefill(
    shape: tuple[int, int, int], peaks: dict[str, float], gen: torch.Generator
) -> list[Row]:
    from kernels import append_prefill_attention, flash

    batch, prefix, suffix = shape
    lens = [prefix + suffix] * batch
    q = torch.randn(batch * suffix, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * suffix
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cost = prefill_cost(*shape)
    rows = []
    for page_size in (1, 16, 256):
        k_cache, v_cache, table = paged_cache(lens, page_size, gen)
        for backend in backends_for(page_size):
            run = partial(
                append_prefill_attention, q, k_cache, v_cache, table, cu, seq_lens,
                max_seqlen_q=suffix, check_values=False, backend=backend,
            )  # fmt: skip
            rows.append(make_row("prefill", backend, page_size, shape, bench_ms(run), cost, peaks))
        if flash.AVAILABLE and page_size == 16:
            k, v = contiguous_kv(k_cache, table, lens), contiguous_kv(v_cache, table, lens)
            cu_k = torch.arange(0, batch + 1, dtype=torch.int32, device="cuda") * (prefix + suffix)
            run = partial(flash.dense_varlen_attention, q, k, v, cu, cu_k, suffix, prefix + suffix)
            rows.append(make_row("prefill", "flash-dense", 0, shape, bench_ms(run), cost, peaks))
        del k_cache, v_cache
    return relate_to_flash(rows)


def bench_decode(
    shape: tuple[int, int], peaks: dict[str, float], gen: torch.Generator
) -> list[Row]:
    from kernels import decode_attention, flash

    batch, context = shape
    lens = [context] * batch
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    cost = prefill_cost(batch, context - 1, 1)
    as_row = (batch, context - 1, 1)
    rows = []
    for page_size in (1, 16, 256):
        k_cache, v_cache, table = paged_cache(lens, page_size, gen)
        for backend in backends_for(page_size):
            run = partial(
                decode_attention, q, k_cache, v_cache, table, seq_lens,
                check_values=False, backend=backend,
            )  # fmt: skip
            rows.append(make_row("decode", backend, page_size, as_row, bench_ms(run), cost, peaks))
        if flash.kvcache_func is not None and page_size == 16:
            k = contiguous_kv(k_cache, table, lens).view(batch, context, KV_HEADS, HEAD_DIM)
            v = contiguous_kv(v_cache, table, lens).view(batch, context, KV_HEADS, HEAD_DIM)
            run = partial(flash.kvcache_func, q.unsqueeze(1), k, v, cache_seqlens=seq_lens)
            rows.append(make_row("decode", "flash-dense", 0, as_row, bench_ms(run), cost, peaks))
        del k_cache, v_cache
    return relate_to_flash(rows)


def lora_step(
    x: torch.Tensor,
    a: torch.Tensor,
    y: torch.Tensor,
    b: torch.Tensor,
    segments: tuple[torch.Tensor, torch.Tensor],
    backend: str,
) -> None:
    from kernels import lora_expand, lora_shrink

    h = lora_shrink(x, a, *segments, check_values=False, backend=backend)
    lora_expand(y, h, b, *segments, check_values=False, backend=backend)


def bench_lora_features(
    rows: int, slots: int, features: tuple[int, int], peaks: dict[str, float]
) -> list[Row]:
    """Shrink + expand per backend, and the base projection, on one (in, out) projection."""
    in_f, out_f = features

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    x, y, w = bf16(rows, in_f), bf16(rows, out_f), bf16(out_f, in_f)
    a, b = bf16(max(slots, 4), LORA_RANK, in_f), bf16(max(slots, 4), out_f, LORA_RANK)
    bounds = [round(i * rows / slots) for i in range(slots + 1)]  # grouped by slot, as served
    segments = (
        torch.tensor(bounds, dtype=torch.int32, device="cuda"),
        torch.arange(slots, dtype=torch.int32, device="cuda"),
    )
    as_row = (slots, in_f, out_f)
    base_ms = bench_ms(partial(torch.matmul, x, w.t()))
    base_cost = (2.0 * rows * in_f * out_f, 2.0 * (in_f * out_f + rows * (in_f + out_f)))
    result = [make_row("lora_base", "linear", 0, as_row, base_ms, base_cost, peaks)]
    cost = (
        2.0 * rows * LORA_RANK * (in_f + out_f),
        2.0 * (slots * LORA_RANK * (in_f + out_f) + rows * (in_f + 2 * out_f)),
    )
    graphs = TIMING["graphs"]
    for backend in ("triton", "torch"):
        TIMING["graphs"] = graphs and backend == "triton"  # the torch path reads the segments
        ms = bench_ms(partial(lora_step, x, a, y, b, segments, backend))
        row = make_row(f"lora_{rows}", backend, 0, as_row, ms, cost, peaks)
        row.of_flash = base_ms / ms
        result.append(row)
    TIMING["graphs"] = graphs
    return result


def bench_lora(shape: tuple[int, int], peaks: dict[str, float]) -> list[Row]:
    """LoRA rows for `shape` = (rows, distinct slots) over every projection of LORA_FEATURES."""
    return [row for f in LORA_FEATURES for row in bench_lora_features(*shape, f, peaks)]


def table(rows: list[Row], peaks: dict[str, float]) -> str:
    head = f"peaks: matmul {peaks['matmul_tflops']:.0f} TFLOP/s, copy {peaks['copy_gbs']:.0f} GB/s"
    columns = ["kernel", "backend", "page", "batch", "prefix", "suffix", "ms", "TFLOP/s", "GB/s"]
    columns += ["floor ms", "of floor", "of flash"]
    lines = [head, " ".join(f"{c:>9}" for c in columns)]
    for r in rows:
        of_flash = "-" if r.of_flash is None else f"{r.of_flash:.2f}"
        cells = [r.kernel, r.backend, *map(str, (r.page_size, r.batch, r.prefix, r.suffix))]
        cells += [f"{r.ms:.3f}", f"{r.tflops:.1f}", f"{r.gbs:.0f}", f"{r.floor_ms:.3f}"]
        cells += [f"{r.of_floor:.2f}", of_flash]
        lines.append(" ".join(f"{c:>9}" for c in cells))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one small shape each (a smoke run)")
    parser.add_argument("--output", type=Path, help="also write the JSON object here")
    parser.add_argument("--lora", action="store_true", help="only the LoRA shrink/expand rows")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="time eager calls (with Python launch overhead, L2 flushed) instead of graph replay",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "kernels_bench needs a CUDA device; none is visible (torch.cuda.is_available() is "
            "False). Nothing was measured.",
            file=sys.stderr,
        )
        return 2
    from kernels import flash

    TIMING["graphs"] = not args.eager
    gen = torch.Generator().manual_seed(0)
    peaks = measure_peaks()
    rows: list[Row] = []
    for p_shape in [] if args.lora else QUICK_PREFILL if args.quick else PREFILL_SHAPES:
        rows += bench_prefill(p_shape, peaks, gen)
    for d_shape in [] if args.lora else QUICK_DECODE if args.quick else DECODE_SHAPES:
        rows += bench_decode(d_shape, peaks, gen)
    for l_shape in QUICK_LORA if args.quick else LORA_SHAPES:
        rows += bench_lora(l_shape, peaks)
    result = {
        "device": torch.cuda.get_device_name(),
        "flash_attn": flash.AVAILABLE,
        "timing": "eager" if args.eager else "cuda_graph",
        "peaks": peaks,
        "rows": [asdict(r) for r in rows],
    }
    print(table(rows, peaks), file=sys.stderr)
    print(json.dumps(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
