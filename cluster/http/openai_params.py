"""OpenAI requests -> the router's GenerateRequest: every parameter mapped or refused by name.

Ranges are checked once, by the serving core with the workers' own functions
(worker/sampling_params.py); this module maps names and shapes, and refuses what has no
meaning here: parameters radixmesh does not implement (`REFUSED`), content that is neither
text nor an image, roles a text model's chat template does not take. Image parts
(`image_url` with a data URL: cluster/http/image_parts.py) go to GenerateRequest.images, each
placed by a ChatPart where it was, and named by its part when refused
("messages[0].content[1].image_url").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from cluster.http.embeddings_schema import EmbeddingRequest
from cluster.http.errors import HttpError, Renames, renames
from cluster.http.image_parts import openai_image
from cluster.http.legacy_functions import LEGACY_FIELDS, legacy
from cluster.http.openai_schema import (
    CHAT_REFUSED,
    REFUSED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationParams,
    NamedToolChoice,
    Prediction,
    ResponseFormat,
    StructuredOutputs,
    ToolParam,
)
from cluster.http.several_prompts import Prompt, check_count, prompts_of
from cluster.images import name_problem
from cluster.requests import MAX_SALT_CHARS, suffixed
from protos.radixmesh.v1 import serving_pb2

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
"""OpenAI's roles -> the chat template's ("developer" is OpenAI's newer name for "system")."""
MAX_TOP_LOGPROBS = 20
TEXT_MATCH = {
    None: serving_pb2.TEXT_MATCH_DEFAULT,
    "exact": serving_pb2.TEXT_MATCH_EXACT,
    "anchored": serving_pb2.TEXT_MATCH_ANCHORED,
    "off": serving_pb2.TEXT_MATCH_OFF,
}
"""The `text_match` body field (an extension, like vLLM's extra sampling fields)."""
TEXT_KEYS = {"type", "text"}
_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (0, 2**63 - 1)
_SEED = (-(2**63), 2**63 - 1)


def refuse_unsupported(
    request: BaseModel, refused: Mapping[str, tuple[str, tuple[object, ...]]] = REFUSED
) -> None:
    """400 naming the first parameter radixmesh does not implement, unless it asks for nothing
    (`refused`: the API's table of them, name -> (why, the values accepted))."""
    for name in type(request).model_fields.keys() & refused.keys():
        value = getattr(request, name)
        why, accepted = refused[name]
        if value is not None and value not in accepted:
            raise HttpError.invalid(name, f"{why} (radixmesh refuses it rather than ignore it)")


def chat_request(
    request: ChatCompletionRequest, request_id: str, tenant: str
) -> tuple[serving_pb2.GenerateRequest, list[str]]:
    """The request, and what its images are called in refusals."""
    refuse_unsupported(request, CHAT_REFUSED)
    if request.top_logprobs is not None and not request.logprobs:
        raise HttpError.invalid("top_logprobs", "needs logprobs: true")
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise HttpError.invalid(
            "top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}"
        )
    both = request.max_tokens is not None and request.max_completion_tokens is not None
    if both and request.max_tokens != request.max_completion_tokens:
        raise HttpError.invalid(
            "max_completion_tokens", "differs from max_tokens; give one of them"
        )
    max_tokens = request.max_completion_tokens  # 0 is refused by name, not taken for unset
    if max_tokens is None:
        max_tokens = request.max_tokens
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    chat = chat_prompt(request.messages)
    message = serving_pb2.GenerateRequest(
        request_id=request_id,
        chat=serving_pb2.ChatMessages(messages=chat.messages),
        sampling=sampling(request, max_tokens, logprobs),
        images=chat.images,
    )
    message.sampling.separate_reasoning = request.separate_reasoning
    if request.prediction is not None:
        message.sampling.prediction = prediction_text(request.prediction)
    message.namespace.tenant = tenant
    set_cache_salt(message, request.cache_salt)
    set_truncation(message, request.truncate_prompt_tokens)
    message.text_match = TEXT_MATCH[request.text_match]
    set_priority(message, request.priority)
    _tools(request, message)
    variables = effort_variables(request.reasoning_effort) | (request.chat_template_kwargs or {})
    if variables or request.chat_template_kwargs is not None:
        message.chat_template_kwargs = json.dumps(variables)
    message.continue_final_message = request.continue_final_message
    if request.add_generation_prompt is not None:
        message.add_generation_prompt = request.add_generation_prompt
    return message, chat.image_fields


def prediction_text(prediction: Prediction) -> str:
    """A predicted output's text: its content, or its text parts joined."""
    if isinstance(prediction.content, str):
        return prediction.content
    texts = []
    for i, part in enumerate(prediction.content):
        text = part.get("text")
        if part.get("type") != "text" or not isinstance(text, str) or len(part) != 2:
            raise HttpError.invalid(
                f"prediction.content[{i}]",
                'a prediction\'s parts are text parts, {"type": "text", "text": "..."}',
            )
        texts.append(text)
    return "".join(texts)


def effort_variables(effort: str | None) -> dict[str, Any]:
    """The chat template's variables for a reasoning effort (the request's own
    chat_template_kwargs override them): `reasoning_effort` as vLLM gives it, and
    `enable_thinking: false` for "none", which Qwen3's template reads."""
    if effort is None:
        return {}
    return {"reasoning_effort": effort} | ({"enable_thinking": False} if effort == "none" else {})


def callable_tools(request: ChatCompletionRequest) -> frozenset[str]:
    """The names of the functions whose calls are read out of the answer's text (none with
    tool_choice "none")."""
    if request.tool_choice == "none" or not request.tools:
        return frozenset()
    return frozenset(tool.function.name for tool in request.tools)


def wire_tools(tools: list[ToolParam] | None) -> list[serving_pb2.Tool]:
    return [
        wire_tool(tool.function.name, tool.function.description, tool.function.parameters)
        for tool in tools or []
    ]


def wire_tool(
    name: str, description: str | None, parameters: dict[str, Any] | None
) -> serving_pb2.Tool:
    """A tool as the serving core takes it (no parameters: it takes none)."""
    return serving_pb2.Tool(
        name=name, description=description, parameters=json.dumps(parameters) if parameters else ""
    )


def _tools(request: ChatCompletionRequest, message: serving_pb2.GenerateRequest) -> None:
    message.tools.extend(wire_tools(request.tools))
    choice = request.tool_choice
    if isinstance(choice, str):
        message.tool_choice = choice
    elif choice is not None:
        message.tool_choice = choice.function.name
    if request.parallel_tool_calls is not None:
        message.parallel_tool_calls = request.parallel_tool_calls


@dataclass
class ChatPrompt:
    messages: list[serving_pb2.ChatMessage] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)
    """The image parts' files, in order (GenerateRequest.images)."""
    image_fields: list[str] = field(default_factory=list)
    """The part each image came in, for refusals ("messages[0].content[1].image_url")."""


