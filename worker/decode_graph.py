"""The stretch of a CPU int4 decode step between two attentions, compiled ahead of time: one
graph for every layer boundary of a model, built in the background, used once it checks out.

A decode step of one sequence spends about a third of each layer in ~25 small eager ops (norms,
casts, slices, RoPE, SiLU, residual adds), each a Python call and a dispatch. `torch.compile` of
that stretch gave nothing back (docs/worker.md: dynamo's lookup and the wrapper cost what fusion
saved); AOTInductor has neither: `torch.export` the stretch from one layer's attention output to
the next layer's rotated q and k, compile it with its four int4 kernels as calls into torch, and
run the package's loader directly. The weights are inputs, so one package serves every boundary
of a model (and of every model of the same shape: it is kept on disk, keyed by what it was
compiled for), and the row count is a dynamic dimension, so it serves a decode batch of any size
up to `DecodeGraph.max_rows` (21 sequences for SmolLM2: `ELEMENTWISE_GRAIN`):

    attention -> x + o -> rms_norm -> gate/up -> silu(gate) * up -> down -> x + down
      -> (the next layer) rms_norm -> qkv -> RoPE on q and k -> (x, q, k, v) -> attention

The same ops as worker/decode_layers.py's loop, in the same order, so the same bits: the norms
are worker/rms_norm.py's tree of elementwise adds, which inductor cannot sum in an order of its
own (torch's fused `rms_norm` here moved the logits by up to 0.3 over 100 steps), and each row's
int4 products do not depend on the rows beside it. A package is used only if it gives the loop's
bits on probe inputs of one to three rows through the model's first and last boundaries;
otherwise, and while it compiles, and wherever it was not built for (a model of one layer,
another format, a non-CPU model, no C++ compiler), the loop runs eagerly. The first layer's
q/k/v and the last layer's MLP, outside any boundary, always run eagerly.

A decode step of one sequence (`kernels.LoneDecode`'s plan: its pages consecutive) has a second
package, `LoneBoundary`: layer i's K/V write and attention in place on its caches, then boundary
i, one call a layer instead of six. Its sequence's first page and length reach it as the lengths
of stride-0 tensors (`carrier`), the caches' page count and page size are dynamic, and it is
checked like the first, on probe sequences, outputs and caches, before it is used.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from kernels import LoneDecode
from kernels.layout import cdiv
from worker.default_model import cache_root
from worker.fused_projections import FusedProjections
from worker.quantized_linear import QuantizedLinear
from worker.rms_norm import rms_norm
from worker.rope import rotate_promoted

if TYPE_CHECKING:
    from worker.model import CausalLM, DecoderLayer

log = logging.getLogger(__name__)

GRAPH_VERSION = 3
"""Part of a package's key, beside a digest of the files the packages trace (`_traced_sources`):
bump it for a change to what they compute that lies outside those files. A kept package that
gives other bits is compiled again anyway."""
ENABLE_ENV = "RADIXMESH_COMPILED_DECODE"
"""`0` keeps every decode step eager (the default for tests: tests/conftest.py)."""

Run = Callable[[list[torch.Tensor]], list[torch.Tensor]]
Inputs = tuple[tuple[torch.Tensor, ...], ...]
"""Boundary i's weights (`boundary_inputs`): after layer i's attention, up to layer i + 1's."""
MAX_ROWS = 1024
"""The most rows (sequences in a decode batch) a package is compiled for; a bigger batch runs
the loop eagerly. A model runs it at fewer rows where an eager SiLU would split between threads
(`ELEMENTWISE_GRAIN`) or its int4 layers switch to their float32 path
(`QuantizedLinear.float32_rows`: AVX2's kernels): `DecodeGraph.max_rows`."""
ELEMENTWISE_GRAIN = 32768
"""torch's grain for splitting an elementwise op between threads (`at::internal::GRAIN_SIZE`):
from that many elements an eager SiLU splits its [rows, intermediate] input into chunks, each
ending in a scalar tail whose `exp` rounds unlike the vectorized one, at places set by the row
and thread counts; inductor's code does not. A package runs fewer rows than that takes."""
CARRIED = 2
"""An int enters a package as the length of a stride-0 tensor (`carrier`: AOTInductor takes
tensors only), `CARRIED` past the int, as torch.export fixes a dimension whose example is 0 or 1."""
LONE_PROBES = ((16, 0, 2), (16, 2, 40), (16, 5, 77), (1, 3, 9))
"""(page size, first page, length) of the sequences a lone package is checked on."""
PROBE_ROWS = (1, 2, 3)
"""The row counts a package is checked at (it is exported at 2: torch.export fixes a dimension
whose example is 1)."""


