"""What makes a request servable, checked the same way wherever it is checked. Imports no torch.

The router checks a request before routing it (so a bad one costs no worker a thing) and the
worker checks it again on arrival; both call these functions with the same `RequestLimits`, so
they cannot disagree. Every refusal is an `InvalidRequest` naming the field. Text is measured
against `max_prompt_chars` before it is tokenised, and a text longer than
`HEAD_CHARS_PER_TOKEN` characters per token of context is tokenised in full only if its head
fits: a prompt too long to serve costs at most a context's worth of tokeniser time.

Images (a vision model's `RequestLimits.image_spec`; worker/images.py, worker/image_prompt.py):
`request_images` decodes and checks a request's image files, and `prompt_ids` places them, so
the ids it returns are expanded (every image position is in them and counts against the
context like any token):

    text      "... <image> ..."          each <image> expanded (`expand_text`), then encoded
    chat      content parts [{"type": "text", "text": ...}, {"type": "image"}]: the template
              writes <image> for an image part, then as text
    token ids one image token id per image (`expand_ids`), or already expanded (what the router
              forwards to a worker): kept as they are when their runs check out (`image_runs`)

A model without vision refuses any image, naming "images".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from worker.chat_continuation import continued
from worker.errors import ContextOverflow, InvalidRequest, PromptTooLarge
from worker.fill_in_middle import FIM_FORMS, FimTokens
from worker.image_prompt import (
    IMAGE_TOKEN,
    ImagePromptSpec,
    PromptImage,
    expand_ids,
    expand_text,
    image_runs,
)
from worker.images import CheckedImage, ImageLimits, check_images
from worker.request import GenerateRequest
from worker.sampling_params import MAX_N, StopLimits
from worker.tool_calls import plain_conversation, template_conversation

DEFAULT_MAX_PROMPT_CHARS = 1 << 20
HEAD_CHARS_PER_TOKEN = 16
"""Prose runs 3-5 characters a token: a text this long per token of context is tried by its head
first. (Only the cost depends on it: a text whose head fits is always tokenised whole.)"""
HEAD_SLACK_TOKENS = 16
"""Cutting a text may split its last word into more tokens than it has whole."""


SCHEDULING_POLICIES = ("fcfs", "priority")
"""How a worker orders its queue (worker/scheduler.py): first come, first served, or by each
request's priority."""


URGENT_ROOM = 2
"""Under the priority policy a request counts against a limit on what waits (the router's
max_in_flight, a worker's max_waiting + max_running) only the requests of its priority or a
more urgent one, so less urgent work never turns it away; all together may take this many
times the limit."""


def crowded(held: Iterable[tuple[int, int]], priority: int, limit: int, says: str) -> str | None:
    """Why a limit on what waits (the router's in-flight calls, a worker's queue) turns away a
    new request of `priority`, given the (priority, count) pairs it holds; None: it is taken.
    It counts only the requests of its priority or a more urgent one, so less urgent work never
    turns it away, and all together stay within URGENT_ROOM times the limit. Where every
    priority is 0 (fcfs) that is a plain count. `says`: how the caller states its limit, with
    a {} for the number."""
    taken = total = 0
    levels = priority != 0
    for theirs, count in held:
        total += count
        taken += count if theirs <= priority else 0
        levels = levels or theirs != 0
    if taken >= limit:
        urgent = f" at priority {priority} or more urgent" if levels else ""
        return f"{taken} requests in flight{urgent}; {says.format(limit)}"
    if total >= URGENT_ROOM * limit:
        every = says.format(f"{URGENT_ROOM} x {limit}")
        return f"{total} requests in flight of every priority; {every}"
    return None


class LimitSettings(Protocol):
    """The operator's request limits, as the engine's config and the cluster's engine section
    both spell them."""

    @property
    def max_stop_strings(self) -> int: ...

    @property
    def max_stop_chars(self) -> int: ...

    @property
    def max_prompt_chars(self) -> int: ...

    @property
    def scheduling_policy(self) -> str: ...


class PromptTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        **variables: Any,
    ) -> str: ...

    @property
    def renders_tools(self) -> bool: ...

    @property
    def fim_tokens(self) -> FimTokens | None: ...


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the model and the operator allow one request."""

    vocab_size: int
    max_model_len: int
    stop: StopLimits = field(default_factory=StopLimits)
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    """Characters of a text prompt, or of all a chat's message contents together."""
    image_spec: ImagePromptSpec | None = None
    """Where the model's images go in a prompt; None: a text model, every image is refused."""
    images: ImageLimits = field(default_factory=ImageLimits)
    """What the operator allows of one request's images."""
    end_token_ids: frozenset[int] = frozenset()
    """The model's end-of-sequence ids, where known (the worker's): `min_tokens` holds them
    back."""
    priorities: bool = False
    """Whether a request may carry a priority other than 0 (the "priority" scheduling
    policy)."""
    hidden_size: int = 0
    """The model's hidden size, an embedding's length (0: not known, as on a router with a
    worker older than embeddings, which then refuses them: `validate_embedding`)."""
    cache_salts: bool = True
    """Whether a request may carry a cache salt (False: on a router with a worker older than
    salts, which would serve it from the unsalted cache)."""

    @classmethod
    def of(
        cls,
        vocab_size: int,
        max_model_len: int,
        settings: LimitSettings,
        image_spec: ImagePromptSpec | None = None,
        images: ImageLimits | None = None,
        end_token_ids: Iterable[int] = (),
        hidden_size: int = 0,
        cache_salts: bool = True,
    ) -> RequestLimits:
        """The model's limits with the operator's: what the router and every worker check."""
        stop = StopLimits(settings.max_stop_strings, settings.max_stop_chars)
        return cls(
            vocab_size,
            max_model_len,
            stop,
            settings.max_prompt_chars,
            image_spec,
            images if images is not None else ImageLimits(),
            frozenset(end_token_ids),
            settings.scheduling_policy == "priority",
            hidden_size,
            cache_salts,
        )


def request_images(request: GenerateRequest, limits: RequestLimits) -> list[CheckedImage]:
    """The request's images, decoded and checked (`images[i]` names a bad one); [] for none.
    A model without vision refuses any."""
    if not request.images:
        return []
    if limits.image_spec is None:
        raise InvalidRequest("images", "this model has no vision encoder; send text only")
    return check_images(request.images, "images", limits.images)


def prompt_images(images: Sequence[CheckedImage]) -> list[PromptImage]:
    """What placing checked images in a prompt needs of them: identity and size."""
    return [PromptImage(i.content_hash, i.width, i.height) for i in images]


def prompt_ids(
    request: GenerateRequest,
    tokenizer: PromptTokenizer | None,
    limits: RequestLimits,
    images: Sequence[CheckedImage] | None = None,
) -> list[int]:
    """The prompt's token ids, from ids as given, text (encoded) or chat (template, encoded),
    with every image expanded into its positions. `images`: the request's images as
    `request_images` returned them (None: checked here)."""
    if images is None:
        images = request_images(request, limits)
    placed = prompt_images(images)
    if request.suffix is not None:
        ids = _filled_in(request, tokenizer, limits, placed)
    else:
        ids = _prompt_ids(request, tokenizer, limits, placed)
    spec = limits.image_spec
    if spec is not None:  # every image token is one of the images' runs, and every run is there
        image_runs(ids[: len(ids) - request.generated_before], placed, spec)
    return ids


