"""The step between two attentions of a CPU int4 decode, compiled ahead of time: one graph for
every layer boundary of the model, built in the background, used once it checks out.

A decode step of one sequence spends about a third of each layer in ~25 small eager ops (norms,
casts, RoPE, SiLU, residual adds), each a Python call and a dispatch. `torch.compile` of that
stretch gave nothing back (docs/worker.md: dynamo's lookup and the wrapper cost what fusion
saved); AOTInductor has neither: `torch.export` the stretch from one layer's attention output to
the next layer's rotated q and k, compile it with its four int4 kernels as calls into torch, and
run the package's loader directly. The weights are inputs, so one package serves all boundaries
of a model (and of every model of the same shape: it is kept on disk, keyed by what it was
compiled for).

    a, x -> x + o(a) -> rms_norm -> gate/up -> silu(gate) * up -> down -> x + down
         -> (next layer) rms_norm -> qkv -> RoPE on q and k -> (x, q, k, v)

The same ops as worker/decode_layers.py's loop, in the same order. Inductor may still reorder a
reduction, so a package is used only if it gives the loop's bits on probe inputs through two real
boundaries of the model; otherwise, and while it compiles, and wherever it was not built for
(more than one row, another format, a non-CPU model, no C++ compiler), the loop runs eagerly.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from worker.default_model import cache_root
from worker.fused_projections import FusedProjections
from worker.quantized_linear import QuantizedLinear

if TYPE_CHECKING:
    from worker.model import CausalLM, DecoderLayer

log = logging.getLogger(__name__)

GRAPH_VERSION = 1
"""Part of a package's key: bump it when `Boundary` changes."""
ENABLE_ENV = "RADIXMESH_COMPILED_DECODE"
"""`0` keeps every decode step eager (the default for tests: tests/conftest.py)."""

