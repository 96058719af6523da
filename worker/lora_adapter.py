"""A LoRA adapter as the worker holds it: per (layer, module) the two low-rank factors.

    W' = W + scaling * B @ A        A: [rank, in]   B: [out, rank]   scaling = alpha / rank

`load_adapter` reads a PEFT directory and checks all of it against the base model before
anything is served:

    adapter_config.json          peft_type LORA; r, lora_alpha, use_rslora; target_modules (a list
                                 of names or suffixes, or one regex); layers_to_transform,
                                 exclude_modules, rank_pattern, alpha_pattern
    adapter_model.safetensors    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
                                 ... .lora_B.weight   (also `lora_A.default.weight`)

Every module the config targets must have both factors, of the shapes the base model and its
rank imply, float, finite; nothing else may be in the file. Anything else is an `AdapterError`
whose one message lists every problem found, each under the file it is in and naming the tensor
at fault. Per-module ranks (`rank_pattern`) are kept as they are (`rank` is the largest); a
module whose own scaling (from `rank_pattern` / `alpha_pattern`) differs from the adapter's has
the ratio folded into its B, so `scaling * B @ A` is always that module's update.

The adapter's identity, `name@digest`, is its part of the cache namespace: the digest covers its
scaling and weights as served, so reloading other weights under the same name never meets the
old KV, and the same weights from any directory (or dtype that holds them exactly) share it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from worker.config import ModelConfig

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target (Llama names: self_attn.* and mlp.*)."""
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ABS_WEIGHT = 65504.0
"""float16's largest value: a LoRA weight beyond it is a corrupted file, not a trained adapter
(a flipped exponent bit reads as 1e30 or so), and would not survive a float16 worker anyway."""
_UNSUPPORTED = {
    "use_dora": "DoRA rescales the merged weight; only plain LoRA is served",
    "modules_to_save": "it holds full copies of modules, not LoRA weights",
    "lora_bias": "LoRA bias terms are not served",
    "target_parameters": "LoRA on raw parameters is not served",
    "layer_replication": "layer replication changes the base model",
    "trainable_token_indices": "trained token embeddings are not LoRA weights",
    "alora_invocation_tokens": "activated LoRA is not served",
    "use_qalora": "QA-LoRA is not served",
    "use_bdlora": "BD-LoRA is not served",
}
"""Config keys that, when set (truthy), make an adapter something other than plain LoRA."""
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(?P<layer>\d+)\.(?P<group>self_attn|mlp)\."
    r"(?P<module>\w+)\.lora_(?P<factor>[AB])(?:\.[\w-]+)?\.weight$"
)


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the file and, where one is at
    fault, the tensor."""


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    name: str
    path: str
    rank: int
    """The largest rank of any module (they differ only under `rank_pattern`)."""
    alpha: float
    scaling: float
    """What multiplies B @ A (alpha / rank; alpha / sqrt(rank) for rsLoRA)."""
    digest: str
    """16 hex digits of a blake2b digest of the scaling and every tensor (name, shape, bytes)."""
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    """(layer, module) -> (A [rank, in], B [out, rank]), float32 on the CPU."""

    @property
    def identity(self) -> str:
        """The adapter's part of the cache namespace (and of the router's block hashes)."""
        return f"{self.name}@{self.digest}"

    @property
    def target_modules(self) -> tuple[str, ...]:
        present = {module for _, module in self.weights}
        return tuple(m for m in TARGET_MODULES if m in present)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def projection_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of the base weight of `module` (one of TARGET_MODULES) in every layer."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (config.q_size, hidden),
        "k_proj": (config.kv_size, hidden),
        "v_proj": (config.kv_size, hidden),
        "o_proj": (hidden, config.q_size),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }[module]


def module_name(layer: int, module: str) -> str:
    """The module's name in transformers' LlamaForCausalLM, as PEFT's patterns see it."""
    group = "self_attn" if module in ATTENTION_MODULES else "mlp"
    return f"model.layers.{layer}.{group}.{module}"


def _model_modules(config: ModelConfig) -> dict[str, tuple[int, str] | None]:
    """Every module name of transformers' model -> (layer, module) for a projection, else None."""
    names: dict[str, tuple[int, str] | None] = {
        name: None for name in ("model", "model.embed_tokens", "model.layers", "model.norm")
    }
    names["model.rotary_emb"] = None
    names["lm_head"] = None
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}"
        for other in ("", ".self_attn", ".mlp", ".mlp.act_fn", ".input_layernorm"):
            names[prefix + other] = None
        names[prefix + ".post_attention_layernorm"] = None
        if config.qk_norm:
            names[prefix + ".self_attn.q_norm"] = None
            names[prefix + ".self_attn.k_norm"] = None
        for module in TARGET_MODULES:
            names[module_name(layer, module)] = (layer, module)
    return names