def _prompt_ids(
    request: GenerateRequest,
    tokenizer: PromptTokenizer | None,
    limits: RequestLimits,
    images: list[PromptImage],
) -> list[int]:
    given = _given(request)
    spec = limits.image_spec
    if request.prompt_token_ids is not None:
        return _given_ids(request, tokenizer, images, spec)
    if tokenizer is None:
        raise InvalidRequest(given[0], "this model has no tokenizer; send token ids")
    if request.prompt is not None:
        _check_chars("prompt", len(request.prompt), limits)
        text = request.prompt
        if spec is not None:
            text = expand_text(text, images, spec)
        return _encode("prompt", text, tokenizer, limits)
    assert request.messages is not None
    if request.continue_final_message:
        _check_continuable(request.messages[-1])
    conversation, tools = _tool_turns(request, tokenizer)
    messages = _chat(conversation, len(images), limits, vision=spec is not None)
    variables = dict(request.template_variables or {})
    if request.continue_final_message or not request.add_generation_prompt:
        variables["add_generation_prompt"] = False

    def render(conversation: list[dict[str, Any]]) -> str:
        try:
            if tools or variables:
                return tokenizer.apply_chat_template(conversation, tools=tools, **variables)
            return tokenizer.apply_chat_template(conversation)
        except ValueError as err:  # no template, or the template refused the conversation
            raise InvalidRequest("messages", str(err)) from err

    text = continued(render, messages) if request.continue_final_message else render(messages)
    if spec is not None:
        text = expand_text(text, images, spec)
    return _encode("messages", text, tokenizer, limits, add_special_tokens=False)


def _given(request: GenerateRequest) -> list[str]:
    """Which of the prompt's fields the request sets: exactly one, or refused."""
    given = [
        name
        for name in ("prompt_token_ids", "prompt", "messages")
        if getattr(request, name) is not None
    ]
    if len(given) != 1:
        raise InvalidRequest(
            "prompt", f"give exactly one of token ids, text or messages; got {given}"
        )
    return given


def _filled_in(
    request: GenerateRequest,
    tokenizer: PromptTokenizer | None,
    limits: RequestLimits,
    images: list[PromptImage],
) -> list[int]:
    """A text or token-id prompt and its suffix in the model's fill-in-the-middle form
    (worker/fill_in_middle.py): the middle is what the model writes."""
    assert request.suffix is not None
    _given(request)
    if request.messages is not None:
        raise InvalidRequest("suffix", "is for a text or token-id prompt, not messages")
    if images:
        raise InvalidRequest("suffix", "is for a prompt without images")
    if tokenizer is None:
        raise InvalidRequest("suffix", "this model has no tokenizer to write it with")
    form = tokenizer.fim_tokens
    if form is None:
        raise InvalidRequest(
            "suffix",
            "this model has no fill-in-the-middle tokens (none of "
            + ", ".join(f.prefix for f in FIM_FORMS)
            + " and their pairs); leave suffix out",
        )
    chars = len(request.suffix) + len(request.prompt or "")
    if chars > limits.max_prompt_chars:
        raise PromptTooLarge(
            "suffix",
            f"the prompt and the suffix are {chars} characters together; the limit is "
            f"{limits.max_prompt_chars} (max_prompt_chars)",
        )
    if request.prompt is None:
        assert request.prompt_token_ids is not None
        return form.ids(request.prompt_token_ids, request.suffix, tokenizer.encode)
    return _encode("prompt", form.text(request.prompt, request.suffix), tokenizer, limits)


def with_fim_ends(request: GenerateRequest, tokenizer: PromptTokenizer | None) -> GenerateRequest:
    """A request with a suffix also stops at the tokens that end a middle (the model's form's
    `ends`); any other request as it is."""
    form = None if tokenizer is None or request.suffix is None else tokenizer.fim_tokens
    if form is None:
        return request
    stops = tuple(dict.fromkeys((*request.sampling.stop_token_ids, *form.ends)))
    return replace(request, sampling=replace(request.sampling, stop_token_ids=stops))


def _check_continuable(last: Any) -> None:
    """A continued message is text: tool calls (written after it by templates that render
    them, so a cut after the text would drop them) and tool results are refused by name."""
    if isinstance(last, dict) and (last.get("tool_calls") or last.get("role") == "tool"):
        raise InvalidRequest(
            "continue_final_message",
            "the last message holds tool calls or a tool's result; only text is continued",
        )


TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "raise_exception",
        "strftime_now",
    }
)
"""What a chat template is given by the renderer itself: no request may set these."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def template_variables(text: str) -> dict[str, Any] | None:
    """A request's `chat_template_kwargs` (JSON text; "" none), checked: an object of
    identifiers other than the template's own names (`TEMPLATE_NAMES`)."""
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError as err:
        raise InvalidRequest("chat_template_kwargs", f"is not JSON: {err}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("chat_template_kwargs", "is a JSON object of the variables")
    for name in value:
        if not _NAME.fullmatch(name):
            raise InvalidRequest(
                "chat_template_kwargs", f"{name[:80]!r} is not a template variable's name"
            )
        if name in TEMPLATE_NAMES:
            raise InvalidRequest(
                f"chat_template_kwargs.{name}", "is the renderer's to give the template"
            )
    return value


def _tool_turns(
    request: GenerateRequest, tokenizer: PromptTokenizer
) -> tuple[Sequence[dict[str, Any]], list[dict[str, Any]] | None]:
    """The conversation and the tools as the chat template takes them: as transformers passes
    them to a template that renders tools, else written into the turns (worker/tool_calls.py)."""
    assert request.messages is not None
    turns = any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
        for m in request.messages
    )
    if not request.tools and not turns:
        return request.messages, None
    if tokenizer.renders_tools:
        tools = [tool.as_openai() for tool in request.tools] or None
        return template_conversation(request.messages), tools
    return plain_conversation(request.messages, request.tools), None


def _given_ids(
    request: GenerateRequest,
    tokenizer: PromptTokenizer | None,
    images: list[PromptImage],
    spec: ImagePromptSpec | None,
) -> list[int]:
    """Token ids as given; with images, each image's one image token expanded, unless the ids
    are expanded already (their runs check out: what the router forwards)."""
    assert request.prompt_token_ids is not None
    ids = list(request.prompt_token_ids)
    if spec is None or not images:
        return ids
    original = ids[: len(ids) - request.generated_before]
    try:
        image_runs(original, images, spec)
        return ids
    except InvalidRequest:
        if sum(t == spec.image_token_id for t in original) != len(images):
            raise
    if tokenizer is None or request.resume is not None:
        raise InvalidRequest(
            "prompt_token_ids",
            "one image token per image needs the tokenizer to expand it; send expanded ids",
        )
    return expand_ids(ids, images, spec, lambda t: tokenizer.encode(t, add_special_tokens=False))


def _chat(
    messages: Sequence[Any], images: int, limits: RequestLimits, vision: bool
) -> list[dict[str, Any]]:
    """The messages checked, for the template: a content of parts stays parts for a vision
    model (its template renders them; a text content becomes one text part) and becomes its
    text for a text model. The image parts must match the images, one for one."""
    if not messages:
        raise InvalidRequest("messages", "is empty; send at least one message")
    chars = image_parts = 0
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not message.get("role"):
            raise InvalidRequest(f"messages[{i}]", "needs a role and a text content")
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
            parts = [{"type": "text", "text": content}]
        elif isinstance(content, list | tuple):
            parts = [
                _part(part, f"messages[{i}].content[{j}]", vision) for j, part in enumerate(content)
            ]
            chars += sum(len(p["text"]) for p in parts if p["type"] == "text")
            image_parts += sum(p["type"] == "image" for p in parts)
        else:
            raise InvalidRequest(f"messages[{i}]", "needs a role and a text content")
        for written in ("reasoning_content", "name"):  # what templates may write into a turn
            value = message.get(written)
            chars += len(value) if isinstance(value, str) else 0
        if vision:
            out.append({**message, "content": parts})
        elif isinstance(content, str):
            out.append(dict(message))
        else:
            out.append({**message, "content": "".join(p["text"] for p in parts)})
    _check_chars("messages", chars, limits)
    if image_parts != images:
        raise InvalidRequest(
            "images", f"the messages have {image_parts} image parts for {images} images"
        )
    return out


