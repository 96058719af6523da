"""The log-probability of a drawn token and the most likely tokens at its position.

Computed from the raw logits row (float32, before penalties and temperature: vLLM's default
"raw_logprobs", and what OpenAI's API reports), on the row's device; only the chosen token's
value and the `top` best pairs cross to the CPU, in one transfer (as float64, which holds both
the float32 values and the ids exactly).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.request import TokenLogprob


def prompt_logprobs(rows: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """The log-probability and rank of `tokens[i]` under logits row i ([len(tokens), vocab]:
    row i is the position before token i), and the `top` most likely pairs of each row; one
    transfer to the CPU for them all."""
    logprobs = torch.log_softmax(rows.detach().float(), dim=-1)
    ids = torch.tensor(tokens, dtype=torch.int64, device=rows.device).unsqueeze(1)
    chosen = logprobs.gather(1, ids)
    ranks = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    best = torch.topk(logprobs, min(top, logprobs.shape[-1]), dim=-1)
    table = torch.cat(
        [chosen.double(), ranks.double(), best.values.double(), best.indices.double()], dim=1
    ).tolist()
    k = best.values.shape[1]
    return [
        TokenLogprob(
            row[0],
            tuple((int(i), v) for i, v in zip(row[2 + k :], row[2 : 2 + k], strict=True)),
            int(row[1]),
        )
        for row in table
    ]


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """`token`'s log-probability under a logits row [vocab], and the `top` most likely
    (token id, log-probability) pairs, most likely first."""
    logprobs = torch.log_softmax(logits.detach().float(), dim=-1)
    best = torch.topk(logprobs, min(top, logprobs.shape[-1]))
    parts = (logprobs[token].reshape(1), best.values, best.indices)
    chosen, *numbers = torch.cat([part.double() for part in parts]).tolist()
    values, ids = numbers[: len(numbers) // 2], numbers[len(numbers) // 2 :]
    return TokenLogprob(chosen, tuple((int(i), v) for i, v in zip(ids, values, strict=True)))
