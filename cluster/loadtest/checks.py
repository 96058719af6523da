"""The command's flags, checked before the server is contacted.

Every bad value or combination raises a `UsageError` that names the flag, so the command ends
(exit 2) before a probe, a warmup or a run: numbers out of range, `--sweep`, `--tenants`,
`--adapters` and `--chaos` that do not parse, flags that do not go together, a `--target` that
is not the `--api`'s kind of address, an absent trace, an output directory that cannot be
written, TLS files that cannot be read.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

from cluster.client_auth import token_or_env
from cluster.client_tls import ClientTls, tls_from_args
from cluster.loadtest.chaos import ChaosPlan
from cluster.loadtest.openai_api import base_url, ssl_context
from cluster.loadtest.trace import MOONCAKE_BLOCK


class UsageError(ValueError):
    """A flag's value, or a combination of flags, the command cannot run with."""


WHOLE_AT_LEAST = {
    "num_requests": 1, "concurrency": 1, "max_tokens": 1, "turns": 1, "trace_block_tokens": 1,
    "warmup": 0,
}  # fmt: skip
POSITIVE = ("rate", "max_seconds", "request_timeout", "slo_ttft_ms", "slo_tpot_ms")
NOT_NEGATIVE = ("time_scale",)
DEFAULT_TARGETS = {"grpc": "127.0.0.1:50051", "openai": "http://127.0.0.1:8000"}


@dataclass(frozen=True)
class Checked:
    """What the flags say, parsed."""

    target: str
    """The router's gRPC host:port (`--api grpc`) or its HTTP API's base URL (`--api openai`)."""
    grpc_target: str | None
    """With `--api openai`: the router's gRPC host:port for the Admin calls, if given."""
    tls: ClientTls | None
    token: str | None
    tenants: list[tuple[str, float]]
    adapters: list[tuple[str, float]]
    sweep: list[float]
    """The levels of `--sweep`; empty without it."""
    chaos: ChaosPlan | None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_numbers(args: argparse.Namespace) -> None:
    for dest, least in WHOLE_AT_LEAST.items():
        if getattr(args, dest) < least:
            raise UsageError(f"{_flag(dest)} must be at least {least}, got {getattr(args, dest)}")
    if args.trace_block_tokens > MOONCAKE_BLOCK:  # a block is drawn whole before it is cut
        raise UsageError(
            f"--trace-block-tokens must be at most {MOONCAKE_BLOCK} (a trace block's tokens), "
            f"got {args.trace_block_tokens}"
        )
    for dest in POSITIVE + NOT_NEGATIVE:
        value = getattr(args, dest)
        if not math.isfinite(value) or value < 0 or (value == 0 and dest in POSITIVE):
            kind = "above 0" if dest in POSITIVE else "0 or more"
            raise UsageError(f"{_flag(dest)} must be a finite number {kind}, got {value}")


def check_combinations(args: argparse.Namespace) -> None:
    if args.sweep is not None and args.compare:
        raise UsageError(
            "--sweep and --compare do not go together: run a sweep under each policy instead"
        )
    if args.sweep is not None and args.arrival == "trace":
        raise UsageError(
            "--sweep needs --arrival closed (concurrencies) or poisson (rates): trace arrivals "
            "use neither, so every level would be the same run"
        )
    if args.chaos and (args.compare or args.sweep is not None):
        raise UsageError("--chaos works on a single run: it does not go with --compare or --sweep")
    modes = args.text_match or []
    if len(set(modes)) < len(modes):
        raise UsageError(f"--text-match names a mode twice: {' '.join(modes)}")
    if len(modes) > 1 and (args.compare or args.sweep is not None or args.chaos):
        raise UsageError(
            "--text-match with several modes makes one run per mode: it does not go with "
            "--compare, --sweep or --chaos (give one mode to those)"
        )
    if modes and args.workload == "trace":
        raise UsageError(
            "--text-match is for text and chat prompts: the trace workload sends token ids"
        )
    for url in args.server_metrics or ():
        if not url.startswith(("http://", "https://")):
            raise UsageError(
                f"--server-metrics {url} is not an http(s):// URL (a metrics endpoint: "
                "http://HOST:PORT/metrics)"
            )


