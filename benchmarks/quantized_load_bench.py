"""How long a quantized model's GGUF blocks take to load: read from the GGUF each time, or cached.

For a converted GGUF (default: SmolLM2-135M-Instruct Q4_1) and a quantized format, alternates in
one process, --repeats times each:

- `gguf`: what every load would do reading the file itself: open it with gguf's reader, build the
  config from its metadata, repack the natively stored linears (worker/gguf_quantized.py);
- `cached`: read the same weights back from `<checkpoint>/quantized/<fmt>.safetensors`
  (worker/quantized_cache.py; built first if missing, not timed);
- `float32`: for scale, today's load of the converted float32 checkpoint (load_checkpoint).

Each is timed until every page of every tensor is in memory (one byte read per 4 KiB:
safetensors may map files lazily, and packing reads every weight anyway); file pages are warm
after the first round.

Prints medians (seconds) as one JSON object. Run:
`python benchmarks/quantized_load_bench.py [--gguf PATH] [--format int4] [--repeats 5]`.
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

from worker.checkpoint import load_checkpoint
from worker.default_model import converted_dir, default_gguf_path
from worker.gguf_checkpoint import config_from_metadata, open_gguf, read_metadata
from worker.gguf_quantized import native_weights
from worker.quantized_cache import PARTS, cache_path, load_quantized, native_quantized
from worker.quantized_weights import QuantizedWeight, WeightFormat


def read_from_gguf(gguf_path: Path, fmt: WeightFormat) -> float:
    reader = open_gguf(gguf_path)
    config = config_from_metadata(read_metadata(reader), {t.name for t in reader.tensors})
    return touch(native_weights(reader, config, fmt))


def read_cached(directory: Path, fmt: WeightFormat) -> float:
    return touch(load_quantized(cache_path(directory, fmt))[0])


def read_float32(directory: Path) -> float:
    return sum(touch_tensor(t) for t in load_checkpoint(directory)[1].values())


def touch(weights: dict[str, QuantizedWeight]) -> float:
    return sum(touch_tensor(getattr(w, part)) for w in weights.values() for part in PARTS)


def touch_tensor(tensor: torch.Tensor) -> float:
    """One byte of every 4 KiB page of the tensor's memory, summed."""
    return float(tensor.contiguous().reshape(-1).view(torch.uint8)[::4096].sum())


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, default=None, help="default: SmolLM2 Q4_1")
    parser.add_argument("--format", default="int4", choices=("int4", "int8"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gguf_path = args.gguf or default_gguf_path()
    directory = converted_dir(gguf_path)
    count = len(native_quantized(directory, args.format))  # builds the cache once
    runs: dict[str, Callable[[], object]] = {
        "gguf": lambda: read_from_gguf(gguf_path, args.format),
        "cached": lambda: read_cached(directory, args.format),
        "float32": lambda: read_float32(directory),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    result = {
        "gguf": str(gguf_path),
        "format": args.format,
        "weights_repacked": count,
        "cache_bytes": cache_path(directory, args.format).stat().st_size,
        "threads": args.threads,
        "repeats": args.repeats,
        "median_s": {name: round(statistics.median(t), 3) for name, t in times.items()},
        "all_s": {name: [round(x, 3) for x in t] for name, t in times.items()},
    }
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