def _listed(items: Iterable[str], separator: str = ", ", kind: str = "", limit: int = 4) -> str:
    """The first `limit` items, then how many more (an adapter of 30 layers has 420 tensors)."""
    listed = list(items)
    shown = separator.join(listed[:limit])
    more = len(listed) - limit
    return shown + (f"{separator}and {more} more {kind}{'s' * (more > 1)}" if more > 0 else "")


def _named(names: Iterable[str]) -> str:
    return _listed(names)


class _Problems:
    """What is wrong, per file, reported together as one `AdapterError`."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name, self.directory = name, directory
        self.found: dict[str, list[str]] = {}

    def add(self, file: str, problem: str) -> None:
        self.found.setdefault(file, []).append(problem)

    def raise_if_any(self) -> None:
        if not self.found:
            return
        parts = [
            f"{self.directory / file}: " + _listed(problems, "; ", "problem", limit=6)
            for file, problems in self.found.items()
        ]
        raise AdapterError(f"adapter {self.name!r} is refused: " + " | ".join(parts))


@dataclass(frozen=True)
class _Spec:
    """What adapter_config.json says, resolved against the base model."""

    rank: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    targets: frozenset[tuple[int, str]]

    def scaling_for(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def module_rank_alpha(self, layer: int, module: str) -> tuple[int, float]:
        """PEFT's `get_pattern_key`: the first pattern matching the module name's tail."""
        name = module_name(layer, module)
        rank, alpha = self.rank, self.alpha
        for pattern, value in self.rank_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", name):
                rank = value
                break
        for pattern, scale in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", name):
                alpha = scale
                break
        return rank, alpha


def _read_json(path: Path, problems: _Problems) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        problems.add(CONFIG_FILE, f"not readable JSON ({error})")
        return {}
    if not isinstance(raw, dict):
        problems.add(CONFIG_FILE, f"holds a {type(raw).__name__}, not an object")
        return {}
    return raw


def _check_kind(raw: dict[str, Any], problems: _Problems) -> None:
    """The config describes plain LoRA on unfused Llama linears without bias."""
    if raw.get("peft_type", "LORA") != "LORA":
        problems.add(CONFIG_FILE, f"peft_type is {raw.get('peft_type')!r}, not 'LORA'")
    if raw.get("bias", "none") != "none":
        problems.add(CONFIG_FILE, f"bias is {raw.get('bias')!r}: only 'none' is served")
    if raw.get("fan_in_fan_out"):
        problems.add(CONFIG_FILE, "fan_in_fan_out is true: Llama linears store [out, in]")
    for key, why in _UNSUPPORTED.items():
        if raw.get(key):
            problems.add(CONFIG_FILE, f"{key} is {raw[key]!r}: {why}")
    pattern = raw.get("layers_pattern")
    if pattern not in (None, "", "layers", [], ["layers"]):
        problems.add(CONFIG_FILE, f"layers_pattern {pattern!r}: Llama's layers are 'layers'")


def _positive_number(value: object, where: str, problems: _Problems) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        problems.add(CONFIG_FILE, f"{where} is {value!r}, not a positive number")
        return 1.0
    return float(value)


def _rank_of(value: object, where: str, problems: _Problems) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.add(CONFIG_FILE, f"{where} is {value!r}, not a positive integer")
        return 1
    return value


def _patterns(raw: dict[str, Any], key: str, problems: _Problems) -> dict[str, Any]:
    value = raw.get(key) or {}
    if not isinstance(value, dict):
        problems.add(CONFIG_FILE, f"{key} is {value!r}, not an object")
        return {}
    for pattern in value:
        try:
            re.compile(pattern)
        except re.error as error:
            problems.add(CONFIG_FILE, f"{key} key {pattern!r} is not a regex ({error})")
            return {}
    return value


def _matches(entry: str, names: Iterable[str]) -> list[str]:
    """PEFT's list semantics: a module is targeted by its full name or a dotted suffix."""
    return [name for name in names if name == entry or name.endswith("." + entry)]


