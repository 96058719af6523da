"""The numbers people compare, from a run's request records.

Latencies in milliseconds at p50 / p90 / p99 / max: TTFT, inter-token latency (between streamed
messages), time per output token, end-to-end latency. Throughput in requests and tokens per
second; goodput: requests per second that met the SLO (TTFT and TPOT both under their bounds).
Hit rate: prompt tokens the workers served from cache over all prompt tokens (their own
per-request counts). Prediction error: the router's predicted cached tokens against the
served ones (None when no record carries a prediction: the OpenAI API reports none). Per
worker: requests, share of the completed ones, output tokens, hit rate (only records that name
their worker: the OpenAI API names none). Per tenant: requests, hit rate, TTFT p50. Errors by
status.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from cluster.loadtest.records import RequestRecord


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = 1000.0
    tpot_ms: float = 200.0


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    if not ordered:
        return {"p50": None, "p90": None, "p99": None, "max": None, "mean": None}

    def at(q: float) -> float:
        return 1000.0 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
        "max": 1000.0 * ordered[-1],
        "mean": 1000.0 * sum(ordered) / len(ordered),
    }


def _hit(records: list[RequestRecord]) -> float:
    prompt = sum(r.prompt_tokens for r in records)
    return sum(r.cached_prompt_tokens for r in records) / prompt if prompt else 0.0


def _prediction(ok: list[RequestRecord]) -> dict[str, float | int | None]:
    """The router's predicted cached tokens against the served ones; None throughout when the
    records carry no prediction (the OpenAI API reports none)."""
    carried = [r for r in ok if r.predicted_cached_tokens is not None]
    if ok and not carried:
        return {"mean_abs_error_tokens": None, "predicted_tokens": None, "served_tokens": None}
    predicted = [r for r in carried if r.prompt_tokens]
    return {
        "mean_abs_error_tokens": (
            sum(abs((r.predicted_cached_tokens or 0) - r.cached_prompt_tokens) for r in predicted)
            / len(predicted)
            if predicted
            else 0.0
        ),
        "predicted_tokens": sum(r.predicted_cached_tokens or 0 for r in carried),
        "served_tokens": sum(r.cached_prompt_tokens for r in carried),
    }


def summarize(records: list[RequestRecord], duration: float, slo: Slo = Slo()) -> dict[str, object]:
    ok = [r for r in records if r.ok]
    duration = max(duration, 1e-9)
    errors: dict[str, int] = defaultdict(int)
    for r in records:
        if not r.ok:
            errors[r.status] += 1
    good = [
        r
        for r in ok
        if (r.ttft or 0) * 1000 <= slo.ttft_ms and (r.tpot is None or r.tpot * 1000 <= slo.tpot_ms)
    ]
    by_worker: dict[str, list[RequestRecord]] = defaultdict(list)
    by_tenant: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in ok:
        if r.worker:
            by_worker[r.worker].append(r)
        by_tenant[r.tenant or "-"].append(r)
    output = sum(r.output_tokens for r in ok)
    return {
        "requests": {"sent": len(records), "completed": len(ok), "errored": len(records) - len(ok)},
        "errors": dict(errors),
        "duration_s": duration,
        "ttft_ms": percentiles(r.ttft for r in ok if r.ttft is not None),
        "inter_token_ms": percentiles(gap for r in ok for gap in r.inter_token()),
        "tpot_ms": percentiles(r.tpot for r in ok if r.tpot is not None),
        "latency_ms": percentiles(r.latency for r in ok if r.latency is not None),
        "throughput": {
            "requests_per_s": len(ok) / duration,
            "output_tokens_per_s": output / duration,
            "total_tokens_per_s": (output + sum(r.prompt_tokens for r in ok)) / duration,
        },
        "goodput": {
            "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
            "requests_per_s": len(good) / duration,
            "fraction": len(good) / len(ok) if ok else 0.0,
        },
        "hit_rate": _hit(ok),
        "prediction": _prediction(ok),
        "workers": {
            name: {
                "requests": len(rs),
                "request_share": len(rs) / len(ok),
                "output_tokens": sum(r.output_tokens for r in rs),
                "hit_rate": _hit(rs),
            }
            for name, rs in sorted(by_worker.items())
        },
        "tenants": {
            name: {
                "requests": len(rs),
                "hit_rate": _hit(rs),
                "ttft_p50_ms": percentiles(r.ttft for r in rs if r.ttft is not None)["p50"],
            }
            for name, rs in sorted(by_tenant.items())
        },
    }