Run = Callable[[list[torch.Tensor]], list[torch.Tensor]]


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
        a: torch.Tensor,
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
        g, mm = self.g, torch.ops.aten._weight_int4pack_mm_for_cpu
        shape, (o_out, gate_up_out, down_out, qkv_out) = (g.hidden,), g.outs
        x = x + mm(a.to(torch.bfloat16), o_packed, g.group, o_scales)[:, :o_out]
        normed = F.rms_norm(x, shape, post_norm, g.eps).to(torch.bfloat16)
        gate_up = mm(normed, gate_up_packed, g.group, gate_up_scales)[:, :gate_up_out]
        inter, up = g.intermediate, g.up_start
        h = F.silu(gate_up[:, :inter].float()) * gate_up[:, up : up + inter]
        x = x + mm(h.to(torch.bfloat16), down_packed, g.group, down_scales)[:, :down_out]
        normed = F.rms_norm(x, shape, input_norm, g.eps).to(torch.bfloat16)
        qkv = mm(normed, qkv_packed, g.group, qkv_scales)[:, :qkv_out]
        dim, kv = g.head_dim, g.kv_heads * g.head_dim
        v = qkv[:, g.v_start : g.v_start + kv].view(1, g.kv_heads, dim)
        qk = qkv[:, : g.heads * dim + kv].view(1, -1, dim)
        qk = qk * cos + qk.roll(dim // 2, -1) * signed_sin  # decode_layers._rotate
        return x, qk[:, : g.heads], qk[:, g.heads :], v.to(qk.dtype)


@dataclass(frozen=True)
class BoundaryWeights:
    """The inputs of every boundary after the first two (a, x) and before the last two."""

    per_boundary: tuple[tuple[torch.Tensor, ...], ...]
    """Boundary i (after layer i's attention, to layer i+1's q/k/v)."""


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
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = attn.qkv_proj, mlp.gate_up_proj
    if not (isinstance(qkv, FusedProjections) and isinstance(gate_up, FusedProjections)):
        return None
    four = (qkv.linear, attn.o_proj, gate_up.linear, mlp.down_proj)
    if attn.q_norm is not None or not all(_plain_int4(m) for m in four):
        return None
    q_at, k_at, v_at = qkv.starts
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if (q_at, k_at) != (0, q_width) or any(w.dtype != torch.float32 for w in norms):
        return None
    return _LayerParts(cast(Four, four), v_at, gate_up.starts[1], *(w.detach() for w in norms))


def geometry_of(model: CausalLM) -> tuple[Geometry, BoundaryWeights] | None:
    """The boundaries' geometry and weights, or None when the graph was not written for them:
    a CPU model whose layers all hold plain int4 projections (fused q/k/v with q and k side by
    side, fused gate/up), without bias or QK-norm, float32 activations and norms, the kernel
    at one row, and the same shapes in every layer."""
    config = model.config
    if model.dtype != torch.float32 or model.model.norm.weight.device.type != "cpu":
        return None
    q_width = config.num_heads * config.head_dim
    found = [_layer_parts(cast("DecoderLayer", layer), q_width) for layer in model.model.layers]
    parts = [p for p in found if p is not None]
    if len(parts) != len(found) or not parts:
        return None
    first = parts[0]
    layouts = {
        (p.v_start, p.up_start, *((m.packed.shape, m.scales_and_zeros.shape) for m in p.four))
        for p in parts
    }
    if len(layouts) != 1:
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
    per_boundary = []
    for here, after in itertools.pairwise(parts):
        _, o, gate_up, down = here.four
        qkv_next = after.four[0]
        per_boundary.append(
            (
                o.packed,
                o.scales_and_zeros.contiguous(),  # a part's scales are a strided view
                here.post_norm,
                gate_up.packed,
                gate_up.scales_and_zeros.contiguous(),
                down.packed,
                down.scales_and_zeros.contiguous(),
                after.input_norm,
                qkv_next.packed,
                qkv_next.scales_and_zeros.contiguous(),
            )
        )
    return geometry, BoundaryWeights(tuple(per_boundary))


def _plain_int4(linear: nn.Module) -> bool:
    return (
        isinstance(linear, QuantizedLinear)
        and linear.format == "int4"
        and linear.device_type == "cpu"
        and not linear.triton
        and linear.bias is None
        and not linear.is_head
        and linear.float32_rows > 1
    )


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def cache_dir() -> Path:
    """Where packages are kept: `decode-graphs` in radixmesh's cache (`$RADIXMESH_CACHE_DIR`,
    or ~/.cache/radixmesh, where the default model is converted)."""
    return cache_root() / "decode-graphs"


def _example(geometry: Geometry, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden, dim = geometry.hidden, geometry.head_dim
    a = torch.randn(1, geometry.heads * dim, generator=gen)
    x = torch.randn(1, hidden, generator=gen)
    angle = torch.rand(1, 1, dim, generator=gen)
    return [a, x, *weights, angle.cos(), angle.sin()]


def package_key(geometry: Geometry, example: Sequence[torch.Tensor]) -> str:
    """What a package was compiled for: torch, the CPU's kernels, the geometry, every input's
    shape and dtype."""
    parts = [
        f"v{GRAPH_VERSION}",
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        repr(geometry),
        *(f"{tuple(t.shape)}{t.dtype}" for t in example),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def compile_boundary(geometry: Geometry, example: list[torch.Tensor], directory: Path) -> Run:
    """The boundary's package for `geometry`, loaded (compiled first unless `directory` holds
    it); its loader's `run` over a flat list of inputs."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"boundary-{package_key(geometry, example)}.pt2"
    if not path.exists():
        exported = torch.export.export(Boundary(geometry), tuple(example))
        partial = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.part.pt2")
        torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
        os.replace(partial, path)  # whole or absent: a reader never loads half a package
    runner = torch._inductor.aoti_load_package(str(path))
    run: Run = runner.loader.run
    return run


def checks_out(run: Run, geometry: Geometry, weights: BoundaryWeights) -> bool:
    """Whether the package gives the eager ops' bits on probe inputs through the model's first
    and last boundaries."""
    boundary = Boundary(geometry)
    for i in {0, len(weights.per_boundary) - 1}:
        example = _example(geometry, weights.per_boundary[i])
        with torch.inference_mode():
            expected = boundary(*example)
            got = run(list(example))
        if len(got) != len(expected) or not all(
            g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)
            for g, e in zip(got, expected, strict=False)
        ):
            return False
    return True


class BoundaryGraph:
    """The compiled boundaries of one model: `run` is None until the package is built, loaded
    and checked (in a thread of its own), and stays None if any of that failed."""

    def __init__(self, geometry: Geometry, weights: BoundaryWeights) -> None:
        self.geometry, self.weights = geometry, weights
        self.run: Run | None = None
        self.failure: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._build, name="decode-graph", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            example = _example(self.geometry, self.weights.per_boundary[0])
            run = compile_boundary(self.geometry, example, cache_dir())
            if checks_out(run, self.geometry, self.weights):
                self.run = run
            else:
                self.failure = "the compiled boundary does not give the eager loop's bits"
        except Exception as error:  # any failure leaves the eager loop running
            self.failure = f"{type(error).__name__}: {error}"
        finally:
            if self.failure is not None:
                log.warning("decode steps stay eager: %s", self.failure)
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build ended (benchmarks, tests); whether it did in `timeout`."""
        return self._done.wait(timeout)

    @classmethod
    def start(cls, model: CausalLM) -> BoundaryGraph | None:
        """The graph for `model`, building; None where it was not written for the model, the
        model has one layer, or compiled decode is off (`RADIXMESH_COMPILED_DECODE=0`)."""
        if not enabled():
            return None
        found = geometry_of(model)
        if found is None or not found[1].per_boundary:
            return None
        return cls(*found)
