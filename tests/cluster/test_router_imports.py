"""The router process stays light: importing the router actor loads no torch (2.7 s of imports
and the memory of a model process, paid again at every restart), nor the engine or kernels."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "triton", "kernels", "worker.engine", "worker.model", "worker.sampling")


def test_importing_the_router_actor_loads_no_torch() -> None:
    code = "import json, sys\nimport cluster.router_actor\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(out.stdout)
    heavy = [m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert heavy == []
    assert "cluster.router_service" in loaded  # the import did reach the serving code
