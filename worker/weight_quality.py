"""Which weight formats keep a model's quality: the threshold, what was measured, the refusal.

Imports nothing but the standard library (cluster/config.py may call it in the router process).

The measure (benchmarks/weights_quality.py): the mean log-likelihood per token of a fixed
held-in text (benchmarks/data/held_in_text.txt) under the model in a weight format, against the
same checkpoint's float32 weights, as a relative perplexity increase exp(dNLL) - 1.

The threshold, MAX_PERPLEXITY_INCREASE = 2 %. A weight format here is a serving choice, not a
model choice: the float32 reference is the checkpoint as its author shipped it, and whatever the
format adds is loss the operator did not ask for. The yardstick is llama.cpp's own perplexity
scoreboard for LLaMA-3-8B (github.com/ggml-org/llama.cpp/pull/6936, wikitext-2, against f16
6.7684): q8_0 +0.004 %, q6_K +0.5 %, q5_K_M +0.9 %, q5_1 +1.8 %, q4_K_M (with an importance
matrix) +2.2 %. q4_K_M is the 4-bit format llama.cpp recommends and most GGUF users run, so
+2 % is about the most loss common practice accepts from a 4-bit model, and a format under it
loses less than the best-calibrated 4-bit file people choose on purpose. It is also well above
this text's measurement noise (the paired standard error of the increase over its 3,575 tokens
is reported beside each number: 0.08-0.28 % here), so no verdict below rests on noise.
Perplexity is the cross-check of choice because it averages every token's probability; greedy
agreement (reported beside it) is too coarse to set a threshold on: one early flip changes every
later token.

MEASURED holds the numbers for the checkpoints measured here, keyed by checkpoint directory name
(the part of the model revision before '@'); `check_format_quality` refuses a format whose
measured increase is past the threshold. cluster/config.py calls it, so a cluster configured
with such a format does not start (a ConfigError naming `model.weights`); `load_model` itself
loads any format (the benchmark must, to measure it). A checkpoint that was never measured is
not refused (there is nothing to go on): measure it with `python benchmarks/weights_quality.py
--source DIR`.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PERPLEXITY_INCREASE = 0.02
"""Relative perplexity increase over float32 on the held-in text a format may cost (see above)."""
DEFAULT_CHECKPOINT = "SmolLM2-135M-Instruct.Q4_1"
"""The default model's converted directory name (worker/default_model.py)."""


@dataclass(frozen=True)
class FormatQuality:
    """One format on one checkpoint, against its float32 weights (benchmarks/weights_quality.py)."""

    perplexity_increase: float
    """exp(mean NLL of the format - mean NLL of float32) - 1 on the held-in text."""
    identical_token_share: float
    """Share of 20 prompts x 32 greedy tokens equal to float32's, position by position."""


MEASURED: dict[str, dict[str, FormatQuality]] = {
    DEFAULT_CHECKPOINT: {
        "float32": FormatQuality(perplexity_increase=0.0, identical_token_share=1.0),
        "bf16": FormatQuality(perplexity_increase=-0.0006, identical_token_share=0.783),
        "int8": FormatQuality(perplexity_increase=0.0118, identical_token_share=0.677),
        "int4": FormatQuality(perplexity_increase=0.0030, identical_token_share=0.847),
    },
}
"""checkpoint directory name -> weight format -> what was measured. SmolLM2-135M-Instruct (the Q4_1
file; float32 perplexity 15.750 on the 3,575-token text), `python
benchmarks/weights_quality.py`, 2 threads, the head bf16 in every format, its logits unrounded
(`QuantizedLinear.as_head`; 2026-11-25): bf16 -0.04 % +- 0.07 %, int8 +0.97 % +- 0.28 %, int4
+0.00 % +- 0.08 % (with the head's logits rounded to bf16, as before: +0.01 %, +1.00 %, +0.07
%). int4 is nearly free here because its projections are the file's own Q4_1 blocks (the float32
weights are those blocks dequantized); int8 quantizes those values again per output row, which
is what it loses. Before the head was kept in bf16, int4's head was the Q8_0 table quantized to
int4 (round to nearest, groups of 32): +5.92 % +- 0.63 %, refused; with the table's own Q8_0
values in int8 per row, +0.24 % +- 0.12 %. int4 measured again once it prefilled with its
kernel instead of the float32 path (eighth session, the same day): +0.09 % +- 0.08 % (was +0.00
%), 84.2 % of tokens and 14 of 20 prompts identical to float32 (was 85.6 % and 17): the same
sums in another order, which moves a few near-ties. bf16 likewise, once it kept its kernel (native
bf16 dot products on an AVX512-BF16 CPU): -0.07 % +- 0.07 % (was -0.04 %), 78.3 % and 14 of 20
(was 88.1 % and 16). All three once more (ninth session), once the head kept its kernel at
every row count where its format does (`head_float32_rows`: the text's 256-row chunks then get
bf16 tail logits) and summed its exact top row by row (`vecdot`): bf16 -0.06 % +- 0.07 %,
78.3 %, 14 / 20; int8 +0.95 % +- 0.28 %, 74.8 % (was 75.8 %), 8 / 20; int4 +0.08 % +- 0.08 %,
84.2 %, 14 / 20. int8 and int4 again (tenth session) once their head became int8 on a CPU with
int8 dot products (`weight_formats.head_format`: activations quantized to int8 per row, the
exact top as before): int8 +1.18 % +- 0.30 % (192 MB), 67.7 %, 5 / 20; int4 +0.30 % +- 0.13 %
(152 MB), 84.7 %, 13 / 20; bf16 unchanged, -0.06 %. On a CPU without int8 dot products the
head stays bf16 and the ninth session's numbers stand. Measure again whenever what a format
does to a layer changes: the numbers belong to the definitions."""