def _part(part: Any, field: str, vision: bool) -> dict[str, Any]:
    """One content part: {"type": "text", "text": str} or {"type": "image"}."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        if vision and IMAGE_TOKEN in part["text"]:
            raise InvalidRequest(
                field, f"a text part holds {IMAGE_TOKEN}; send images as image parts"
            )
        return {"type": "text", "text": part["text"]}
    if kind == "image":
        if not vision:
            raise InvalidRequest(field, "an image part, and this model has no vision encoder")
        return {"type": "image"}
    raise InvalidRequest(field, 'expected {"type": "text", "text": ...} or {"type": "image"}')


CONTEXT_IS = "This model's maximum context length is {} tokens."
"""How a prompt over the context is refused: OpenAI's and vLLM's words, which clients and agent
frameworks match to trim a conversation (besides the error's code: worker/errors.py)."""
SHORTEN = "Please reduce the length of the prompt."


def _encode(
    name: str,
    text: str,
    tokenizer: PromptTokenizer,
    limits: RequestLimits,
    add_special_tokens: bool = True,
) -> list[int]:
    """The text's ids; refused by its head alone when that already overflows the context."""
    head = HEAD_CHARS_PER_TOKEN * limits.max_model_len
    if len(text) > head:
        probe = getattr(tokenizer, "probe", tokenizer)  # the router's text index: not through it
        tokens = len(probe.encode(text[:head], add_special_tokens=add_special_tokens))
        if tokens > limits.max_model_len + HEAD_SLACK_TOKENS:
            raise ContextOverflow(
                name,
                f"{CONTEXT_IS.format(limits.max_model_len)} However, its {len(text)} characters "
                f"are more: the first {head} alone are {tokens} tokens. {SHORTEN}",
                f"prompt is too long: {tokens} tokens > {limits.max_model_len - 1} maximum",
            )
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _check_chars(name: str, chars: int, limits: RequestLimits) -> None:
    if chars > limits.max_prompt_chars:
        raise PromptTooLarge(
            name,
            f"{chars} characters; the limit is {limits.max_prompt_chars} (max_prompt_chars)",
        )


def check_priority(priority: int, limits: RequestLimits) -> None:
    """A priority other than 0 needs the priority scheduling policy."""
    if priority and not limits.priorities:
        raise InvalidRequest(
            "priority",
            f"{priority}: priority scheduling is off (engine.scheduling_policy is fcfs); send "
            "0, or serve with scheduling_policy: priority",
        )


def validate(request: GenerateRequest, prompt: Sequence[int], limits: RequestLimits) -> None:
    """The prompt and the sampling parameters fit the model. For a resumed sample the prompt
    ends with tokens already generated: they count against max_tokens, not the prompt."""
    if not prompt:
        raise InvalidRequest("prompt", "is empty")
    check_priority(request.priority, limits)
    if request.pooling is not None:
        validate_embedding(request, prompt, limits)
        return
    generated = _check_resume(request, len(prompt))
    original = len(prompt) - generated
    if original >= limits.max_model_len:  # before the scan below: a huge prompt costs no loop
        raise ContextOverflow(
            "prompt",
            f"{CONTEXT_IS.format(limits.max_model_len)} However, the prompt is {original} "
            f"tokens, which leave no room to generate. {SHORTEN}",
            f"prompt is too long: {original} tokens > {limits.max_model_len - 1} maximum",
        )
    _check_vocabulary(prompt, limits.vocab_size)
    vocab_size = limits.vocab_size
    max_tokens = request.sampling.max_tokens
    if isinstance(max_tokens, int) and max_tokens > limits.max_model_len - original:
        raise ContextOverflow(
            "max_tokens",
            f"{CONTEXT_IS.format(limits.max_model_len)} However, you requested "
            f"{original + max_tokens} tokens ({original} in the prompt, {max_tokens} in the "
            f"completion). Please reduce the length of the prompt or max_tokens.",
            f"input length and `max_tokens` exceed context limit: {original} + {max_tokens} > "
            f"{limits.max_model_len}, decrease input length or `max_tokens` and try again",
        )
    sampling = request.sampling
    sampling.validate(vocab_size, limits.max_model_len - original, limits.stop)
    if sampling.prompt_logprobs is not None and request.images:
        raise InvalidRequest("prompt_logprobs", "not served for a prompt with images")
    held = sampling.held_tokens(limits.end_token_ids)
    if sampling.allowed_token_ids and held.issuperset(sampling.allowed_token_ids):
        raise InvalidRequest(
            "allowed_token_ids",
            f"every allowed token ends the sample, and min_tokens {sampling.min_tokens} "
            "holds them back: nothing could be drawn",
        )


def validate_embedding(
    request: GenerateRequest, prompt: Sequence[int], limits: RequestLimits
) -> None:
    """An embedding request's prompt fits the context (all of it: nothing is generated), and
    it asks for nothing of generation's but one sample."""
    assert request.pooling is not None
    if not limits.hidden_size:  # the router's, when a worker predates embeddings
        raise InvalidRequest(
            "pooling", "a worker of this cluster does not serve embeddings (an older version)"
        )
    if len(prompt) > limits.max_model_len:
        raise ContextOverflow(
            "input",
            f"{CONTEXT_IS.format(limits.max_model_len)} However, you requested "
            f"{len(prompt)} tokens in the input for embedding generation. Please reduce the "
            "length of the input.",
            f"input is too long: {len(prompt)} tokens > {limits.max_model_len} maximum",
        )
    _check_vocabulary(prompt, limits.vocab_size)
    sampling = request.sampling
    if request.resume is not None:
        raise InvalidRequest("resume", "an embedding request generates nothing to resume")
    if sampling.n != 1:
        raise InvalidRequest("n", f"an embedding request has one output, not {sampling.n}")
    asked = {
        "logprobs": sampling.logprobs is not None,
        "prompt_logprobs": sampling.prompt_logprobs is not None,
        "structured": sampling.structured is not None,
        "tools": bool(request.tools),
    }
    for name, given in asked.items():
        if given:
            raise InvalidRequest(name, "is for generating text, not for an embedding request")
    dimensions, hidden = request.pooling.dimensions, limits.hidden_size
    if dimensions is not None and dimensions < 1:
        raise InvalidRequest("dimensions", f"{dimensions}: an embedding keeps at least 1 value")
    if dimensions is not None and hidden and dimensions > hidden:
        raise InvalidRequest(
            "dimensions", f"{dimensions}: this model's embeddings have {hidden} values"
        )


def _check_vocabulary(prompt: Sequence[int], vocab_size: int) -> None:
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            "prompt_token_ids", f"token {bad} is outside the vocabulary [0, {vocab_size})"
        )


def _check_resume(request: GenerateRequest, prompt_len: int) -> int:
    """How many of the prompt's tokens were generated before (0 unless resumed)."""
    resume = request.resume
    if resume is None:
        return 0
    if request.sampling.n != 1:
        raise InvalidRequest("sampling.n", "a resumed sample is resumed alone: n must be 1")
    if not 0 <= resume.sample_index < MAX_N:
        raise InvalidRequest("resume.sample_index", f"must be in [0, {MAX_N})")
    if not 0 <= resume.generated < prompt_len:
        raise InvalidRequest(
            "resume.generated", f"{resume.generated} of a {prompt_len}-token sequence"
        )
    if resume.generated >= request.sampling.max_tokens:
        raise InvalidRequest(
            "resume.generated",
            f"{resume.generated} tokens already reach max_tokens {request.sampling.max_tokens}",
        )
    return resume.generated