def check_api(args: argparse.Namespace) -> tuple[str, str | None]:
    """The target (and, over HTTP, the gRPC target) the `--api` needs; UsageError for flags
    that belong to the other API, or that it cannot serve. (An adapter is named over gRPC by
    namespace.adapter, over the OpenAI API by `model`, as vLLM does.)"""
    target = args.target or DEFAULT_TARGETS[args.api]
    if args.api == "grpc":
        if "://" in target:
            raise UsageError(
                f"--target {target} is a URL: gRPC takes HOST:PORT (for the HTTP API, add "
                "--api openai)"
            )
        for flag, value in (("--grpc-target", args.grpc_target), ("--model", args.model)):
            if value is not None:
                raise UsageError(f"{flag} is for --api openai (over gRPC, --target is the router)")
        return target, None
    try:
        url = base_url(target)
    except ValueError as err:
        raise UsageError(str(err)) from err
    if args.grpc_target is not None and "://" in args.grpc_target:
        raise UsageError(f"--grpc-target {args.grpc_target} is a URL: it takes HOST:PORT")
    several = len(args.text_match or []) > 1
    if (args.compare or args.sweep is not None or several) and args.grpc_target is None:
        raise UsageError(
            "--compare, --sweep and several --text-match modes switch the policy or empty the "
            "caches through the router's Admin service, which is gRPC only: with --api openai, "
            "also give the router's gRPC address (--grpc-target HOST:PORT)"
        )
    if args.tls_ca is not None and url.startswith("http://"):
        raise UsageError(f"--tls-ca is for an https:// target, not {url}")
    return url, args.grpc_target


ZIPF_EXPONENT = 1.1
ZIPF_ADAPTER = "lora-{}"


def adapter_weights(text: str) -> list[tuple[str, float]]:
    """`--adapters`: `name=weight,...` as `weights`, or `zipf:N[:S]`: adapters lora-0 ..
    lora-(N-1), adapter k drawn with weight 1 / (k + 1)^S (S: ZIPF_EXPONENT); load them first
    (`radixmesh adapters load lora-0 DIR`, ...)."""
    if not text.startswith("zipf:"):
        return weights("--adapters", text)
    count, _, exponent = text.removeprefix("zipf:").partition(":")
    try:
        n, s = int(count), float(exponent or ZIPF_EXPONENT)
    except ValueError:
        n, s = 0, math.nan
    if n < 1 or not math.isfinite(s) or s < 0:
        raise UsageError(
            f"--adapters {text!r}: expected zipf:N or zipf:N:S with N >= 1 adapters and an "
            "exponent S >= 0 (e.g. zipf:16:1.1)"
        )
    return [(ZIPF_ADAPTER.format(k), 1 / (k + 1) ** s) for k in range(n)]


def weights(flag: str, text: str) -> list[tuple[str, float]]:
    """`name=weight,...` (a bare name weighs 1) -> pairs; at least one weight above 0."""
    if not text:
        return [("", 1.0)]
    pairs = []
    for item in text.split(","):
        name, _, given = item.partition("=")
        try:
            weight = float(given or 1)
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight) or weight < 0:
            raise UsageError(
                f"{flag}: the weight of {name.strip()!r} is {given.strip()!r}, not a number >= 0 "
                "(e.g. acme=3,globex=1)"
            )
        pairs.append((name.strip(), weight))
    if not any(weight > 0 for _, weight in pairs):
        raise UsageError(f"{flag}: every weight is 0 in {text!r}")
    return pairs


def sweep_levels(text: str, arrival: str) -> list[float]:
    """`1,4,16`: concurrencies (whole numbers) under closed arrivals, rates under poisson."""
    levels = []
    for item in text.split(","):
        try:
            level = float(item)
        except ValueError:
            level = math.nan
        if not math.isfinite(level) or level <= 0:
            raise UsageError(
                f"--sweep: {item.strip()!r} is not a number above 0 (comma-separated "
                "concurrencies or rates, e.g. 1,4,16)"
            )
        if arrival == "closed" and level != int(level):
            raise UsageError(f"--sweep: a concurrency is a whole number of users, got {level:g}")
        levels.append(level)
    return levels


def check_paths(args: argparse.Namespace) -> None:
    if args.workload == "trace" and not args.trace.is_file():
        state = "not a file" if args.trace.exists() else "absent"
        raise UsageError(f"the trace {args.trace} is {state} (--trace PATH)")
    out: Path = args.output_dir
    if out.exists() and not out.is_dir():
        raise UsageError(f"--output-dir {out} is a file, not a directory")
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--output-dir {out} cannot be written ({existing} is not writable)")


def check(args: argparse.Namespace) -> Checked:
    """The flags parsed, or a UsageError (or the TLS flags' own error) naming what is wrong."""
    check_numbers(args)
    check_combinations(args)
    check_paths(args)
    chaos = ChaosPlan.parse(args.chaos, args.ray_address) if args.chaos else None
    if chaos is not None and chaos.at_s >= args.max_seconds:
        raise UsageError(
            f"--chaos at {chaos.at_s:g} s is not before --max-seconds {args.max_seconds:g}: "
            "the run stops launching requests then"
        )
    adapters = adapter_weights(args.adapters)
    target, grpc_target = check_api(args)
    tls = tls_from_args(args)
    if args.api == "openai":
        ssl_context(tls)  # a CA or client certificate that is not PEM fails here
    return Checked(
        target=target,
        grpc_target=grpc_target,
        tls=tls,
        token=token_or_env(args.token),
        tenants=weights("--tenants", args.tenants),
        adapters=adapters,
        sweep=sweep_levels(args.sweep, args.arrival) if args.sweep is not None else [],
        chaos=chaos,
    )
