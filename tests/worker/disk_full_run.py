"""Saves to a disk that fills up: run by tests/worker/test_disk_full.py as
`python -m tests.worker.disk_full_run DIR`, with DIR a small tmpfs of its own mount namespace.
Prints one JSON object of what it saw.

Three engines in turn save their caches to DIR/w0, each more than the disk holds:
- the first serves `FIRST` prompts and stops (the drain's save);
- the second loads what was saved, answers the last of them, serves `SECOND` more, stops;
- the third loads that and answers the last of `SECOND`.
Then a fourth, in DIR/w1 on what room is left, has each of `SECOND` evicted right after it
is served, so that what eviction drops is written to disk (worker/disk_spill.py) as the
saver's thread does; a fifth loads that and asks for the first and the last two of them.
What a disk shows after each save, and the answers, are compared to an engine that never
saved.
"""

from __future__ import annotations

import json
import logging
import random
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.worker.helpers import LLAMA, drain, greedy
from worker.engine import Engine, EngineConfig
from worker.kv_persistence import MANIFEST
from worker.metrics import EngineCollector
from worker.tiny_model import tiny_model

RNG = random.Random(5)
FIRST = [[RNG.randrange(1, 384) for _ in range(48)] for _ in range(24)]
SECOND = [[RNG.randrange(1, 384) for _ in range(48)] for _ in range(12)]


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def answer(engine: Engine, prompt: list[int], request_id: str) -> tuple[list[int], int]:
    """(greedy tokens, prompt tokens served from the cache) of one request."""
    outputs: list[Any] = []
    engine.submit(greedy(request_id, prompt, 4), outputs.append)
    drain(engine)
    final = next(o for o in outputs if o.finished)
    return [t for o in outputs for t in o.token_ids], final.cached_prompt_tokens


def on_disk(directory: Path, warnings: Warnings) -> dict[str, Any]:
    """What the save left: the files, those the manifest lists, the bytes free, and the
    warnings logged since the last call."""
    manifest = json.loads((directory / MANIFEST).read_text())
    told, warnings.lines = warnings.lines, []
    return {
        "files": sorted(p.name for p in directory.iterdir() if p.name != MANIFEST),
        "listed": sorted(f"{node['name']}.safetensors" for node in manifest["nodes"]),
        "free": shutil.disk_usage(directory).free,
        "warnings": told,
    }


def main(root: Path) -> dict[str, Any]:
    warnings = Warnings()
    logging.getLogger("worker").addHandler(warnings)
    model = tiny_model(LLAMA, seed=4)
    config = EngineConfig(num_pages=512, page_size=4, max_running=4, persist_dir=str(root))
    cold = Engine(model, None, EngineConfig(num_pages=512, page_size=4, max_running=4))
    seen: dict[str, Any] = {"total": shutil.disk_usage(root).total}

    first = Engine(model, None, config, source="w0")
    for i, prompt in enumerate(FIRST):
        answer(first, prompt, f"a{i}")
    first.stop()
    seen["first"] = on_disk(root / "w0", warnings)
    metrics = {
        family.name: family.samples[0].value for family in EngineCollector(first, "w0").collect()
    }
    seen["first_metrics"] = {k: v for k, v in metrics.items() if "disk_bytes" in k}
    seen["first_file_bytes"] = sum(
        (root / "w0" / name).stat().st_size for name in seen["first"]["listed"]
    )

    second = Engine(model, None, config, source="w0")
    seen["second_loaded"] = second.loaded.nodes
    seen["second_answer"] = answer(second, FIRST[-1], "last-of-first")
    for i, prompt in enumerate(SECOND):
        answer(second, prompt, f"b{i}")
    second.stop()
    seen["second"] = on_disk(root / "w0", warnings)

    third = Engine(model, None, config, source="w0")
    seen["third_loaded"] = third.loaded.nodes
    seen["third_answer"] = answer(third, SECOND[-1], "last-of-second")
    third.stop()
    seen["cold_answers"] = [answer(cold, FIRST[-1], "c1")[0], answer(cold, SECOND[-1], "c2")[0]]

    spiller = Engine(model, None, config, source="w1")
    assert spiller.saver is not None and spiller.spill is not None
    for i, prompt in enumerate(SECOND):
        answer(spiller, prompt, f"s{i}")
        spiller.cache.tree.evict(spiller.cache.tree.evictable_pages)
        spiller.runner.copy_pages(spiller.cache.take_tier_copies())
        spiller.saver.list_spills(0.0)
    seen["spills"] = on_disk(root / "w1", warnings)
    spiller.saver.stop()  # what the drain would write besides is written already
    reader = Engine(model, None, config, source="w1")
    seen["spills_cached"] = [answer(reader, SECOND[i], f"r{i}")[1] for i in (0, -2, -1)]

    # another tenant of the disk fills it for a while: nothing fits, then all does
    for engine in (first, second, third, spiller, reader):
        engine.stop()
    shutil.rmtree(root / "w0")
    shutil.rmtree(root / "w1")
    blocker = root / "someone else's"
    blocker.write_bytes(bytes(shutil.disk_usage(root).free - 4096))
    late = Engine(model, None, config, source="w2")
    assert late.store is not None
    answer(late, FIRST[0], "late0")
    seen["while_full"] = late.store.save(late)
    blocker.unlink()
    seen["after_full"] = late.store.save(late)
    seen["after_full_unwritable"] = len(late.store.unwritable)

    # the volume grows: the bound a full disk lowered rises again, and more is kept
    grower = Engine(model, None, config, source="w3")
    assert grower.store is not None
    for i, prompt in enumerate(FIRST):
        answer(grower, prompt, f"g{i}")
    seen["before_growing"] = grower.store.save(grower), grower.store.max_bytes
    subprocess.run(["mount", "-o", "remount,size=1m", str(root)], check=True)
    seen["after_growing"] = grower.store.save(grower), grower.store.max_bytes
    return seen


def over_the_file_size_limit(root: Path, limit: int) -> dict[str, Any]:
    """An engine whose process may write no file over `limit` bytes (RLIMIT_FSIZE, as a
    container's ulimit sets it) saves a long prompt's node, which is over it, and short ones,
    which are not; a second engine loads what was saved and asks for each."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails (EFBIG), not the process
    warnings = Warnings()
    logging.getLogger("worker").addHandler(warnings)
    model = tiny_model(LLAMA, seed=4)
    config = EngineConfig(num_pages=512, page_size=4, max_running=4, persist_dir=str(root))
    long_one = [RNG.randrange(1, 384) for _ in range(400)]
    below = [[*long_one, *SECOND[i][:8]] for i in range(2)]  # two nodes under the long one
    first = Engine(model, None, config, source="w0")
    for i, prompt in enumerate([*SECOND[:3], long_one, *below]):
        answer(first, prompt, f"a{i}")
    first.stop()
    assert first.store is not None
    seen: dict[str, Any] = {"disk": on_disk(root / "w0", warnings)}
    seen["unwritable"] = len(first.store.unwritable)
    second = Engine(model, None, config, source="w0")
    seen["cached"] = [answer(second, p, f"b{i}")[1] for i, p in enumerate([*SECOND[:3], long_one])]
    return seen


if __name__ == "__main__":
    if len(sys.argv) > 2:
        print(json.dumps(over_the_file_size_limit(Path(sys.argv[1]), int(sys.argv[2]))))
    else:
        print(json.dumps(main(Path(sys.argv[1]))))