def _matched_modules(raw: dict[str, Any], config: ModelConfig, problems: _Problems) -> list[str]:
    """Names of the model's modules that `target_modules` (minus `exclude_modules`) selects."""
    names = _model_modules(config)
    targets = raw.get("target_modules")
    if isinstance(targets, str) and targets.lower() == "all-linear":
        return [name for name, where in names.items() if where is not None]
    if isinstance(targets, str):
        try:
            matched = [name for name in names if re.fullmatch(targets, name)]
        except re.error as error:
            problems.add(CONFIG_FILE, f"target_modules {targets!r} is not a regex ({error})")
            return []
        if not matched:
            problems.add(CONFIG_FILE, f"target_modules {targets!r} matches no module of the model")
        selected = matched
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        selected = []
        for entry in targets:
            found = _matches(entry, names)
            if not found:
                problems.add(CONFIG_FILE, f"target module {entry!r} is not a module of the model")
            selected += found
    else:
        problems.add(CONFIG_FILE, f"target_modules is {targets!r}, not a list of names or a regex")
        return []
    excluded = raw.get("exclude_modules")
    if isinstance(excluded, str):
        selected = [name for name in selected if not re.fullmatch(excluded, name)]
    elif isinstance(excluded, list):
        selected = [name for name in selected if not _matches_any(name, excluded)]
    unserved = sorted({name.rsplit(".", 1)[-1] for name in selected if names[name] is None})
    if unserved:
        problems.add(
            CONFIG_FILE,
            f"target module(s) {_named(unserved)} cannot carry LoRA here "
            f"(only {', '.join(TARGET_MODULES)})",
        )
    return selected


def _matches_any(name: str, entries: list[str]) -> bool:
    return any(name == entry or name.endswith("." + entry) for entry in entries)


def _layers(raw: dict[str, Any], config: ModelConfig, problems: _Problems) -> set[int] | None:
    """`layers_to_transform` as a set (None: every layer); it applies to list targets only."""
    value = raw.get("layers_to_transform")
    if value is None or value == [] or isinstance(raw.get("target_modules"), str):
        return None
    layers = [value] if isinstance(value, int) else value
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        problems.add(CONFIG_FILE, f"layers_to_transform is {value!r}, not a list of layers")
        return None
    beyond = [i for i in layers if not 0 <= i < config.num_layers]
    if beyond:
        problems.add(
            CONFIG_FILE,
            f"layers_to_transform names layer(s) {beyond}; the model has {config.num_layers}",
        )
    return set(layers)


def _read_spec(raw: dict[str, Any], config: ModelConfig, problems: _Problems) -> _Spec:
    _check_kind(raw, problems)
    rank = _rank_of(raw.get("r"), "r", problems)
    alpha = _positive_number(raw.get("lora_alpha"), "lora_alpha", problems)
    rank_pattern = _patterns(raw, "rank_pattern", problems)
    for pattern, value in rank_pattern.items():
        rank_pattern[pattern] = _rank_of(value, f"rank_pattern[{pattern!r}]", problems)
    alpha_pattern = _patterns(raw, "alpha_pattern", problems)
    for pattern, value in alpha_pattern.items():
        alpha_pattern[pattern] = _positive_number(value, f"alpha_pattern[{pattern!r}]", problems)
    names = _model_modules(config)
    layers = _layers(raw, config, problems)
    targets = frozenset(
        where
        for name in _matched_modules(raw, config, problems)
        if (where := names[name]) is not None and (layers is None or where[0] in layers)
    )
    return _Spec(rank, alpha, bool(raw.get("use_rslora")), rank_pattern, alpha_pattern, targets)


def _read_tensors(path: Path, problems: _Problems) -> dict[str, torch.Tensor]:
    """Every tensor of the file as stored; a file safetensors cannot read is one problem."""
    tensors: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                tensors[key] = handle.get_tensor(key)
    except (SafetensorError, OSError, RuntimeError, ValueError, struct.error) as error:
        problems.add(WEIGHTS_FILE, f"not a readable safetensors file ({error})")
        return {}
    if not tensors:
        problems.add(WEIGHTS_FILE, "holds no tensors")
    return tensors


def _factors(
    tensors: dict[str, torch.Tensor], config: ModelConfig, problems: _Problems
) -> dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]]:
    """(layer, module) -> {"A"/"B": (key, tensor)}, refusing keys that are not served LoRA."""
    factors: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        found = _KEY.match(key)
        module = found["module"] if found else ""
        if found is None or module not in TARGET_MODULES:
            problems.add(
                WEIGHTS_FILE,
                f"tensor {key} is not the lora_A or lora_B weight of a projection served with "
                f"LoRA ({', '.join(TARGET_MODULES)})",
            )
            continue
        layer = int(found["layer"])
        if found["group"] != ("self_attn" if module in ATTENTION_MODULES else "mlp"):
            problems.add(WEIGHTS_FILE, f"tensor {key} puts {module} under {found['group']}")
        elif layer >= config.num_layers:
            problems.add(
                WEIGHTS_FILE,
                f"tensor {key} is for layer {layer}; the model has {config.num_layers} layers",
            )
        elif found["factor"] in factors.setdefault((layer, module), {}):
            other = factors[layer, module][found["factor"]][0]
            problems.add(WEIGHTS_FILE, f"tensors {other} and {key} are the same factor")
        else:
            factors[layer, module][found["factor"]] = (key, tensor)
    return factors


