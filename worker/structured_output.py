"""Structured outputs: a request's constraint compiled to a grammar over the model's vocabulary
by xgrammar (what vLLM and SGLang use), and one matcher a sample that masks every draw to the
tokens that keep its text a prefix of one the grammar accepts. Once the text is complete the
grammar allows only an end-of-sequence token, and the sample ends with "stop".

Compiling runs in the submitting thread, never on the engine's (a large schema takes
milliseconds); xgrammar keeps what it compiled, so a schema many requests share compiles once.
xgrammar is imported, and the vocabulary's tables built (0.3 s for SmolLM2's 49,152 tokens), on
the first structured request: an engine that never serves one never loads it.

JSON is generated compact, on one line, with json.dumps's separators (`{"a": 1, "b": [2, 3]}`):
xgrammar's default lets any whitespace go between tokens, and a small model that starts a run of
newlines inside an object can fill max_tokens with them (decision 70).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from worker.errors import InvalidRequest
from worker.sampling_params import StructuredOutput

if TYPE_CHECKING:
    import xgrammar

    from worker.tokenizer import Tokenizer

GRAMMAR_CACHE_BYTES = 128 * 1024 * 1024
"""What the compiled grammars kept for the next request may hold (xgrammar's default keeps
every one: a worker serving a new schema per request would grow without end)."""
ANY_OBJECT = '{"type": "object"}'
"""OpenAI's `json_object`: any JSON object (a bare array or number is not one)."""
_LENGTH_BOUNDED_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"
"""xgrammar 0.2.9 writes the characters of a string with minLength or maxLength as
`_LENGTH_BOUNDED_CHAR`, which lets a raw control character (U+0000-U+001F but CR and LF) into
the string; JSON allows none unescaped (RFC 8259 section 7), and `json.loads` refuses them. Its
unbounded strings exclude them, as `_JSON_STRING_CHAR` does."""
_COMPILER_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
"""The time, C++ source location and failed check xgrammar puts before its messages."""


class GrammarRefused(RuntimeError):
    """A sampled token the sample's grammar does not allow: only a logits row with no finite
    value among the allowed tokens gets here."""


