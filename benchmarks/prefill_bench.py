"""What the prefix cache saves: TTFT of a cached prompt vs a cold one, and decode with vs without.

For each model (SmolLM2-135M-Instruct, and a bigger random CPU-sized config):

- TTFT of a prompt of L tokens whose first P are already cached, for P/L in --fractions, next to
  the same prompt cold, as a measured ratio beside the FLOP ratio (what an ideal kernel saves);
- decode: tokens/s and per-step latency of 128 new tokens through the engine (paged KV cache)
  vs recomputing the whole sequence every step (no cache), seed 003's comparison;
- on SmolLM2, single-request decode through the engine vs transformers' `generate` (same CPU,
  same run, same greedy tokens);
- with `--sections host-tier` (not in the default run): TTFT of the whole prompt cold, cached on
  the device, and cached on the host tier (its pages demoted between requests and promoted back
  by the next one, a real copy of every layer's K and V), as ratios to cold: issue 15's target
  is host hit <= 25 % of cold. On a CPU both tiers are host memory, so the promotion is a copy
  within RAM, not a PCIe transfer;
- with `--sections cold`: cold TTFT of prompts of each of --cold-lens tokens;
- with `--sections chats`: two conversations of --chat-turns turns each, interleaved (A1 B1 A2
  B2 ...), every turn's prompt the whole conversation so far (a shared system prompt, then
  user and assistant turns of fixed token counts, random ids: TTFT does not read them); the TTFT
  of each turn and their sum. The engine's prefix cache serves each turn's history.

`--weights float32 bf16 int8 int4` repeats everything per weight format (benchmarks/
weights_axis.py: `load_model(..., weights=fmt)`), reporting the weights' size beside it.
`--against llama.cpp` runs the cold, decode and chats sections on llama.cpp too, on the same
GGUF file (SmolLM2 only; benchmarks/llama_cpp_side.py, through llama-cpp-python when it is
installed, else one line saying it was skipped), same token ids, same thread count, and reports
radixmesh / llama.cpp for each. `--rounds N` then measures decode and the cold TTFTs N more
times on each side, once each a round, alternating sides (who goes first alternates too), and
reports each round's ratio with their median, min and max: on a machine whose speed drifts
between phases, a ratio of two runs minutes apart measures the drift as well.

Prints one JSON object (and --output) and a report in seed 003's shape. Medians of --repeats.
Run: `python benchmarks/prefill_bench.py [--models smollm2 big] [--prompt-len 1024]`; issue 19's
table: `python benchmarks/prefill_bench.py --models smollm2 --weights float32 bf16 int8 int4
--sections cold decode chats --against llama.cpp --no-transformers --no-uncached --threads 2`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import llama_cpp_side
from benchmarks.weights_axis import BIG, load_for_bench, weight_bytes
from worker.config import ModelConfig
from worker.default_model import default_gguf_path, default_model_dir
from worker.engine import Engine, EngineConfig
from worker.model import CausalLM
from worker.model_runner import Chunk, ModelRunner
from worker.quantized_weights import WEIGHT_FORMATS
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams

console = Console(stderr=True)
HOST_TARGET = 0.25
"""Issue 15: TTFT of a prompt served from the host tier <= this fraction of recomputing it."""
SECTIONS = ("ttft", "decode", "host-tier", "cold", "chats")
AGAINST = ("llama.cpp",)
__all__ = ["BIG", "first_token_seconds", "main", "prefill_flops"]


def prefill_flops(config: ModelConfig, start: int, end: int) -> float:
    """FLOPs to compute positions [start, end) over a cached [0, start), logits at the last only."""
    h, layers = config.hidden_size, config.num_layers
    per_token = 2 * layers * (h * (config.q_size + 2 * config.kv_size) + config.q_size * h)
    per_token += 2 * layers * 3 * h * config.intermediate_size
    tokens = end - start
    keys = (start + 1 + end) * tokens / 2  # sum of the key counts of the queries
    attention = 4 * layers * config.num_heads * config.head_dim * keys
    return per_token * tokens + attention + 2 * h * config.vocab_size


def bench_engine(
    model: CausalLM, tokenizer: object, length: int, host_pages: int = 0, **overrides: Any
) -> Engine:
    """An engine that prefills a prompt of `length` in one pass; `overrides` set other fields
    of its EngineConfig (benchmarks/copy_stream_bench.py: where tier copies go)."""
    config = EngineConfig(
        num_pages=2 * length // 16 + 64,
        page_size=16,
        max_running=4,
        token_budget=length + 16,
        max_prefill_chunk=length + 16,
        max_model_len=length + 256,
        host_pages=host_pages,
        **overrides,
    )
    return Engine(model, tokenizer, config)  # type: ignore[arg-type]


def first_token(engine: Engine, prompt: list[int], request_id: str) -> tuple[float, RequestOutput]:
    """Submit, step until the first token; returns (seconds, that output)."""
    outputs: list[RequestOutput] = []
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    began = time.perf_counter()
    engine.submit(GenerateRequest(request_id, tuple(prompt), sampling=sampling), outputs.append)
    while not outputs:
        engine.step()
    elapsed = time.perf_counter() - began
    while engine.step():
        pass
    return elapsed, outputs[0]


def first_token_seconds(engine: Engine, prompt: list[int], request_id: str) -> tuple[float, int]:
    """Submit, step until the first token; returns (seconds, cached prompt tokens)."""
    elapsed, output = first_token(engine, prompt, request_id)
    return elapsed, output.cached_prompt_tokens


def ttft(model: CausalLM, prompt: list[int], fractions: list[float], repeats: int) -> dict:
    engine = bench_engine(model, None, len(prompt))
    first_token_seconds(engine, prompt[:64], "warmup")
    cold = []
    for r in range(repeats):
        engine.cache.tree.clear()
        cold.append(first_token_seconds(engine, prompt, f"cold{r}")[0])
    cold_s = statistics.median(cold)
    rows = []
    for fraction in fractions:
        cached = int(fraction * len(prompt))
        times, used = [], 0
        for r in range(repeats):
            engine.cache.tree.clear()
            first_token_seconds(engine, prompt[:cached], f"warm{fraction}{r}")
            seconds, used = first_token_seconds(engine, prompt, f"hit{fraction}{r}")
            times.append(seconds)
        hit_s = statistics.median(times)
        flop_ratio = prefill_flops(model.config, used, len(prompt)) / prefill_flops(
            model.config, 0, len(prompt)
        )
        rows.append(
            {
                "cached_fraction": fraction,
                "cached_tokens": used,
                "ttft_ms": 1000 * hit_s,
                "ratio_to_cold": hit_s / cold_s,
                "flop_ratio": flop_ratio,
            }
        )
    return {"prompt_tokens": len(prompt), "cold_ttft_ms": 1000 * cold_s, "cached": rows}


def host_tier(model: CausalLM, prompt: list[int], repeats: int) -> dict:
    """TTFT of `prompt` cold, whole on the device, and whole on the host tier, alternating.

    Each repeat: clear the cache; the cold request (which caches the prompt); the device hit;
    then every cached page is demoted (`evict` with a host tier, the demotion copies performed
    there, outside the timing) and the host hit promotes them back as it starts (inside it).
    The engine is driven by `step()` on this thread, so the cache may be touched between steps.
    """
    pages = 2 * len(prompt) // 16 + 64
    engine = bench_engine(model, None, len(prompt), host_pages=pages)
    first_token_seconds(engine, prompt[:64], "warmup")
    tree = engine.cache.tree
    times: dict[str, list[float]] = {"cold": [], "device": [], "host": []}
    tokens: dict[str, list[int]] = {"cold": [], "device": [], "host": []}
    cached = {"device": 0, "host": 0}
    demoted, promoted, host_hits = [], [], []
    for r in range(repeats):
        tree.clear()
        for path in ("cold", "device", "host"):
            if path == "host":
                before = engine.stats()
                tree.evict(tree.evictable_pages)  # demotes every cached page to the host tier
                engine.runner.copy_pages(engine.cache.take_tier_copies())
                middle = engine.stats()
                demoted.append(middle.demoted_pages - before.demoted_pages)
            seconds, output = first_token(engine, prompt, f"{path}{r}")
            times[path].append(seconds)
            tokens[path].append(output.token_ids[0])
            if path != "cold":
                cached[path] = output.cached_prompt_tokens
        after = engine.stats()
        promoted.append(after.promoted_pages - middle.promoted_pages)
        host_hits.append(after.host_hit_tokens - middle.host_hit_tokens)
    ms = {path: 1000 * statistics.median(values) for path, values in times.items()}
    per_page = engine.runner.page_bytes
    return {
        "prompt_tokens": len(prompt),
        "page_size": engine.config.page_size,
        "host_pages": pages,
        "repeats": repeats,
        "cold_ttft_ms": ms["cold"],
        "device_hit_ttft_ms": ms["device"],
        "host_hit_ttft_ms": ms["host"],
        "device_hit_ratio": ms["device"] / ms["cold"],
        "host_hit_ratio": ms["host"] / ms["cold"],
        "device_cached_tokens": cached["device"],
        "host_cached_tokens": cached["host"],
        "demoted_pages": demoted,
        "promoted_pages": promoted,
        "host_hit_tokens": host_hits,
        "promoted_mb": promoted[-1] * per_page / 1e6,
        "same_first_token": tokens["host"] == tokens["device"] == tokens["cold"],
        "ttft_ms": {path: [1000 * t for t in values] for path, values in times.items()},
        "target_ratio": HOST_TARGET,
        "within_target": ms["host"] / ms["cold"] <= HOST_TARGET,
    }


def decode_with_cache(model: CausalLM, prompt: list[int], new_tokens: int) -> dict:
    engine = bench_engine(model, None, len(prompt) + new_tokens)
    stamps: list[float] = []
    tokens: list[int] = []
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def sink(output: object) -> None:
        stamps.append(time.perf_counter())
        tokens.extend(output.token_ids)  # type: ignore[attr-defined]

    began = time.perf_counter()
    engine.submit(GenerateRequest("decode", tuple(prompt), sampling=sampling), sink)
    while engine.step():
        pass
    steps = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "ttft_ms": 1000 * (stamps[0] - began),
        "decode_s": stamps[-1] - stamps[0],
        "tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
        "step_ms": _latency(steps),
        "tokens": tokens,
        "kv_cache_mb": sum(k.numel() * k.element_size() * 2 for k, _ in engine.runner.kv) / 1e6,
    }


def decode_without_cache(model: CausalLM, prompt: list[int], new_tokens: int) -> dict:
    """Seed 003's baseline: every step recomputes the whole sequence from scratch."""
    sequence, steps = list(prompt), []
    for _ in range(new_tokens):
        began = time.perf_counter()
        runner = ModelRunner(model, num_pages=len(sequence) // 16 + 2, page_size=16)
        pages = list(range(1, len(sequence) // 16 + 2))
        sequence.append(int(runner.run([Chunk(sequence, 0, pages, True)])[0].argmax()))
        steps.append(time.perf_counter() - began)
    return {
        "tokens_per_s": (new_tokens - 1) / sum(steps[1:]),
        "step_ms": _latency(steps[1:]),
        "tokens": sequence[len(prompt) :],
    }


def decode_transformers(path: Path, prompt: list[int], new_tokens: int) -> dict:
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    kwargs = dict(attention_mask=mask, do_sample=False, eos_token_id=None)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, **kwargs)
        began = time.perf_counter()
        first = model.generate(ids, max_new_tokens=1, **kwargs)
        first_s = time.perf_counter() - began
        began = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
        total = time.perf_counter() - began
    del first
    return {
        "tokens_per_s": (new_tokens - 1) / max(1e-9, total - first_s),
        "tokens": out[0, len(prompt) :].tolist(),
    }


def _latency(steps: list[float]) -> dict:
    ms = sorted(1000 * s for s in steps)
    return {
        "mean": statistics.fmean(ms),
        "p50": ms[len(ms) // 2],
        "p95": ms[int(0.95 * (len(ms) - 1))],
        "p99": ms[int(0.99 * (len(ms) - 1))],
        "min": ms[0],
        "max": ms[-1],
    }


def cold_ttfts(model: CausalLM, prompt: list[int], lengths: list[int], repeats: int) -> dict:
    """Cold TTFT (median of `repeats`, cache cleared before each) of the first L tokens of
    `prompt`, for each L in `lengths`."""
    engine = bench_engine(model, None, max(lengths))
    first_token_seconds(engine, prompt[:64], "warmup")
    ms = {}
    for length in lengths:
        times = []
        for r in range(repeats):
            engine.cache.tree.clear()
            times.append(first_token_seconds(engine, prompt[:length], f"cold{length}-{r}")[0])
        ms[str(length)] = 1000 * statistics.median(times)
    return {"ttft_ms": ms}


def chat_turns(vocab: int, args: argparse.Namespace) -> list[list[int]]:
    """The prompts of two interleaved conversations (A1 B1 A2 B2 ...), each the conversation so
    far: a system prompt both share, then per turn a user message and (before the next turn) an
    assistant reply, of fixed token counts, random ids (seeded)."""
    generator = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    system = ids(args.chat_system_tokens)
    history = [list(system), list(system)]
    turns = []
    for _ in range(args.chat_turns):
        for chat in history:
            chat.extend(ids(args.chat_user_tokens))
            turns.append(list(chat))
            chat.extend(ids(args.chat_reply_tokens))
    return turns


def chats(model: CausalLM, turns: list[list[int]]) -> dict:
    """TTFT of each turn through one engine (its prefix cache holding both histories)."""
    engine = bench_engine(model, None, 2 * max(len(t) for t in turns))
    first_token_seconds(engine, turns[0][:64], "warmup")
    engine.cache.tree.clear()
    seconds, cached = [], []
    for i, prompt in enumerate(turns):
        elapsed, hit = first_token_seconds(engine, prompt, f"turn{i}")
        seconds.append(elapsed)
        cached.append(hit)
    return {
        "turn_tokens": [len(t) for t in turns],
        "cached_tokens": cached,
        "ttft_ms": [1000 * t for t in seconds],
        "sum_ttft_s": sum(seconds),
    }


def bench_prompt(vocab: int, args: argparse.Namespace) -> list[int]:
    """The random prompt every section cuts its prompts from (seeded: the same on each side)."""
    length = max(args.prompt_len, *args.cold_lens)
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0)).tolist()


def bench_model(name: str, weights: str, args: argparse.Namespace) -> dict:
    model = load_for_bench(name, weights)
    path = default_model_dir() if name == "smollm2" else None
    vocab = model.config.vocab_size
    prompt = bench_prompt(vocab, args)
    result: dict = {
        "model": name,
        "weights": weights,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": vocab,
        "weight_mb": weight_bytes(model) / 1e6,
    }
    if "ttft" in args.sections:
        console.print(f"[bold]{name}[/] ({weights}): TTFT, {args.prompt_len}-token prompt")
        result["ttft"] = ttft(model, prompt[: args.prompt_len], args.fractions, args.repeats)
    if "host-tier" in args.sections:
        console.print(f"[bold]{name}[/] ({weights}): host tier, {args.prompt_len}-token prompt")
        result["host_tier"] = host_tier(model, prompt[: args.prompt_len], args.repeats)
    if "cold" in args.sections:
        console.print(f"[bold]{name}[/] ({weights}): cold TTFT, {args.cold_lens} tokens")
        result["cold"] = cold_ttfts(model, prompt, args.cold_lens, args.repeats)
    if "decode" in args.sections:
        result["decode"] = decode(name, model, path, prompt[: args.prompt_len], args)
    if "chats" in args.sections:
        console.print(f"[bold]{name}[/] ({weights}): two interleaved {args.chat_turns}-turn chats")
        result["chats"] = chats(model, chat_turns(vocab, args))
    return result


def alternated_rounds(name: str, mine: list[dict], args: argparse.Namespace) -> dict:
    """`--rounds`: each format's decode and cold TTFTs, and llama.cpp's, one measurement of
    each a round, the side going first alternating round by round (an even count puts each
    side first equally often). Returns per side {"decode": [tokens/s a round], "cold":
    {length: [ms a round]}} for what `args.sections` holds of the two. The table shows the
    median of a side's rounds and the median (min-max) of the rounds' ratios."""
    prompt = bench_prompt(mine[0]["vocab_size"], args)
    short = prompt[: args.decode_prompt_len]
    models = {r["weights"]: load_for_bench(name, r["weights"]) for r in mine}
    decode, cold = "decode" in args.sections, "cold" in args.sections
    sections = [s for s in ("decode", "cold") if s in args.sections]
    job = llama_job(mine[0]["vocab_size"], args, sections, 1)
    sides = ["llama.cpp", *models]
    rounds: dict = {
        side: {"decode": [], "cold": {str(n): [] for n in args.cold_lens}} for side in sides
    }
    for r in range(args.rounds):
        console.print(f"[bold]{name}[/]: round {r + 1} of {args.rounds}")
        for side in sides if r % 2 else [*sides[1:], sides[0]]:
            got = rounds[side]
            if side == "llama.cpp":
                theirs = llama_cpp_side.measure_in_subprocess(job)
                measured = theirs.get("cold", {}).get("ttft_ms", {})
                got["decode"] += [theirs["decode"]["tokens_per_s"]] if decode else []
            else:
                model = models[side]
                measured = cold_ttfts(model, prompt, args.cold_lens, 1)["ttft_ms"] if cold else {}
                if decode:
                    got["decode"].append(
                        decode_with_cache(model, short, args.decode_tokens)["tokens_per_s"]
                    )
            for n, ms in measured.items():
                got["cold"][n].append(ms)
    return rounds


def rounds_ratios(rounds: dict, weights: str) -> dict:
    """Each round's radixmesh / llama.cpp, with their median, min and max: decode tokens/s,
    and each cold TTFT."""
    ours, theirs = rounds[weights], rounds["llama.cpp"]
    pairs = {"decode": (ours["decode"], theirs["decode"])}
    pairs |= {f"cold {n}": (ms, theirs["cold"][n]) for n, ms in ours["cold"].items()}
    ratios = {}
    for measure, (a, b) in pairs.items():
        if a:
            each = [x / y for x, y in zip(a, b, strict=True)]
            ratios[measure] = {
                "ratios": each,
                "median": statistics.median(each),
                "min": min(each),
                "max": max(each),
            }
    return ratios


def against_llama_cpp(name: str, vocab: int, args: argparse.Namespace) -> dict:
    """The cold, decode and chats sections on llama.cpp, same GGUF and token ids; or why not."""
    if name != "smollm2":
        return {"skipped": f"{name} has no GGUF file (only smollm2 does)"}
    why = llama_cpp_side.unavailable()
    if why is not None:
        return {"skipped": why}
    job = llama_job(vocab, args, args.sections, args.repeats)
    console.print(f"[bold]llama.cpp[/]: {', '.join(k for k in SECTIONS if k in job)}")
    return llama_cpp_side.measure_in_subprocess(job)


def llama_job(vocab: int, args: argparse.Namespace, sections: list[str], repeats: int) -> dict:
    """llama.cpp's job for the cold, decode and chats sections among `sections`: our side's
    token ids, a context that holds the longest of every section `args` asks for."""
    prompt = bench_prompt(vocab, args)
    turns = chat_turns(vocab, args)
    longest = max(*(len(t) for t in turns), *args.cold_lens, 1024)
    job: dict = {
        "gguf": str(default_gguf_path()),
        "threads": torch.get_num_threads(),
        "n_ctx": max(longest, args.decode_prompt_len + args.decode_tokens) + 256,
        "repeats": repeats,
    }
    if "cold" in sections:
        job["cold"] = [prompt[:n] for n in args.cold_lens]
    if "decode" in sections:
        short = prompt[: args.decode_prompt_len]
        job["decode"] = {"prompt": short, "new_tokens": args.decode_tokens}
    if "chats" in sections:
        job["chats"] = turns
    return job


def compared(ours: dict, theirs: dict) -> dict:
    """radixmesh / llama.cpp for each measure both sides have (time ratios: < 1 is faster)."""
    ratios: dict = {}
    if "cold" in ours and "cold" in theirs:
        mine, other = ours["cold"]["ttft_ms"], theirs["cold"]["ttft_ms"]
        ratios["cold_ttft"] = {n: mine[n] / other[n] for n in mine if n in other}
    if "decode" in ours and "decode" in theirs:
        ratios["decode_tokens_per_s"] = (
            ours["decode"]["with_cache"]["tokens_per_s"] / theirs["decode"]["tokens_per_s"]
        )
        ratios["same_decode_tokens"] = ours["decode"].get("tokens") == theirs["decode"]["tokens"]
    if "chats" in ours and "chats" in theirs:
        ratios["chats_sum_ttft"] = ours["chats"]["sum_ttft_s"] / theirs["chats"]["sum_ttft_s"]
    return ratios


def decode(
    name: str, model: CausalLM, path: Path | None, prompt: list[int], args: argparse.Namespace
) -> dict:
    short = prompt[: args.decode_prompt_len]
    console.print(f"[bold]{name}[/]: decode, {args.decode_tokens} tokens")
    cached = decode_with_cache(model, short, args.decode_tokens)
    result = {
        "prompt_tokens": len(short),
        "new_tokens": args.decode_tokens,
        "with_cache": {k: v for k, v in cached.items() if k != "tokens"},
        "tokens": cached["tokens"],
    }
    if not args.no_uncached:
        uncached = decode_without_cache(model, short, args.decode_tokens)
        assert cached["tokens"] == uncached["tokens"], "cache and no-cache decodes disagree"
        result["without_cache"] = {k: v for k, v in uncached.items() if k != "tokens"}
        result["speedup"] = cached["tokens_per_s"] / uncached["tokens_per_s"]
    if path is not None and not args.no_transformers:
        reference = decode_transformers(path, short, args.decode_tokens)
        result["transformers_generate"] = {
            "tokens_per_s": reference["tokens_per_s"],
            "same_tokens": reference["tokens"] == cached["tokens"],
        }
        result["ratio_to_transformers"] = cached["tokens_per_s"] / reference["tokens_per_s"]
    return result


def report(result: dict) -> None:
    lines = [
        f"=== Prefix-cache benchmark: {result['model']} ({result['parameters'] / 1e6:.1f} M) ===",
        f"Weights:          {result['weights']} ({result['weight_mb']:.0f} MB), activations "
        "float32 (CPU, torch SDPA attention)",
    ]
    if "decode" in result:
        mb = result["decode"]["with_cache"]["kv_cache_mb"]
        lines.append(f"KV cache:         paged, page_size 16 ({mb:.1f} MB)")
    if "ttft" in result:
        lines += _ttft_lines(result["ttft"])
    if "decode" in result:
        lines += _decode_lines(result["decode"])
    if "cold" in result:
        cold = ", ".join(f"{n}: {ms:.0f} ms" for n, ms in result["cold"]["ttft_ms"].items())
        lines += ["", f"Cold TTFT:          {cold}"]
    if "chats" in result:
        c = result["chats"]
        lines.append(
            f"Interleaved chats:  {len(c['ttft_ms'])} turns, sum of TTFTs {c['sum_ttft_s']:.2f} s"
        )
    console.print("\n".join(lines) + "\n")
    if "host_tier" in result:
        console.print(host_tier_table(result["host_tier"]))


def against_table(results: list[dict], theirs: dict) -> Table:
    """Issue 19's table: each weight format's measures next to llama.cpp's."""
    table = Table(title=f"radixmesh vs llama.cpp ({theirs.get('gguf', '')}), same run")
    table.add_column("measure")
    table.add_column("llama.cpp", justify="right")
    for r in results:
        table.add_column(f"{r['weights']} ({r['weight_mb']:.0f} MB)", justify="right")
    if "decode" in theirs:
        cells = [
            f"{r['decode']['with_cache']['tokens_per_s']:.1f} "
            f"({r['against']['decode_tokens_per_s']:.2f}x)"
            for r in results
        ]
        table.add_row("decode tok/s", f"{theirs['decode']['tokens_per_s']:.1f}", *cells)
    if "rounds" in theirs:
        n = len(theirs["rounds"]["decode"]) or len(next(iter(theirs["rounds"]["cold"].values())))
        for measure in results[0]["against"]["rounds"]:
            table.add_row(
                f"{measure}, {n} rounds alternated",
                _rounds_theirs(theirs["rounds"], measure),
                *(_rounds_cell(r, measure) for r in results),
            )
    for n, ms in theirs.get("cold", {}).get("ttft_ms", {}).items():
        cells = [
            f"{r['cold']['ttft_ms'][n] / 1000:.2f} s ({r['against']['cold_ttft'][n]:.2f}x)"
            for r in results
        ]
        table.add_row(f"cold TTFT {n}", f"{ms / 1000:.2f} s", *cells)
    if "chats" in theirs:
        cells = [
            f"{r['chats']['sum_ttft_s']:.2f} s ({r['against']['chats_sum_ttft']:.2f}x)"
            for r in results
        ]
        table.add_row("chats, sum of TTFTs", f"{theirs['chats']['sum_ttft_s']:.2f} s", *cells)
    return table


def _rounds_theirs(rounds: dict, measure: str) -> str:
    if measure == "decode":
        return f"{statistics.median(rounds['decode']):.1f} tok/s"
    return f"{statistics.median(rounds['cold'][measure.split()[1]]) / 1000:.2f} s"


def _rounds_cell(result: dict, measure: str) -> str:
    ratio = result["against"]["rounds"][measure]
    spread = f"({ratio['median']:.2f}x, {ratio['min']:.2f}-{ratio['max']:.2f})"
    return f"{_rounds_theirs(result['rounds'], measure).removesuffix(' tok/s')} {spread}"


def _ttft_lines(t: dict) -> list[str]:
    lines = [
        "",
        f"--- Prefill: {t['prompt_tokens']}-token prompt ---",
        f"TTFT cold (median):        {t['cold_ttft_ms']:.1f} ms",
    ]
    for row in t["cached"]:
        lines.append(
            f"TTFT {row['cached_tokens']:5d} cached ({row['cached_fraction']:.0%}): "
            f"{row['ttft_ms']:8.1f} ms  = {row['ratio_to_cold']:.3f} of cold "
            f"(FLOP ratio {row['flop_ratio']:.3f})"
        )
    return lines


def _decode_lines(d: dict) -> list[str]:
    w = d["with_cache"]
    step = w["step_ms"]
    lines = [
        "",
        f"--- Decode: {d['new_tokens']} tokens after a {d['prompt_tokens']}-token prompt ---",
    ]
    if "without_cache" in d:
        wo = d["without_cache"]
        lines += [
            f"Decode throughput:  {wo['tokens_per_s']:.1f} -> {w['tokens_per_s']:.1f} tok/s "
            f"({d['speedup']:.1f}x with the cache)",
            f"Per-step latency:   mean {step['mean']:.1f} ms (was {wo['step_ms']['mean']:.1f}), "
            f"p50 {step['p50']:.1f}, p95 {step['p95']:.1f}, p99 {step['p99']:.1f}, "
            f"min {step['min']:.1f}, max {step['max']:.1f}",
        ]
    else:
        lines += [
            f"Decode throughput:  {w['tokens_per_s']:.1f} tok/s",
            f"Per-step latency:   mean {step['mean']:.1f} ms, p50 {step['p50']:.1f}, "
            f"p95 {step['p95']:.1f}, min {step['min']:.1f}, max {step['max']:.1f}",
        ]
    if "transformers_generate" in d:
        hf = d["transformers_generate"]
        lines.append(
            f"transformers generate: {hf['tokens_per_s']:.1f} tok/s; radixmesh engine "
            f"{w['tokens_per_s']:.1f} tok/s ({d['ratio_to_transformers']:.2f}x), "
            f"same tokens: {hf['same_tokens']}"
        )
    return lines


def host_tier_table(h: dict) -> Table:
    verdict = "met" if h["within_target"] else "NOT met"
    table = Table(
        title=f"Host tier: {h['prompt_tokens']}-token prompt, page_size {h['page_size']}, "
        f"median of {h['repeats']} (target host hit <= {h['target_ratio']:.0%} of cold: "
        f"{verdict})"
    )
    for column in ("TTFT of", "cached tokens", "pages promoted", "median ms", "of cold"):
        table.add_column(column, justify="right")
    table.add_row("cold (no cache)", "0", "-", f"{h['cold_ttft_ms']:.1f}", "1.000")
    table.add_row(
        "device hit",
        str(h["device_cached_tokens"]),
        "-",
        f"{h['device_hit_ttft_ms']:.1f}",
        f"{h['device_hit_ratio']:.3f}",
    )
    table.add_row(
        "host hit",
        str(h["host_cached_tokens"]),
        f"{h['promoted_pages'][-1]} ({h['promoted_mb']:.1f} MB)",
        f"{h['host_hit_ttft_ms']:.1f}",
        f"{h['host_hit_ratio']:.3f}",
    )
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", choices=["smollm2", "big", "tiny"], default=["smollm2", "big"]
    )
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.9, 0.97])
    parser.add_argument("--decode-prompt-len", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=["ttft", "decode"],
        help="what to measure (host-tier: TTFT from the host tier vs cold, issue 15)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument(
        "--no-uncached", action="store_true", help="skip decode's recompute-everything baseline"
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        choices=WEIGHT_FORMATS,
        default=["float32"],
        help="weight formats to measure, one after the other (worker/weight_formats.py)",
    )
    parser.add_argument(
        "--against",
        choices=AGAINST,
        default=None,
        help="also run the cold / decode / chats sections on llama.cpp, same GGUF (smollm2)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="with --against: measure decode and cold TTFT this many more times on each side, "
        "alternating sides",
    )
    parser.add_argument("--cold-lens", type=int, nargs="+", default=[256, 1024, 1999])
    parser.add_argument("--chat-turns", type=int, default=5)
    parser.add_argument("--chat-system-tokens", type=int, default=64)
    parser.add_argument("--chat-user-tokens", type=int, default=128)
    parser.add_argument("--chat-reply-tokens", type=int, default=160)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.rounds and (args.against is None or not {"decode", "cold"} & set(args.sections)):
        parser.error("--rounds alternates the decode and cold sections with --against's")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict = {"torch_threads": torch.get_num_threads(), "models": []}
    for name in args.models:
        mine = []
        for weights in args.weights:
            result = bench_model(name, weights, args)
            results["models"].append(result)
            mine.append(result)
            report(result)
        if args.against is None:
            continue
        theirs = against_llama_cpp(name, mine[0]["vocab_size"], args)
        results.setdefault("llama_cpp", {})[name] = theirs
        if "skipped" in theirs:
            console.print(f"llama.cpp comparison skipped: {theirs['skipped']}")
            continue
        for result in mine:
            result["against"] = compared(result, theirs)
        if args.rounds:  # parse_args saw to the sections
            rounds = alternated_rounds(name, mine, args)
            theirs["rounds"] = rounds["llama.cpp"]
            for result in mine:
                result["rounds"] = rounds[result["weights"]]
                result["against"]["rounds"] = rounds_ratios(rounds, result["weights"])
        console.print(against_table(mine, theirs))
    for result in results["models"]:
        result.get("decode", {}).pop("tokens", None)
    for theirs in results.get("llama_cpp", {}).values():
        theirs.get("decode", {}).pop("tokens", None)
    print(json.dumps(results))
    if args.output is not None:
        args.output.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
