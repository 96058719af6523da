"""The OpenAI API's requests and responses, as pydantic models (the fields radixmesh serves).

Requests are strict: a parameter that is not declared here is refused by name (400), and a
declared one that radixmesh does not implement (audio, web search, ...) is refused unless it has its
no-op value (`REFUSED`, checked in cluster/http/openai_params.py). vLLM's extensions that
radixmesh implements (top_k, min_p, min_tokens, repetition_penalty, ignore_eos, stop_token_ids,
allowed_token_ids, include_stop_str_in_output, skip_special_tokens, structured_outputs and its
older guided_* fields, prompt_logprobs, priority) are accepted.
Responses follow OpenAI's schema field for field, so its SDK parses them as it parses OpenAI's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

LONE_SURROGATE = "lone_surrogate"
"""The validation error type of a string no UTF-8 text can hold (cluster/http/app.py)."""


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


def lone_surrogate(body: object) -> tuple[str, str] | None:
    """(where, the code point as an escape) of the first string, or key, of decoded JSON `body`
    that holds a lone UTF-16 surrogate; None when none does. JSON's `"\\ud800"` decodes to
    one, and no UTF-8 text can hold it: protobuf, the tokenizer and the response encoder would
    each fail on it. A list whose first item is a number (or a boolean) is not read, as a
    token-id prompt can hold a million numbers: every field that takes such a list and is
    served takes numbers only, so a string in one fails validation, whose message shows it
    with `repr` (escaped); the untyped fields that could hold one are refused or ignored."""
    stack: list[tuple[tuple[str | int, ...], object]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            found = _surrogate(value)
        elif isinstance(value, dict):
            found = next(filter(None, map(_surrogate, value)), None)  # JSON keys are strings
            stack.extend(((*path, key), item) for key, item in reversed(value.items()))
        elif isinstance(value, list) and value and not isinstance(value[0], int | float):
            stack.extend(((*path, i), value[i]) for i in reversed(range(len(value))))
            continue
        else:
            continue
        if found is not None:
            return _where(path), found
    return None


def _where(path: tuple[str | int, ...]) -> str:
    """A field's path as the API's errors name it: `messages[0].content`."""
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path)
    return where.removeprefix(".") or "body"


def _surrogate(text: str) -> str | None:
    if text.isascii():
        return None
    try:
        text.encode()
    except UnicodeEncodeError as err:
        return f"\\u{ord(text[err.start]):04x}"
    return None


class Body(Strict):
    """A request body: refused, naming the field, when a string in it is not Unicode text."""

    @model_validator(mode="before")
    @classmethod
    def _unicode_only(cls, data: Any) -> Any:
        found = lone_surrogate(data)
        if found is not None:
            where, escape = found
            raise PydanticCustomError(
                LONE_SURROGATE,
                "holds a lone UTF-16 surrogate ({escape}), which is not Unicode text",
                {"where": where, "escape": escape},
            )
        return data


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far (guidellm asks for it)."""


class CalledFunction(Strict):
    name: str
    arguments: str
    """A JSON object, as JSON text."""
    parsed_arguments: Any = Field(default=None, exclude=True)
    """What the SDK's `parse` read `arguments` into, sent back with the message: ignored (and
    not stored with it)."""


class ToolCallParam(Strict):
    """One call of an assistant's turn, as the client sends the conversation back."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: Any = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    function_call: CalledFunction | None = None
    """An assistant turn's call, the legacy way (cluster/http/legacy_functions.py)."""
    refusal: Any = None
    audio: Any = None
    reasoning_content: str | None = None
    """An assistant turn's reasoning, as a response gave it (vLLM's and SGLang's name; a
    thinking model's template may write it back into its turn)."""
    reasoning: str | None = None
    """The same, by vLLM's newer name."""
    parsed: Any = Field(default=None, exclude=True)
    """What the SDK's `parse` read the content into, sent back with the message: ignored (and
    not stored with it)."""
    annotations: Any = Field(default=None, exclude=True)
    """An answer's annotations (OpenAI's citations), sent back with it: ignored."""


class JsonSchemaFormat(Strict):
    """`response_format.json_schema`: OpenAI's structured outputs."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    """Accepted either way: the schema is always enforced, token by token."""


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` (one of them)."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    """xgrammar's structural tag, as JSON text."""


