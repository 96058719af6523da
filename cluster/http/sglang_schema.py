"""SGLang's native `POST /generate` request, field for field (its `GenerateReqInput` and
`SamplingParams`), and how it reads as a text completion (cluster/http/sglang_generate.py).

A field left null takes SGLang's default, as in SGLang. What SGLang takes and radixmesh does
not serve is refused by name unless it asks for nothing (`REFUSED`): video, audio, hidden states,
custom logit processors, sessions, disaggregation; also an unknown field, per-prompt lists of
the logprob fields, and `spaces_between_special_tokens: false`. A batch may give
`sampling_params` as one list entry per prompt (`per_prompt`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import ValidationError

from cluster.http.errors import HttpError, Renames, renames
from cluster.http.openai_params import refuse_unsupported
from cluster.http.openai_schema import Body, CompletionRequest, Strict, lone_surrogate
from cluster.http.several_prompts import check_count

DEFAULT_MAX_NEW_TOKENS = 128
"""SGLang's default `max_new_tokens`."""


class SglangSampling(Strict):
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    """-1 (SGLang's default): no top-k."""
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: Literal[True] | None = None
    no_stop_trim: bool | None = None
    """The stop string stays in the text (vLLM's `include_stop_str_in_output`)."""
    n: int | None = None
    json_schema: str | None = None
    """A JSON Schema, as JSON text."""
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None


class GenerateRequest(Body):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SglangSampling | list[SglangSampling] | None = None
    """One for every prompt, or, in a batch, a list of one per prompt."""
    rid: str | list[str] | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    """With `return_logprob`: the prompt's logprobs from this position on (-1, the default:
    none)."""
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    stream: bool | None = None
    lora_path: str | None = None
    """A loaded LoRA adapter's name (radixmesh's adapters are named, as vLLM's)."""
    priority: int | None = None
    image_data: str | list[str | list[str | None] | None] | None = None
    """A vision model's images, placed at the prompt's `<image>` placeholders (or its image
    token ids): data URLs or bare base64; for a batch, one entry per prompt, or one image for
    every prompt; null for none. The server fetches nothing (no URL, no file path)."""
    video_data: Any = None
    audio_data: Any = None
    return_hidden_states: Any = None
    custom_logit_processor: Any = None
    session_params: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    data_parallel_rank: Any = None
    log_metrics: bool | None = None
    """SGLang's switch for its request metrics: false leaves the request out of the router's
    calls by status, latencies and tenant usage (RouterService.generate's `metered`)."""

    @property
    def start(self) -> int:
        """Where the prompt's logprobs begin (-1: none asked for)."""
        if not self.return_logprob or self.logprob_start_len is None:
            return -1
        return self.logprob_start_len

    @property
    def top(self) -> int:
        return self.top_logprobs_num or 0

    @property
    def several(self) -> bool:
        """Whether `text` or `input_ids` is a list of prompts (a batch)."""
        ids = self.input_ids
        return isinstance(self.text, list) or (bool(ids) and isinstance(ids[0], list))  # type: ignore[index]

    @property
    def listed(self) -> bool:
        """Whether the answer is a list: several prompts, or several samples of one."""
        given = self.sampling_params
        first = given[0] if isinstance(given, list) and given else given
        n = first.n if isinstance(first, SglangSampling) else None
        return self.several or (n or 1) > 1


class AbortRequest(Body):
    """SGLang's `POST /abort_request` (`abort_all` wins over `rid`, as there)."""

    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None
    """SGLang's text for the aborted requests' finish reason: radixmesh writes its own."""


REFUSED: dict[str, tuple[str, tuple[object, ...]]] = {
    # field: (why it is refused, the values that ask for nothing and are accepted)
    "video_data": ("video is not served", ()),
    "audio_data": ("audio is not served", ()),
    "return_hidden_states": ("hidden states are not returned", (False,)),
    "custom_logit_processor": ("custom logit processors are not run", ()),
    "session_params": ("sessions are not kept (every prefix is cached anyway)", ()),
    "bootstrap_host": ("prefill-decode disaggregation is not served", ()),
    "bootstrap_port": ("prefill-decode disaggregation is not served", ()),
    "bootstrap_room": ("prefill-decode disaggregation is not served", ()),
    "data_parallel_rank": ("the router chooses the worker", ()),
}
"""SGLang's fields radixmesh does not serve."""

NAMES = {
    "prompt": "text",
    "prompt_token_ids": "input_ids",
    "max_tokens": "sampling_params.max_new_tokens",
    "min_tokens": "sampling_params.min_new_tokens",
    "seed": "sampling_params.sampling_seed",
    "include_stop_str_in_output": "sampling_params.no_stop_trim",
    "logprobs": "top_logprobs_num",
    "prompt_logprobs": "logprob_start_len",
    "request_id": "rid",
    "images": "image_data",
    "model": "lora_path",
    "sampling.structured.json_schema": "sampling_params.json_schema",
    "sampling.structured.regex": "sampling_params.regex",
    "sampling.structured.grammar": "sampling_params.ebnf",
    "sampling.structured.structural_tag": "sampling_params.structural_tag",
    "structured_outputs": "sampling_params.json_schema",
}
"""A refused field as the serving core or the completions API names it -> as SGLang's."""
SAMPLING = frozenset(SglangSampling.model_fields)