@dataclass(frozen=True)
class Geometry:
    """What a package is compiled for, besides the tensors' shapes."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    up_start: int
    v_start: int
    group: int
    eps: float
    outs: tuple[int, int, int, int]
    """The true widths of o, gate/up, down and qkv (a kernel's output is padded past them)."""


class Boundary(nn.Module):
    """One layer boundary as plain tensor ops (what `torch.export` traces)."""

    def __init__(self, geometry: Geometry) -> None:
        super().__init__()
        self.g = geometry

    def forward(
        self,
        attended: torch.Tensor,
        x: torch.Tensor,
        o_packed: torch.Tensor,
        o_scales: torch.Tensor,
        post_norm: torch.Tensor,
        gate_up_packed: torch.Tensor,
        gate_up_scales: torch.Tensor,
        down_packed: torch.Tensor,
        down_scales: torch.Tensor,
        input_norm: torch.Tensor,
        qkv_packed: torch.Tensor,
        qkv_scales: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        g, mm, rows = self.g, torch.ops.aten._weight_int4pack_mm_for_cpu, x.shape[0]
        o_out, gate_up_out, down_out, qkv_out = g.outs
        x = x + mm(attended.to(torch.bfloat16), o_packed, g.group, o_scales)[:, :o_out]
        normed = rms_norm(x, post_norm, g.eps).to(torch.bfloat16)
        gate_up = mm(normed, gate_up_packed, g.group, gate_up_scales)[:, :gate_up_out]
        inter, up = g.intermediate, g.up_start
        h = F.silu(gate_up[:, :inter].float()) * gate_up[:, up : up + inter]
        x = x + mm(h.to(torch.bfloat16), down_packed, g.group, down_scales)[:, :down_out]
        normed = rms_norm(x, input_norm, g.eps).to(torch.bfloat16)
        qkv = mm(normed, qkv_packed, g.group, qkv_scales)[:, :qkv_out]
        dim, kv = g.head_dim, g.kv_heads * g.head_dim
        v = qkv[:, g.v_start : g.v_start + kv].view(rows, g.kv_heads, dim)
        qk = qkv[:, : g.heads * dim + kv].view(rows, -1, dim)
        qk = rotate_promoted(qk, cos, signed_sin)
        return x, qk[:, : g.heads], qk[:, g.heads :], v.to(qk.dtype)


class LoneBoundary(nn.Module):
    """A decode step of one sequence at layer i: its K/V write and attention, in place on the
    layer's caches (`kernels.LoneDecode`: what the loop runs for it), then boundary i. One call
    a layer, where the loop makes six (-15 % an int4 SmolLM2 step).

    `attention` is q, k, v (float32, rotated, one row), x, the layer's K and V caches
    (float32 [pages, page size, kv_heads, head_dim], contiguous, two pages or more of any
    size), the int64 slot of the new K/V, and the first page and the length of the sequence as
    `carrier`s; `boundary` is `Boundary`'s inputs after `attended` and x. AOTInductor does not
    check a package's inputs unless told to (`AOTI_RUNTIME_CHECK_INPUTS=1`), so the loop passes
    only what it was compiled for (worker/decode_layers.py `_planned`). Told to, it refuses a
    dynamic size of 1 (one row, pages of one position), which inductor compiles for as 2 and up
    whatever range export gives it; both packages then fail their probes and the loop stays
    eager. Unchecked, the probes hold size 1 to the eager bits."""

    def __init__(self, geometry: Geometry) -> None:
        super().__init__()
        self.g = geometry
        self.boundary = Boundary(geometry)

    def forward(
        self, attention: tuple[torch.Tensor, ...], boundary: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, x, k_cache, v_cache, slots, first, longest = attention
        plan = LoneDecode.over(k_cache, slots, first.shape[0] - CARRIED, longest.shape[0] - CARRIED)
        plan.write(k_cache, v_cache, k, v)
        attended = plan.attend(q, k_cache, v_cache).reshape(1, self.g.heads * self.g.head_dim)
        return self.boundary(attended, x, *boundary)


_ONE = torch.empty(1)


def carrier(n: int) -> torch.Tensor:
    """n as a tensor a package reads the length of (`CARRIED`)."""
    return _ONE.expand(n + CARRIED)


Four = tuple[QuantizedLinear, QuantizedLinear, QuantizedLinear, QuantizedLinear]
"""A layer's fused q/k/v, o, fused gate/up and down."""


@dataclass(frozen=True)
class _LayerParts:
    four: Four
    v_start: int
    up_start: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor


def _layer_parts(layer: DecoderLayer, q_width: int) -> _LayerParts | None:
    """What the graphs read of a layer `DecodeLayers.of` took (fused q/k/v and gate/up, plain
    CPU linears, no QK-norm, float32 norms: worker/decode_layers.py checks those), or None
    unless its four projections are int4 with the kernel at one row at least and q and k side by
    side."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = cast(FusedProjections, attn.qkv_proj)
    gate_up = cast(FusedProjections, mlp.gate_up_proj)
    four = (qkv.linear, attn.o_proj, gate_up.linear, mlp.down_proj)
    q_at, k_at, v_at = qkv.starts
    if (q_at, k_at) != (0, q_width) or not all(_int4_kernel(m) for m in four):
        return None
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return _LayerParts(cast(Four, four), v_at, gate_up.starts[1], *(w.detach() for w in norms))


def geometry_of(model: CausalLM) -> tuple[Geometry, Inputs, int] | None:
    """The graphs' geometry and weights for a model `DecodeLayers.of` took (a CPU model with
    float32 activations, its layers the flat loop's), or None unless it has two layers or more
    and every layer holds int4 projections (`_layer_parts`) of the same shapes and group size."""
    config = model.config
    q_width = config.num_heads * config.head_dim
    found = [_layer_parts(cast("DecoderLayer", layer), q_width) for layer in model.model.layers]
    parts = [p for p in found if p is not None]
    if len(parts) != len(found) or len(parts) < 2:
        return None
    first = parts[0]
    layouts = {
        (p.v_start, p.up_start, *((m.packed.shape, m.scales_and_zeros.shape) for m in p.four))
        for p in parts
    }
    groups = {m.group_size for p in parts for m in (p.four[0], p.four[2], p.four[3])}
    if len(layouts) != 1 or len(groups) != 1:
        return None
    qkv, o, gate_up, down = first.four
    geometry = Geometry(
        config.hidden_size,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        first.up_start,
        first.v_start,
        qkv.group_size,
        config.rms_norm_eps,
        (o.out_features, gate_up.out_features, down.out_features, qkv.out_features),
    )
    silu_rows = (ELEMENTWISE_GRAIN - 1) // config.intermediate_size
    rows = min(MAX_ROWS, silu_rows, *(m.float32_rows - 1 for p in parts for m in p.four))
    if rows < 1:
        return None
    return geometry, boundary_inputs(parts), rows


def boundary_inputs(parts: Sequence[_LayerParts]) -> Inputs:
    """What each boundary reads besides its activations: layer i's o, post-attention norm,
    gate/up and down, then layer i + 1's input norm and q/k/v (packed, and the scales whole:
    a fused part's are a strided view of its buffer)."""
    inputs = []
    for part, following in itertools.pairwise(parts):
        _, o, gate_up, down = part.four
        qkv = following.four[0]
        inputs.append(
            (
                o.packed,
                o.scales_and_zeros.contiguous(),
                part.post_norm,
                gate_up.packed,
                gate_up.scales_and_zeros.contiguous(),
                down.packed,
                down.scales_and_zeros.contiguous(),
                following.input_norm,
                qkv.packed,
                qkv.scales_and_zeros.contiguous(),
            )
        )
    return tuple(inputs)


def _int4_kernel(linear: nn.Module) -> bool:
    return (
        isinstance(linear, QuantizedLinear) and linear.format == "int4" and linear.float32_rows > 1
    )


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def cache_dir() -> Path:
    """Where packages are kept: `decode-graphs` in radixmesh's cache (`$RADIXMESH_CACHE_DIR`,
    or ~/.cache/radixmesh, where the default model is converted)."""
    return cache_root() / "decode-graphs"


def _example(geometry: Geometry, inputs: Inputs, boundary: int, rows: int) -> list[torch.Tensor]:
    """Probe inputs of boundary `boundary` (also what the package is exported with)."""
    gen = torch.Generator().manual_seed(boundary * 1000 + rows)
    hidden, dim = geometry.hidden, geometry.head_dim
    attended, x = torch.randn(2, rows, hidden, generator=gen)
    angle = torch.rand(rows, 1, dim, generator=gen) * 100
    return [attended, x, *inputs[boundary], angle.cos(), angle.sin()]


def _lone_example(
    geometry: Geometry, inputs: Inputs, boundary: int, page_size: int, first: int, length: int
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Probe inputs of `LoneBoundary` at boundary `boundary`: a sequence of `length` positions
    from page `first` of random caches with two pages past it, its new K/V at its last slot."""
    gen = torch.Generator().manual_seed(boundary * 1000 + first * 10 + length)
    heads, kv_heads, dim = geometry.heads, geometry.kv_heads, geometry.head_dim
    pages = first + cdiv(length, page_size) + 2
    k_cache, v_cache = (torch.randn(pages, page_size, kv_heads, dim, generator=gen) for _ in "kv")
    qk = torch.randn(1, heads + kv_heads, dim, generator=gen)  # views, as the boundary gives them
    q, k = qk[:, :heads], qk[:, heads:]
    v = torch.randn(1, kv_heads, dim, generator=gen)
    x = torch.randn(1, geometry.hidden, generator=gen)
    slot = torch.tensor([first * page_size + length - 1])
    angle = torch.rand(1, 1, dim, generator=gen) * 100
    attention = (q, k, v, x, k_cache, v_cache, slot, carrier(first), carrier(length))
    return attention, (*inputs[boundary], angle.cos(), angle.sin())


def _dynamic_rows(example: Sequence[torch.Tensor]) -> tuple[dict[int, Any] | None, ...]:
    """The row dimension of the activations (the first two inputs, cos and sin) dynamic."""
    rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
    last = len(example) - 2
    return tuple({0: rows} if i < 2 or i >= last else None for i in range(len(example)))


@functools.cache
def _host() -> tuple[str, ...]:
    """What the generated code depends on besides the graph: the vector ISA inductor picks, the
    CPU's flags (it compiles for the host's own instructions) and the C++ compiler."""
    from torch._inductor import cpp_builder, cpu_vec_isa  # noqa: PLC0415 - imports triton

    flags = ""
    with contextlib.suppress(OSError):
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    compiler = cpp_builder.get_cpp_compiler()
    return (
        str(cpu_vec_isa.pick_vec_isa()),
        hashlib.sha256(flags.encode()).hexdigest(),
        cpp_builder.get_compiler_version_info(compiler),
    )


@functools.cache
def _traced_sources() -> str:
    """A digest of the files whose code the packages trace (this one, the K/V write and
    attention of kernels/torch_sdpa.py, the norm, RoPE): a change to any of them compiles the
    packages again rather than trusting the probes alone."""
    digest = hashlib.sha256()
    for function in (Boundary, LoneDecode, rms_norm, rotate_promoted):
        source = inspect.getsourcefile(function)
        digest.update(Path(source).read_bytes() if source else b"?")
    return digest.hexdigest()


def package_key(
    name: str, geometry: Geometry, example: Sequence[torch.Tensor], dynamic: object = None
) -> str:
    """What a package was compiled for: the graph and its most rows, the code it traces, torch,
    the host (`_host`), the geometry, every input's shape, strides and dtype, and which
    dimensions are dynamic over what range."""
    parts = [
        f"{name}-v{GRAPH_VERSION}-rows{MAX_ROWS}",
        _traced_sources(),
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        *_host(),
        repr(geometry),
        *(f"{tuple(t.shape)}{t.stride()}{t.dtype}" for t in example),
        repr(dynamic),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


_COMPILING = threading.Lock()
"""One build at a time in a process: `torch.export` and inductor are not thread-safe."""


def compile_package(
    name: str,
    module: nn.Module,
    example: tuple[Any, ...],
    dynamic: tuple[Any, ...],
    geometry: Geometry,
    directory: Path,
    fresh: bool = False,
) -> Run:
    """`module`'s package, exported at `example` with `dynamic` shapes, loaded (compiled first
    unless `directory` holds it, or `fresh`: compiled again over what it holds); its loader's
    `run` over a flat list of inputs."""
    directory.mkdir(parents=True, exist_ok=True)
    flat = torch.utils._pytree.tree_leaves(example)
    path = directory / f"{name}-{package_key(name, geometry, flat, dynamic)}.pt2"
    with _COMPILING:
        if fresh or not path.exists():
            exported = torch.export.export(module, example, dynamic_shapes=dynamic)
            partial = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.part.pt2")
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
            with partial.open("rb") as written:
                os.fsync(written.fileno())
            os.replace(partial, path)  # whole or absent: a reader never loads half a package
        runner = torch._inductor.aoti_load_package(str(path))
    run: Run = runner.loader.run
    return run


def compile_boundary(
    geometry: Geometry, example: list[torch.Tensor], directory: Path, fresh: bool = False
) -> Run:
    """The boundary's package (`compile_package`), its row count dynamic."""
    module, dynamic = Boundary(geometry), _dynamic_rows(example)
    return compile_package("boundary", module, tuple(example), dynamic, geometry, directory, fresh)


def compile_lone(
    geometry: Geometry, example: tuple[Any, ...], directory: Path, fresh: bool = False
) -> Run:
    """The lone sequence's layer (`LoneBoundary`, `compile_package`): its caches' pages and
    page size, its first page and its length dynamic."""
    big = 2**31 - 1
    pages = torch.export.Dim("pages", min=2, max=big)
    page = torch.export.Dim("page", min=1, max=big)
    cache = {0: pages, 1: page}
    first = {0: torch.export.Dim("first", min=CARRIED, max=big)}
    longest = {0: torch.export.Dim("longest", min=CARRIED + 2, max=big)}
    attention = (None, None, None, None, cache, cache, None, first, longest)
    dynamic = (attention, tuple(None for _ in example[1]))
    module = LoneBoundary(geometry)
    return compile_package("lone", module, example, dynamic, geometry, directory, fresh)


def checks_out(run: Run, geometry: Geometry, inputs: Inputs) -> bool:
    """Whether the package gives its eager ops' bits on probe inputs of `PROBE_ROWS` rows
    through the model's first and last boundaries."""
    boundary = Boundary(geometry)
    for index in {0, len(inputs) - 1}:
        for rows in PROBE_ROWS:
            example = _example(geometry, inputs, index, rows)
            with torch.inference_mode():
                expected = boundary(*example)
                got = run(list(example))
            if not _same(got, expected):
                return False
    return True


def lone_checks_out(run: Run, geometry: Geometry, inputs: Inputs) -> bool:
    """Whether the lone package gives its eager ops' outputs and caches bit for bit on probe
    sequences (`LONE_PROBES`) through the model's first and last boundaries."""
    layer = LoneBoundary(geometry)
    for index in {0, len(inputs) - 1}:
        for page_size, first, length in LONE_PROBES:
            attention, boundary = _lone_example(geometry, inputs, index, page_size, first, length)
            ours = list(attention)
            ours[4:6] = (attention[4].clone(), attention[5].clone())
            with torch.inference_mode():
                expected = layer(attention, boundary)
                got = run([*ours, *boundary])
            if not (_same(got, expected) and _same(ours[4:6], attention[4:6])):
                return False
    return True


def _same(got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> bool:
    return len(got) == len(expected) and all(
        g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)
        for g, e in zip(got, expected, strict=False)
    )


class DecodeGraph:
    """The compiled boundary of one model: `run` is None until its package is built, loaded
    and checked (in a thread of its own), and stays None if any of that failed. It runs steps
    of up to `max_rows` rows (`MAX_ROWS` says which), where it gives the loop's bits."""

    def __init__(self, geometry: Geometry, inputs: Inputs, max_rows: int) -> None:
        self.geometry, self.inputs, self.max_rows = geometry, inputs, max_rows
        self.run: Run | None = None
        self.failure: str | None = None
        self.lone: Run | None = None
        """`LoneBoundary`'s package: a decode step of one sequence, once built and checked
        after `run` (None if that failed: `lone_failure`)."""
        self.lone_failure: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._build, name="decode-graph", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            geometry, inputs = self.geometry, self.inputs
            self.run, self.failure = self._built(
                "decode steps",
                lambda fresh: compile_boundary(
                    geometry, _example(geometry, inputs, 0, 2), cache_dir(), fresh
                ),
                checks_out,
            )
            if self.run is not None and len(inputs) > 1:  # layers 1 to n - 2 run it
                self.lone, self.lone_failure = self._built(
                    "one sequence's attentions",
                    lambda fresh: compile_lone(
                        geometry,
                        _lone_example(geometry, inputs, 0, *LONE_PROBES[1]),
                        cache_dir(),
                        fresh,
                    ),
                    lone_checks_out,
                )
        finally:
            self._done.set()

    def _built(
        self,
        what: str,
        compile: Callable[[bool], Run],
        check: Callable[[Run, Geometry, Inputs], bool],
    ) -> tuple[Run | None, str | None]:
        """A package compiled (`compile(fresh)`) and checked, or None and why not (logged: which
        decode steps `what` stay eager)."""
        failure = None
        for fresh in (False, True):  # a kept package that fails is compiled again, once
            try:
                run = compile(fresh)
                if check(run, self.geometry, self.inputs):
                    return run, None
                failure = "the compiled graph does not give the eager loop's bits"
            except Exception as error:
                failure = f"{type(error).__name__}: {error}"
        log.warning("%s stay eager: %s", what, failure)
        return None, failure

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build ended (benchmarks, tests); whether it did in `timeout`."""
        return self._done.wait(timeout)

    @classmethod
    def start(cls, model: CausalLM) -> DecodeGraph | None:
        """The graph for `model` (one `DecodeLayers.of` took: it calls this), building; None
        where it was not written for it, or compiled decode is off
        (`RADIXMESH_COMPILED_DECODE=0`)."""
        if not enabled():
            return None
        found = geometry_of(model)
        return None if found is None else cls(*found)