class GrammarCompiler:
    """Compiles the structured outputs of one engine's requests (thread-safe)."""

    def __init__(
        self, tokenizer: Tokenizer | None, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        """`vocab_size`: the model's logits width (may exceed the tokenizer's vocabulary);
        `stop_token_ids`: the ids that end a sample (the only ones a complete text allows)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None

    def compile(self, structured: StructuredOutput) -> xgrammar.CompiledGrammar:
        """The grammar of `structured`; `InvalidRequest` naming its field if it does not
        compile, or if this model cannot end one (no tokenizer, no end-of-sequence token)."""
        compiler = self._ready(structured.field)
        try:
            if structured.kind in ("json_schema", "json_object"):
                return compiler.compile_grammar(json_grammar(structured.spec or ANY_OBJECT))
            if structured.kind == "regex":
                return compiler.compile_regex(structured.spec)
            if structured.kind == "grammar":
                return compiler.compile_grammar(structured.spec)
            if structured.kind == "structural_tag":
                return compiler.compile_structural_tag(mend_structural_tag(structured.spec))
            return compiler.compile_grammar(choice_grammar(structured.choices))
        except RuntimeError as err:  # xgrammar's errors, whatever the kind
            raise InvalidRequest(structured.field, f"does not compile: {_message(err)}") from None

    def _ready(self, field: str) -> xgrammar.GrammarCompiler:
        if self.tokenizer is None:
            raise InvalidRequest(field, "this model has no tokenizer, so no text to constrain")
        if not self.stop_token_ids:
            raise InvalidRequest(
                field, "this model has no end-of-sequence token to end a structured output with"
            )
        with self._lock:
            if self._compiler is None:
                xgrammar = _xgrammar()
                # transformers' wrapper is xgrammar's public way to read a tokenizers vocabulary
                # and detect its byte encoding (byte-level, byte-fallback or raw); xgrammar has
                # imported transformers already
                from transformers import PreTrainedTokenizerFast  # noqa: PLC0415

                fast = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer.backend)
                info = xgrammar.TokenizerInfo.from_huggingface(
                    fast, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgrammar.GrammarCompiler(
                    info, cache_limit_bytes=GRAMMAR_CACHE_BYTES
                )
            return self._compiler


@functools.lru_cache(maxsize=256)
def json_grammar(schema: str) -> str:
    """The EBNF grammar of compact JSON that `schema` accepts (xgrammar's, with one mend).
    Kept for the next request that sends the same schema, as xgrammar keeps what it compiles
    from the grammar."""
    grammar = str(_xgrammar().Grammar.from_json_schema(schema, any_whitespace=False))
    return grammar.replace(_LENGTH_BOUNDED_CHAR, _JSON_STRING_CHAR)


def mend_structural_tag(spec: str) -> str:
    """`spec` with each JSON-schema part (style "json") written as the grammar `json_grammar`
    makes of it: xgrammar's own JSON parts in a structural tag let any run of whitespace in
    between tokens and raw control characters into strings, as its plain schemas do."""

    def mend(value: Any) -> Any:
        if isinstance(value, list):
            return [mend(item) for item in value]
        if not isinstance(value, dict):
            return value
        if (
            value.get("type") == "json_schema"
            and "json_schema" in value
            and value.get("style", "json") == "json"
        ):
            return {"type": "grammar", "grammar": json_grammar(json.dumps(value["json_schema"]))}
        return {key: mend(item) for key, item in value.items()}

    return json.dumps(mend(json.loads(spec)))


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose texts are exactly `choices` (JSON string escapes are EBNF's;
    non-ASCII characters stay as they are, as xgrammar reads no surrogate pairs)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _xgrammar() -> Any:
    import xgrammar  # noqa: PLC0415 - 1.6 s with transformers: loaded by the first structured request

    return xgrammar


def _message(err: Exception) -> str:
    return _COMPILER_NOISE.sub("", str(err).strip().splitlines()[0] if str(err).strip() else "")


class Constraint:
    """One sample's place in its grammar."""

    def __init__(self, grammar: xgrammar.CompiledGrammar) -> None:
        xgrammar = _xgrammar()
        self._apply = xgrammar.apply_token_bitmask_inplace
        self._matcher = xgrammar.GrammarMatcher(grammar)
        vocab_size = grammar.tokenizer_info.vocab_size
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor, owned: bool = False) -> torch.Tensor:
        """`logits` [vocab] with every token the grammar does not allow next at -inf: in place
        when the caller `owned` the row (a penalized copy), else in a copy (the raw row is
        shared by a request's samples and its logprobs)."""
        if not self._matcher.fill_next_token_bitmask(self._bitmask):
            return logits  # every token is allowed
        masked = (logits if owned else logits.clone()).view(1, -1)
        self._apply(masked, self._bitmask.to(masked.device))
        return masked.view(-1)

    def allows(self, tokens: Sequence[int]) -> bool:
        """Whether the grammar allows `tokens` next, in order (tried on a fork of the matcher,
        which stays where it is)."""
        trial = self._matcher.fork()
        return all(trial.accept_token(token) for token in tokens)

    def accept_text(self, text: str) -> bool:
        """Advance past `text` (the answer's start, written in a token that closed a
        reasoning) if the grammar allows it; False, and nowhere else, if not."""
        return self._matcher.accept_string(text)

    def accept(self, token: int) -> None:
        """Advance past `token`; `GrammarRefused` if the grammar does not allow it."""
        if not self._matcher.accept_token(token):
            raise GrammarRefused(f"token {token} does not continue the structured output")

    @property
    def complete(self) -> bool:
        """The grammar accepted an end-of-sequence token: the text is whole."""
        return bool(self._matcher.is_terminated())
