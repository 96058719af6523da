"""The weight-format axis the benchmarks share: a model loaded in one of the weight formats.

`load_for_bench("smollm2", fmt)` is `load_model("default", weights=fmt)`, exactly what a worker
serving the default model with `model.weights: fmt` holds (int4 / int8 from the GGUF's own
blocks where it has them). "tiny" and "big" are seeded random models (worker/tiny_model.py)
put into `fmt` by `apply_weight_format`, quantized round-to-nearest: their timings and code
paths are real, their quality numbers mean nothing.
"""

from __future__ import annotations

from worker.config import ModelConfig
from worker.loader import load_model
from worker.model import CausalLM
from worker.quantized_weights import WEIGHT_FORMATS, WeightFormat
from worker.tiny_model import TINY_CONFIG, tiny_model
from worker.weight_formats import apply_weight_format, check_weight_format, weight_bytes

BIG = ModelConfig(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_layers=8,
    num_heads=16,
    num_kv_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
)
"""A bigger random CPU-sized config (prefill_bench's "big")."""
MODELS = ("smollm2", "big", "tiny")

__all__ = ["BIG", "MODELS", "WEIGHT_FORMATS", "load_for_bench", "weight_bytes"]


def load_for_bench(name: str, fmt: WeightFormat | str = "float32") -> CausalLM:
    """Model `name` (one of MODELS) with its linear layers and head in weight format `fmt`,
    its compiled decode graph built (worker/decode_graph.py; a benchmark measures the steady
    state a server reaches seconds after it starts)."""
    weights = check_weight_format(fmt, "--weights")
    if name == "smollm2":
        model = load_model("default", weights=weights).model
    elif name not in MODELS:
        raise ValueError(f"model {name!r} is not one of {', '.join(MODELS)}")
    else:
        model = apply_weight_format(
            tiny_model(BIG if name == "big" else TINY_CONFIG, seed=0), weights
        )
    layers = model.decode_layers()
    if layers is not None and layers.graph is not None:
        layers.graph.wait()
    return model
