"""Put a loaded CausalLM's weights into a weight format: float32 (as loaded), bf16, int8, int4.

`apply_weight_format(model, fmt)` replaces, in place, every decoder layer's q/k/v/o and
gate/up/down projections and the output head with a `QuantizedLinear`
(worker/quantized_linear.py) packed for the device the model is on, so call it after placing the
model. What each format does to the parts:

    part                     float32   bf16                       int8 / int4
    q k v o gate up down     as is     bf16 matrices              per-group int (group 32)
    output head              as is     bf16; a tied head shares   its own quantized copy (tied
                                       the bf16 embedding table   or not)
    embedding table          as is     bf16                       bf16 (a lookup reads one row
                                                                  a token: it is not what
                                                                  decode waits for)
    norms, biases, RoPE      as is (the model's dtype: the activations' dtype never changes)

`quantized` maps Hugging Face tensor names ("model.layers.0.self_attn.q_proj.weight",
"lm_head.weight", "model.embed_tokens.weight") to weights already in quantized form, such as a
GGUF file's own blocks (worker/gguf_checkpoint.py): those are used as they are, in their own
format, instead of quantizing the float weight (a file that mixes Q8_0 and Q4 tensors keeps its
mix); with fmt bf16 they are dequantized. For a tied head, a quantized
"model.embed_tokens.weight" serves as the head's weight and, dequantized, as the table.

LoRA stacks (worker/lora_weights.py) read shapes from the config and add their terms to the
projections' outputs, which stay in the activations' dtype: adapters work unchanged on a
quantized base.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from worker.model import CausalLM
from worker.quantized_linear import LinearFormat, QuantizedLinear
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
) -> CausalLM:
    """Convert `model` in place to `fmt` (module docstring) and return it."""
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
        if given:
            raise ValueError("weights 'float32' keeps the float weights; got quantized ones too")
        return model
    linear_fmt: LinearFormat = fmt
    device = model.model.embed_tokens.weight.device
    for name, parent, attr in _projections(model):
        linear = getattr(parent, attr)
        source = given.get(f"{name}.weight", linear.weight.detach())
        setattr(parent, attr, _pack(source, linear_fmt, linear.bias, group_size, device))
    embed = model.model.embed_tokens
    head_source: torch.Tensor | QuantizedWeight
    if isinstance(model.lm_head, nn.Linear):
        head_source = given.get(HEAD, model.lm_head.weight.detach())
    else:  # tied: quantized from the table as loaded, before it is rounded to bf16
        head_source = given.get(EMBED, embed.weight.detach())
    table = dequantize(given[EMBED]) if EMBED in given else embed.weight.detach()
    embed.weight = nn.Parameter(table.to(device, torch.bfloat16).contiguous(), requires_grad=False)
    if fmt == "bf16" and model.lm_head is None:
        model.lm_head = QuantizedLinear(embed.weight.detach(), "bf16")  # shares the table
    else:
        model.lm_head = _pack(head_source, linear_fmt, None, group_size, device)
    return model


def linear_names(model: CausalLM) -> list[str]:
    """The HF names (without `.weight`) of the projections a weight format replaces."""
    return [name for name, _, _ in _projections(model)]


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights: every parameter and every QuantizedLinear buffer (packed
    values, scales, zeros), a storage shared by two counted once; not the RoPE tables."""
    tensors: list[torch.Tensor] = list(model.parameters())
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            tensors += list(module.buffers())
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


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
) -> QuantizedLinear:
    """A QuantizedLinear of `fmt` for a float weight; a given QuantizedWeight keeps its own
    format (dequantized for bf16)."""
    if isinstance(source, QuantizedWeight):
        source = _to(source, device)
        if fmt != "bf16":
            return QuantizedLinear(source, source.format, bias)  # type: ignore[arg-type]
    return QuantizedLinear(source, fmt, bias, group_size)


def _to(weight: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if weight.q.device == device:
        return weight
    return QuantizedWeight(
        weight.format,
        weight.q.to(device),
        weight.scales.to(device),
        weight.zeros.to(device),
        weight.group_size,
    )
