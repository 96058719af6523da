"""The cache on disk: an engine stopped with `persist_dir` saves its cache, the next one loads
it and the first request hits, with the outputs of a cold run. A manifest of anything else is
refused, a damaged file is dropped with everything below it, tenants stay apart, disk use stays
under its bound, and the background saver writes while the engine serves."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import shutil
import time
from pathlib import Path

import pytest
import torch

from cache import DEFAULT_NAMESPACE, CacheNamespace
from cache.integrity import check_sequence_cache
from tests.worker.helpers import LLAMA, drain, greedy, recorded_engine, relative_error
from worker import kv_persistence
from worker.engine import Engine, EngineConfig
from worker.kv_persistence import MANIFEST, BackgroundSaver
from worker.loader import load_model
from worker.model import CausalLM
from worker.tiny_model import build_tiny_checkpoint, tiny_model

RNG = random.Random(8)
SYSTEM = [RNG.randrange(1, 384) for _ in range(40)]
TURNS = [[*SYSTEM, *(RNG.randrange(1, 384) for _ in range(12 + 4 * i))] for i in range(3)]
MODEL: list[CausalLM] = []


def model() -> CausalLM:
    if not MODEL:
        MODEL.append(tiny_model(LLAMA, seed=4))
    return MODEL[0]


def config(directory: Path | None, **overrides: object) -> EngineConfig:
    base: dict[str, object] = dict(
        num_pages=64, page_size=4, max_running=4, persist_interval_s=0.0,
        persist_dir=None if directory is None else str(directory),
    )  # fmt: skip
    base.update(overrides)
    return EngineConfig(**base)  # type: ignore[arg-type]


def serve(engine: Engine, prompts: list[list[int]], ns: CacheNamespace = DEFAULT_NAMESPACE) -> None:
    for i, prompt in enumerate(prompts):
        request = dataclasses.replace(greedy(f"warm{i}", prompt, 4), namespace=ns)
        engine.submit(request, lambda o: None)
        drain(engine)


def ask(engine: Engine, prompt: list[int], ns: CacheNamespace = DEFAULT_NAMESPACE) -> tuple:
    """(tokens, cached prompt tokens, first logits) of one greedy request."""
    recorder = engine.observe_logits
    request = dataclasses.replace(greedy("ask", prompt, 6), namespace=ns)
    outputs: list = []
    logits: dict = {}
    engine.observe_logits = lambda rid, i, pos, row: logits.setdefault(pos, row.clone())
    engine.submit(request, outputs.append)
    drain(engine)
    engine.observe_logits = recorder
    final = next(o for o in outputs if o.finished)
    tokens = [t for o in outputs for t in o.token_ids]
    return tokens, final.cached_prompt_tokens, logits[len(prompt)]


def saved(directory: Path, ns: CacheNamespace = DEFAULT_NAMESPACE, **overrides: object) -> Path:
    engine = Engine(model(), None, config(directory, **overrides), source="w0")
    serve(engine, TURNS, ns)
    engine.stop()
    return directory / "w0"


def test_a_restarted_engine_starts_warm_with_the_outputs_of_a_cold_one(tmp_path: Path) -> None:
    saved(tmp_path)
    assert (tmp_path / "w0" / MANIFEST).exists()
    warm = Engine(model(), None, config(tmp_path), source="w0")
    assert warm.loaded.nodes > 0 and warm.loaded.refused == ""
    check_sequence_cache(warm.cache)
    cold = Engine(model(), None, config(None), source="w0")
    prompt = [*TURNS[2], 5, 6, 7]
    tokens, cached, logits = ask(warm, prompt)
    cold_tokens, cold_cached, cold_logits = ask(cold, prompt)
    assert cold_cached == 0
    assert cached == (len(TURNS[2]) + 3) // 4 * 4, "the saved turn (prompt and answer) hits"
    assert tokens == cold_tokens
    assert relative_error(logits, cold_logits) < 1e-5


def test_a_host_tier_is_saved_and_loaded_too(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path, num_pages=20, host_pages=64), source="w0")
    serve(engine, TURNS)
    assert engine.cache.tree.host_cached_pages > 0, "nothing reached the host tier"
    engine.stop()
    manifest = json.loads((tmp_path / "w0" / MANIFEST).read_text())
    saved_positions = sum(node["positions"] for node in manifest["nodes"])
    assert saved_positions > 19 * 4, "the host tier's nodes were saved with the device's"
    warm = Engine(model(), None, config(tmp_path, num_pages=20, host_pages=64), source="w0")
    assert warm.loaded.positions == saved_positions
    check_sequence_cache(warm.cache)
    _, cached, _ = ask(warm, [*TURNS[0], 9])
    assert cached >= len(SYSTEM) // 4 * 4


@pytest.mark.parametrize(
    "change",
    [{"page_size": 8}, {"model_revision": "other-weights"}, {"block_size": 8}],
    ids=["page_size", "model_revision", "block_size"],
)
def test_a_cache_saved_with_anything_else_is_refused_and_the_engine_starts_cold(
    tmp_path: Path, change: dict[str, object], caplog: pytest.LogCaptureFixture
) -> None:
    saved(tmp_path)
    with caplog.at_level(logging.WARNING, logger="worker.kv_persistence"):
        engine = Engine(model(), None, config(tmp_path, **change), source="w0")
    (name,) = change
    assert name in engine.loaded.refused and engine.loaded.nodes == 0
    lines = [r for r in caplog.records if "not loading" in r.getMessage()]
    assert len(lines) == 1 and name in lines[0].getMessage()
    assert engine.cache.tree.node_count == 0
    _, cached, _ = ask(engine, TURNS[0])
    assert cached == 0


def test_new_weights_written_over_a_checkpoint_never_get_its_old_kv(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Weights retrained and written over a checkpoint (same file names, shapes and dtype, so
    the same sizes) get a new model revision: the next start refuses the cache the old weights
    computed and answers as a cold engine on the new weights does. A second host holding the
    same bytes (copied, other file times) agrees on the revision."""
    checkpoint = tmp_path / "model"
    old = load_model(build_tiny_checkpoint(checkpoint, seed=0))
    sizes = {f.name: f.stat().st_size for f in checkpoint.iterdir()}
    engine = Engine(old.model, None, config(tmp_path, model_revision=old.revision), source="w0")
    serve(engine, [TURNS[0]])
    engine.stop()  # the drain saves the cache
    new = load_model(build_tiny_checkpoint(checkpoint, seed=1))  # retrained, written in place
    assert {f.name: f.stat().st_size for f in checkpoint.iterdir()} == sizes
    assert new.revision != old.revision
    shutil.copytree(checkpoint, tmp_path / "host2" / "model", copy_function=shutil.copy)
    assert load_model(tmp_path / "host2" / "model").revision == new.revision
    with caplog.at_level(logging.WARNING, logger="worker.kv_persistence"):
        warm = Engine(new.model, None, config(tmp_path, model_revision=new.revision), source="w0")
    assert "model_revision" in warm.loaded.refused and warm.loaded.nodes == 0
    assert len([r for r in caplog.records if "not loading" in r.getMessage()]) == 1
    cold = Engine(new.model, None, config(None, model_revision=new.revision), source="w0")
    prompt = [*TURNS[0], 7]
    tokens, cached, _ = ask(warm, prompt)
    assert cached == 0, "KV the old weights computed was served"
    assert tokens == ask(cold, prompt)[0]


