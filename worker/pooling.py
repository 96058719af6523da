"""An embedding from a final hidden state: the prompt's last token's (vLLM's last-token
pooling, what Qwen3-Embedding, gte-Qwen2 and e5-mistral are trained for), cut to
`dimensions` (a Matryoshka-trained model's shorter embedding) and then, by default, scaled to
unit L2 norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.request import PoolingParams


def pooled(hidden: torch.Tensor, params: PoolingParams) -> tuple[float, ...]:
    """The embedding of one hidden state row (`CausalLM.hidden_states`), in float32."""
    x = hidden.float()
    if params.dimensions is not None:
        x = x[: params.dimensions]
    if params.normalize:
        x = F.normalize(x, dim=-1)
    return tuple(x.tolist())
