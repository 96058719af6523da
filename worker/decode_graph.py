"""The stretches of a CPU int4 decode step between its norms and attentions, compiled ahead
of time: two graphs for all layers of a model, built in the background, used once they check out.

A decode step of one sequence spends about a third of each layer in ~25 small eager ops (casts,
slices, RoPE, SiLU, residual adds), each a Python call and a dispatch. `torch.compile` of that
stretch gave nothing back (docs/worker.md: dynamo's lookup and the wrapper cost what fusion
saved); AOTInductor has neither: `torch.export` the stretch, compile it with its int4 kernels as
calls into torch, and run the package's loader directly. The weights are inputs, so one package
serves every layer of a model (and of every model of the same shape: it is kept on disk, keyed
by what it was compiled for). Two graphs, with the norms between them left eager:

    attention -> o, x + o (eager) -> rms_norm (eager)
      -> [MLP graph]  gate/up -> silu(gate) * up -> down -> x + down
      -> rms_norm (eager)
      -> [QKV graph]  qkv -> RoPE on q and k -> (q, k, v) -> the next attention

The same ops as worker/decode_layers.py's loop, in the same order, so the same bits: inductor
derives a norm's reduction from its parts and sums in its own order (71 of 300 random rows
differed in the last bit, and over 100 SmolLM2 steps the logits drifted by up to 0.3), so the
norms stay torch's own. A package is used only if it gives the loop's bits on probe inputs
through the model's first and last layers; otherwise, and while it compiles, and wherever it
was not built for (more than one row, another format, a non-CPU model, no C++ compiler), the
loop runs eagerly.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
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

GRAPH_VERSION = 2
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


class _Block(nn.Module):
    """A stretch of a decode step as plain tensor ops (what `torch.export` traces)."""

    def __init__(self, geometry: Geometry) -> None:
        super().__init__()
        self.g = geometry


class MlpBlock(_Block):
    """x + down(silu(gate) * up) of the normed x: `DecodeLayers.run`'s MLP."""

    def forward(
        self,
        normed: torch.Tensor,
        x: torch.Tensor,
        gate_up_packed: torch.Tensor,
        gate_up_scales: torch.Tensor,
        down_packed: torch.Tensor,
        down_scales: torch.Tensor,
    ) -> torch.Tensor:
        g, mm = self.g, torch.ops.aten._weight_int4pack_mm_for_cpu
        _, gate_up_out, down_out, _ = g.outs
        gate_up = mm(normed.to(torch.bfloat16), gate_up_packed, g.group, gate_up_scales)
        gate_up = gate_up[:, :gate_up_out]
        inter, up = g.intermediate, g.up_start
        h = F.silu(gate_up[:, :inter].float()) * gate_up[:, up : up + inter]
        return x + mm(h.to(torch.bfloat16), down_packed, g.group, down_scales)[:, :down_out]


