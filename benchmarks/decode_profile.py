"""Where a decode step's time goes: the engine's step split into linear layers, attention and the
rest, by torch's profiler, for one request decoding greedily.

A step is timed three ways, each the median over --steps steps after a warm-up:

- `step_ms`: `Engine.step()` as the engine runs it (scheduling, batch building, the forward
  pass, sampling);
- `forward_ms`: the model's forward pass alone (`ModelRunner.run`), so that step - forward is
  the engine's own overhead;
- `ops`: the profiler's self CPU time per aten op over the same steps (a profiled step runs
  slower: each op pays the profiler's bookkeeping, so shares are read from it, times from the
  unprofiled steps), grouped by what each op is for:

      linear      the projections and the output head (mm / addmm / the int4 / int8 kernels,
                  _int_mm, fbgemm's quantized::linear_dynamic)
      attention   SDPA and the page gather (index_select)
      kv write    index_copy_ into the KV pages
      other       everything else: norms, RoPE, activations, residual adds, dtype casts, views

`ops per step` counts the aten and quantized ops called from Python (an `aten::linear` is one
linear op, not the `aten::t` and `aten::mm` it calls). `other` and the time no op accounts
for (Python between ops: step_ms - the ops' total) is what fusing would save.
Prints a table on stderr and one JSON object on stdout.
Run: `python benchmarks/decode_profile.py [--model smollm2|tiny] [--weights bf16] [--context 1024]
[--module-path]` (`--module-path`: through the modules instead of the flat loop, for A/B runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerActivity, profile

from benchmarks.weights_axis import load_for_bench
from worker.engine import Engine, EngineConfig
from worker.model import CausalLM
from worker.request import GenerateRequest
from worker.sampling_params import SamplingParams

console = Console(stderr=True)
CATEGORIES: dict[str, tuple[str, ...]] = {
    "linear": (
        "aten::mm",
        "aten::addmm",
        "aten::_weight_int4pack_mm_for_cpu",
        "aten::_weight_int4pack_mm",
        "aten::_weight_int8pack_mm",
        "aten::_int_mm",
        "quantized::linear_dynamic",  # the int8 head through fbgemm (worker/fbgemm_int8.py)
    ),
    "attention": (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::index_select",
        "aten::index",
    ),
    "kv write": ("aten::index_copy_",),
}


def category(op: str) -> str:
    return next((name for name, ops in CATEGORIES.items() if op in ops), "other")


def _subtree_category(event: Any) -> str:
    """The category of an op called from Python: that of the first op under it that has one
    (`aten::linear` is linear through the `aten::mm` it calls)."""
    name = category(event.name)
    if name != "other":
        return name
    for child in event.cpu_children:
        name = _subtree_category(child)
        if name != "other":
            return name
    return "other"


def decoding_engine(model: CausalLM, context: int, steps: int) -> tuple[Engine, Callable[[], None]]:
    """An engine decoding one greedy request after a `context`-token prompt, and a step function."""
    length = context + 2 * steps + 64
    config = EngineConfig(
        num_pages=length // 16 + 8,
        page_size=16,
        max_running=1,
        token_budget=context + 16,
        max_prefill_chunk=context + 16,
        max_model_len=length,
    )
    engine = Engine(model, None, config)
    vocab = model.config.vocab_size
    prompt = tuple(int(t) for t in torch.randint(3, vocab, (context,), generator=_seeded()))
    sampling = SamplingParams(max_tokens=2 * steps + 32, temperature=0.0, ignore_eos=True)
    engine.submit(GenerateRequest("decode", prompt, sampling=sampling), lambda _: None)
    engine.step()  # the prefill

    def step() -> None:
        if not engine.step():
            raise RuntimeError("the request finished before the profile did")

    return engine, step


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def profile_decode(model: CausalLM, context: int, steps: int) -> dict[str, Any]:
    engine, step = decoding_engine(model, context, steps)
    runner, forward_times = engine.runner, list[float]()
    run = runner.run

    def timed_run(chunks: Any) -> torch.Tensor:
        began = time.perf_counter()
        out = run(chunks)
        forward_times.append(time.perf_counter() - began)
        return out

    runner.run = timed_run  # type: ignore[method-assign]
    for _ in range(3):
        step()
    forward_times.clear()
    step_times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - began)
    runner.run = run  # type: ignore[method-assign]
    profiled = max(4, steps // 4)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(profiled):
            step()
    ops: dict[str, dict[str, float]] = {}
    for event in prof.key_averages():
        if event.self_cpu_time_total > 0:
            ops[event.key] = {
                "self_ms_per_step": event.self_cpu_time_total / 1000 / profiled,
                "calls_per_step": event.count / profiled,
            }
    profiled_ms = sum(o["self_ms_per_step"] for o in ops.values())
    shares: dict[str, float] = {}
    for op, row in ops.items():
        name = category(op)
        shares[name] = shares.get(name, 0.0) + row["self_ms_per_step"] / profiled_ms
    calls: dict[str, float] = {}  # ops called from Python (not the ones they call in turn)
    for event in prof.events():
        if event.cpu_parent is None and event.name.startswith(("aten::", "quantized::")):
            name = _subtree_category(event)
            calls[name] = calls.get(name, 0.0) + 1 / profiled
    step_ms = 1000 * statistics.median(step_times)
    return {
        "context": context,
        "steps": steps,
        "step_ms": step_ms,
        "forward_ms": 1000 * statistics.median(forward_times),
        "tokens_per_s": 1000 / step_ms,
        "op_share": shares,
        "ops_per_step": calls,
        "top_ops": dict(sorted(ops.items(), key=lambda kv: -kv[1]["self_ms_per_step"])[:15]),
    }


def report(result: dict[str, Any]) -> Table:
    table = Table(
        title=f"{result['model']} ({result['weights']}), decode after {result['context']} "
        f"tokens: step {result['step_ms']:.1f} ms (forward {result['forward_ms']:.1f} ms), "
        f"{result['torch_threads']} threads"
    )
    for column in ("part", "share of op time", "ops per step", "~ms of a step"):
        table.add_column(column, justify="right")
    for name in (*CATEGORIES, "other"):
        share = result["op_share"].get(name, 0.0)
        ops = result["ops_per_step"].get(name, 0.0)
        table.add_row(name, f"{share:.1%}", f"{ops:.0f}", f"{share * result['forward_ms']:.1f}")
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--weights", default="float32", help="float32 | bf16 | int8 | int4")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--module-path",
        action="store_true",
        help="decode through the modules, not worker/decode_layers.py's flat loop (A/B runs)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_for_bench(args.model, args.weights)
    model.flat_decode = not args.module_path
    result = {
        "model": args.model,
        "weights": args.weights,
        "flat_decode": model.flat_decode and model.decode_layers() is not None,
        "torch_threads": torch.get_num_threads(),
        **profile_decode(model, args.context, args.steps),
    }
    console.print(report(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