def chat_prompt(messages: list[ChatMessage]) -> ChatPrompt:
    chat = ChatPrompt()
    for i, each in enumerate(messages):
        where = f"messages[{i}]"
        role = ROLES.get(each.role)
        if role is None:
            raise HttpError.invalid(f"{where}.role", f"{each.role!r} is not one of {sorted(ROLES)}")
        for name in ("function_call", "audio", "refusal"):
            if getattr(each, name) not in (None, []):
                raise HttpError.invalid(f"{where}.{name}", "is not supported")
        if each.name is not None:
            problem = (
                name_problem(role, each.name)
                if isinstance(each.name, str)
                else "is a participant's name, text"
            )
            if problem is not None:
                raise HttpError.invalid(f"{where}.name", problem)
        if each.tool_calls and role != "assistant":
            raise HttpError.invalid(f"{where}.tool_calls", "only an assistant's turn has calls")
        if (each.tool_call_id is None) != (role != "tool"):
            problem = "is only for a tool message" if role != "tool" else "is required"
            raise HttpError.invalid(f"{where}.tool_call_id", f"{problem} (the call answered)")
        turn = _message(role, each.content, where, chat)
        for call in each.tool_calls or []:
            turn.tool_calls.append(
                serving_pb2.ToolCall(
                    id=call.id, name=call.function.name, arguments=call.function.arguments
                )
            )
        turn.tool_call_id = each.tool_call_id or ""
        turn.name = each.name or ""
        reasoning = each.reasoning_content if each.reasoning_content is not None else each.reasoning
        if reasoning is not None and role != "assistant":
            name = "reasoning_content" if each.reasoning_content is not None else "reasoning"
            raise HttpError.invalid(f"{where}.{name}", "only an assistant's turn has reasoning")
        turn.reasoning_content = reasoning or ""
        chat.messages.append(turn)
    return chat