def _check_tensor(key: str, tensor: torch.Tensor, shape: tuple[int, int]) -> str | None:
    """What is wrong with one factor, if anything."""
    if tensor.dtype not in FLOAT_DTYPES:
        return f"tensor {key} is {tensor.dtype}, not one of float32, float16, bfloat16"
    if tuple(tensor.shape) != shape:
        return f"tensor {key} has shape {list(tensor.shape)}, expected {list(shape)}"
    values = tensor.float()
    if not bool(torch.isfinite(values).all()):
        return f"tensor {key} holds NaN or infinite values"
    if bool((values.abs() > MAX_ABS_WEIGHT).any()):
        return f"tensor {key} holds values beyond +-{MAX_ABS_WEIGHT:g} (a corrupted file?)"
    return None


def _check_module(
    where: tuple[int, str],
    found: dict[str, tuple[str, torch.Tensor]],
    spec: _Spec,
    config: ModelConfig,
    problems: _Problems,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Both factors of one targeted module, checked against its rank and the base shapes."""
    layer, module = where
    if set(found) != {"A", "B"}:
        key = next(iter(found.values()))[0]
        missing = "lora_B" if "A" in found else "lora_A"
        problems.add(WEIGHTS_FILE, f"tensor {key} has no {missing} beside it")
        return None
    rank = spec.module_rank_alpha(layer, module)[0]
    out_features, in_features = projection_shape(config, module)
    (key_a, a), (key_b, b) = found["A"], found["B"]
    errors = [
        error
        for error in (
            _check_tensor(key_a, a, (rank, in_features)),
            _check_tensor(key_b, b, (out_features, rank)),
        )
        if error is not None
    ]
    for error in errors:
        problems.add(WEIGHTS_FILE, error)
    return None if errors else (a.float().contiguous(), b.float().contiguous())


def _digest(
    scaling: float, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
) -> str:
    """16 hex digits of blake2b over the scaling and each factor (name, dtype, shape, bytes)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(struct.pack("<d", scaling))
    for layer, module in sorted(weights):
        for factor, tensor in zip("AB", weights[layer, module], strict=True):
            header = (
                f"{module_name(layer, module)}.lora_{factor}|{tensor.dtype}|{list(tensor.shape)}"
            )
            digest.update(header.encode())
            digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _collect(
    tensors: dict[str, torch.Tensor], spec: _Spec, config: ModelConfig, problems: _Problems
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """The checked factors of every targeted module; factors of untargeted ones are refused."""
    factors = _factors(tensors, config, problems)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for where, found in sorted(factors.items()):
        if where not in spec.targets:
            keys = " and ".join(key for key, _ in found.values())
            problems.add(WEIGHTS_FILE, f"{keys}: for a module {CONFIG_FILE} does not target")
            continue
        pair = _check_module(where, found, spec, config, problems)
        if pair is not None:
            weights[where] = pair
    absent = [module_name(*where) for where in sorted(spec.targets) if where not in factors]
    if absent and tensors:
        problems.add(
            WEIGHTS_FILE,
            f"no lora_A/lora_B for {len(absent)} module(s) {CONFIG_FILE} targets: {_named(absent)}",
        )
    return weights


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT directory `path` as adapter `name` of a model of `config`.

    Raises `AdapterError` listing every problem (missing files, bad JSON, unsupported options,
    unknown or unservable target modules, misshapen, missing, extra, non-float, non-finite or
    unreadable tensors, a rank above `max_rank`). Weights come back float32 on the CPU.
    """
    directory = Path(path)
    problems = _Problems(name, directory)
    if not directory.is_dir():
        raise AdapterError(f"adapter {name!r} is refused: {directory} is not a directory")
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        if not (directory / file).is_file():
            problems.add(file, "missing (a PEFT adapter directory holds both)")
    problems.raise_if_any()
    raw = _read_json(directory / CONFIG_FILE, problems)
    problems.raise_if_any()
    spec = _read_spec(raw, config, problems)
    tensors = _read_tensors(directory / WEIGHTS_FILE, problems)
    weights = _collect(tensors, spec, config, problems)
    rank = max((a.shape[0] for a, _ in weights.values()), default=spec.rank)
    if rank > max_rank:
        problems.add(
            CONFIG_FILE,
            f"rank {rank} is above the configured maximum {max_rank} (engine.max_lora_rank)",
        )
    problems.raise_if_any()
    scaling = spec.scaling_for(spec.rank, spec.alpha)
    for (layer, module), (a, b) in weights.items():
        own = spec.scaling_for(*spec.module_rank_alpha(layer, module))
        if own != scaling:
            weights[layer, module] = (a, b * (own / scaling))
    return LoraAdapter(
        name=name,
        path=str(directory),
        rank=rank,
        alpha=spec.alpha,
        scaling=scaling,
        digest=_digest(scaling, weights),
        weights=weights,
    )
