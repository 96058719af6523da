"""A run's outputs: one JSON file, a markdown summary, and PNG plots.

report.json   every run's settings (the API and target included), summary and per-request
              records (plus chaos, if any)
summary.md    the API the requests went through, then a table, one column per run; with two
              runs, a last column A / B (first over second)
cdf.png       TTFT and end-to-end latency CDFs, one line per run
timeline.png  hit rate and each worker's requests over time
sweep.png     throughput and p99 TTFT against offered load (sweeps)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from cluster.loadtest import server_metrics
from cluster.loadtest.chaos import KILL_FAILED, RUN_ENDED_FIRST
from cluster.loadtest.records import RequestRecord

ROWS = (
    ("requests completed", "count", lambda s: s["requests"]["completed"]),
    ("errors", "count", lambda s: s["requests"]["errored"]),
    ("TTFT p50 ms", "ms", lambda s: s["ttft_ms"]["p50"]),
    ("TTFT p90 ms", "ms", lambda s: s["ttft_ms"]["p90"]),
    ("TTFT p99 ms", "ms", lambda s: s["ttft_ms"]["p99"]),
    ("inter-token p50 ms", "ms", lambda s: s["inter_token_ms"]["p50"]),
    ("TPOT p50 ms", "ms", lambda s: s["tpot_ms"]["p50"]),
    ("latency p50 ms", "ms", lambda s: s["latency_ms"]["p50"]),
    ("latency p99 ms", "ms", lambda s: s["latency_ms"]["p99"]),
    ("requests/s", "rate", lambda s: s["throughput"]["requests_per_s"]),
    ("output tokens/s", "rate", lambda s: s["throughput"]["output_tokens_per_s"]),
    ("goodput req/s", "rate", lambda s: s["goodput"]["requests_per_s"]),
    ("prefix hit rate", "percent", lambda s: s["hit_rate"]),
    ("prediction error (tokens)", "rate", lambda s: s["prediction"]["mean_abs_error_tokens"]),
)


@dataclass
class RunResult:
    label: str
    settings: dict[str, Any]
    summary: dict[str, Any]
    records: list[RequestRecord] = field(default_factory=list)
    offered_load: float | None = None


def _cell(value: object, kind: str = "rate") -> str:
    if value is None:
        return "-"
    if kind == "count":
        return str(value)
    if kind == "percent":
        return f"{float(value):.1%}"  # type: ignore[arg-type]
    return f"{float(value):.2f}"  # type: ignore[arg-type]


def api_line(runs: list[RunResult]) -> str:
    """`API: openai, http://127.0.0.1:8000, model tiny`: what the requests went through (every
    run of a command uses the same); "" for settings that do not say."""
    settings = runs[0].settings if runs else {}
    if "api" not in settings:
        return ""
    line = f"API: {settings['api']}, {settings.get('target', '?')}"
    return line + (f", model {settings['model']}" if settings.get("model") else "")


def markdown(runs: list[RunResult], chaos: dict[str, Any] | None = None) -> str:
    head = (
        "| metric | "
        + " | ".join(r.label for r in runs)
        + (f" | {runs[0].label} / {runs[1].label} |" if len(runs) == 2 else " |")
    )
    lines = [head, "|" + " --- |" * (len(runs) + 1 + (len(runs) == 2))]
    for name, kind, get in ROWS:
        values = [get(r.summary) for r in runs]
        row = f"| {name} | " + " | ".join(_cell(v, kind) for v in values) + " |"
        if len(runs) == 2:
            a, b = values
            ratio = (
                a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
            )
            row += f" {'-' if ratio is None else f'{ratio:.2f}x'} |"
        lines.append(row)
    workers = sorted({w for r in runs for w in r.summary["workers"]})
    for worker in workers:
        shares = [r.summary["workers"].get(worker, {}).get("request_share") for r in runs]
        cells = " | ".join(_cell(share, "percent") for share in shares)
        lines.append(f"| share of {worker} | {cells} |" + (" |" if len(runs) == 2 else ""))
    text = "\n".join(lines)
    api = api_line(runs)
    if api:
        text = f"{api}\n\n{text}"
    for run in runs:
        if run.summary["errors"]:
            text += f"\n\nErrors of {run.label}: {run.summary['errors']}"
        if len(run.summary["tenants"]) > 1:
            tenants = ", ".join(
                f"{t}: {v['requests']} requests, hit {v['hit_rate']:.1%}"
                for t, v in run.summary["tenants"].items()
            )
            text += f"\n\nTenants of {run.label}: {tenants}"
    server = server_metrics.markdown(
        [r.label for r in runs], [r.summary.get("server", {}) for r in runs]
    )
    if server:
        text += "\n\n" + server
    if chaos:
        text += "\n\n" + chaos_markdown(chaos)
    return text + "\n"


def chaos_markdown(chaos: dict[str, Any]) -> str:
    """One paragraph: the kill and what followed, a failed kill, or the run ending first."""
    target = chaos["target"]
    if chaos["outcome"] == RUN_ENDED_FIRST:
        return (
            f"Chaos: no kill. The requests ended at {chaos['requests_ended_at_s']:.1f} s, before "
            f"the kill of the {target} planned at {chaos['planned_at_s']:.1f} s."
        )
    if chaos["outcome"] == KILL_FAILED:
        return (
            f"Chaos: the kill of the {target} at {chaos['at_s']:.1f} s failed: {chaos['error']}. "
            "The run went on without it."
        )
    outcomes = ", ".join(f"{k}: {v}" for k, v in sorted(chaos["in_flight_outcomes"].items()))
    recovery = chaos["recovery_s"]
    whole = chaos["all_workers_healthy_after_s"]
    return (
        f"Chaos: killed the {target} at {chaos['at_s']:.1f} s. "
        f"In flight then: {chaos['in_flight']} ({outcomes or 'none'}). "
        f"First success after the kill: "
        f"{'never' if recovery is None else f'{recovery:.2f} s later'}. "
        f"Every worker healthy again: "
        f"{'not before the watch ended' if whole is None else f'{whole:.2f} s after the kill'}. "
        f"Requests the clients saw fail: {chaos['errors']}, of which truncated streams: "
        f"{chaos['truncated']}. "
        f"{'Recovered.' if chaos['recovered'] else 'The cluster did NOT recover.'}"
    )


def _cdf(axis: Any, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    axis.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def plot_cdfs(runs: list[RunResult], path: Path) -> None:
    figure, (ttft, latency) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        ok = [r for r in run.records if r.ok]
        _cdf(ttft, [1000 * r.ttft for r in ok if r.ttft is not None], run.label)
        _cdf(latency, [1000 * r.latency for r in ok if r.latency is not None], run.label)
    for axis, title in ((ttft, "time to first token"), (latency, "end-to-end latency")):
        axis.set_xlabel("ms")
        axis.set_ylabel("fraction of requests")
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # no line when every request failed
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def timeline_bucket_s(span_s: float) -> float:
    """About 30 buckets over the run, at a round width (0.1, 0.2, 0.5, 1, 2, 5, ... s)."""
    target = max(span_s, 0.1) / 30
    width = 0.1
    while width < target:
        for step in (2.0, 2.5, 2.0):  # 0.1 -> 0.2 -> 0.5 -> 1 -> 2 -> 5 -> 10
            width *= step
            if width >= target:
                break
    return round(width, 3)


def plot_timeline(runs: list[RunResult], path: Path, bucket_s: float | None = None) -> None:
    """Hit rate per bucket of request starts, and each worker's requests in flight over time
    (sampled at bucket centres), so an imbalance between workers shows while it happens."""
    figure, (hits, load) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    span = max((r.end or r.start for run in runs for r in run.records), default=0.0)
    width = bucket_s or timeline_bucket_s(span)
    for run in runs:
        ok = sorted((r for r in run.records if r.ok), key=lambda r: r.start)
        if not ok:
            continue
        buckets = int(max(r.end or r.start for r in ok) // width) + 1
        times = [width * (i + 0.5) for i in range(buckets)]
        prompt, cached = [0] * buckets, [0] * buckets
        in_flight: dict[str, list[int]] = {}
        for r in ok:
            b = int(r.start // width)
            prompt[b] += r.prompt_tokens
            cached[b] += r.cached_prompt_tokens
            counts = in_flight.setdefault(r.worker, [0] * buckets)
            end = r.end if r.end is not None else r.start
            for i, t in enumerate(times):
                if r.start <= t < end:
                    counts[i] += 1
        started = [i for i in range(buckets) if prompt[i]]
        hits.plot(
            [times[i] for i in started],
            [cached[i] / prompt[i] for i in started],
            label=run.label,
            marker=".",
        )
        for worker, counts in sorted(in_flight.items()):
            load.step(times, counts, where="mid", label=f"{run.label}: {worker}")
    hits.set_ylabel("prefix hit rate")
    hits.set_title(f"per {width:g} s: hit rate of the requests started, requests in flight")
    load.set_ylabel("requests in flight per worker")
    load.set_xlabel("seconds into the run")
    for axis in (hits, load):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_sweep(runs: list[RunResult], path: Path) -> None:
    levels = [r.offered_load for r in runs]
    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    throughput.plot(
        levels, [r.summary["throughput"]["output_tokens_per_s"] for r in runs], marker="o"
    )
    ttft.plot(levels, [r.summary["ttft_ms"]["p99"] or 0 for r in runs], marker="o")
    throughput.set_ylabel("output tokens/s")
    ttft.set_ylabel("TTFT p99 ms")
    for axis in (throughput, ttft):
        axis.set_xlabel(str(runs[0].settings.get("sweep_axis", "offered load")))
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write(
    output_dir: Path,
    runs: list[RunResult],
    chaos: dict[str, Any] | None = None,
    sweep: bool = False,
) -> dict[str, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        name: output_dir / name for name in ("report.json", "summary.md", "cdf.png", "timeline.png")
    }
    report = {
        "runs": [
            {
                "label": r.label,
                "settings": r.settings,
                "offered_load": r.offered_load,
                "summary": r.summary,
                "requests": [rec.to_json() for rec in r.records],
            }
            for r in runs
        ],
        "chaos": chaos,
    }
    paths["report.json"].write_text(json.dumps(report, indent=2))
    paths["summary.md"].write_text(markdown(runs, chaos))
    plot_cdfs(runs, paths["cdf.png"])
    plot_timeline(runs, paths["timeline.png"])
    if sweep:
        paths["sweep.png"] = output_dir / "sweep.png"
        plot_sweep(runs, paths["sweep.png"])
    return paths