def _message(
    role: str, content: str | list[dict[str, Any]] | None, where: str, chat: ChatPrompt
) -> serving_pb2.ChatMessage:
    """A message: its text (a string, or text parts joined by newlines, as vLLM joins them), or,
    with image parts, its parts in order (each image's file appended to `chat.images`)."""
    if content is None:
        return serving_pb2.ChatMessage(role=role)
    if isinstance(content, str):
        return serving_pb2.ChatMessage(role=role, content=content)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind == "image_url":
            chat.image_fields.append(f"{where}.content[{j}].image_url")
            chat.images.append(openai_image(part, f"{where}.content[{j}]"))
            parts.append(serving_pb2.ChatPart(image=len(chat.images) - 1))
        elif kind == "text" and isinstance(part.get("text"), str) and set(part) <= TEXT_KEYS:
            parts.append(serving_pb2.ChatPart(text=part["text"]))
        else:
            raise HttpError.invalid(
                f"{where}.content[{j}]",
                "expected a text part ({'type': 'text', 'text': ...}) or an image_url part, "
                f"got type {kind!r}",
            )
    if not any(p.WhichOneof("part") == "image" for p in parts):
        return serving_pb2.ChatMessage(role=role, content="\n".join(p.text for p in parts))
    return serving_pb2.ChatMessage(role=role, parts=parts)


def completion_requests(
    request: CompletionRequest, request_id: str, tenant: str
) -> list[serving_pb2.GenerateRequest]:
    """One generation a prompt (cluster/http/several_prompts.py): the request's id for one
    prompt, `{id}-{i}` for prompt i of several."""
    refuse_unsupported(request)
    if request.best_of is not None and request.best_of != (request.n or 1):
        raise HttpError.invalid("best_of", "best_of other than n is not supported")
    if request.echo and request.suffix:
        raise HttpError.invalid(
            "echo",
            "not with suffix: the prompt the model reads is the fill-in-the-middle form, not "
            "the text sent",
        )
    if request.echo and request.truncate_prompt_tokens is not None:
        raise HttpError.invalid(
            "echo", "not with truncate_prompt_tokens: the prompt served is not the text sent"
        )
    prompts = prompts_of(request.prompt)
    check_count(len(prompts), "prompt")
    alone = request.echo and request.max_tokens == 0  # the prompt alone: one token, dropped
    params = sampling(request, 1 if alone else request.max_tokens, request.logprobs)
    if request.echo and request.logprobs is not None:  # the prompt's logprobs too
        check_range("logprobs", [request.logprobs], _INT32)
        params.prompt_logprobs = max(request.logprobs, request.prompt_logprobs or 0)
    return prompt_requests(
        prompts,
        request_id,
        tenant,
        request,
        lambda _: "prompt",
        sampling=params,
        suffix=request.suffix or "",
    )


def prompt_requests(
    prompts: Sequence[Prompt],
    request_id: str,
    tenant: str,
    body: CompletionRequest | EmbeddingRequest,
    name: Callable[[int], str],
    **fields: Any,
) -> list[serving_pb2.GenerateRequest]:
    """One request per prompt, with `fields` (its sampling, or its pooling) and the body's
    `text_match` and `priority`: `request_id`, or `{request_id}-{i}` for prompt i of several.
    `name(i)`: what refusals call prompt i's token ids."""
    messages = []
    for i, prompt in enumerate(prompts):
        message = serving_pb2.GenerateRequest(
            request_id=request_id if len(prompts) == 1 else suffixed(request_id, f"-{i}"), **fields
        )
        if isinstance(prompt, str):
            message.text = prompt
        else:
            check_range(name(i), prompt, _INT64)
            message.token_ids.ids.extend(prompt)
        message.namespace.tenant = tenant
        set_cache_salt(message, body.cache_salt)
        set_truncation(message, body.truncate_prompt_tokens)
        message.text_match = TEXT_MATCH[body.text_match]
        set_priority(message, body.priority)
        messages.append(message)
    return messages