class GenerationParams(Body):
    """What chat and text completions share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    use_beam_search: bool = False
    """vLLM's: the `n` best of a beam search (cluster/http/beam_search.py), not samples."""
    length_penalty: float = 1.0
    """vLLM's, with use_beam_search: a beam's score is its logprob over its length to this."""
    min_p: float | None = None
    min_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    thinking_token_budget: int | None = None
    """vLLM's: a thinking model's reasoning is closed after this many tokens (`</think>`
    forced; worker/thinking_tokens.py)."""
    prompt_logprobs: int | None = None
    """vLLM's: each prompt token's logprob, rank and this many alternatives, in the response's
    `prompt_logprobs` (not with `stream`, as vLLM)."""
    cache_salt: str | None = None
    """vLLM's: only requests of the same salt share cached KV (within the tenant), so users of
    one tenant cannot learn each other's prompts by timing."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: only the prompt's last this many tokens are served (-1: the context length)."""
    return_token_ids: bool | None = None
    """vLLM's: the prompt's token ids (`prompt_token_ids`) and each choice's generated ones
    (`token_ids`) in the response; streamed, the prompt's in the first chunk and each chunk's
    new tokens in it."""
    text_match: Literal["exact", "anchored", "off"] | None = None
    """radixmesh: how the prompt's text reuses the router's text index (docs/router.md)."""
    priority: int | None = None
    """vLLM's: lower is served earlier (engine.scheduling_policy "priority"; refused unless 0
    under "fcfs")."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    """vLLM's older names for `structured_outputs`' fields."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    """Token ids (as JSON writes keys: strings) to a bias in [-100, 100]."""
    service_tier: Any = None
    metadata: Any = None
    store: Any = None


Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
"""OpenAI's reasoning efforts."""


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    """Accepted either way: the arguments always satisfy the parameters' schema."""


