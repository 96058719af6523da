"""Real PEFT adapters for tests: made by `peft` on transformers' Llama, saved as PEFT saves them.

    base = build_tiny_checkpoint(tmp_path / "base")
    adapter_dir = make_peft_adapter(tmp_path / "a", base, rank=8, alpha=16, seed=1)
    merged_dir = merged_checkpoint(make_peft_model(base, rank=8, alpha=16, seed=1), tmp_path / "m")

`make_peft_model` wraps `transformers.LlamaForCausalLM` (read from the checkpoint directory)
with `peft.get_peft_model(LoraConfig(...))`. PEFT starts B at zero, which makes an adapter that
changes nothing, so by default ("random") both factors are redrawn from `seed`: the same
arguments give the same weights, another seed other weights. `merged_checkpoint` writes
`merge_and_unload()`'s weights (W + scaling * B @ A, merged by peft) as a checkpoint directory
that `worker.loader.load_model` reads: the oracle for "adapter applied == weights merged".
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from worker.checkpoint import expected_shapes, read_config, save_checkpoint

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
ALL = ATTENTION + MLP
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_peft_model(
    base_checkpoint_dir: Path,
    rank: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] | str = ("q_proj", "v_proj"),
    seed: int = 0,
    init: str = "random",
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    layers_to_transform: Sequence[int] | None = None,
    scale: float = 0.2,
) -> Any:
    """A `peft.PeftModel` over the float32 transformers model of `base_checkpoint_dir`.

    `init="random"`: every A is N(0, 1/in) and every B N(0, (scale/rank)^2)-ish (drawn from
    `seed`), so the update is a visible fraction of the base output; `init="peft"`: PEFT's own
    initialisation (B = 0, a no-op adapter). A string `target_modules` is PEFT's regex form.
    """
    import peft
    import transformers

    if init not in ("random", "peft"):
        raise ValueError(f"init must be 'random' or 'peft', got {init!r}")
    base = transformers.LlamaForCausalLM.from_pretrained(
        str(base_checkpoint_dir), torch_dtype=torch.float32
    )
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # peft annotates int; floats work
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        layers_to_transform=list(layers_to_transform) if layers_to_transform else None,
        lora_dropout=0.0,
        bias="none",
    )
    model = peft.get_peft_model(base, config).eval()
    if init == "random":
        randomise_lora(model, seed, scale)
    return model


def randomise_lora(model: Any, seed: int, scale: float = 0.2) -> None:
    """Redraw every LoRA factor of `model` from `seed`, module by module in name order."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in sorted(lora_layers(model).items()):
            a = module.lora_A["default"].weight
            b = module.lora_B["default"].weight
            rank, fan_in = a.shape
            a.copy_(torch.randn(a.shape, generator=generator) * fan_in**-0.5)
            b.copy_(torch.randn(b.shape, generator=generator) * scale / rank**0.5)


def lora_layers(model: Any) -> dict[str, Any]:
    """Base-model module name ("model.layers.0.self_attn.q_proj") -> peft's LoRA layer."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    return {
        name.removeprefix(prefix): module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }


def make_peft_adapter(
    directory: Path,
    base_checkpoint_dir: Path,
    rank: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] | str = ("q_proj", "v_proj"),
    seed: int = 0,
    init: str = "random",
    dtype: torch.dtype = torch.float32,
    **options: Any,
) -> Path:
    """Save a real PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for
    the model of `base_checkpoint_dir`; `options` go to `make_peft_model`. `dtype` is the dtype
    the tensors are stored in."""
    model = make_peft_model(base_checkpoint_dir, rank, alpha, target_modules, seed, init, **options)
    return save_peft_adapter(model, directory, dtype)


def save_peft_adapter(model: Any, directory: Path, dtype: torch.dtype = torch.float32) -> Path:
    """`model.save_pretrained(directory)` with the LoRA factors stored as `dtype`."""
    if dtype != torch.float32:
        model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(str(directory))
    return Path(directory)


def merged_checkpoint(model: Any, directory: Path, base_checkpoint_dir: Path) -> Path:
    """Write peft's `merge_and_unload()` of `model` (left as it was) as a checkpoint directory,
    with the base's tokenizer files: the base model with the adapter merged into its weights."""
    merged = copy.deepcopy(model).merge_and_unload()
    config = read_config(Path(base_checkpoint_dir))
    state = merged.state_dict()
    weights = {name: state[name].detach().float() for name in expected_shapes(config)}
    tokenizer = {
        name: (Path(base_checkpoint_dir) / name).read_bytes()
        for name in TOKENIZER_FILES
        if (Path(base_checkpoint_dir) / name).is_file()
    }
    return save_checkpoint(Path(directory), config, weights, tokenizer)
