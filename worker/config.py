"""The model's configuration: one frozen dataclass, read from a Hugging Face `config.json`.

Covers the Llama / Qwen decoder family: RMSNorm, RoPE (plain, linear, dynamic NTK, llama3),
GQA, SwiGLU, optional q/k/v bias (Qwen2), optional per-head QK-norm (Qwen3), tied or separate
LM head. Weight names follow Hugging Face's Llama layout, so HF checkpoints load as they are.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
ROPE_KINDS = ("default", "linear", "dynamic", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope scaling {self.kind!r} is not one of {ROPE_KINDS}")
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")

    @classmethod
    def from_hf(cls, raw: dict[str, Any] | None, max_positions: int) -> RopeScaling:
        if not raw:
            return cls()
        kind = raw.get("rope_type", raw.get("type", "default"))
        return cls(
            kind=kind,
            factor=float(raw.get("factor", 1.0)),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                raw.get("original_max_position_embeddings", max_positions)
            ),
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    architecture: str = "llama"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """q, k, v projections carry a bias (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head of q and k before RoPE (Qwen3)."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {ARCHITECTURES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads < 1 or self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """From the dict of a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3)."""
        arch = raw.get("model_type", "llama")
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        max_positions = int(raw.get("max_position_embeddings", 2048))
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            architecture=arch,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=RopeScaling.from_hf(raw.get("rope_scaling"), max_positions),
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "qwen2")),
            qk_norm=arch == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        )

    def to_hf(self) -> dict[str, Any]:
        """The `config.json` dict that `from_hf` reads back (and transformers understands)."""
        rope: dict[str, Any] | None = None
        kind = self.rope_scaling.kind
        if kind != "default":
            keys = {
                "linear": ("factor",),
                "dynamic": ("factor", "original_max_position_embeddings"),
            }
            scaling = asdict(self.rope_scaling)
            wanted = keys.get(kind, tuple(k for k in scaling if k != "kind"))
            rope = {"rope_type": kind, **{k: scaling[k] for k in wanted}}
        return {
            "architectures": [
                {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}.get(
                    self.architecture,
                    "Qwen2ForCausalLM" if self.architecture == "qwen2" else "Qwen3ForCausalLM",
                )
            ],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) or None,
            "torch_dtype": self.dtype,
            "hidden_act": "silu",
        }
