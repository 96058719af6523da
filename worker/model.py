"""The Llama / Qwen decoder over a flattened, unpadded batch, writing K/V into the paged cache.

    embed -> [ RMSNorm -> attention -> + -> RMSNorm -> SwiGLU MLP -> + ] x L -> RMSNorm -> head

Attention projects q/k/v (bias for Qwen2), applies per-head RMSNorm to q and k (Qwen3), rotates
them by position, writes K/V into each layer's pages (`kernels.write_kv`), and attends over each
sequence's whole paged K/V: `append_prefill_attention` for chunks, `decode_attention` when every
chunk is one token. What is the same for every layer of a step is done once, in `Step`: the RoPE
rows, and the kernel dispatch (layer 0 goes through the checked public functions, the others call
the implementation they chose). Logits are computed only for `batch.logits_indices`, in float32.
With LoRA stacks and a batch cut into adapter segments, each group of projections sharing an input
(q/k/v, o, gate/up, down) that an adapter of the step targets adds its low-rank terms through
`Step.lora`: one shrink and one expand over the segments for the group (`kernels.lora`, on the
packed stacks of worker/lora_weights.py); groups no adapter of the step targets, and steps
without segments, run exactly as without stacks.
With a quantized weight format, q/k/v and gate/up are each multiplied as one matrix
(`qkv_proj`, `gate_up_proj`: worker/fused_projections.py), and where q and k lie side by side
in the fused output (no LoRA on them this step, no QK-norm) they are rotated as one tensor.
Parameter names are Hugging Face's, so `load_state_dict` takes an HF Llama/Qwen state dict.
The model holds no KV and no request state; never call it from two threads at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import kernels
from kernels.lora import lora_expand, lora_shrink
from worker.batch import ForwardBatch
from worker.config import ModelConfig
from worker.decode_layers import DecodeLayers
from worker.fused_projections import FusedProjections
from worker.lora_weights import LoraStacks
from worker.rms_norm import rms_norm
from worker.rope import RotaryEmbedding, rotate

KvCache = tuple[torch.Tensor, torch.Tensor]
GROUPED_EXPAND_ROWS = 64
"""Up to this many rows a LoRA group expands in one call into its outputs laid side by side
(decode: per-call overhead dominates); above, each module expands from its slice of h (prefill:
no copy of the outputs, no multiplying the zeros off b's diagonal)."""


@dataclass(slots=True)
class Step:
    """What every layer of one forward pass shares."""

    batch: ForwardBatch
    cos: torch.Tensor
    sin: torch.Tensor
    write: Callable[..., Any] | None = None
    """The bound write_kv implementation, once layer 0 has gone through the checked dispatch."""
    attend: Callable[..., Any] | None = None
    lora_stacks: LoraStacks | None = None
    lora_groups: tuple[str, ...] = ()
    """The projection groups some adapter of this step targets (empty: no LoRA this step)."""
    lora_checked: bool = False
    """The segments went through the kernels' value checks once (the first call) this step."""

    def lora(
        self, layer: int, group: str, x: torch.Tensor, *ys: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """`ys`, the outputs of `group`'s modules on `x` (in GROUPS order), plus each row's
        adapter terms: one shrink for the group's packed modules, then one expand into their
        outputs laid side by side (a copy when there are several; the base values are not
        recomputed, so rows without an adapter keep them bit for bit). Returned in order, the
        packed ones as views, the others (no loaded adapter targets them) as they came."""
        if group not in self.lora_groups:
            return ys
        assert self.lora_stacks is not None
        starts, slots = self.batch.lora_seg_starts, self.batch.lora_seg_slots
        assert starts is not None and slots is not None
        a, b = self.lora_stacks.group_weights(layer, group)
        check, self.lora_checked = not self.lora_checked, True
        h = lora_shrink(x, a, starts, slots, check_values=check)
        packed = self.lora_stacks.packed[group]
        if len(packed) == 1:
            lora_expand(ys[packed[0]], h, b, starts, slots, check_values=False)
            return ys
        if x.shape[0] > GROUPED_EXPAND_ROWS:  # each module's block of b, from its slice of h
            rank = self.lora_stacks.max_rank
            row = 0
            for n, i in enumerate(packed):
                width = ys[i].shape[1]
                block = b[:, row : row + width, n * rank : (n + 1) * rank]
                part = h[:, n * rank : (n + 1) * rank]
                lora_expand(ys[i], part, block, starts, slots, check_values=False)
                row += width
            return ys
        parts = [ys[i] for i in packed]
        y = torch.cat(parts, dim=1)
        lora_expand(y, h, b, starts, slots, check_values=False)
        out = list(ys)
        for i, part in zip(packed, y.split([p.shape[1] for p in parts], dim=1), strict=True):
            out[i] = part
        return tuple(out)

    def write_kv(self, cache: KvCache, k: torch.Tensor, v: torch.Tensor) -> None:
        k_cache, v_cache = cache
        if self.write is None:
            kernels.write_kv(k_cache, v_cache, k, v, self.batch.slot_mapping, check_values=False)
            self.write = kernels.bind("write_kv", k_cache)
        else:
            self.write(k_cache, v_cache, k, v, self.batch.slot_mapping)

    def lone_decode(self, cache: KvCache) -> kernels.LoneDecode | None:
        """A decode step of one sequence on a cache the CPU's torch SDPA path serves, planned
        once for the layers after the first (kernels/torch_sdpa.py: the same ops as
        `write_kv` and `attention`, without their per-layer lookups), or None."""
        b, k_cache = self.batch, cache[0]
        if not b.is_decode or kernels.choose_backend("decode_attention", k_cache) != "torch_sdpa":
            return None
        return kernels.LoneDecode.plan(k_cache, b.page_table, b.seq_lens_k, b.slot_mapping)

    def attention(self, q: torch.Tensor, cache: KvCache) -> torch.Tensor:
        b = self.batch
        args: tuple[torch.Tensor, ...]
        kwargs: dict[str, int] = {}
        if b.is_decode:
            operation, args = "decode_attention", (b.page_table, b.seq_lens_k)
        else:
            operation = "append_prefill_attention"
            args = (b.page_table, b.cu_seqlens_q, b.seq_lens_k)
            kwargs = {"max_seqlen_q": b.max_seqlen_q}
        if self.attend is not None:
            out: torch.Tensor = self.attend(q, *cache, *args, **kwargs)
            return out
        out = getattr(kernels, operation)(q, *cache, *args, check_values=False, **kwargs)
        self.attend = kernels.bind(operation, cache[0])
        return out


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Hugging Face's: normalised in float32, back in x's dtype, times the weight. On a CPU
        in float32, with the sum of squares as a tree of adds (worker/rms_norm.py: the bits a
        compiled decode graph reproduces); elsewhere torch's fused rms_norm, which gives
        transformers' bits (one op where there were seven)."""
        if x.dtype == self.weight.dtype == torch.float32:
            if x.device.type == "cpu":
                return rms_norm(x, self.weight, self.eps)
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        normed = nn.functional.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.q_size, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.kv_size, bias=bias)
        self.o_proj = nn.Linear(config.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.qkv_proj: FusedProjections | None = None
        """q/k/v multiplied as one (a weight format sets it: worker/fused_projections.py)."""

    def forward(self, x: torch.Tensor, step: Step, cache: KvCache) -> torch.Tensor:
        tokens, layer = x.shape[0], self.layer
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            qkv = self.qkv_proj(x)
            q, k, v = self.qkv_proj.split(qkv)
            if self.qkv_proj.adjacent and self.q_norm is None and "qkv" not in step.lora_groups:
                # q and k side by side are one [tokens, heads + kv_heads, dim]: one rotation
                qk = rotate(
                    qkv[:, : q.shape[1] + k.shape[1]].view(tokens, heads + kv_heads, -1),
                    step.cos,
                    step.sin,
                )
                step.write_kv(cache, qk[:, heads:], v.view(tokens, kv_heads, -1))
                return self._attend(qk[:, :heads], step, cache)
        q, k, v = step.lora(layer, "qkv", x, q, k, v)
        q = q.view(tokens, heads, -1)
        k, v = k.view(tokens, kv_heads, -1), v.view(tokens, kv_heads, -1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate(q, step.cos, step.sin), rotate(k, step.cos, step.sin)
        step.write_kv(cache, k, v)
        return self._attend(q, step, cache)

    def _attend(self, q: torch.Tensor, step: Step, cache: KvCache) -> torch.Tensor:
        tokens, layer = q.shape[0], self.layer
        out = step.attention(q, cache).reshape(tokens, self.num_heads * self.head_dim)
        return step.lora(layer, "o_proj", out, self.o_proj(out))[0]


class Mlp(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj: FusedProjections | None = None
        """gate/up multiplied as one (a quantized weight format sets it)."""

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        layer = self.layer
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        gate, up = step.lora(layer, "gate_up", x, gate, up)
        h = nn.functional.silu(gate) * up
        return step.lora(layer, "down_proj", h, self.down_proj(h))[0]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Mlp(config, layer)

    def forward(self, x: torch.Tensor, step: Step, cache: KvCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), step, cache)
        return x + self.mlp(self.post_attention_layernorm(x), step)


class Decoder(nn.Module):
    """`model.*` in a Hugging Face checkpoint."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            config.rope_scaling,
            config.max_position_embeddings,
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head: nn.Module | None = None
        """A separate head (nn.Linear, or worker/quantized_linear.py's QuantizedLinear once a
        weight format gives a tied head its own copy); None: logits use the embedding table."""
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.flat_decode = True
        """Run the CPU decode steps it applies to as worker/decode_layers.py's flat loop (the
        same values, fewer ops); False: always through the modules (for comparisons)."""
        self._decode_layers: tuple[tuple[torch.dtype, torch.device], DecodeLayers | None] | None
        self._decode_layers = None  # (what it was built for, the loop) after a decode step

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv_caches: list[KvCache],
        lora: LoraStacks | None = None,
        layer_ready: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Float32 logits [len(batch.logits_indices), vocab] of one step; writes its K/V.
        With `lora`, rows in adapter segments get their adapter's terms. `layer_ready(l)` is
        called before layer l (the copy stream's wait: worker/kv_copies.py)."""
        return self.logits(self.hidden_states(batch, kv_caches, lora, layer_ready))

    @torch.inference_mode()
    def hidden_states(
        self,
        batch: ForwardBatch,
        kv_caches: list[KvCache],
        lora: LoraStacks | None = None,
        layer_ready: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """[len(batch.logits_indices), hidden] the final norm's output at the logits rows, in
        the model's dtype: what the head reads, and what an embedding is pooled from. Writes
        the step's K/V, as `forward`."""
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"{len(kv_caches)} KV caches for {self.config.num_layers} layers")
        x = self.model.embed_tokens(batch.input_ids).to(self.dtype)  # a bf16 table: upcast
        if batch.embed_rows is not None and batch.embeds is not None:  # image positions
            x[batch.embed_rows] = batch.embeds.to(x.dtype)
        step = Step(batch, *self.model.rotary.lookup(batch.positions))
        if batch.lora_seg_slots is not None:
            if lora is None:
                raise ValueError("a batch with LoRA segments and no LoRA stacks")
            step.lora_stacks = lora
            slots = batch.lora_slots or tuple(batch.lora_seg_slots.tolist())
            step.lora_groups = lora.groups_in_use(slots)
        flat = self.decode_layers() if self.flat_decode and DecodeLayers.applies(step) else None
        if flat is not None:
            x = flat.run(x, step, kv_caches, layer_ready)
        else:
            for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
                if layer_ready is not None:
                    layer_ready(i)
                x = layer(x, step, cache)
        return self.model.norm(x[batch.logits_indices])

    @torch.inference_mode()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of `hidden_states` rows."""
        if self.lm_head is not None:
            logits: torch.Tensor = self.lm_head(x)
            return logits.float()
        return (x @ self.model.embed_tokens.weight.t()).float()

    def decode_layers(self) -> DecodeLayers | None:
        """The flat decode loop over the layers as they are (None: not for these layers),
        built on first use and again when the model's dtype or device changed;
        `forget_decode_layers` after changing which modules the layers hold."""
        built_for = (self.dtype, self.model.norm.weight.device)
        if self._decode_layers is None or self._decode_layers[0] != built_for:
            self._decode_layers = (built_for, DecodeLayers.of(self))
        return self._decode_layers[1]

    def forget_decode_layers(self) -> None:
        self._decode_layers = None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and KV cache's) dtype: the norms', which no weight format changes."""
        return self.model.norm.weight.dtype

    def kv_page_bytes(self, page_size: int) -> int:
        """Bytes of one page of `allocate_kv`'s caches: its K and V over every layer."""
        c, item = self.config, torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_layers * page_size * c.num_kv_heads * c.head_dim * item

    def allocate_kv(
        self, num_pages: int, page_size: int, device: torch.device | str | None = None
    ) -> list[KvCache]:
        """One (k, v) pair of [num_pages, page_size, kv_heads, head_dim] per layer."""
        weight = self.model.embed_tokens.weight
        return [
            kernels.empty_kv_cache(
                num_pages,
                page_size,
                self.config.num_kv_heads,
                self.config.head_dim,
                self.dtype,
                device if device is not None else weight.device,
            )
            for _ in range(self.config.num_layers)
        ]

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face-named state dict strictly (a tied head has no `lm_head.weight`)."""
        state = dict(state_dict)
        if self.lm_head is None:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"weights do not fit the model: missing {missing}, unexpected {unexpected}"
            )
