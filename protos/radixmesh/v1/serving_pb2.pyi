from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TextMatch(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TEXT_MATCH_DEFAULT: _ClassVar[TextMatch]
    TEXT_MATCH_EXACT: _ClassVar[TextMatch]
    TEXT_MATCH_ANCHORED: _ClassVar[TextMatch]
    TEXT_MATCH_OFF: _ClassVar[TextMatch]
TEXT_MATCH_DEFAULT: TextMatch
TEXT_MATCH_EXACT: TextMatch
TEXT_MATCH_ANCHORED: TextMatch
TEXT_MATCH_OFF: TextMatch

class LoadAdapterRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class AdapterInfo(_message.Message):
    __slots__ = ("name", "identity", "rank", "target_modules", "resident", "path", "worker")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    name: str
    identity: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    resident: bool
    path: str
    worker: str
    def __init__(self, name: _Optional[str] = ..., identity: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., resident: _Optional[bool] = ..., path: _Optional[str] = ..., worker: _Optional[str] = ...) -> None: ...

class LoadAdapterResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class UnloadAdapterRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadAdapterResponse(_message.Message):
    __slots__ = ("workers", "pages_freed")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    workers: int
    pages_freed: int
    def __init__(self, workers: _Optional[int] = ..., pages_freed: _Optional[int] = ...) -> None: ...

class ListAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[AdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[AdapterInfo, _Mapping]]] = ...) -> None: ...

class SetPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: str
    def __init__(self, policy: _Optional[str] = ...) -> None: ...

class SetPolicyResponse(_message.Message):
    __slots__ = ("previous",)
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    previous: str
    def __init__(self, previous: _Optional[str] = ...) -> None: ...

class ClearCachesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ClearCachesResponse(_message.Message):
    __slots__ = ("pages_freed",)
    PAGES_FREED_FIELD_NUMBER: _ClassVar[int]
    pages_freed: int
    def __init__(self, pages_freed: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "parts", "tool_calls", "tool_call_id", "reasoning_content", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    parts: _containers.RepeatedCompositeFieldContainer[ChatPart]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    reasoning_content: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ChatPart, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Tool(_message.Message):
    __slots__ = ("name", "description", "parameters")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    parameters: str
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., parameters: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatPart(_message.Message):
    __slots__ = ("text", "image")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: int
    def __init__(self, text: _Optional[str] = ..., image: _Optional[int] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Namespace(_message.Message):
    __slots__ = ("adapter", "tenant", "cache_salt")
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    adapter: str
    tenant: str
    cache_salt: str
    def __init__(self, adapter: _Optional[str] = ..., tenant: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "n", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "structured", "min_p", "min_tokens", "logit_bias", "allowed_token_ids", "include_stop_str_in_output", "skip_special_tokens", "prompt_logprobs", "bad_words", "separate_reasoning", "thinking_token_budget", "prediction", "return_prompt_token_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_FIELD_NUMBER: _ClassVar[int]
    SEPARATE_REASONING_FIELD_NUMBER: _ClassVar[int]
    THINKING_TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    n: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int
    structured: StructuredOutput
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    prompt_logprobs: int
    bad_words: _containers.RepeatedScalarFieldContainer[str]
    separate_reasoning: bool
    thinking_token_budget: int
    prediction: str
    return_prompt_token_ids: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., prompt_logprobs: _Optional[int] = ..., bad_words: _Optional[_Iterable[str]] = ..., separate_reasoning: _Optional[bool] = ..., thinking_token_budget: _Optional[int] = ..., prediction: _Optional[str] = ..., return_prompt_token_ids: _Optional[bool] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, values: _Optional[_Iterable[str]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "chat", "namespace", "sampling", "images", "text_match", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs", "continue_final_message", "add_generation_prompt", "priority", "pooling", "suffix", "truncate_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TEXT_MATCH_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    chat: ChatMessages
    namespace: Namespace
    sampling: SamplingParams
    images: _containers.RepeatedScalarFieldContainer[bytes]
    text_match: TextMatch
    tools: _containers.RepeatedCompositeFieldContainer[Tool]
    tool_choice: str
    parallel_tool_calls: bool
    chat_template_kwargs: str
    continue_final_message: bool
    add_generation_prompt: bool
    priority: int
    pooling: PoolingParams
    suffix: str
    truncate_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., namespace: _Optional[_Union[Namespace, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., images: _Optional[_Iterable[bytes]] = ..., text_match: _Optional[_Union[TextMatch, str]] = ..., tools: _Optional[_Iterable[_Union[Tool, _Mapping]]] = ..., tool_choice: _Optional[str] = ..., parallel_tool_calls: _Optional[bool] = ..., chat_template_kwargs: _Optional[str] = ..., continue_final_message: _Optional[bool] = ..., add_generation_prompt: _Optional[bool] = ..., priority: _Optional[int] = ..., pooling: _Optional[_Union[PoolingParams, _Mapping]] = ..., suffix: _Optional[str] = ..., truncate_prompt_tokens: _Optional[int] = ...) -> None: ...

class PoolingParams(_message.Message):
    __slots__ = ("dimensions", "normalize")
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    dimensions: int
    normalize: bool
    def __init__(self, dimensions: _Optional[int] = ..., normalize: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "text", "finished", "finish_reason", "prompt_tokens", "cached_prompt_tokens", "predicted_cached_tokens", "worker", "logprobs", "stop_string", "host_cached_tokens", "disk_cached_tokens", "prompt_logprobs", "prompt_token_ids", "reasoning_text", "reasoning_tokens", "tool_calls", "embedding", "peer_cached_tokens", "accepted_prediction_tokens", "rejected_prediction_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TEXT_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    PEER_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    prompt_tokens: int
    cached_prompt_tokens: int
    predicted_cached_tokens: int
    worker: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    stop_string: str
    host_cached_tokens: int
    disk_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    reasoning_text: str
    reasoning_tokens: int
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    embedding: _containers.RepeatedScalarFieldContainer[float]
    peer_cached_tokens: int
    accepted_prediction_tokens: int
    rejected_prediction_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., predicted_cached_tokens: _Optional[int] = ..., worker: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., stop_string: _Optional[str] = ..., host_cached_tokens: _Optional[int] = ..., disk_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., reasoning_text: _Optional[str] = ..., reasoning_tokens: _Optional[int] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., embedding: _Optional[_Iterable[float]] = ..., peer_cached_tokens: _Optional[int] = ..., accepted_prediction_tokens: _Optional[int] = ..., rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("logprob", "top_ids", "top_logprobs", "rank")
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    rank: int
    def __init__(self, logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., rank: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker", "healthy", "requests_finished", "prompt_tokens", "cached_prompt_tokens", "generated_tokens", "running", "waiting", "free_pages", "cached_pages", "private_pages", "evicted_pages", "preemptions", "total_pages", "address", "host_total_pages", "host_cached_pages", "demoted_pages", "promoted_pages", "host_evicted_pages", "host_hit_tokens", "disk_hit_tokens", "disk_skipped_tokens", "disk_spilled_pages", "disk_spill_skipped_pages", "peer_read_tokens", "peer_read_failures", "peer_skipped_tokens")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PRIVATE_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_SKIPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_SPILLED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DISK_SPILL_SKIPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PEER_READ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PEER_READ_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PEER_SKIPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    healthy: bool
    requests_finished: int
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    running: int
    waiting: int
    free_pages: int
    cached_pages: int
    private_pages: int
    evicted_pages: int
    preemptions: int
    total_pages: int
    address: str
    host_total_pages: int
    host_cached_pages: int
    demoted_pages: int
    promoted_pages: int
    host_evicted_pages: int
    host_hit_tokens: int
    disk_hit_tokens: int
    disk_skipped_tokens: int
    disk_spilled_pages: int
    disk_spill_skipped_pages: int
    peer_read_tokens: int
    peer_read_failures: int
    peer_skipped_tokens: int
    def __init__(self, worker: _Optional[str] = ..., healthy: _Optional[bool] = ..., requests_finished: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., free_pages: _Optional[int] = ..., cached_pages: _Optional[int] = ..., private_pages: _Optional[int] = ..., evicted_pages: _Optional[int] = ..., preemptions: _Optional[int] = ..., total_pages: _Optional[int] = ..., address: _Optional[str] = ..., host_total_pages: _Optional[int] = ..., host_cached_pages: _Optional[int] = ..., demoted_pages: _Optional[int] = ..., promoted_pages: _Optional[int] = ..., host_evicted_pages: _Optional[int] = ..., host_hit_tokens: _Optional[int] = ..., disk_hit_tokens: _Optional[int] = ..., disk_skipped_tokens: _Optional[int] = ..., disk_spilled_pages: _Optional[int] = ..., disk_spill_skipped_pages: _Optional[int] = ..., peer_read_tokens: _Optional[int] = ..., peer_read_failures: _Optional[int] = ..., peer_skipped_tokens: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("policy", "requests_routed", "requests_retried", "requests_in_flight", "predicted_cached_tokens", "actual_cached_tokens", "workers", "index_bytes", "vocab_size", "max_model_len", "requests_migrated", "text_index", "tenants", "uncounted_tenant_requests")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ROUTED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_RETRIED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTUAL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    TEXT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    UNCOUNTED_TENANT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    requests_routed: int
    requests_retried: int
    requests_in_flight: int
    predicted_cached_tokens: int
    actual_cached_tokens: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    index_bytes: int
    vocab_size: int
    max_model_len: int
    requests_migrated: int
    text_index: TextIndexStats
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStats]
    uncounted_tenant_requests: int
    def __init__(self, policy: _Optional[str] = ..., requests_routed: _Optional[int] = ..., requests_retried: _Optional[int] = ..., requests_in_flight: _Optional[int] = ..., predicted_cached_tokens: _Optional[int] = ..., actual_cached_tokens: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., index_bytes: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., requests_migrated: _Optional[int] = ..., text_index: _Optional[_Union[TextIndexStats, _Mapping]] = ..., tenants: _Optional[_Iterable[_Union[TenantStats, _Mapping]]] = ..., uncounted_tenant_requests: _Optional[int] = ...) -> None: ...

class TenantStats(_message.Message):
    __slots__ = ("tenant", "requests", "prompt_tokens", "cached_tokens", "generated_tokens")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    def __init__(self, tenant: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., generated_tokens: _Optional[int] = ...) -> None: ...

class TextIndexStats(_message.Message):
    __slots__ = ("mode", "chars", "nodes", "prompts", "prompt_chars", "reused_chars", "tokenized_chars", "backoff_tokens", "evicted_chars")
    MODE_FIELD_NUMBER: _ClassVar[int]
    CHARS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CHARS_FIELD_NUMBER: _ClassVar[int]
    REUSED_CHARS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZED_CHARS_FIELD_NUMBER: _ClassVar[int]
    BACKOFF_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_CHARS_FIELD_NUMBER: _ClassVar[int]
    mode: str
    chars: int
    nodes: int
    prompts: int
    prompt_chars: int
    reused_chars: int
    tokenized_chars: int
    backoff_tokens: int
    evicted_chars: int
    def __init__(self, mode: _Optional[str] = ..., chars: _Optional[int] = ..., nodes: _Optional[int] = ..., prompts: _Optional[int] = ..., prompt_chars: _Optional[int] = ..., reused_chars: _Optional[int] = ..., tokenized_chars: _Optional[int] = ..., backoff_tokens: _Optional[int] = ..., evicted_chars: _Optional[int] = ...) -> None: ...