def sampling(
    request: GenerationParams, max_tokens: int | None, logprobs: int | None
) -> serving_pb2.SamplingParams:
    """The sampling fields the request sets (absent ones take the workers' defaults)."""
    top_k = request.top_k
    if top_k == -1:  # vLLM's spelling of "no top-k"
        top_k = 0
    ints = {
        "max_tokens": max_tokens,
        "top_k": top_k,
        "n": request.n,
        "logprobs": logprobs,
        "min_tokens": request.min_tokens,
        "thinking_token_budget": request.thinking_token_budget,
    }
    floats = {
        "temperature": request.temperature,
        "top_p": request.top_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty,
        "min_p": request.min_p,
    }
    message = serving_pb2.SamplingParams(
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
    )
    if not request.skip_special_tokens:
        message.skip_special_tokens = False
    for name, value in ints.items():
        if value is not None:
            check_range(name, [value], _INT32)
            setattr(message, name, value)
    for name, float_value in floats.items():
        if float_value is not None:
            setattr(message, name, float_value)
    if request.seed is not None:  # OpenAI takes any 64-bit seed; the sampler's are non-negative
        check_range("seed", [request.seed], _SEED)
        message.seed = request.seed & _INT64[1]
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    message.stop.extend(stop)
    if request.stop_token_ids:
        check_range("stop_token_ids", request.stop_token_ids, _INT64)
        message.stop_token_ids.extend(request.stop_token_ids)
    _token_fields(request, message)
    asked = structured_output(request)
    if asked is not None:
        message.structured.CopyFrom(_one(*asked))
    return message


def _token_fields(request: GenerationParams, message: serving_pb2.SamplingParams) -> None:
    """The fields that name token ids: allowed_token_ids, logit_bias, prompt_logprobs,
    return_token_ids."""
    if request.allowed_token_ids is not None:
        if not request.allowed_token_ids:
            raise HttpError.invalid("allowed_token_ids", "is empty: give at least one token id")
        check_range("allowed_token_ids", request.allowed_token_ids, _INT64)
        message.allowed_token_ids.extend(request.allowed_token_ids)
    message.logit_bias.update(logit_bias(request.logit_bias or {}))
    message.bad_words.extend(request.bad_words or [])
    if request.prompt_logprobs is not None:
        if request.stream:
            raise HttpError.invalid("prompt_logprobs", "not available with stream, as in vLLM")
        check_range("prompt_logprobs", [request.prompt_logprobs], _INT32)
        message.prompt_logprobs = request.prompt_logprobs
    message.return_prompt_token_ids = bool(request.return_token_ids)


def logit_bias(biases: Mapping[str, float]) -> dict[int, float]:
    """OpenAI's `logit_bias` by token id: JSON writes the ids as keys, so as strings."""
    by_id: dict[int, float] = {}
    for key, bias in biases.items():
        token = int(key) if key.strip().isdecimal() else None
        if token is None or token > _INT32[1]:
            raise HttpError.invalid(f"logit_bias.{key}", "the key is not a token id")
        if token in by_id:
            raise HttpError.invalid(f"logit_bias.{key}", f"token {token} is given twice")
        by_id[token] = bias
    return by_id


Asked = tuple[str, object, str]
"""A structured output as a request asks for it: its kind in vLLM's names (json, regex, choice,
grammar, json_object, structural_tag), its value, and the field that asked."""


def structured_output(request: GenerationParams) -> Asked | None:
    """The request's structured output (OpenAI's `response_format`, vLLM's
    `structured_outputs` or one of its older `guided_*`); None for free text. Two of them in
    one request are refused."""
    found = []
    if request.response_format is not None and request.response_format.type != "text":
        found.append(_response_format(request.response_format))
    if request.structured_outputs is not None:
        found.append(_structured_outputs(request.structured_outputs))
    guided = {
        "json": request.guided_json,
        "regex": request.guided_regex,
        "choice": request.guided_choice,
        "grammar": request.guided_grammar,
    }
    found += [
        (kind, value, f"guided_{kind}") for kind, value in guided.items() if value is not None
    ]
    if len(found) > 1:
        raise HttpError.invalid(
            found[1][2], f"{found[0][2]} asks for a structured output already; give one"
        )
    return found[0] if found else None


TOOL_FIELDS = ((r"tools\[(\d+)\]\.(name|description|parameters)", r"tools[\1].function.\2"),)
"""A tool's fields as the serving core names them -> as OpenAI's body nests them."""


