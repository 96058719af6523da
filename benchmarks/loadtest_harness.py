"""How fast the load-test harness itself is: streamed tokens/s it processes on one core.

A stub server (cluster/loadtest/stub_server.py) streams one token per message, as fast as it
can, in its own process pinned to another core; the harness (this process) is pinned to one
core and runs the random workload closed-loop against it. The harness must keep up with at least
2,000 streamed tokens/s without becoming the bottleneck. Prints one JSON object.
Run: `python benchmarks/loadtest_harness.py [--requests 300] [--tokens 64] [--concurrency 32]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console

from cluster.loadtest.grpc_api import Target
from cluster.loadtest.metrics import summarize
from cluster.loadtest.runner import Arrivals, Bounds, Run
from cluster.loadtest.workloads import WorkloadOptions, build

console = Console(stderr=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)
    cores = sorted(os.sched_getaffinity(0))
    stub = subprocess.Popen(
        [sys.executable, "-m", "cluster.loadtest.stub_server"], stdout=subprocess.PIPE, text=True
    )
    os.sched_setaffinity(stub.pid, {cores[-1]})
    try:
        line = stub.stdout.readline()  # type: ignore[union-attr]
        address = line.strip().rsplit(" ", 1)[-1]
        os.sched_setaffinity(0, {cores[0]})
        sessions = build(
            "random",
            WorkloadOptions(requests=args.requests, max_tokens=args.tokens, max_model_len=512),
        )
        run = Run(
            Target(address),
            sessions,
            Arrivals("closed", args.concurrency),
            Bounds(args.requests, 300.0),
            console,
        )
        records = asyncio.run(run.run())
        summary = summarize(records, run.duration)
        result = {
            "requests": summary["requests"],
            "streamed_tokens": sum(r.output_tokens for r in records),
            "messages": sum(len(r.token_times) for r in records),
            "seconds": run.duration,
            "tokens_per_s_one_core": summary["throughput"]["output_tokens_per_s"],
            "harness_core": cores[0],
            "stub_core": cores[-1],
        }
        print(json.dumps(result))
        console.print(
            f"the harness processed {result['tokens_per_s_one_core']:.0f} streamed tokens/s "
            f"({result['messages']} messages) on core {cores[0]}"
        )
        return 0
    finally:
        os.sched_setaffinity(0, cores)  # callers (tests) keep every core they had
        stub.terminate()
        stub.wait(timeout=10)


if __name__ == "__main__":
    raise SystemExit(main())
