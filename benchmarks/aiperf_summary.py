"""One table from an aiperf run's per-level exports: requests, errors, throughput, TTFT, inter-token
time, and the prompt and cached tokens the server reported. Exits 1 if any request failed.

Run: `python benchmarks/aiperf_summary.py OUT_DIR` (benchmarks/aiperf_serving.sh runs it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def stat(data: dict[str, Any], key: str, which: str = "avg") -> float:
    return float((data.get(key) or {}).get(which) or 0)


def main(out: Path) -> int:
    files = sorted(out.glob("concurrency_*/profile_export_aiperf.json")) or sorted(
        out.glob("profile_export_aiperf.json")
    )
    if not files:
        print(f"no aiperf exports under {out}", file=sys.stderr)
        return 1
    table = Table(title=f"aiperf against radixmesh ({out})")
    for column in (
        "level", "ok", "errors", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms",
        "ITL p50 ms", "latency p50 ms", "prompt tok", "cached tok",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    failed = 0
    for path in files:
        data = json.loads(path.read_text())
        errors = int(stat(data, "error_request_count"))
        failed += errors
        table.add_row(
            path.parent.name if path.parent != out else "run",
            f"{stat(data, 'request_count'):.0f}",
            str(errors),
            f"{stat(data, 'request_throughput'):.2f}",
            f"{stat(data, 'output_token_throughput'):.1f}",
            f"{stat(data, 'time_to_first_token', 'p50'):.1f}",
            f"{stat(data, 'time_to_first_token', 'p99'):.1f}",
            f"{stat(data, 'inter_token_latency', 'p50'):.2f}",
            f"{stat(data, 'request_latency', 'p50'):.1f}",
            f"{stat(data, 'usage_prompt_tokens'):.0f}",
            f"{stat(data, 'usage_prompt_cache_read_tokens'):.0f}",
        )
        for error in data.get("error_summary") or []:
            print(f"error x{error.get('count', 0)}: {json.dumps(error.get('error_details'))[:300]}")
    Console().print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
