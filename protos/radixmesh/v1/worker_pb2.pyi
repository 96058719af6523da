from protos.radixmesh.v1 import serving_pb2 as _serving_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "namespace", "sampling", "predicted_cached_tokens", "resume", "prompt_block_hashes", "images", "priority", "pooling", "kv_peer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    KV_PEER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: _serving_pb2.Namespace
    sampling: _serving_pb2.SamplingParams
    predicted_cached_tokens: int
    resume: Resume
    prompt_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    images: _containers.RepeatedScalarFieldContainer[bytes]
    priority: int
    pooling: _serving_pb2.PoolingParams
    kv_peer: KvPeer
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[_Union[_serving_pb2.Namespace, _Mapping]] = ..., sampling: _Optional[_Union[_serving_pb2.SamplingParams, _Mapping]] = ..., predicted_cached_tokens: _Optional[int] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., prompt_block_hashes: _Optional[_Iterable[int]] = ..., images: _Optional[_Iterable[bytes]] = ..., priority: _Optional[int] = ..., pooling: _Optional[_Union[_serving_pb2.PoolingParams, _Mapping]] = ..., kv_peer: _Optional[_Union[KvPeer, _Mapping]] = ...) -> None: ...

class KvPeer(_message.Message):
    __slots__ = ("worker", "address", "positions")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    address: str
    positions: int
    def __init__(self, worker: _Optional[str] = ..., address: _Optional[str] = ..., positions: _Optional[int] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("identity_version", "model_revision", "page_size", "block_size", "dtype", "num_layers", "kv_heads", "head_dim")
    IDENTITY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    identity_version: int
    model_revision: str
    page_size: int
    block_size: int
    dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    def __init__(self, identity_version: _Optional[int] = ..., model_revision: _Optional[str] = ..., page_size: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class ReadKvRequest(_message.Message):
    __slots__ = ("token_ids", "namespace", "start", "layout")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    namespace: _serving_pb2.Namespace
    start: int
    layout: KvLayout
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., namespace: _Optional[_Union[_serving_pb2.Namespace, _Mapping]] = ..., start: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ...) -> None: ...

class KvPages(_message.Message):
    __slots__ = ("start", "positions", "tensors")
    START_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    start: int
    positions: int
    tensors: bytes
    def __init__(self, start: _Optional[int] = ..., positions: _Optional[int] = ..., tensors: _Optional[bytes] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("sample_index", "generated")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    generated: int
    def __init__(self, sample_index: _Optional[int] = ..., generated: _Optional[int] = ...) -> None: ...

class StreamKvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("seq", "kind", "block_hashes")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("worker", "events")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, worker: _Optional[str] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class GetSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvSnapshot(_message.Message):
    __slots__ = ("worker", "seq", "block_hashes", "host_block_hashes", "disk_block_hashes")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    worker: str
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    host_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    disk_block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker: _Optional[str] = ..., seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., host_block_hashes: _Optional[_Iterable[int]] = ..., disk_block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("queued_prefill_tokens", "running_sequences", "free_pages", "total_pages", "adapters", "adapter_swap_seconds")
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queued_prefill_tokens: int
    running_sequences: int
    free_pages: int
    total_pages: int
    adapters: _containers.RepeatedCompositeFieldContainer[_serving_pb2.AdapterInfo]
    adapter_swap_seconds: float
    def __init__(self, queued_prefill_tokens: _Optional[int] = ..., running_sequences: _Optional[int] = ..., free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., adapters: _Optional[_Iterable[_Union[_serving_pb2.AdapterInfo, _Mapping]]] = ..., adapter_swap_seconds: _Optional[float] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker", "identity_version", "block_size", "model_revision", "page_size", "total_pages", "vocab_size", "max_model_len", "max_running", "vision", "hidden_size", "cache_salts")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    VISION_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALTS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    identity_version: int
    block_size: int
    model_revision: str
    page_size: int
    total_pages: int
    vocab_size: int
    max_model_len: int
    max_running: int
    vision: VisionInfo
    hidden_size: int
    cache_salts: bool
    def __init__(self, worker: _Optional[str] = ..., identity_version: _Optional[int] = ..., block_size: _Optional[int] = ..., model_revision: _Optional[str] = ..., page_size: _Optional[int] = ..., total_pages: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., max_running: _Optional[int] = ..., vision: _Optional[_Union[VisionInfo, _Mapping]] = ..., hidden_size: _Optional[int] = ..., cache_salts: _Optional[bool] = ...) -> None: ...

class VisionInfo(_message.Message):
    __slots__ = ("image_token_id", "image_seq_len", "tile_size", "longest_edge", "do_image_splitting", "max_images", "max_image_pixels", "max_image_bytes")
    IMAGE_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    TILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    LONGEST_EDGE_FIELD_NUMBER: _ClassVar[int]
    DO_IMAGE_SPLITTING_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGES_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    image_token_id: int
    image_seq_len: int
    tile_size: int
    longest_edge: int
    do_image_splitting: bool
    max_images: int
    max_image_pixels: int
    max_image_bytes: int
    def __init__(self, image_token_id: _Optional[int] = ..., image_seq_len: _Optional[int] = ..., tile_size: _Optional[int] = ..., longest_edge: _Optional[int] = ..., do_image_splitting: _Optional[bool] = ..., max_images: _Optional[int] = ..., max_image_pixels: _Optional[int] = ..., max_image_bytes: _Optional[int] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files",)
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, str]
    def __init__(self, files: _Optional[_Mapping[str, str]] = ...) -> None: ...
