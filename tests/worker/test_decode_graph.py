"""worker/decode_graph.py: the compiled layer boundary of a CPU int4 decode gives the eager loop's
logits and K/V bit for bit at one row and at two, is built once and then loaded from the disk
cache, and leaves the loop eager wherever it does not apply or its build fails."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.worker.test_decode_layers import kv_copy, prefilled
from worker import decode_graph
from worker.config import ModelConfig
from worker.decode_graph import ENABLE_ENV, DecodeGraph
from worker.decode_layers import DecodeLayers
from worker.default_model import CACHE_ENV
from worker.model import CausalLM
from worker.model_runner import Chunk
from worker.tiny_model import TINY_CONFIG, TINY_QWEN3_CONFIG, tiny_model
from worker.weight_formats import apply_weight_format

NO_COMPILER = not any(shutil.which(c) for c in ("g++", "c++", "clang++"))
"""Inductor compiles C++: without a compiler the build fails (tested below) and nothing is kept."""
needs_compiler = pytest.mark.skipif(NO_COMPILER, reason="no C++ compiler to build a package")
THREE_LAYERS = replace(TINY_CONFIG, num_layers=3)
"""Two boundaries: the build checks the first and the last."""
FOUR_LAYERS = replace(TINY_CONFIG, num_layers=4)
"""Three boundaries: a lone sequence runs the lone package twice a step, one call's q, k and v
feeding the next."""


@pytest.fixture(scope="module")
def package_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for the module: the first build compiles, the others load its package."""
    return tmp_path_factory.mktemp("radixmesh-cache")


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch, package_dir: Path) -> Path:
    monkeypatch.setenv(ENABLE_ENV, "1")
    monkeypatch.setenv(CACHE_ENV, str(package_dir))
    return package_dir


def built(model: CausalLM) -> DecodeGraph:
    layers = model.decode_layers()
    assert layers is not None and layers.graph is not None
    assert layers.graph.wait(600), "the build did not end"
    return layers.graph