def sglang_names(body: GenerateRequest) -> Renames:
    """The request's names of the fields the serving core may refuse."""
    prompt = "text" if body.text is not None else "input_ids"
    named = renames(
        {**NAMES, "prompt": prompt},
        [
            (r"prompt\[(\d+)\]", prompt + r"[\1]"),
            (r"(stop|stop_token_ids|logit_bias)([.\[].*)", r"sampling_params.\1\2"),
        ],
    )

    def rename(param: str) -> str | None:
        if param in SAMPLING:  # the core's name of a field SGLang spells alike
            return f"sampling_params.{param}"
        return named(param)

    return rename


def per_prompt(body: GenerateRequest) -> list[GenerateRequest]:
    """A batch whose `sampling_params` is a list, as one request a prompt with its own (each
    prompt's entry of `text` or `input_ids`, its `rid` and its `image_data` taken by the
    route from the batch); else the request itself."""
    given = body.sampling_params
    if not isinstance(given, list):
        return [body]
    prompts = body.text if body.text is not None else body.input_ids
    field = "text" if body.text is not None else "input_ids"
    if isinstance(prompts, list):  # as for one request of them all
        check_count(len(prompts), field)
    if not body.several or not isinstance(prompts, list):
        raise HttpError.invalid("sampling_params", "a list is one entry per prompt of a batch")
    if len(given) != len(prompts):
        raise HttpError.invalid(
            "sampling_params", f"{len(given)} entries for {len(prompts)} prompts: give one each"
        )
    ns = [each.n or 1 for each in given]
    if len(set(ns)) > 1:
        p = next(p for p, n in enumerate(ns) if n != ns[0])
        raise HttpError.invalid(
            f"sampling_params[{p}].n", f"{ns[p]}: every prompt takes the same n ({ns[0]})"
        )
    return [
        body.model_copy(update={field: prompt, "sampling_params": each, "image_data": None})
        for prompt, each in zip(prompts, given, strict=True)
    ]


def at_prompt(names: Renames, p: int) -> Renames:
    """The names of a batch's prompt p's fields, read alone (`per_prompt`): its entry of the
    prompts, and its `sampling_params`."""

    def rename(param: str) -> str | None:
        named = names(param) or param
        for head in ("text", "input_ids", "sampling_params"):
            if named == head or named.startswith((f"{head}.", f"{head}[")):
                return f"{head}[{p}]{named.removeprefix(head)}"
        return named

    return rename


def as_completion(body: GenerateRequest, model: str) -> CompletionRequest:
    """The same request as a text completion (vLLM's fields where OpenAI has none)."""
    refuse_unsupported(body, REFUSED)
    if (body.text is None) == (body.input_ids is None):
        raise HttpError.invalid("text", "give exactly one of text or input_ids")
    start = body.start
    if start < -1:
        raise HttpError.invalid("logprob_start_len", f"must be >= -1, got {start}")
    if start >= 0 and body.input_ids and not body.several and start >= len(body.input_ids):
        raise HttpError.invalid(
            "logprob_start_len", f"{start} is past the prompt's {len(body.input_ids)} tokens"
        )
    s = body.sampling_params or SglangSampling()
    assert isinstance(s, SglangSampling), "a list is read prompt by prompt (per_prompt)"
    logprobs = body.top if body.return_logprob else None
    fields: dict[str, Any] = {
        "model": model,
        "prompt": body.text if body.text is not None else body.input_ids,
        "max_tokens": s.max_new_tokens,  # absent: the route's fill_cap
        "min_tokens": s.min_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "frequency_penalty": s.frequency_penalty,
        "presence_penalty": s.presence_penalty,
        "repetition_penalty": s.repetition_penalty,
        "stop": s.stop,
        "stop_token_ids": None if s.ignore_eos else s.stop_token_ids,  # SGLang skips both
        "ignore_eos": s.ignore_eos,
        "skip_special_tokens": s.skip_special_tokens,
        "include_stop_str_in_output": s.no_stop_trim,
        "n": s.n,
        "seed": s.sampling_seed,
        "logit_bias": s.logit_bias,
        "priority": body.priority,
        "logprobs": logprobs,
        "prompt_logprobs": body.top if start >= 0 else None,
        "stream": body.stream,
        "structured_outputs": _structured(s),
    }
    try:
        return CompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as err:  # SGLang's fields are typed as the completions API's
        raise HttpError.invalid("sampling_params", str(err.errors()[0]["msg"])) from None


def _structured(s: SglangSampling) -> dict[str, Any] | None:
    """vLLM's `structured_outputs` for SGLang's constraint fields (at most one)."""
    asked = {
        name: value
        for name, value in (
            ("json_schema", s.json_schema),
            ("regex", s.regex),
            ("ebnf", s.ebnf),
            ("structural_tag", s.structural_tag),
        )
        if value is not None
    }
    if len(asked) > 1:
        raise HttpError.invalid(
            "sampling_params." + sorted(asked)[1], f"give one constraint, not {sorted(asked)}"
        )
    if not asked:
        return None
    ((name, value),) = asked.items()
    if name == "json_schema":
        try:
            schema = json.loads(value)
        except (ValueError, RecursionError) as err:
            raise HttpError.invalid("sampling_params.json_schema", f"is not JSON: {err}") from None
        if lone_surrogate(schema) is not None:
            raise HttpError.invalid("sampling_params.json_schema", "holds a lone UTF-16 surrogate")
        if not isinstance(schema, dict | bool):
            kind = type(schema).__name__
            raise HttpError.invalid(
                "sampling_params.json_schema", f"is a JSON {kind}, not a schema"
            )
        return {"json": schema}
    return {{"regex": "regex", "ebnf": "grammar"}.get(name, name): value}