def test_another_dtype_is_refused(tmp_path: Path) -> None:
    saved(tmp_path)
    half = tiny_model(LLAMA, seed=4).to(torch.bfloat16)
    engine = Engine(half, None, config(tmp_path), source="w0")
    assert "dtype" in engine.loaded.refused and engine.cache.tree.node_count == 0


@pytest.mark.parametrize(
    "field,value",
    [("namespace", {"image_hash": "zz"}), ("namespace", None), ("namespace", {"tenant": 7}),
     ("parent", ["x"]), ("positions", "40"), ("nbytes", None), ("start", -4),
     ("name", "../../escape"), ("checksum", 5), ("blocks", ["1"])],
)  # fmt: skip
def test_a_manifest_field_of_the_wrong_type_is_refused_and_the_engine_starts_cold(
    tmp_path: Path, field: str, value: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest whose node holds a field of the wrong type or value (edited by hand, written
    by something else) is refused whole, with one warning naming manifest.json, the node and
    the field, as an unreadable manifest is: the engine starts cold and serves, and its drain
    saves a cache the next start loads. Before, the engine's start raised an error naming
    neither, or (nbytes null) every background save and the drain raised TypeError."""
    directory = saved(tmp_path)
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["nodes"][0][field] = value
    (directory / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="worker.kv_persistence"):
        engine = Engine(model(), None, config(tmp_path), source="w0")
    assert f"node 0: {field}" in engine.loaded.refused and engine.loaded.nodes == 0
    (line,) = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert MANIFEST in line and f"node 0: {field}" in line
    _, cached, _ = ask(engine, TURNS[0])
    assert cached == 0
    engine.stop()  # the drain saves over the refused manifest
    again = Engine(model(), None, config(tmp_path), source="w0")
    assert again.loaded.refused == "" and again.loaded.nodes > 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_file_is_dropped_with_everything_below_it(tmp_path: Path, damage: str) -> None:
    directory = saved(tmp_path)
    manifest = json.loads((directory / MANIFEST).read_text())
    nodes = manifest["nodes"]
    (victim,) = [n for n in nodes if n["parent"] is None]  # the system prompt: all hang below it
    assert victim["positions"] == len(SYSTEM) and len(nodes) == 4
    path = directory / f"{victim['name']}.safetensors"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    else:
        path.unlink()
    engine = Engine(model(), None, config(tmp_path), source="w0")
    assert (engine.loaded.nodes, engine.loaded.dropped) == (0, len(nodes))
    check_sequence_cache(engine.cache)
    _, cached, _ = ask(engine, TURNS[1])
    assert cached == 0, "KV below a damaged file was served"


def test_a_damaged_leaf_costs_only_itself(tmp_path: Path) -> None:
    directory = saved(tmp_path)
    nodes = json.loads((directory / MANIFEST).read_text())["nodes"]
    leaf = max((n for n in nodes if n["parent"] is not None), key=lambda n: n["positions"])
    path = directory / f"{leaf['name']}.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    engine = Engine(model(), None, config(tmp_path), source="w0")
    assert (engine.loaded.nodes, engine.loaded.dropped) == (len(nodes) - 1, 1)
    _, cached, _ = ask(engine, [*TURNS[2], 1])  # the longest tail is TURNS[2]'s
    assert cached == len(SYSTEM)


def test_a_reload_never_serves_one_tenants_kv_to_another(tmp_path: Path) -> None:
    acme = CacheNamespace(tenant="acme")
    saved(tmp_path, acme)
    engine = Engine(model(), None, config(tmp_path), source="w0")
    assert engine.loaded.nodes > 0
    _, other, _ = ask(engine, TURNS[0], CacheNamespace(tenant="globex"))
    _, shared, _ = ask(engine, TURNS[0])
    _, own, _ = ask(engine, TURNS[0], acme)
    assert (other, shared) == (0, 0)
    assert own == len(TURNS[0]) - 1


def test_a_reload_keeps_salts_apart_and_a_release_before_salts_refuses_them(
    tmp_path: Path,
) -> None:
    """A salted node (vLLM's cache_salt) is read back in its salt alone. Its manifest takes a
    format of its own, which a release before salts refuses rather than read the salted KV into
    the unsalted namespace; an unsalted cache keeps the format it had."""
    salted = CacheNamespace(tenant="acme", salt="d1")
    directory = saved(tmp_path / "salted", salted)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["format"] == kv_persistence.SALTED_FORMAT
    engine = Engine(model(), None, config(tmp_path / "salted"), source="w0")
    _, unsalted, _ = ask(engine, TURNS[0], CacheNamespace(tenant="acme"))
    _, other, _ = ask(engine, TURNS[0], CacheNamespace(tenant="acme", salt="d2"))
    _, own, _ = ask(engine, TURNS[0], salted)
    assert (unsalted, other) == (0, 0)
    assert own == len(TURNS[0]) - 1
    engine.stop()
    plain = saved(tmp_path / "plain")
    assert json.loads((plain / "manifest.json").read_text())["format"] == kv_persistence.FORMAT


def test_disk_use_stays_under_its_bound_keeping_the_most_recent(tmp_path: Path) -> None:
    directory = saved(tmp_path)
    full = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    bound = full * 3 // 4  # the system prompt and one turn's tail fit, not every tail
    engine = Engine(model(), None, config(tmp_path, persist_max_bytes=bound), source="w0")
    serve(engine, [TURNS[2]])  # most recent
    engine.stop()
    files = list(directory.glob("*.safetensors"))
    assert 0 < sum(p.stat().st_size for p in files) <= bound
    manifest = json.loads((directory / MANIFEST).read_text())
    assert {p.stem for p in files} == {n["name"] for n in manifest["nodes"]}, "stray files"
    again = Engine(model(), None, config(tmp_path), source="w0")
    _, cached, _ = ask(again, [*TURNS[2], 1])
    assert cached >= len(TURNS[2]) // 4 * 4, "the most recent turn was kept"
    _, oldest, _ = ask(again, [*TURNS[0], 1])
    assert oldest == len(SYSTEM), "the least recent turn was left out"


def test_the_background_saver_writes_while_serving_in_small_copies(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path, persist_interval_s=3600.0), source="w0")
    assert engine.saver is not None
    engine.start()
    try:
        for request in [greedy(f"t{i}", prompt, 4) for i, prompt in enumerate(TURNS)]:
            list(engine.generate(request))
        saver = BackgroundSaver(engine, engine.store, 3600.0, max_bytes_per_call=1)  # type: ignore[arg-type]
        assert saver.pages_per_call == 1
        listed = saver.save_once()
        assert listed > 0
        out = list(engine.generate(greedy("after", TURNS[0], 3)))
        assert out[-1].finished, "the engine kept serving"
    finally:
        engine.stop()
    warm = Engine(model(), None, config(tmp_path), source="w0")
    assert warm.loaded.nodes >= listed and warm.loaded.dropped == 0
    _, cached, _ = ask(warm, [*TURNS[1], 3])
    assert cached >= len(TURNS[1]) // 4 * 4


def test_a_background_save_that_keeps_failing_is_told_once_and_its_recovery_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A save that fails every pass (its directory replaced by a file) logs one traceback, not
    one a pass (nor a busy loop of retries), and says when saves land again."""
    engine = Engine(model(), None, config(tmp_path, persist_interval_s=0.05), source="w0")
    engine.start()
    try:
        list(engine.generate(greedy("t0", TURNS[0], 4)))
        directory = tmp_path / "w0"
        directory.mkdir(exist_ok=True)
        directory.rename(tmp_path / "away")
        directory.write_text("not a directory")
        list(engine.generate(greedy("t1", TURNS[1], 4)))  # a node the next pass must write
        with caplog.at_level(logging.WARNING, logger="worker.kv_persistence"):
            time.sleep(2.5)  # 50 passes at the interval
            failed = [r for r in caplog.records if "save of the KV cache failed" in r.message]
            assert len(failed) == 1, f"{len(failed)} tracebacks"
            directory.unlink()
            (tmp_path / "away").rename(directory)
            deadline = time.monotonic() + 5
            while "works again" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "background save of the KV cache works again" in caplog.text
        out = list(engine.generate(greedy("after", TURNS[0], 3)))
        assert out[-1].finished, "the engine kept serving"
    finally:
        engine.stop()


def test_without_a_persist_dir_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a save to a relative path would land here
    engine, _ = recorded_engine(model(), config(None))
    serve(engine, TURNS[:1])
    engine.stop()
    assert engine.store is None and engine.saver is None and not any(tmp_path.iterdir())


def test_a_prefix_evicted_from_every_tier_is_read_back_from_disk(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path, host_pages=16), source="w0")
    serve(engine, TURNS[:1])
    assert engine.store is not None
    engine.store.save(engine)  # as the background saver would, while serving
    cache = engine.cache
    cache.tree.evict(cache.tree.evictable_pages)  # to the host...
    assert cache.tree.host_cached_pages > 0
    cache.tree.clear()  # ...and out of every tier
    engine.runner.copy_pages(cache.take_tier_copies())
    assert cache.tree.node_count == 0
    cold = Engine(model(), None, config(None), source="w0")
    prompt = [*TURNS[0], 5, 6]
    tokens, cached, logits = ask(engine, prompt)
    cold_tokens, _, cold_logits = ask(cold, prompt)
    assert cached == (len(TURNS[0]) + 3) // 4 * 4, "the saved conversation was read back"
    assert engine.stats().disk_hit_tokens == cached
    assert tokens == cold_tokens and relative_error(logits, cold_logits) < 1e-5
    check_sequence_cache(cache)


def test_a_damaged_file_read_on_demand_is_recomputed_not_served(tmp_path: Path) -> None:
    engine = Engine(model(), None, config(tmp_path), source="w0")
    serve(engine, TURNS[:1])
    assert engine.store is not None
    engine.store.save(engine)
    engine.cache.tree.clear()
    for path in (tmp_path / "w0").glob("*.safetensors"):
        path.write_bytes(path.read_bytes()[:100])
    tokens, cached, _ = ask(engine, [*TURNS[0], 5, 6])
    assert cached == 0 and engine.stats().disk_hit_tokens == 0 and len(tokens) == 6
    check_sequence_cache(engine.cache)


def test_a_persist_dir_that_cannot_be_written_is_refused_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="persist_dir"):
        Engine(model(), None, config(blocker), source="w0")


def test_a_file_with_keys_of_another_dtype_is_dropped_not_loaded(tmp_path: Path) -> None:
    from safetensors.torch import load, save
    from xxhash import xxh3_128_hexdigest

    directory = saved(tmp_path)
    manifest = json.loads((directory / MANIFEST).read_text())
    leaf = next(n for n in manifest["nodes"] if n["parent"] is not None)
    path = directory / f"{leaf['name']}.safetensors"
    tensors = load(path.read_bytes())
    tensors["keys"] = tensors["keys"].to(torch.int32)  # same shape, wrong type
    data = save(tensors)
    path.write_bytes(data)
    leaf["checksum"], leaf["nbytes"] = xxh3_128_hexdigest(data), len(data)  # and it checks out
    (directory / MANIFEST).write_text(json.dumps(manifest))
    engine = Engine(model(), None, config(tmp_path), source="w0")
    assert (engine.loaded.nodes, engine.loaded.dropped) == (len(manifest["nodes"]) - 1, 1)
    check_sequence_cache(engine.cache)