def counting(run: decode_graph.Run, calls: list[str], name: str) -> decode_graph.Run:
    """`run`, noting `name` in `calls` at each call."""

    def counted(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(name)
        return run(inputs)

    return counted


def int4_model(seed: int, config: ModelConfig = THREE_LAYERS) -> CausalLM:
    return apply_weight_format(tiny_model(config, seed=seed), "int4")


@needs_compiler
@pytest.mark.parametrize(("rows", "page_size"), [(1, 4), (1, 1), (1, 16), (2, 4)])
def test_the_compiled_layers_give_the_eager_loops_logits_and_kv_bit_for_bit(
    compiled: Path, rows: int, page_size: int
) -> None:
    """Each of 8 greedy steps of `rows` sequences runs eagerly, then, from the K/V as it was
    before it, through the compiled packages: equal logits, equal K/V. One sequence's layers
    after the first run the lone package (its attention inside), a batch's the boundary."""
    model = int4_model(seed=11, config=FOUR_LAYERS)
    graph = built(model)
    assert graph.run is not None, graph.failure
    assert graph.lone is not None, graph.lone_failure
    kept = sorted(p.name.split("-")[0] for p in compiled.glob("decode-graphs/*.pt2"))
    assert kept == ["boundary", "lone"], "the packages were not kept"
    silu_rows = (decode_graph.ELEMENTWISE_GRAIN - 1) // FOUR_LAYERS.intermediate_size
    assert graph.max_rows == min(decode_graph.MAX_ROWS, silu_rows)
    packages: dict[str, decode_graph.Run] = {"run": graph.run, "lone": graph.lone}
    calls: list[str] = []

    boundaries = FOUR_LAYERS.num_layers - 1  # the last layer's MLP stays eager
    expected = ["run"] * boundaries if rows > 1 else ["run"] + ["lone"] * (boundaries - 1)
    runner, chunks = prefilled(model, rows, page_size=page_size)
    for _ in range(8):
        before = kv_copy(runner)
        graph.run = graph.lone = None
        eager = runner.run(chunks).clone()
        kv_eager = kv_copy(runner)
        for cache, saved in zip((t for layer in runner.kv for t in layer), before, strict=True):
            cache.copy_(saved)
        graph.run = counting(packages["run"], calls, "run")
        graph.lone = counting(packages["lone"], calls, "lone")
        got = runner.run(chunks)
        assert calls == expected, "the packages did not run"
        calls.clear()
        assert torch.equal(got, eager), (got - eager).abs().max()
        for ours, theirs in zip(kv_copy(runner), kv_eager, strict=True):
            assert torch.equal(ours.nan_to_num(), theirs.nan_to_num())
        tokens = got.argmax(-1).tolist()
        chunks = [
            Chunk([token], chunk.start + 1, chunk.pages, True)
            for chunk, token in zip(chunks, tokens, strict=True)
        ]
    graph.max_rows = rows - 1  # a batch past what it runs: the eager loop
    runner.run(chunks)
    assert calls == (["lone"] * (boundaries - 1) if rows == 1 else [])


@needs_compiler
@pytest.mark.parametrize("layers", ["every layer", "layer 1 only"])
def test_the_lone_package_does_not_run_on_caches_that_are_views_into_a_buffer(
    compiled: Path, layers: str
) -> None:
    """The package checks none of its inputs, and the loop gives it only caches that start
    their storage: caches further into a buffer, in every layer or in one after the first
    (which the checked calls do not see), run that step's attentions eagerly around the
    boundary package, with the same logits."""
    model = int4_model(seed=12)
    graph = built(model)
    assert graph.lone is not None, graph.lone_failure
    calls: list[str] = []
    graph.lone = counting(graph.lone, calls, "lone")
    runner, chunks = prefilled(model, 1)
    expected = runner.run(chunks).clone()
    assert calls, "the lone package did not run on the runner's own caches"
    calls.clear()
    moved = range(len(runner.kv)) if layers == "every layer" else [1]  # 1: where it runs
    for i in moved:
        runner.kv[i] = tuple(torch.cat([torch.zeros_like(t[:1]), t])[1:] for t in runner.kv[i])
    got = runner.run(chunks)  # the same step again: the same K/V written, the same logits
    assert not calls
    assert torch.equal(got, expected)


@needs_compiler
def test_a_second_model_of_the_same_shape_loads_the_package_without_compiling(
    compiled: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built(int4_model(seed=1))  # compiles, unless the test above already did

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    graph = built(int4_model(seed=2))  # other weights: inputs, not part of the package
    assert graph.run is not None, graph.failure


@pytest.mark.parametrize("broken", ["no compiler", "other bits"])
def test_a_failed_or_inexact_build_leaves_the_loop_eager(
    broken: str, compiled: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A build that raises (no C++ compiler, say), or whose package does not give the eager
    ops' bits, is not used: the failure is kept and the loop decodes eagerly, as before."""
    fake = _no_compiler if broken == "no compiler" else _off_by_a_bit(decode_graph.Boundary)
    monkeypatch.setattr(decode_graph, "compile_boundary", fake)
    model = int4_model(seed=3)
    graph = built(model)
    assert graph.run is None and graph.lone is None
    assert graph.failure == _failure(broken)
    assert graph.lone_failure is None  # not tried without the boundary
    runner, chunks = prefilled(model, 1)
    flat = runner.run(chunks).clone()
    model.flat_decode = False
    runner, chunks = prefilled(model, 1)
    assert torch.equal(runner.run(chunks), flat)


@needs_compiler
@pytest.mark.parametrize("broken", ["no compiler", "other bits", "caches untouched"])
def test_a_failed_or_inexact_lone_build_leaves_the_boundary_running(
    broken: str, compiled: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lone package failing (no compiler; other bits out; the right outputs but its K/V
    not written) leaves a lone sequence's attentions eager and the boundary package running
    between them, with the eager loop's logits."""
    fakes = {
        "no compiler": _no_compiler,
        "other bits": _off_by_a_bit(decode_graph.LoneBoundary),
        "caches untouched": _on_copies_of_the_caches,
    }
    monkeypatch.setattr(decode_graph, "compile_lone", fakes[broken])
    model = int4_model(seed=3, config=FOUR_LAYERS)
    graph = built(model)
    assert graph.run is not None and graph.failure is None
    assert graph.lone is None and graph.lone_failure == _failure(broken)
    calls: list[str] = []
    graph.run = counting(graph.run, calls, "run")
    runner, chunks = prefilled(model, 1)
    got = runner.run(chunks).clone()
    assert len(calls) == FOUR_LAYERS.num_layers - 1, "the boundary did not run at each boundary"
    graph.run = None
    runner, chunks = prefilled(model, 1)
    assert torch.equal(runner.run(chunks), got)


def _no_compiler(*args: object) -> decode_graph.Run:
    raise RuntimeError("no compiler")


def _off_by_a_bit(module: type[torch.nn.Module]) -> Callable[..., decode_graph.Run]:
    """A build whose package is `module`'s eager ops with x one float32 step off."""

    def build(geometry: decode_graph.Geometry, example: Any, *args: object) -> decode_graph.Run:
        eager = module(geometry)
        spec = torch.utils._pytree.tree_structure(tuple(example))

        def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            x, *rest = eager(*torch.utils._pytree.tree_unflatten(inputs, spec))
            return [x.nextafter(x + 1), *rest]

        return run

    return build


def _on_copies_of_the_caches(
    geometry: decode_graph.Geometry, example: Any, *args: object
) -> decode_graph.Run:
    """A lone build whose package gives the right outputs from copies of the caches, leaving
    the caches themselves unwritten."""
    eager = decode_graph.LoneBoundary(geometry)

    def run(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        copied = [*inputs[:4], inputs[4].clone(), inputs[5].clone(), *inputs[6:]]
        attention, boundary = copied[:9], copied[9:]
        return list(eager(tuple(attention), tuple(boundary)))

    return run


def _failure(broken: str) -> str:
    if broken == "no compiler":
        return "RuntimeError: no compiler"
    return "the compiled graph does not give the eager loop's bits"


def test_it_is_built_only_where_it_was_written_for(
    compiled: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other formats, QK-norm, one layer (no boundary), or compiled decode turned off: no graph
    at all."""
    for model in (
        int4_model(seed=4, config=replace(TINY_CONFIG, num_layers=1)),
        apply_weight_format(tiny_model(THREE_LAYERS, seed=4), "int8"),
        apply_weight_format(tiny_model(THREE_LAYERS, seed=4), "bf16"),
        apply_weight_format(tiny_model(TINY_QWEN3_CONFIG, seed=4), "int4"),
    ):
        layers = model.decode_layers()
        assert layers is None or layers.graph is None
    monkeypatch.setenv(ENABLE_ENV, "0")
    layers = DecodeLayers.of(int4_model(seed=4))
    assert layers is not None and layers.graph is None


@needs_compiler
def test_a_kept_package_that_does_not_check_out_is_compiled_again(
    compiled: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A package on disk that fails the probe (written by another build, or damaged) is not
    trusted for good: the build compiles it again, once, and uses the new one."""
    built(int4_model(seed=5))  # the package is on disk
    real, probes = decode_graph.checks_out, []

    def first_fails(*args: object) -> bool:
        probes.append(1)
        return len(probes) > 1 and real(*args)  # type: ignore[arg-type]

    compiles: list[bool] = []
    compile_boundary = decode_graph.compile_boundary

    def noted(*args: object) -> decode_graph.Run:
        compiles.append(bool(args[3]))
        return compile_boundary(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_graph, "checks_out", first_fails)
    monkeypatch.setattr(decode_graph, "compile_boundary", noted)
    graph = built(int4_model(seed=6))
    assert graph.run is not None and graph.failure is None
    assert compiles == [False, True]  # loaded, then compiled fresh
