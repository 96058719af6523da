"""Decode steps of the engine on a GPU, per weight format: what the Triton kernels give a model.

A model shaped like SmolLM2-135M (30 layers, hidden 576, GQA 9:3, vocab 49,152, tied head) with
seeded random weights (the timings do not depend on the values; no checkpoint need travel to
the GPU machine) is put in each weight format (`apply_weight_format` after moving it to the
GPU: int4 / int8 layers then multiply through kernels/triton_quant_matmul.py, bf16 through
cuBLAS) and decodes greedily after a 64-token prompt, one request and a batch of 16. The
figure is the median engine step (the whole step: scheduling, the forward pass, sampling, the
cache), synchronised, after warm-up steps.

`--host-tier N` also times issue 15's host tier on the GPU: TTFT of an N-token prompt cold, as a
whole-prompt hit on the device, and as a whole-prompt hit on the host tier (pinned CPU memory:
every page demoted between requests, promoted back inside the measured TTFT), alternating
(`prefill_bench.host_tier`), for the SmolLM2-shaped model and a Llama-3.2-1B-shaped one (16
layers, GQA 32:8, head 64: 32 KB of bf16 KV a token), both in bf16. Prints tables on stderr and
one JSON object on stdout; exits 2 with a message without CUDA.
Run: `python benchmarks/gpu_decode_bench.py [--steps 40] [--host-tier 1024]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from rich.console import Console
from rich.table import Table

from worker.config import ModelConfig
from worker.engine import Engine, EngineConfig
from worker.model import CausalLM
from worker.quantized_weights import WEIGHT_FORMATS
from worker.request import GenerateRequest
from worker.sampling_params import SamplingParams
from worker.tiny_model import tiny_model
from worker.weight_formats import apply_weight_format, weight_bytes

console = Console(stderr=True)
SMOLLM2_SHAPED = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    architecture="llama",
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_ids=(2,),
)
LLAMA_1B_SHAPED = replace(
    SMOLLM2_SHAPED,
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    rope_theta=500000.0,
)
CONTEXT = 64


def step_ms(engine: Engine, steps: int) -> float:
    """The median of `steps` engine steps, each synchronised, after 5 warm-up steps."""
    times = []
    for i in range(steps + 5):
        torch.cuda.synchronize()
        began = time.perf_counter()
        if not engine.step():
            raise RuntimeError("the requests finished before the measurement did")
        torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e3


def formatted(fmt: str) -> CausalLM:
    """The SmolLM2-shaped model on the GPU in weight format `fmt`."""
    model = tiny_model(SMOLLM2_SHAPED, seed=0).to("cuda")
    return apply_weight_format(model, fmt)  # type: ignore[arg-type]


def decode_config(batch: int, length: int, **more: Any) -> EngineConfig:
    """An engine for `batch` requests of `CONTEXT`-token prompts growing to `length`: pages for
    all of them, and every prompt's prefill in the first step's budget."""
    return EngineConfig(
        num_pages=batch * (length // 16 + 2) + 8,
        page_size=16,
        max_running=batch,
        token_budget=batch * CONTEXT + 16,
        max_prefill_chunk=CONTEXT + 16,
        max_model_len=length,
        **more,
    )


def measure(model: CausalLM, fmt: str, batch: int, steps: int) -> dict[str, object]:
    engine = Engine(model, None, decode_config(batch, CONTEXT + steps + 64))
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(3, SMOLLM2_SHAPED.vocab_size, (CONTEXT,), generator=gen)
        prompt = tuple(int(t) for t in ids)
        engine.submit(GenerateRequest(f"r{i}", prompt, sampling=sampling), lambda _: None)
    engine.step()  # the prefills: the token budget holds every prompt
    ms = step_ms(engine, steps)
    return {
        "weights": fmt,
        "batch": batch,
        "step_ms": ms,
        "tokens_per_s": batch * 1e3 / ms,
        "weight_mb": weight_bytes(model) / 1e6,
    }


def host_tier_rows(prompt_tokens: int, repeats: int) -> list[dict[str, object]]:
    """`prefill_bench.host_tier` on the GPU for each shaped model in bf16."""
    from benchmarks.prefill_bench import host_tier  # only this section needs it

    rows = []
    gen = torch.Generator().manual_seed(1)
    for name, config in (("smollm2-135m", SMOLLM2_SHAPED), ("llama-3.2-1b", LLAMA_1B_SHAPED)):
        model = tiny_model(config, seed=0).to("cuda", torch.bfloat16)
        prompt = [
            int(t) for t in torch.randint(3, config.vocab_size, (prompt_tokens,), generator=gen)
        ]
        result = host_tier(model, prompt, repeats)
        rows.append({"model": name} | result)
        del model
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--weights", nargs="+", default=list(WEIGHT_FORMATS))
    parser.add_argument("--host-tier", type=int, default=0, help="prompt tokens (0: skip)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        console.print("needs a CUDA device: nothing was measured")
        return 2
    tiers = host_tier_rows(args.host_tier, args.repeats) if args.host_tier else []
    if tiers:
        table = Table(title=f"host tier on {torch.cuda.get_device_name()}, {args.host_tier} tokens")
        for column in ("model", "cold ms", "device hit ms", "host hit ms", "host / cold", "MB"):
            table.add_column(column, justify="right")
        for t in tiers:
            table.add_row(
                str(t["model"]),
                f"{t['cold_ttft_ms']:.1f}",
                f"{t['device_hit_ttft_ms']:.1f}",
                f"{t['host_hit_ttft_ms']:.1f}",
                f"{t['host_hit_ratio']:.3f}",
                f"{t['promoted_mb']:.0f}",
            )
        console.print(table)
    rows: list[dict[str, object]] = []
    for fmt in args.weights:  # one model a format, one engine a batch size
        model = formatted(fmt)
        rows.extend(measure(model, fmt, batch, args.steps) for batch in args.batches)
        del model
        torch.cuda.empty_cache()
    out = Table(title=f"decode on {torch.cuda.get_device_name()}, SmolLM2-shaped, {CONTEXT} tokens")
    for column in ("weights", "MB", "batch", "step ms", "tokens/s"):
        out.add_column(column, justify="right")
    for r in rows:
        out.add_row(
            str(r["weights"]),
            f"{r['weight_mb']:.0f}",
            str(r["batch"]),
            f"{r['step_ms']:.2f}",
            f"{r['tokens_per_s']:.0f}",
        )
    console.print(out)
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, "host_tier": tiers}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
