"""`radixmesh loadtest`: run a workload against a cluster and write its reports.

    radixmesh loadtest --target 127.0.0.1:50051 --workload multi-turn --num-requests 200 \\
        --output-dir out/ [--arrival closed --concurrency 8 | --arrival poisson --rate 4 |
        --arrival trace --time-scale 0.05] [--sweep 1,4,16] [--compare cache_aware round_robin]
        [--tenants acme=1,globex=1] [--chaos worker-0@10 --ray-address HOST:PORT]

The target is probed first: an unreachable one ends the command within seconds, saying so.
`--compare` switches the router's policy through the Admin service and empties every cache
before each policy, so both start cold; `--sweep` runs each concurrency (closed) or rate
(poisson) in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

import grpc
from rich.console import Console

from cluster.client_tls import add_tls_arguments, tls_from_args
from cluster.loadtest import report, workloads
from cluster.loadtest.chaos import ChaosPlan
from cluster.loadtest.metrics import Slo, summarize
from cluster.loadtest.report import RunResult
from cluster.loadtest.runner import ARRIVALS, Arrivals, Bounds, Run, Target
from cluster.loadtest.trace import MOONCAKE_TRACE
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc

console = Console(stderr=True)


class Unreachable(RuntimeError):
    pass


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="127.0.0.1:50051", help="router host:port")
    parser.add_argument("--workload", choices=workloads.WORKLOADS, default="shared-prefix")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--output-dir", type=Path, default=Path("loadtest-results"))
    parser.add_argument("--arrival", choices=ARRIVALS, default="closed")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=4.0, help="sessions per second (poisson)")
    parser.add_argument("--sweep", default=None, help="comma-separated concurrencies or rates")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (multi-turn)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tenants", default="", help="weights, e.g. acme=3,globex=1")
    parser.add_argument("--adapters", default="", help="weights, e.g. =9,sql-lora=1")
    parser.add_argument("--trace", type=Path, default=MOONCAKE_TRACE)
    parser.add_argument("--trace-block-tokens", type=int, default=32, help="tokens per 512-block")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies trace times")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument("--chaos", default=None, help="TARGET@SECONDS: router@10, worker-0@10")
    parser.add_argument("--ray-address", default=None, help="the cluster's Ray (for --chaos)")
    parser.add_argument("--compare", nargs=2, metavar="POLICY", default=None)
    parser.add_argument(
        "--warmup", type=int, default=8, help="requests sent (and discarded) before measuring"
    )
    parser.add_argument("--token", default=None, help="bearer token (admin calls need a '*' one)")
    add_tls_arguments(parser)


def weights(text: str) -> list[tuple[str, float]]:
    if not text:
        return [("", 1.0)]
    pairs = []
    for item in text.split(","):
        name, _, weight = item.partition("=")
        pairs.append((name.strip(), float(weight or 1)))
    return pairs


async def probe(target: Target) -> serving_pb2.GetStatsResponse:
    async with target.channel() as channel:
        stub = serving_pb2_grpc.ServingStub(channel)
        try:
            return await stub.GetStats(
                serving_pb2.GetStatsRequest(), metadata=target.metadata, timeout=5
            )
        except grpc.aio.AioRpcError as err:
            raise Unreachable(
                f"cannot reach {target.address}: {err.code().name}: {err.details()}"
            ) from err


async def admin(target: Target, policy: str | None = None, clear: bool = True) -> None:
    async with target.channel() as channel:
        stub = serving_pb2_grpc.AdminStub(channel)
        if policy is not None:
            await stub.SetPolicy(
                serving_pb2.SetPolicyRequest(policy=policy), metadata=target.metadata, timeout=30
            )
        for attempt in range(60):
            if not clear:
                return
            try:
                await stub.ClearCaches(
                    serving_pb2.ClearCachesRequest(), metadata=target.metadata, timeout=30
                )
                return
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION or attempt == 59:
                    raise
                await asyncio.sleep(0.5)  # requests still finishing


async def one_run(
    args: argparse.Namespace,
    target: Target,
    options: workloads.WorkloadOptions,
    arrivals: Arrivals,
    label: str,
    chaos: ChaosPlan | None,
) -> tuple[RunResult, dict[str, object] | None]:
    sessions = workloads.build(args.workload, options)
    bounds = Bounds(args.num_requests, args.max_seconds, args.request_timeout)
    run = Run(target, sessions, arrivals, bounds, console, chaos=chaos)
    records = await run.run()
    settings = {
        "workload": args.workload,
        "arrival": arrivals.kind,
        "concurrency": arrivals.concurrency,
        "rate": arrivals.rate,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }
    summary = summarize(records, run.duration, Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    return RunResult(label, settings, summary, records), run.chaos_report


async def warm_up(
    args: argparse.Namespace, target: Target, options: workloads.WorkloadOptions
) -> None:
    """A few discarded requests (first forward passes are slow), then every cache emptied, so
    the first measured run starts as warm, and as cold, as the ones after it."""
    if args.warmup <= 0:
        return
    sessions = workloads.build("random", replace(options, requests=args.warmup, seed=args.seed + 1))
    bounds = Bounds(args.warmup, args.max_seconds, args.request_timeout)
    await Run(target, sessions, Arrivals("closed", 2), bounds, console).run()
    if args.compare or args.sweep:
        await admin(target)


async def main_async(args: argparse.Namespace) -> int:
    target = Target(args.target, args.token, tls_from_args(args))
    stats = await probe(target)
    options = workloads.WorkloadOptions(
        requests=args.num_requests, seed=args.seed, max_tokens=args.max_tokens,
        tenants=weights(args.tenants), adapters=weights(args.adapters), trace=args.trace,
        trace_block_tokens=args.trace_block_tokens, trace_time_scale=args.time_scale,
        vocab_size=stats.vocab_size or 49_152, max_model_len=stats.max_model_len or 2048,
        turns=args.turns,
    )  # fmt: skip
    if args.workload == "trace" and not args.trace.exists():
        raise Unreachable(f"the trace {args.trace} is absent (--trace PATH)")
    chaos = ChaosPlan.parse(args.chaos, args.ray_address) if args.chaos else None
    arrivals = Arrivals(args.arrival, args.concurrency, args.rate, args.seed)
    await warm_up(args, target, options)
    runs: list[RunResult] = []
    chaos_report = None
    if args.compare:
        for policy in args.compare:
            await admin(target, policy)
            result, _ = await one_run(args, target, options, arrivals, policy, None)
            runs.append(result)
    elif args.sweep:
        axis = "concurrency" if args.arrival == "closed" else "rate"
        for level in [float(x) for x in args.sweep.split(",")]:
            await admin(target)
            level_arrivals = Arrivals(args.arrival, int(level), level, args.seed)
            result, _ = await one_run(
                args, target, options, level_arrivals, f"{axis}={level:g}", None
            )
            result.offered_load = level
            result.settings["sweep_axis"] = axis
            runs.append(result)
    else:
        result, chaos_report = await one_run(args, target, options, arrivals, stats.policy, chaos)
        runs.append(result)
    paths = report.write(args.output_dir, runs, chaos_report, sweep=bool(args.sweep))
    print(report.markdown(runs, chaos_report))
    console.print("reports: " + ", ".join(str(p) for p in paths.values()))
    return 0


def main(args: argparse.Namespace) -> int:
    began = time.monotonic()
    try:
        return asyncio.run(main_async(args))
    except (Unreachable, ValueError) as err:
        console.print(f"[red]loadtest:[/] {err} (after {time.monotonic() - began:.1f} s)")
        return 2


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