class ToolParam(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class Prediction(Strict):
    """OpenAI's predicted output: text the answer is expected to repeat, mostly (a file being
    rewritten). Decoding verifies its tokens as drafts; the answer is the one without it. The
    parts are checked where the request is read (`openai_params.prediction_text`), naming the
    part that is not text."""

    type: Literal["content"]
    content: str | list[dict[str, Any]]


class ChatCompletionRequest(GenerationParams):
    messages: list[ChatMessage]
    separate_reasoning: bool = True
    """SGLang's: a thinking model's reasoning comes in `reasoning_content`, apart from the
    answer in `content` (false: the whole text, tags and all, in `content`)."""
    include_reasoning: bool = True
    """vLLM's: false leaves the reasoning out of the response (told apart all the same)."""
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[FunctionDefinition] | None = None
    """OpenAI's legacy tools, served as tools (cluster/http/legacy_functions.py)."""
    function_call: Literal["none", "auto"] | FunctionName | None = None
    """The legacy tool_choice."""
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: more variables for the chat template (`{"enable_thinking": false}`)."""
    continue_final_message: bool = False
    """vLLM's: the last message (the assistant's) is continued, its turn left open."""
    add_generation_prompt: bool | None = None
    """vLLM's: whether the template opens the reply (default true; not with
    continue_final_message)."""
    audio: Any = None
    modalities: Any = None
    prediction: Prediction | None = None
    reasoning_effort: Effort | None = None
    """OpenAI's: given to the chat template as `reasoning_effort` (vLLM's way; gpt-oss's
    template reads it); "none" also sets `enable_thinking: false` (Qwen3's)."""
    web_search_options: Any = None
    verbosity: Any = None
    prompt_cache_key: str | None = None
    """Accepted: what OpenAI's asks for, a conversation routed to its cache, the router does for
    every prompt by its prefix (docs/router.md)."""
    prompt_cache_retention: Literal["in-memory", "in_memory", "24h"] | None = None
    """Accepted: a cached prefix stays while the pages it holds are not needed (least recently
    used first, then the host and disk tiers where configured), whichever was asked."""
    safety_identifier: str | None = None
    store: bool | None = None
    """OpenAI's: keep the completion, to be listed and read back
    (cluster/http/stored_completions.py)."""
    metadata: dict[str, str] | None = None
    """Kept with a stored completion, and what its listing filters by."""


class CompletionRequest(GenerationParams):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    """The prompt, then the completion, in `text` (with `logprobs`: the prompt tokens' too,
    the first's null)."""
    best_of: Any = None
    suffix: str | None = None
    """Fill in the middle: what follows the completion, written with the prompt in the model's
    fill-in-the-middle form (worker/fill_in_middle.py); refused by a model without one.
    Empty: none."""


REFUSED: dict[str, tuple[str, tuple[object, ...]]] = {
    # parameter: (why it is refused, the values that ask for nothing and are accepted)
    "audio": ("only text is served", ()),
    "modalities": ("only text is served", (["text"],)),
    "web_search_options": ("web search is not supported", ()),
    "verbosity": ("not supported", ()),
    "service_tier": ("there is one tier", ("auto", "default")),
    "metadata": ("stored completions are not supported", ({},)),
    "store": ("stored completions are not supported", (False,)),
}
"""Parameters of the OpenAI API that radixmesh does not implement."""
CHAT_REFUSED = {name: why for name, why in REFUSED.items() if name not in ("metadata", "store")}
"""Of those, the chat API's: it stores completions (legacy completions do not, as OpenAI's)."""


# -- responses -------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int
    """Prompt tokens served from the prefix cache."""


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0
    """A thinking model's reasoning tokens, when told from its answer."""
    accepted_prediction_tokens: int = 0
    """With `prediction`: of the completion's tokens, those drawn as the prediction proposed."""
    rejected_prediction_tokens: int = 0
    """With `prediction`: the prediction's tokens computed as drafts and not drawn (not in
    `completion_tokens`, which counts the completion's tokens only)."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails = CompletionTokensDetails()


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionCall | None = None
    """The call, when the request gave `functions` (OpenAI's legacy shape; absent otherwise)."""
    reasoning_content: str | None = None
    """A thinking model's reasoning (vLLM's and SGLang's field; None: the model did not
    reason, or is not a thinking model)."""
    reasoning: str | None = None
    """The same, by vLLM's newer name (both are written, as vLLM writes both)."""

    @model_serializer(mode="wrap")
    def _present(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if self.function_call is None:  # only an answer to `functions` has the field
            data.pop("function_call", None)  # (already left out by an exclude, if any)
        return data


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


TokenIds = Annotated[list[int] | None, Field(exclude_if=lambda ids: ids is None)]
"""vLLM's `prompt_token_ids` and `token_ids` (`return_token_ids`): absent unless asked."""


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None
    token_ids: TokenIds = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: TokenIds = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    function_call: FunctionCall | None = None
    reasoning_content: str | None = None
    """A thinking model's reasoning since the last chunk (and as `reasoning`, vLLM's newer
    name)."""

    @model_serializer
    def _present(self) -> dict[str, Any]:  # a delta carries only what changed
        fields = (
            ("role", self.role),
            ("content", self.content),
            ("reasoning_content", self.reasoning_content),
            ("reasoning", self.reasoning_content),
            ("tool_calls", [c.model_dump() for c in self.tool_calls] if self.tool_calls else None),
            ("function_call", self.function_call.model_dump() if self.function_call else None),
        )
        return {k: v for k, v in fields if v is not None}


class ChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: TokenIds = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: TokenIds = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    """null for an echoed prompt's first token (nothing before it)."""
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token or one of its alternatives."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's `prompt_logprobs`: per prompt token (null for the first), token id -> entry, the
prompt token itself and its `prompt_logprobs` most likely alternatives."""


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: TokenIds = None
    token_ids: TokenIds = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "radixmesh"
    root: str
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- vLLM's tokenizer endpoints ----------------------------------------------------------------
class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolParam] | None = None
    """vLLM's: counted as they are written into the prompt."""
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the chat template writes them)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """vLLM's `/tokenizer_info`: the tokenizer's special tokens and chat template."""

    tokenizer_class: str = "PreTrainedTokenizerFast"
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None = None
    chat_template: str | None
    model_max_length: int


# -- vLLM's LoRA endpoints -----------------------------------------------------------------------
class LoadLoraAdapterRequest(Body):
    lora_name: str
    lora_path: str
    load_inplace: bool | None = None
    """vLLM's flag to replace an adapter of the same name; radixmesh always replaces (the new
    weights get a new cache identity)."""


class UnloadLoraAdapterRequest(Body):
    lora_name: str
    lora_int_id: int | None = None
    """vLLM's numeric id; radixmesh knows adapters by name only (ignored)."""
