"""A CPU decode step's decoder layers as one flat loop: the module path's arithmetic, fewer ops.

On a CPU a decode step of a small model is bound by the cost of each op and module call, not
by the arithmetic (docs/worker.md, "Where a decode step's time goes"). `DecodeLayers` holds
each layer's norm weights and kernels, read once per model, and runs the layers as one loop,
without the module calls (`DecoderLayer` -> `Attention` -> `FusedProjections` ->
`QuantizedLinear`, about ten a layer) and without the casts that type promotion makes for free:

    x -> rms_norm -> qkv kernel (bf16) -> RoPE on q and k (float32) -> write K/V -> attention
      -> o kernel -> x + o -> rms_norm -> gate/up kernel -> silu(gate) * up -> down kernel
      -> x + down

A kernel's bf16 output meets float32 only in ops that promote it (`x + y`, `y * cos`,
`silu(gate.float()) * up`), which upcast exactly as `y.to(float32)` did, so every value is the
module path's bit for bit (tests/worker/test_decode_layers.py compares logits and K/V). Each
linear multiplies through its own `QuantizedLinear.bound_matmul` (`_matmul`, an int4 kernel
call's buffers looked up once), so the kernel or the float32 path is chosen by the row count
exactly as in `QuantizedLinear.forward`.

It runs what it was written for, and the modules run the rest:
- a CPU model whose layers all have fused q/k/v and gate/up projections (a quantized weight
  format: worker/fused_projections.py), without bias or QK-norm, with float32 activations
  (`DecodeLayers.of`: built on the first decode step, again after `fuse_projections`);
- a decode step without LoRA terms (`DecodeLayers.applies`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from worker.decode_graph import DecodeGraph, Run, carrier
from worker.fused_projections import FusedProjections
from worker.quantized_linear import QuantizedLinear
from worker.rms_norm import rms_norm
from worker.rope import rotate_promoted

if TYPE_CHECKING:
    from kernels import LoneDecode
    from worker.model import CausalLM, DecoderLayer, KvCache, Step

Matmul = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """What one decoder layer's decode step reads: norms, and each projection's matmul."""

    input_norm: torch.Tensor
    qkv: Matmul
    qkv_starts: tuple[int, ...]
    """Where q, k and v begin in the fused output (a part padded to whole int4 blocks leaves a
    gap after it: worker/fused_projections.py)."""
    o: Matmul
    post_norm: torch.Tensor
    gate_up: Matmul
    up_start: int
    down: Matmul


@dataclass(frozen=True, slots=True)
class DecodeLayers:
    layers: tuple[LayerWeights, ...]
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    graph: DecodeGraph | None = None
    """The stretch between two attentions compiled ahead of time (worker/decode_graph.py):
    used once built and checked; the loop runs eagerly meanwhile."""

    @classmethod
    def of(cls, model: CausalLM) -> DecodeLayers | None:
        """The flat loop over `model`'s layers, or None when it was not written for them."""
        if model.dtype != torch.float32 or model.model.norm.weight.device.type != "cpu":
            return None
        layers = []
        for layer in model.model.layers:
            weights = _layer_weights(cast("DecoderLayer", layer))
            if weights is None:
                return None
            layers.append(weights)
        config = model.config
        return cls(
            tuple(layers),
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.rms_norm_eps,
            DecodeGraph.start(model),
        )

    @staticmethod
    def applies(step: Step) -> bool:
        """Whether the flat loop may run `step`: a decode step without LoRA terms."""
        return step.batch.is_decode and not step.lora_groups

    def run(
        self,
        x: torch.Tensor,
        step: Step,
        kv_caches: list[KvCache],
        layer_ready: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The layers over x [tokens, hidden] (float32); returns the last layer's output.

        One sequence's K/V writes and attentions after the first layer's go through a plan made
        once (`Step.lone_decode`) where its pages allow. Between two attentions (o, the
        residual, the norm, the MLP, the residual, the next layer's norm, q/k/v, RoPE) one call
        of the compiled graph once it is built and checked (worker/decode_graph.py: the same
        ops, so the same bits), eager ops until then; for one sequence, once the lone package
        is built too (`DecodeGraph.lone`), layers 1 to n - 2 are one call each, their K/V write
        and attention inside it."""
        graph = self.graph
        run = graph.run if graph is not None and x.shape[0] <= graph.max_rows else None
        tokens, width, last = x.shape[0], self.heads * self.head_dim, len(self.layers) - 1
        cos, sin = step.cos, step.sin
        q, k, v = self._qkv(self.layers[0], x, cos, sin)
        lone: LoneDecode | None = None
        lone_run: Run | None = None  # the compiled lone layer
        planned: tuple[torch.Tensor, ...] = ()  # what it reads of the plan: slot, first, length
        for i, (weights, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if layer_ready is not None:
                layer_ready(i)
            if lone_run is not None and i < last:
                assert graph is not None
                x, q, k, v = lone_run([q, k, v, x, *cache, *planned, *graph.inputs[i], cos, sin])
                continue
            if lone is not None:
                lone.write(*cache, k, v)
                attended = lone.attend(q, *cache).reshape(tokens, width)
            else:
                step.write_kv(cache, k, v)
                attended = step.attention(q, cache).reshape(tokens, width)
                if i == 0 and tokens == 1:  # checked through the dispatch once: plan the rest
                    lone = step.lone_decode(cache)
                    lone_run, planned = _planned(lone, kv_caches, graph)
            if run is not None and i < last:
                assert graph is not None
                x, q, k, v = run([attended, x, *graph.inputs[i], cos, sin])
                continue
            x = self._mlp(weights, x + weights.o(attended))
            if i < last:
                q, k, v = self._qkv(self.layers[i + 1], x, cos, sin)
        return x

    def _qkv(
        self, weights: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's q and k, rotated (float32), and v in their dtype, of x before its norm."""
        tokens, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = weights.qkv(rms_norm(x, weights.input_norm, self.eps))
        q_at, k_at, v_at = weights.qkv_starts
        v = qkv[:, v_at : v_at + kv_heads * dim].view(tokens, kv_heads, dim)
        if k_at == heads * dim:  # q and k side by side: one rotation
            qk = rotate_promoted(qkv[:, : k_at + kv_heads * dim].view(tokens, -1, dim), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]
        else:
            q = qkv[:, q_at : q_at + heads * dim].view(tokens, heads, dim)
            k = qkv[:, k_at : k_at + kv_heads * dim].view(tokens, -1, dim)
            q, k = rotate_promoted(q, cos, sin), rotate_promoted(k, cos, sin)
        return q, k, v.to(k.dtype)

    def _mlp(self, weights: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        """x + the MLP of x's norm."""
        gate_up = weights.gate_up(rms_norm(x, weights.post_norm, self.eps))
        inter, up = self.intermediate, weights.up_start
        h = F.silu(gate_up[:, :inter].float()) * gate_up[:, up : up + inter]
        return x + weights.down(h)


def _planned(
    lone: LoneDecode | None, kv_caches: list[KvCache], graph: DecodeGraph | None
) -> tuple[Run | None, tuple[torch.Tensor, ...]]:
    """The compiled lone layer (`DecodeGraph.lone`) and what it reads of a lone decode's plan
    besides each layer's tensors, or (None, ()) where it does not run the step: no plan, no
    package, a sequence of fewer than two positions, or caches it was not compiled for
    (`_fits`). The package checks none of its inputs, so this is what keeps it to them."""
    if lone is None or graph is None or graph.lone is None or lone.longest < 2:
        return None, ()
    if not _fits(kv_caches, lone):
        return None, ()
    return graph.lone, (lone.slots, carrier(lone.first), carrier(lone.longest))


def _fits(kv_caches: list[KvCache], lone: LoneDecode) -> bool:
    """Whether every layer's K and V cache is what the lone package was compiled for: float32,
    contiguous from the start of its storage, two pages or more, all of one shape, holding the
    sequence's pages. Layer 0's went through the checked calls; the others did not."""
    k_cache = kv_caches[0][0]
    shape = k_cache.shape
    if shape[0] < 2 or lone.end > shape[0]:
        return False
    return all(
        c.dtype == torch.float32
        and c.shape == shape
        and c.is_contiguous()
        and not c.storage_offset()
        for cache in kv_caches
        for c in cache
    )


def _layer_weights(layer: DecoderLayer) -> LayerWeights | None:
    """What the loop reads of `layer`, or None when the loop was not written for it."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv, gate_up, o, down = attn.qkv_proj, mlp.gate_up_proj, attn.o_proj, mlp.down_proj
    if not (
        isinstance(qkv, FusedProjections)
        and isinstance(gate_up, FusedProjections)
        and isinstance(o, QuantizedLinear)
        and isinstance(down, QuantizedLinear)
        and attn.q_norm is None
        and all(_plain(linear) for linear in (qkv.linear, gate_up.linear, o, down))
    ):
        return None
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(w.dtype != torch.float32 for w in norms):
        return None
    return LayerWeights(
        norms[0],
        qkv.linear.bound_matmul(),
        qkv.starts,
        o.bound_matmul(),
        norms[1],
        gate_up.linear.bound_matmul(),
        gate_up.starts[1],
        down.bound_matmul(),
    )


def _plain(linear: QuantizedLinear) -> bool:
    """A CPU layer without bias whose `_matmul` gives its output (not the head's logits)."""
    return (
        linear.device_type == "cpu"
        and not linear.triton
        and linear.bias is None
        and not linear.is_head
    )
