"""`radixmesh loadtest`: run a workload against a cluster and write its reports.

    radixmesh loadtest --target 127.0.0.1:50051 --workload multi-turn --num-requests 200 \\
        --output-dir out/ [--arrival closed --concurrency 8 | --arrival poisson --rate 4 |
        --arrival trace --time-scale 0.05] [--sweep 1,4,16] [--compare cache_aware round_robin]
        [--tenants acme=1,globex=1] [--chaos worker-0@10 --ray-address HOST:PORT]
    radixmesh loadtest --api openai --target http://127.0.0.1:8000 [--model ID]
        [--grpc-target 127.0.0.1:50051 (for --compare, --sweep, several --text-match)] ...
    radixmesh loadtest --workload plain-multi-turn --text-match exact anchored ...

The flags are checked first (cluster/loadtest/checks.py), then the target is probed: a bad
flag, an unreachable target or refused credentials end the command within seconds, saying so.
`--api` picks the API every request goes through: gRPC's Serving.Generate, or the OpenAI API's
streamed completions (cluster/loadtest/openai_api.py); the reports say which. `--compare`
switches the router's policy through the Admin service (gRPC, whichever API the requests use)
and empties every cache before each policy, so both start cold; `--sweep` runs each
concurrency (closed) or rate (poisson) in turn. `--text-match MODE` asks the router's text
index for that mode in every request (serving.proto's text_match, or the HTTP body's); with
several modes, each runs in turn from emptied caches (the workers' and the router's text
index) and the reports put them side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from cluster.client_auth import add_token_argument
from cluster.client_tls import add_tls_arguments
from cluster.loadtest import chaos, openai_api, report, server_metrics, workloads
from cluster.loadtest.checks import Checked, check
from cluster.loadtest.control import ServerError, admin, probe
from cluster.loadtest.grpc_api import Target
from cluster.loadtest.metrics import Slo, summarize
from cluster.loadtest.report import RunResult
from cluster.loadtest.runner import ARRIVALS, Arrivals, Bounds, Endpoint, Run
from cluster.loadtest.trace import MOONCAKE_TRACE
from cluster.loadtest.workloads import Session

console = Console(stderr=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api", choices=("grpc", "openai"), default="grpc")
    parser.add_argument(
        "--target",
        default=None,
        help="the router's host:port (grpc; default 127.0.0.1:50051), or its HTTP API's base "
        "URL (openai; default http://127.0.0.1:8000)",
    )
    parser.add_argument(
        "--grpc-target",
        default=None,
        help="with --api openai: the router's gRPC host:port, for the Admin calls of --compare "
        "and --sweep",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="with --api openai: the model id (default: the first GET /v1/models lists)",
    )
    parser.add_argument("--workload", choices=workloads.WORKLOADS, default="shared-prefix")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--output-dir", type=Path, default=Path("loadtest-results"))
    parser.add_argument("--arrival", choices=ARRIVALS, default="closed")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=4.0, help="sessions per second (poisson)")
    parser.add_argument(
        "--sweep", default=None, help="comma-separated concurrencies (closed) or rates (poisson)"
    )
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation (multi-turn)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tenants", default="", help="weights, e.g. acme=3,globex=1")
    parser.add_argument(
        "--adapters",
        default="",
        help="weights, e.g. =9,sql-lora=1 ('' is the base model), or zipf:N[:S] over lora-0.."
        "lora-(N-1) (the OpenAI API names an adapter as its model)",
    )
    parser.add_argument("--trace", type=Path, default=MOONCAKE_TRACE)
    parser.add_argument("--trace-block-tokens", type=int, default=32, help="tokens per 512-block")
    parser.add_argument("--time-scale", type=float, default=1.0, help="multiplies trace times")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument(
        "--chaos", default=None, help="TARGET@SECONDS, TARGET router or worker-<N>: worker-0@10"
    )
    parser.add_argument("--ray-address", default=None, help="the cluster's Ray (for --chaos)")
    parser.add_argument("--compare", nargs=2, metavar="POLICY", default=None)
    parser.add_argument(
        "--text-match",
        nargs="+",
        choices=workloads.TEXT_MATCHES,
        default=None,
        metavar="MODE",
        help="how the router's text index tokenises text and chat prompts, sent with every "
        "request (exact, anchored, off; default: the router's router.text_index.mode); "
        "several: one run per mode from emptied caches, reported side by side",
    )
    parser.add_argument(
        "--warmup", type=int, default=64, help="requests sent (and discarded) before measuring"
    )
    parser.add_argument(
        "--server-metrics",
        nargs="+",
        default=None,
        metavar="URL",
        help="the router's Prometheus endpoint (and any workers'), e.g. "
        "http://127.0.0.1:9400/metrics: read before and after each run, the report puts the "
        "cluster's own latency percentiles beside the client's",
    )
    add_token_argument(
        parser,
        "with tokens configured, --compare, --sweep and several --text-match modes need one "
        "bound to '*' (admin)",
    )
    add_tls_arguments(parser)


@dataclass(frozen=True)
class Probed:
    """What the command learnt of the cluster before its runs."""

    endpoint: Endpoint
    """Where the requests go."""
    admin: Target | None
    """The gRPC port for the Admin calls (None: --api openai without --grpc-target)."""
    policy: str | None
    vocab_size: int
    max_model_len: int


async def probe_target(args: argparse.Namespace, checked: Checked) -> Probed:
    """The probe of the API the requests use (gRPC's GetStats; GET /health and /v1/models), and
    GetStats over --grpc-target too (the policy and the vocabulary only gRPC reports)."""
    grpc_target = checked.target if args.api == "grpc" else checked.grpc_target
    admin_target = Target(grpc_target, checked.token, checked.tls) if grpc_target else None
    stats = await probe(admin_target) if admin_target is not None else None
    if args.api == "grpc":
        assert admin_target is not None and stats is not None
        return Probed(
            admin_target, admin_target, stats.policy, stats.vocab_size, stats.max_model_len
        )
    http = openai_api.HttpTarget(checked.target, checked.token, checked.tls)
    served = await openai_api.probe(http, args.model)
    return Probed(
        replace(http, model=served.model),
        admin_target,
        stats.policy if stats is not None else None,
        stats.vocab_size if stats is not None else 0,
        served.max_model_len or (stats.max_model_len if stats is not None else 0),
    )


def run_settings(target: Endpoint) -> dict[str, object]:
    """The API and where it was reached, in every run's settings (the reports show them)."""
    settings: dict[str, object] = {"api": target.api}
    if isinstance(target, openai_api.HttpTarget):
        settings |= {"target": target.url, "model": target.model}
    elif isinstance(target, Target):
        settings["target"] = target.address
    return settings


async def one_run(
    args: argparse.Namespace,
    target: Endpoint,
    sessions: list[Session],
    arrivals: Arrivals,
    label: str,
    plan: chaos.ChaosPlan | None,
    text_match: str | None = None,
) -> tuple[RunResult, dict[str, object] | None]:
    bounds = Bounds(args.num_requests, args.max_seconds, args.request_timeout)
    run = Run(target, sessions, arrivals, bounds, console, chaos=plan)
    before = await _scraped(args.server_metrics)
    records = await run.run()
    settings = {
        **run_settings(target),
        "workload": args.workload,
        "arrival": arrivals.kind,
        "concurrency": arrivals.concurrency,
        "rate": arrivals.rate,
        "num_requests": args.num_requests,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "text_match": text_match,
    }
    summary = summarize(records, run.duration, Slo(args.slo_ttft_ms, args.slo_tpot_ms))
    after = await _scraped(args.server_metrics) if before is not None else None
    if before is not None and after is not None:
        summary["server"] = server_metrics.summary(before, after)
    return RunResult(label, settings, summary, records), run.chaos_report


async def _scraped(urls: list[str] | None) -> server_metrics.Scrape | None:
    """The endpoints' histograms; None without --server-metrics, or when one cannot be read
    now (a --chaos kill of the router, say: the run and the runs before it still count). The
    command read them once before its first run, so a wrong URL has ended it already."""
    if not urls:
        return None
    try:
        return await asyncio.to_thread(server_metrics.scrape, urls)
    except ServerError as err:
        console.print(f"[yellow]{escape(str(err))}[/]; this run has no server figures")
        return None


async def warm_up(
    args: argparse.Namespace, target: Endpoint, options: workloads.WorkloadOptions
) -> None:
    """A few discarded requests, as many at once as the run will send (a CPU worker's first
    batches of a new size are slow, and the router learns the workers' speeds from these). With
    --compare or --sweep, every run empties the caches before it starts (`main_async`), the
    first included; a single run keeps what the warmup cached (and needs no admin token)."""
    if args.warmup <= 0:
        return
    kind = "random" if args.workload == "trace" else args.workload  # a trace has no other seed
    sessions = workloads.build(kind, replace(options, requests=args.warmup, seed=args.seed + 1))
    bounds = Bounds(args.warmup, args.max_seconds, args.request_timeout)
    at_once = max(1, min(args.warmup, args.concurrency))
    await Run(target, sessions, Arrivals("closed", at_once), bounds, console).run()


def chaos_exit(chaos_report: dict[str, object] | None) -> int:
    """1 when the planned kill failed or the cluster did not recover from it (the reports say
    why), else 0."""
    if chaos_report is None:
        return 0
    if chaos_report["outcome"] == chaos.KILL_FAILED:
        why = escape(str(chaos_report["error"]))
        console.print(
            f"[red]loadtest: the chaos kill failed (see the reports):[/] {why}", soft_wrap=True
        )
        return 1
    if chaos_report["outcome"] == chaos.KILLED and not chaos_report["recovered"]:
        console.print(
            f"[red]loadtest: the cluster did not recover from the kill of the "
            f"{chaos_report['target']} (see the reports)[/]",
            soft_wrap=True,
        )
        return 1
    if chaos_report["outcome"] == chaos.RUN_ENDED_FIRST:
        console.print("[yellow]loadtest: no chaos kill: the requests ended before its time[/]")
    return 0


async def main_async(args: argparse.Namespace, checked: Checked) -> int:
    probed = await probe_target(args, checked)
    if args.server_metrics:  # unreadable: said now, not after the warmup
        await asyncio.to_thread(server_metrics.scrape, args.server_metrics)
    target = probed.endpoint
    options = workloads.WorkloadOptions(
        requests=args.num_requests, seed=args.seed, max_tokens=args.max_tokens,
        tenants=checked.tenants, adapters=checked.adapters, trace=args.trace,
        trace_block_tokens=args.trace_block_tokens, trace_time_scale=args.time_scale,
        vocab_size=probed.vocab_size or 49_152, max_model_len=probed.max_model_len or 2048,
        turns=args.turns,
    )  # fmt: skip
    sessions = workloads.build(args.workload, options)  # a malformed trace fails before warmup
    modes = args.text_match or [None]
    sessions = workloads.with_text_match(sessions, modes[0])
    arrivals = Arrivals(args.arrival, args.concurrency, args.rate, args.seed)
    await warm_up(args, target, options)
    runs: list[RunResult] = []
    chaos_report = None
    if len(modes) > 1:
        runs = await text_match_runs(args, probed, sessions, arrivals, modes)
    elif args.compare:
        assert probed.admin is not None  # checks.py: --compare over HTTP needs --grpc-target
        for policy in args.compare:
            await admin(probed.admin, policy)
            result, _ = await one_run(args, target, sessions, arrivals, policy, None, modes[0])
            runs.append(result)
    elif checked.sweep:
        assert probed.admin is not None
        axis = "concurrency" if args.arrival == "closed" else "rate"
        for level in checked.sweep:
            await admin(probed.admin)
            level_arrivals = Arrivals(args.arrival, int(level), level, args.seed)
            result, _ = await one_run(
                args, target, sessions, level_arrivals, f"{axis}={level:g}", None, modes[0]
            )
            result.offered_load = level
            result.settings["sweep_axis"] = axis
            runs.append(result)
    else:
        label = probed.policy or target.api  # the policy is GetStats' to tell
        result, chaos_report = await one_run(
            args, target, sessions, arrivals, label, checked.chaos, modes[0]
        )
        runs.append(result)
    paths = report.write(args.output_dir, runs, chaos_report, sweep=bool(checked.sweep))
    print(report.markdown(runs, chaos_report))
    console.print("reports: " + ", ".join(str(p) for p in paths.values()))
    return chaos_exit(chaos_report)


async def text_match_runs(
    args: argparse.Namespace,
    probed: Probed,
    sessions: list[Session],
    arrivals: Arrivals,
    modes: list[str],
) -> list[RunResult]:
    """The same sessions once per text match mode, each from emptied caches (ClearCaches
    empties the router's text index too)."""
    assert probed.admin is not None  # checks.py: several modes over HTTP need --grpc-target
    runs = []
    for mode in modes:
        await admin(probed.admin)
        marked = workloads.with_text_match(sessions, mode)
        label = f"text_match={mode}"
        result, _ = await one_run(args, probed.endpoint, marked, arrivals, label, None, mode)
        runs.append(result)
    return runs


def main(args: argparse.Namespace) -> int:
    """0 after the reports are written (1 if a --chaos kill failed or the cluster did not recover
    from it); 2, with one line on stderr
    naming what was wrong, for a bad flag, an unreachable target or a refused call."""
    began = time.monotonic()
    try:
        return asyncio.run(main_async(args, check(args)))
    except (ServerError, ValueError) as err:
        after = time.monotonic() - began
        message = f"[red]loadtest:[/] {escape(str(err))} (after {after:.1f} s)"
        console.print(message, soft_wrap=True)  # one line, whatever the terminal's width
        return 2


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
