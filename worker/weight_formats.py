"""Put a loaded CausalLM's weights into a weight format: float32 (as loaded), bf16, int8, int4.

`apply_weight_format(model, fmt)` replaces, in place, every decoder layer's q/k/v/o and
gate/up/down projections and the output head with a `QuantizedLinear`
(worker/quantized_linear.py) packed for the device the model is on, so call it after placing the
model. What each format does to the parts:

    part                     float32   bf16 / int8 / int4
    q k v o gate up down     as is     bf16 matrices; int8 per channel; int4 groups of 32
    output head              as is     `head_format`: bf16 (a tied head is the bf16 table
                                       itself, an untied one a bf16 matrix), int8 for int8 /
                                       int4 on a CPU with int8 dot products; `head=` picks
    embedding table          as is     bf16 (a lookup reads one row a token: it is not what
                                       decode waits for)
    norms, biases, RoPE      as is (the model's dtype: the activations' dtype never changes)

`quantized` maps Hugging Face tensor names ("model.layers.0.self_attn.q_proj.weight",
"lm_head.weight", "model.embed_tokens.weight") to weights already in quantized form, such as a
GGUF file's own blocks (worker/gguf_checkpoint.py): a projection's is used as it is, in its own
format, instead of quantizing the float weight (a file that mixes Q8_0 and Q4 tensors keeps its
mix); with fmt bf16 it is dequantized. The table is the dequantized
"model.embed_tokens.weight" in bf16; the head (that, for a tied model) takes the head's format,
dequantized and quantized again if it differs.

Last, each layer's q/k/v and gate/up are fused (worker/fused_projections.py: `qkv_proj`,
`gate_up_proj`, one matrix each whose buffers the parts become views of), so a decode step
makes four calls a layer instead of seven; float32 keeps its nn.Linear layers apart.

LoRA stacks (worker/lora_weights.py) read shapes from the config and add their terms to the
projections' outputs, which stay in the activations' dtype: adapters work unchanged on a
quantized base.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from worker import fbgemm_int8, quantized_linear
from worker.fused_projections import fuse_projections
from worker.model import CausalLM
from worker.quantized_linear import LINEAR_FORMATS, LinearFormat, QuantizedLinear
from worker.quantized_weights import (
    DEFAULT_GROUP,
    WEIGHT_FORMATS,
    QuantizedWeight,
    WeightFormat,
    dequantize,
)

PROJECTIONS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"


def head_format(fmt: WeightFormat, device: torch.device) -> LinearFormat:
    """The output head's format for weight format `fmt` on `device`: bf16 for bf16 (a tied head
    is then the bf16 table itself, no copy); int8 for int8 and int4 on a CPU whose int8 head
    multiplies with integer dot products (`quantized_linear.INT8_DYNAMIC_HEAD`), bf16 elsewhere.

    The head is the matrix quantization hurts most. Measured on SmolLM2-135M (a 112-token
    passage, next-token perplexity against float32's 9.16; one thread): int4 layers with an
    int4 head 10.07 (+10 %, top-1 agreeing with float32 at 86.6 % of positions), with an int8
    head 9.29 (98.2 %), with the bf16 table as head 9.20 (99.1 %); llama.cpp's Q4 files keep it
    in Q8_0 / Q6_K (SmolLM2's Q4_1 file holds token_embd as Q8_0). Since then every head
    recomputes its 64 largest logits exactly, and an int8 head on a VNNI CPU reads 28 MB where
    bf16 reads 57: on the held-in text (3,575 tokens, 2 threads) int4 with the int8 head cost
    +0.30 % perplexity against +0.08 % with the bf16 head, greedy tokens as often the same (13
    and 14 of 20 prompts whole), for decode 14-19 % faster (int4, three runs each way, each a
    process of its own, alternated: 55.4-63.7 against 48.1-53.7 tokens/s);
    without VNNI the int8 head is no faster than bf16 (`_weight_int8pack_mm`, compute-bound),
    so it is not worth its 28 MB there. `apply_weight_format(..., head=)` picks another."""
    if fmt == "float32":
        raise ValueError("weights 'float32' keeps the head as loaded: it has no head format")
    if fmt == "bf16" or device.type != "cpu" or not quantized_linear.INT8_DYNAMIC_HEAD:
        return "bf16"
    return "int8"


def check_weight_format(fmt: object, field: str = "weights") -> WeightFormat:
    """`fmt` if it is one of WEIGHT_FORMATS, else a ValueError naming `field`."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"{field}: {fmt!r} is not one of {', '.join(WEIGHT_FORMATS)}")
    return fmt


def apply_weight_format(
    model: CausalLM,
    fmt: WeightFormat,
    quantized: Mapping[str, QuantizedWeight] | None = None,
    group_size: int = DEFAULT_GROUP,
    head: LinearFormat | None = None,
) -> CausalLM:
    """Convert `model` in place to `fmt` (module docstring) and return it; `head` overrides
    the output head's format (default: `head_format`)."""
    check_weight_format(fmt)
    given = dict(quantized or {})
    names = {f"{name}.weight" for name in linear_names(model)} | {EMBED}
    if model.lm_head is not None:
        names.add(HEAD)
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"quantized weights for tensors the model does not have: {unknown}")
    done = next((m for m in model.modules() if isinstance(m, QuantizedLinear)), None)
    if done is not None:
        raise ValueError(f"the model already holds {done.format} layers: load it again instead")
    if fmt == "float32":
        if given or head is not None:
            raise ValueError("weights 'float32' keeps the float weights and head as loaded")
        return model
    device = model.model.embed_tokens.weight.device
    head_fmt = head_format(fmt, device) if head is None else head
    if head_fmt not in LINEAR_FORMATS:
        raise ValueError(f"head: {head_fmt!r} is not one of {', '.join(LINEAR_FORMATS)}")
    for name, parent, attr in _projections(model):
        linear = getattr(parent, attr)
        source = given.get(f"{name}.weight", linear.weight.detach())
        setattr(parent, attr, _pack(source, fmt, linear.bias, group_size, device))
    embed = model.model.embed_tokens
    head_source: torch.Tensor | QuantizedWeight
    if isinstance(model.lm_head, nn.Linear):
        head_source = given.get(HEAD, model.lm_head.weight.detach())
    else:  # tied: quantized from the table as loaded, before it is rounded to bf16
        head_source = given.get(EMBED, embed.weight.detach())
    table = dequantize(given[EMBED]) if EMBED in given else embed.weight.detach()
    embed.weight = nn.Parameter(table.to(device, torch.bfloat16).contiguous(), requires_grad=False)
    if head_fmt == "bf16" and model.lm_head is None:
        model.lm_head = QuantizedLinear(embed.weight.detach(), "bf16").as_head()  # the table
    else:
        model.lm_head = _pack(head_source, head_fmt, None, group_size, device, keep=False)
        model.lm_head.as_head()
    fuse_projections(model)
    return model


def linear_names(model: CausalLM) -> list[str]:
    """The HF names (without `.weight`) of the projections a weight format replaces."""
    return [name for name, _, _ in _projections(model)]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: every parameter and every QuantizedLinear buffer (packed
    values, scales, zeros), a storage shared by two counted once, and an int8 head's copy in
    fbgemm's layout (worker/fbgemm_int8.py); not the RoPE tables."""
    tensors: list[torch.Tensor] = list(model.parameters())
    copies = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            tensors += list(module.buffers())
            if module.fbgemm is not None:
                copies += fbgemm_int8.packed_bytes(module.q)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) + copies


def _projections(model: CausalLM) -> list[tuple[str, nn.Module, str]]:
    found = []
    for i, layer in enumerate(model.model.layers):
        for block, attrs in PROJECTIONS.items():
            parent = getattr(layer, block)
            for attr in attrs:
                found.append((f"model.layers.{i}.{block}.{attr}", parent, attr))
    return found


def _pack(
    source: torch.Tensor | QuantizedWeight,
    fmt: LinearFormat,
    bias: torch.Tensor | None,
    group_size: int,
    device: torch.device,
    keep: bool = True,
) -> QuantizedLinear:
    """A QuantizedLinear of `fmt` for a float weight. A given QuantizedWeight keeps its own
    format when `keep` and fmt is not bf16 (a projection: the file's choice); otherwise it is
    dequantized and takes `fmt` (the head's format is ours to choose)."""
    if isinstance(source, QuantizedWeight):
        source = source.to(device)
        if keep and fmt != "bf16":
            return QuantizedLinear(source, source.format, bias)  # type: ignore[arg-type]
        if source.format != fmt:
            source = dequantize(source)
    return QuantizedLinear(source, fmt, bias, group_size)