AUTO = "auto"
AUTO_CPU_ORDER = ("bf16", "int4", "int8")
"""What `weights: auto` tries on a CPU, in order (docs/decisions.md 51). SmolLM2, 2 threads, one
run: bf16 decodes 31.2 tokens/s against float32's 18.3 with float32's TTFT (then; shorter since
on an AVX512-BF16 CPU), and answered 7 of 7
plain questions token for token as float32 does (6 of 7 within 24 tokens since it keeps its
kernel on an AVX512-BF16 CPU, the France question among the 6); int4 answered 2 of the 7
otherwise (3 since; "What is the capital of France?": "L'Etoile, la Marseillaise, ...", as
llama.cpp does on the same Q4_1 file; float32 and bf16: "The capital of France is Paris."), a
near-tie its roundings flip. On an AVX-512 CPU with AVX512-BF16 (one run, eighth session) bf16
has the shorter TTFT (0.26 s at 256 tokens against int4's 0.44) and int4 the fastest decode
(43.2 against 25.9 tokens/s); bf16 is first for the answers. On the 20 prompts of
benchmarks/weights_quality.py the two agree with float32 about equally (int4 17 identical then,
14 since it prefills with its kernel; bf16 16 then, 14 since). With its int8 head on a CPU with
int8 dot products (tenth session) int4 answers the France question as float32 does, 13 of the
20 prompts identical; bf16 stays first for its shorter TTFT (decision 51)."""


def auto_weight_format(checkpoint: str, device: str) -> str:
    """The weight format `model.weights: auto` serves `checkpoint` (a directory name) in on
    `device` ("cpu" or "cuda"): on a CPU the first of AUTO_CPU_ORDER measured to keep quality
    on this checkpoint, else float32. float32 on CUDA, where the quantized kernels beat cuBLAS's
    bf16 only for a lone row (on an H100; from 2 rows their tile kernel is 2-6x slower, and a
    small model's step is launch-bound: docs/models.md), and for a checkpoint never measured,
    where what round-to-nearest quantization costs is unknown (decode is faster in every format
    on a CPU; a silent loss of quality is not what a default may buy)."""
    if device != "cpu":
        return "float32"
    measured = MEASURED.get(checkpoint, {})
    keeps = [
        f for f in AUTO_CPU_ORDER if f in measured and acceptable(measured[f].perplexity_increase)
    ]
    return keeps[0] if keeps else "float32"


class WeightFormatRefused(ValueError):
    """A weight format measured to lose more than MAX_PERPLEXITY_INCREASE on this checkpoint."""


def acceptable(perplexity_increase: float) -> bool:
    """Whether a measured relative perplexity increase keeps quality (<= the threshold)."""
    return perplexity_increase <= MAX_PERPLEXITY_INCREASE


def check_format_quality(checkpoint: str, weights: str) -> None:
    """Refuse `weights` for `checkpoint` (a checkpoint directory name) when it was measured past
    the threshold; formats and checkpoints never measured pass."""
    measured = MEASURED.get(checkpoint, {}).get(weights)
    if measured is None or acceptable(measured.perplexity_increase):
        return
    keeps = sorted(f for f, q in MEASURED[checkpoint].items() if acceptable(q.perplexity_increase))
    raise WeightFormatRefused(
        f"weight format {weights!r} on {checkpoint}: perplexity "
        f"{measured.perplexity_increase:+.1%} over float32 on the held-in text, past the "
        f"{MAX_PERPLEXITY_INCREASE:.0%} a format may cost (worker/weight_quality.py); formats "
        f"measured within it: {', '.join(['float32', *keeps])}"
    )
