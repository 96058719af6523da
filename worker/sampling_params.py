"""What a request asks of the sampler, and the checks on it. Imports no torch.

The router validates requests with these before routing them and the worker validates again on
arrival (worker/validation.py), so the router process stays free of torch; the worker's sampler
(worker/sampling.py) is built from them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from worker.errors import InvalidRequest

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20
"""Top log-probabilities per token a request may ask for (OpenAI's top_logprobs bound)."""
MAX_STRUCTURED_CHARS = 1_048_576
"""Characters of a structured output's schema, pattern, grammar or choices together (a tool
call's constraint holds every tool's parameters): compiling one is work the worker does before
the request is queued."""
MAX_CHOICES = 1_024
MAX_BAD_WORDS = 256
MAX_PREDICTION_CHARS = 1_048_576
"""Characters of a predicted output (it is tokenized before the request is queued)."""
MAX_LOGIT_BIAS = 100.0
"""A logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)."""
MAX_PENALTY = 2.0
"""Presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range);
repetition penalty in (0, MAX_PENALTY]."""


@dataclass(frozen=True, slots=True)
class StopLimits:
    """Bounds on a request's stop strings: what one request may make every token check
    (the check itself costs the same for any number of strings: worker/stop.py)."""

    max_strings: int = MAX_STOP_STRINGS
    max_chars: int = MAX_STOP_CHARS
    """Characters of each string."""


StructuredKind = Literal[
    "json_schema", "json_object", "regex", "choice", "grammar", "structural_tag"
]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = (
    "json_schema",
    "json_object",
    "regex",
    "choice",
    "grammar",
    "structural_tag",
)


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a sample's text must be: the worker compiles it to a grammar over the vocabulary
    (worker/structured_output.py) and masks every draw with it."""

    kind: StructuredKind
    spec: str = ""
    """The schema or the structural tag (JSON text), the pattern or the grammar; "" for
    json_object and choice."""
    choices: tuple[str, ...] = ()

    @property
    def field(self) -> str:
        """The request field that holds it, for refusals."""
        return f"sampling.structured.{self.kind}"

    def validate(self) -> None:
        """Raise `InvalidRequest` for what no compiler could take: an unknown kind, an empty or
        oversized spec, a schema that is not JSON. The worker's compiler judges the rest."""
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequest(
                "sampling.structured", f"{self.kind!r} is not one of {list(STRUCTURED_KINDS)}"
            )
        size = len(self.spec) + sum(len(c) for c in self.choices)
        if size > MAX_STRUCTURED_CHARS:
            raise InvalidRequest(
                self.field, f"{size:,} characters; at most {MAX_STRUCTURED_CHARS:,} are allowed"
            )
        if self.kind == "choice":
            if not 1 <= len(self.choices) <= MAX_CHOICES:
                raise InvalidRequest(
                    self.field, f"{len(self.choices)} choices; give 1 to {MAX_CHOICES}"
                )
            if not all(self.choices):
                raise InvalidRequest(self.field, "a choice is the empty string")
        elif self.kind != "json_object" and not self.spec:
            raise InvalidRequest(self.field, "is empty")
        if self.kind in ("json_schema", "structural_tag"):
            try:
                value = json.loads(self.spec)
            except ValueError as err:
                raise InvalidRequest(self.field, f"is not JSON: {err}") from None
            if self.kind == "json_schema" and not isinstance(value, (dict, bool)):
                raise InvalidRequest(
                    self.field, f"a schema is an object or a boolean, got {type(value).__name__}"
                )
            if self.kind == "structural_tag" and not isinstance(value, dict):
                raise InvalidRequest(
                    self.field, f"a structural tag is an object, got {type(value).__name__}"
                )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    """0 disables (all tokens)."""
    top_p: float = 1.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    """Strings that end generation; they are not included in the output text."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated."""
    repetition_penalty: float = 1.0
    """Divides the positive logits (multiplies the negative ones) of every token in the prompt
    or generated; 1 is none."""
    logprobs: int | None = None
    """Log-probabilities of each generated token and of this many most likely tokens at its
    position, from the raw distribution; None: none."""
    structured: StructuredOutput | None = None
    """What the text must be; None: free text."""
    min_p: float = 0.0
    """After temperature, tokens less likely than `min_p` x the most likely one are dropped;
    0: none (vLLM's)."""
    min_tokens: int = 0
    """No end before this many tokens: end-of-sequence and `stop_token_ids` cannot be drawn,
    and no stop string ends the text, until the sample has generated them (vLLM's)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before penalties, ids increasing (OpenAI's;
    a bias of -100 or 100 bans or all but forces a token)."""
    allowed_token_ids: tuple[int, ...] = ()
    """Only these tokens may be drawn; (): any (vLLM's)."""
    include_stop_str_in_output: bool = False
    """A stop string that ends the text stays in it, and so does the text of a stop token
    (end-of-sequence, `stop_token_ids`) that ends it (vLLM's)."""
    skip_special_tokens: bool = True
    """The text leaves special tokens out (vLLM's; false writes them, as `<|im_end|>`)."""
    separate_reasoning: bool = False
    """A thinking model's text comes as reasoning and content (worker/reasoning.py; SGLang's);
    no effect on a model whose chat template has no `</think>`."""
    thinking_token_budget: int | None = None
    """A thinking model's reasoning is closed (`</think>` forced) once a sample has generated
    this many tokens inside it (vLLM's; worker/thinking_tokens.py); None: no budget. No effect
    on a model whose chat template has no `</think>`."""
    bad_words: tuple[str, ...] = ()
    """Words never written (vLLM's): each as tokens, alone and after a space, its last token
    banned wherever the generated tokens end with the rest (worker/bad_words.py)."""
    prompt_logprobs: int | None = None
    """Log-probabilities of each prompt token after the first under the tokens before it, and
    of this many most likely tokens at its position (vLLM's; what OpenAI's `echo` with
    `logprobs` reports). Every prompt position is computed for them, none read from the cache;
    None: none."""
    return_prompt_token_ids: bool = False
    """The prompt's token ids go out with the first token of the first sample
    (`RequestOutput.prompt_token_ids`; vLLM's `return_token_ids`)."""
    prediction: str = ""
    """The text the output is expected to repeat, mostly (OpenAI's predicted outputs): decoding
    verifies its tokens as drafts (worker/predicted_output.py); the output does not change.
    "": none."""

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    def validate(
        self, vocab_size: int, max_new_tokens: int, stop_limits: StopLimits = StopLimits()
    ) -> None:
        """Raise `InvalidRequest` naming the first field out of range."""
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= max_new_tokens:
            raise InvalidRequest(
                "max_tokens", f"must be in [1, {max_new_tokens}], got {self.max_tokens}"
            )
        if not 0 <= self.temperature < math.inf:  # also refuses NaN
            raise InvalidRequest("temperature", f"must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidRequest("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequest("seed", f"must be a non-negative int, got {self.seed}")
        if self.n > 1 and self.temperature == 0:
            raise InvalidRequest("n", "n > 1 needs temperature > 0 (greedy samples are identical)")
        self._validate_penalties()
        self._validate_logprobs()
        for token in self.stop_token_ids:
            if not 0 <= token < vocab_size:
                raise InvalidRequest("stop_token_ids", f"{token} is outside [0, {vocab_size})")
        self._validate_stop(stop_limits)
        if self.structured is not None:
            self.structured.validate()
        self._validate_shaping(vocab_size)
        self._validate_budget_and_prediction()

    def _validate_budget_and_prediction(self) -> None:
        if len(self.prediction) > MAX_PREDICTION_CHARS:
            raise InvalidRequest(
                "prediction",
                f"{len(self.prediction)} characters; at most {MAX_PREDICTION_CHARS} are allowed",
            )
        budget = self.thinking_token_budget
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget < 2**31
        ):
            raise InvalidRequest("thinking_token_budget", f"must be in [0, 2**31), got {budget}")

    def _validate_shaping(self, vocab_size: int) -> None:
        """min_p, min_tokens, logit_bias, allowed_token_ids and bad_words."""
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequest(
                "bad_words", f"{len(self.bad_words)} words; at most {MAX_BAD_WORDS} are allowed"
            )
        for i, word in enumerate(self.bad_words):
            if not word.strip() or len(word) > MAX_STOP_CHARS:
                raise InvalidRequest(
                    f"bad_words[{i}]", f"must hold text, at most {MAX_STOP_CHARS} characters"
                )
        if not 0 <= self.min_p <= 1:  # also refuses NaN
            raise InvalidRequest("min_p", f"must be in [0, 1] (0 disables), got {self.min_p}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(
                "min_tokens",
                f"must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}",
            )
        previous = -1
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab_size:
                raise InvalidRequest("logit_bias", f"token {token} is outside [0, {vocab_size})")
            if token <= previous:
                raise InvalidRequest("logit_bias", f"token {token} is given twice or out of order")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # also refuses NaN
                raise InvalidRequest(
                    f"logit_bias.{token}",
                    f"must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}",
                )
            previous = token
        for token in self.allowed_token_ids:
            if not 0 <= token < vocab_size:
                raise InvalidRequest("allowed_token_ids", f"{token} is outside [0, {vocab_size})")

    def held_tokens(self, end_token_ids: Iterable[int]) -> frozenset[int]:
        """The tokens `min_tokens` holds back: those that would end the sample (the model's
        end-of-sequence ids unless `ignore_eos`, and `stop_token_ids`)."""
        if not self.min_tokens:
            return frozenset()
        ends = frozenset(self.stop_token_ids)
        return ends if self.ignore_eos else ends | frozenset(end_token_ids)

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequest(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # also refuses NaN
                raise InvalidRequest(
                    name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}"
                )
        if not 0 < self.repetition_penalty <= MAX_PENALTY:
            raise InvalidRequest(
                "repetition_penalty",
                f"must be in (0, {MAX_PENALTY:g}] (1 is none), got {self.repetition_penalty}",
            )

    def _validate_stop(self, limits: StopLimits) -> None:
        if len(self.stop) > limits.max_strings:
            raise InvalidRequest(
                "stop", f"{len(self.stop)} stop strings; at most {limits.max_strings} are allowed"
            )
        for i, stop in enumerate(self.stop):
            if not stop:
                raise InvalidRequest(f"stop[{i}]", "stop strings must be non-empty")
            if len(stop) > limits.max_chars:
                raise InvalidRequest(
                    f"stop[{i}]",
                    f"{len(stop)} characters; a stop string has at most {limits.max_chars}",
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