class QkvBlock(_Block):
    """q, k and v of the normed x, q and k rotated, v in their dtype: `DecodeLayers.run`'s
    q/k/v with q and k side by side."""

    def forward(
        self,
        normed: torch.Tensor,
        qkv_packed: torch.Tensor,
        qkv_scales: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, mm = self.g, torch.ops.aten._weight_int4pack_mm_for_cpu
        qkv = mm(normed.to(torch.bfloat16), qkv_packed, g.group, qkv_scales)[:, : g.outs[3]]
        dim, kv = g.head_dim, g.kv_heads * g.head_dim
        v = qkv[:, g.v_start : g.v_start + kv].view(1, g.kv_heads, dim)
        qk = qkv[:, : g.heads * dim + kv].view(1, -1, dim)
        qk = qk * cos + qk.roll(dim // 2, -1) * signed_sin  # decode_layers._rotate
        return qk[:, : g.heads], qk[:, g.heads :], v.to(qk.dtype)


@dataclass(frozen=True)
class LayerInputs:
    """What the two graphs read of each layer besides their activations."""

    mlp: tuple[tuple[torch.Tensor, ...], ...]
    """Layer i's gate/up and down, packed, and their scales."""
    qkv: tuple[tuple[torch.Tensor, ...], ...]
    """Layer i's fused q/k/v, packed, and its scales."""


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
    unless its four projections are int4 with the kernel at one row and q and k side by side."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = cast(FusedProjections, attn.qkv_proj)
    gate_up = cast(FusedProjections, mlp.gate_up_proj)
    four = (qkv.linear, attn.o_proj, gate_up.linear, mlp.down_proj)
    q_at, k_at, v_at = qkv.starts
    if (q_at, k_at) != (0, q_width) or not all(_int4_at_one_row(m) for m in four):
        return None
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return _LayerParts(cast(Four, four), v_at, gate_up.starts[1], *(w.detach() for w in norms))


def geometry_of(model: CausalLM) -> tuple[Geometry, LayerInputs] | None:
    """The graphs' geometry and weights for a model `DecodeLayers.of` took (a CPU model with
    float32 activations, its layers the flat loop's), or None unless every layer holds int4
    projections (`_layer_parts`) of the same shapes and group size."""
    config = model.config
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
    mlp, qkv_inputs = [], []
    for part in parts:
        qkv, _, gate_up, down = part.four
        # a part's scales are a strided view of the fused buffer: the graphs take them whole
        mlp.append(
            (
                gate_up.packed,
                gate_up.scales_and_zeros.contiguous(),
                down.packed,
                down.scales_and_zeros.contiguous(),
            )
        )
        qkv_inputs.append((qkv.packed, qkv.scales_and_zeros.contiguous()))
    return geometry, LayerInputs(tuple(mlp), tuple(qkv_inputs))


def _int4_at_one_row(linear: nn.Module) -> bool:
    return (
        isinstance(linear, QuantizedLinear) and linear.format == "int4" and linear.float32_rows > 1
    )


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "1") != "0"


def cache_dir() -> Path:
    """Where packages are kept: `decode-graphs` in radixmesh's cache (`$RADIXMESH_CACHE_DIR`,
    or ~/.cache/radixmesh, where the default model is converted)."""
    return cache_root() / "decode-graphs"


def _examples(geometry: Geometry, inputs: LayerInputs, layer: int) -> dict[str, list[torch.Tensor]]:
    """Probe inputs of both graphs with layer `layer`'s weights (also what they compile for)."""
    gen = torch.Generator().manual_seed(layer)
    hidden, dim = geometry.hidden, geometry.head_dim
    normed, x = torch.randn(2, 1, hidden, generator=gen)
    angle = torch.rand(1, 1, dim, generator=gen)
    return {
        "mlp": [normed, x, *inputs.mlp[layer]],
        "qkv": [normed, *inputs.qkv[layer], angle.cos(), angle.sin()],
    }


def _blocks(geometry: Geometry) -> dict[str, _Block]:
    return {"mlp": MlpBlock(geometry), "qkv": QkvBlock(geometry)}


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


def package_key(name: str, geometry: Geometry, example: Sequence[torch.Tensor]) -> str:
    """What a package was compiled for: the graph, torch, the host (`_host`), the geometry,
    every input's shape and dtype."""
    parts = [
        f"{name}-v{GRAPH_VERSION}",
        torch.__version__,
        torch.backends.cpu.get_cpu_capability(),
        *_host(),
        repr(geometry),
        *(f"{tuple(t.shape)}{t.dtype}" for t in example),
    ]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


_COMPILING = threading.Lock()
"""One build at a time in a process: `torch.export` and inductor are not thread-safe."""


def compile_block(
    name: str,
    block: nn.Module,
    geometry: Geometry,
    example: list[torch.Tensor],
    directory: Path,
    fresh: bool = False,
) -> Run:
    """Graph `name`'s package, loaded (compiled first unless `directory` holds it, or `fresh`:
    compiled again over what it holds); its loader's `run` over a flat list of inputs."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{package_key(name, geometry, example)}.pt2"
    with _COMPILING:
        if fresh or not path.exists():
            exported = torch.export.export(block, tuple(example))
            partial = path.with_name(f"{path.stem}.{os.getpid()}.{threading.get_ident()}.part.pt2")
            torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
            with partial.open("rb") as written:
                os.fsync(written.fileno())
            os.replace(partial, path)  # whole or absent: a reader never loads half a package
        runner = torch._inductor.aoti_load_package(str(path))
    run: Run = runner.loader.run
    return run


def checks_out(runs: dict[str, Run], geometry: Geometry, inputs: LayerInputs) -> bool:
    """Whether each package gives its eager ops' bits on probe inputs with the weights of the
    model's first and last layers."""
    blocks = _blocks(geometry)
    for layer in {0, len(inputs.mlp) - 1}:
        for name, example in _examples(geometry, inputs, layer).items():
            with torch.inference_mode():
                expected = blocks[name](*example)
                got = runs[name](list(example))
            if isinstance(expected, torch.Tensor):
                expected = (expected,)
            if len(got) != len(expected) or not all(
                g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e)
                for g, e in zip(got, expected, strict=False)
            ):
                return False
    return True


class DecodeGraph:
    """The compiled graphs of one model: `runs` (the q/k/v graph's `run`, the MLP's) is None
    until both packages are built, loaded and checked (in a thread of its own), and stays None
    if any of that failed."""

    def __init__(self, geometry: Geometry, inputs: LayerInputs) -> None:
        self.geometry, self.inputs = geometry, inputs
        self.runs: tuple[Run, Run] | None = None
        self.failure: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._build, name="decode-graphs", daemon=True)
        self._thread.start()

    def _build(self) -> None:
        try:
            for fresh in (False, True):  # a kept package that fails is compiled again, once
                try:
                    runs = self._compile(fresh)
                except Exception as error:
                    self.failure = f"{type(error).__name__}: {error}"
                    continue
                if checks_out(runs, self.geometry, self.inputs):
                    self.runs, self.failure = (runs["qkv"], runs["mlp"]), None
                    return
                self.failure = "a compiled graph does not give the eager loop's bits"
        finally:
            if self.failure is not None:
                log.warning("decode steps stay eager: %s", self.failure)
            self._done.set()

    def _compile(self, fresh: bool) -> dict[str, Run]:
        examples = _examples(self.geometry, self.inputs, 0)
        return {
            name: compile_block(name, block, self.geometry, examples[name], cache_dir(), fresh)
            for name, block in _blocks(self.geometry).items()
        }

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the build ended (benchmarks, tests); whether it did in `timeout`."""
        return self._done.wait(timeout)

    @classmethod
    def start(cls, model: CausalLM) -> DecodeGraph | None:
        """The graphs for `model` (one `DecodeLayers.of` took: it calls this), building; None
        where they were not written for it, or compiled decode is off
        (`RADIXMESH_COMPILED_DECODE=0`)."""
        if not enabled():
            return None
        found = geometry_of(model)
        return None if found is None else cls(*found)