def refusal_names(request: GenerationParams) -> Renames:
    """The request's names of the fields the serving core may refuse."""
    fields = structured_fields(request)
    if not isinstance(request, ChatCompletionRequest):
        return renames(fields, TOOL_FIELDS)
    named = isinstance(request.tool_choice, NamedToolChoice)
    if not legacy(request):
        if named:
            fields["tool_choice"] = "tool_choice.function.name"  # the function it names
        return renames(fields, TOOL_FIELDS)
    return renames(
        fields
        | {
            "tool_choice": "function_call.name" if named else "function_call",
            "tools": "functions",
            "sampling.structured.structural_tag": "functions",
        },
        LEGACY_FIELDS,
    )


def structured_fields(request: GenerationParams) -> dict[str, str]:
    """What a refusal of the request's structured output is named by the worker -> by the
    request (`sampling.structured.json_schema` -> `response_format.json_schema.schema`)."""
    asked = structured_output(request)
    if asked is None:  # the calls' constraint, if any, is made of the tools' parameters
        calls = isinstance(request, ChatCompletionRequest) and callable_tools(request)
        return {"sampling.structured.structural_tag": "tools"} if calls else {}
    kind, _, where = asked
    return {f"sampling.structured.{'json_schema' if kind == 'json' else kind}": where}


def _response_format(form: ResponseFormat) -> Asked:
    if form.type == "json_object":
        return "json_object", True, "response_format"
    if form.json_schema is None:
        raise HttpError.invalid("response_format.json_schema", "is required with type json_schema")
    if form.json_schema.schema_ is None:  # OpenAI's schema is optional: any object then
        return "json_object", True, "response_format.json_schema"
    return "json", form.json_schema.schema_, "response_format.json_schema.schema"


def _structured_outputs(given: StructuredOutputs) -> Asked:
    kinds = {
        "json": given.json_,
        "regex": given.regex,
        "choice": given.choice,
        "grammar": given.grammar,
        "json_object": given.json_object,
        "structural_tag": given.structural_tag,
    }
    set_ = [kind for kind, value in kinds.items() if value is not None]
    if len(set_) != 1:
        raise HttpError.invalid(
            "structured_outputs", f"set one of {', '.join(kinds)}; {len(set_)} are set"
        )
    kind = set_[0]
    return kind, kinds[kind], f"structured_outputs.{kind}"


def _one(kind: str, value: object, where: str) -> serving_pb2.StructuredOutput:
    """The constraint a request asks for (a JSON schema as an object or as text)."""
    message = serving_pb2.StructuredOutput()
    if kind == "json":
        message.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif kind == "choice":
        assert isinstance(value, list)
        message.choice.values.extend(value)
    elif kind == "json_object":
        if value is not True:
            raise HttpError.invalid(where, "must be true when set")
        message.json_object = True
    else:
        assert isinstance(value, str)
        setattr(message, kind, value)
    return message


def set_cache_salt(message: serving_pb2.GenerateRequest, salt: str | None) -> None:
    """vLLM's `cache_salt`: only requests of the same salt (in the tenant) share KV."""
    if salt is None:
        return
    if not salt:
        raise HttpError.invalid("cache_salt", "must be a non-empty string")
    if len(salt) > MAX_SALT_CHARS:
        raise HttpError.invalid("cache_salt", f"at most {MAX_SALT_CHARS} characters")
    message.namespace.cache_salt = salt


def set_truncation(message: serving_pb2.GenerateRequest, keep: int | None) -> None:
    """vLLM's `truncate_prompt_tokens`: only the prompt's last `keep` tokens are served (-1:
    the context length; the serving core checks the rest)."""
    if keep is not None:
        check_range("truncate_prompt_tokens", [keep], _INT32)
        message.truncate_prompt_tokens = keep


def set_priority(message: serving_pb2.GenerateRequest, priority: int | None) -> None:
    """vLLM's `priority` (lower first), as the int32 the wire carries; whether the workers
    schedule by it is the router's check."""
    if priority is not None:
        check_range("priority", [priority], _INT32)
        message.priority = priority


def check_range(name: str, values: list[int], bounds: tuple[int, int]) -> None:
    low, high = bounds
    bad = next((v for v in values if not low <= v <= high), None)
    if bad is not None:
        raise HttpError.invalid(name, f"{bad} is out of range")
