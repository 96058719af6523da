"""The cluster's configuration: frozen sections built once from a YAML file (or the defaults).

    model:    source ("default" = SmolLM2-135M-Instruct, a checkpoint dir, a .gguf), device,
              dtype, weight format, LoRA adapters every worker loads at start
    engine:   the worker engine (pages, page size, batching limits, context, LoRA slots, image
              limits and the vision encoder's cache)
    workers:  how many (default: one per GPU, else 2 CPU workers), CPUs each, bind host
    router:   the public endpoint, routing policy, admission and message limits, retries, the
              text index
    security: TLS files, bearer tokens (each bound to a tenant, or "*" for any)
    metrics:  Prometheus ports of the router and of each worker (port + index)

Unknown keys, wrongly typed values, numbers out of their range and names that are not one of
the choices (a policy, a device, a dtype) are refused with an error that names the key, when the
file is loaded: a typo must not silently fall back to a default, nor surface from inside a Ray
actor after the workers have loaded the model.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from cache import CacheConfig
from router.policies import POLICIES
from worker.images import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_IMAGES
from worker.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from worker.speculation import MAX_SPECULATIVE_TOKENS
from worker.validation import DEFAULT_MAX_PROMPT_CHARS, SCHEDULING_POLICIES
from worker.weight_quality import (
    AUTO,
    DEFAULT_CHECKPOINT,
    WeightFormatRefused,
    auto_weight_format,
    check_format_quality,
)

T = TypeVar("T")
ANY_TENANT = "*"
MAX_ADAPTER_NAME_CHARS = 128
"""An adapter's name is part of every cache key of its namespace and of the OpenAI `model`."""
DEFAULT_SERVED_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ENCODER_CACHE_BYTES = 64 << 20
WEIGHT_FORMATS = ("float32", "bf16", "int8", "int4")
BATCH_ORDERS = ("prefix", "file")
"""worker/quantized_weights.py's WEIGHT_FORMATS, spelled out: this module must not import torch
(the router loads it); a test holds the two equal."""


class ConfigError(ValueError):
    """A configuration file that cannot be used as written; the message names the key."""


def _at_least(default: Any, least: float, most: float | None = None) -> Any:
    """A numeric field that `build` refuses below `least` (or above `most`); None passes."""
    return field(default=default, metadata={"least": least, "most": most})


def _port(default: int) -> Any:
    return _at_least(default, 0, 65535)


def _one_of(default: Any, choices: Collection[object]) -> Any:
    """A field that `build` refuses unless it is one of `choices`."""
    return field(default=default, metadata={"choices": choices})


@dataclass(frozen=True)
class AdapterSection:
    """A LoRA adapter every worker loads at start: what requests call it, where its PEFT
    directory is (adapter_config.json + adapter_model.safetensors, readable by every worker)."""

    name: str
    path: str


@dataclass(frozen=True)
class ModelSection:
    source: str = "default"
    device: str = _one_of("auto", ("auto", "cpu", "cuda"))
    """"auto" (CUDA when the node has GPUs, else CPU), "cpu" or "cuda"."""
    dtype: str | None = _one_of(None, ("float32", "bfloat16", "float16", None))
    """float32, bfloat16, float16; default: bfloat16 on CUDA, the checkpoint's own on CPU."""
    weights: str = _one_of(AUTO, (AUTO, *WEIGHT_FORMATS))
    """The linear layers' and output head's weight format (worker/weight_formats.py): float32
    (as loaded, in `dtype`), bf16, int8 (per channel) or int4 (groups of 32). Activations stay
    in `dtype` whatever the format. "auto": on a CPU the first format of bf16, int4, int8
    measured to keep quality on the checkpoint (bf16 for the default model), else float32
    (worker/weight_quality.py's `auto_weight_format`; `weights_for` resolves it)."""
    served_name: str | None = None
    """The model's name in the OpenAI and Anthropic APIs (the `model` a request names, the id in
    /v1/models); default: SmolLM2-135M-Instruct for the default model, else the source's
    directory name, or its file name without `.gguf`."""
    adapters: tuple[AdapterSection, ...] = ()
    """LoRA adapters loaded by every worker at start (more: the Admin RPC LoadAdapter, or
    POST /v1/load_lora_adapter). Names are unique, non-empty, without '@' (the cache identity
    is name@digest), at most MAX_ADAPTER_NAME_CHARS characters, and not the model's own name."""

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, adapter in enumerate(self.adapters):
            where = f"adapters[{i}].name"
            problem = adapter_name_problem(adapter.name)
            if problem:
                raise ConfigError(f"{where}: {problem}")
            if adapter.name in seen:
                raise ConfigError(f"{where}: {adapter.name!r} is listed twice")
            if adapter.name == self.name:
                raise ConfigError(f"{where}: {adapter.name!r} is the base model's served name")
            if not adapter.path:
                raise ConfigError(f"adapters[{i}].path: must not be empty")
            seen.add(adapter.name)
        try:  # a weight format measured to lose too much on this checkpoint is refused here
            if self.weights != AUTO:
                check_format_quality(self.checkpoint_name, self.weights)
        except WeightFormatRefused as err:
            raise ConfigError(f"weights: {err}") from None

    def weights_for(self, device: str) -> str:
        """The weight format a worker on `device` ("cpu" or "cuda") loads: `weights`, with
        "auto" resolved for this checkpoint and device."""
        if self.weights == AUTO:
            return auto_weight_format(self.checkpoint_name, device)
        return self.weights

    @property
    def checkpoint_name(self) -> str:
        """The name worker/weight_quality.py's measurements know the checkpoint by: its
        directory's name (a .gguf is converted into a directory named after the file)."""
        if self.source == "default":
            return DEFAULT_CHECKPOINT
        return (Path(self.source.rstrip("/")).name or self.source).removesuffix(".gguf")

    @property
    def name(self) -> str:
        if self.served_name:
            return self.served_name
        if self.source == "default":
            return DEFAULT_SERVED_NAME
        name = Path(self.source.rstrip("/")).name or self.source
        return name.removesuffix(".gguf")  # a checkpoint directory keeps its dots (Qwen2.5-7B)


@dataclass(frozen=True)
class EngineSection:
    num_pages: int | None = _at_least(None, 2)
    """Pages of each worker's KV pool, the null page included; null: sized from memory
    (kv_cache_memory_bytes, else on CUDA gpu_memory_utilization, else 4096 on a CPU)."""
    page_size: int = _at_least(16, 1)
    max_running: int = _at_least(32, 1)
    token_budget: int = _at_least(512, 1)
    max_prefill_chunk: int = _at_least(512, 1)
    max_model_len: int | None = _at_least(2048, 1)
    max_waiting: int = _at_least(256, 0)
    scheduling_policy: str = _one_of("fcfs", SCHEDULING_POLICIES)
    """"fcfs": first come, first served, and a request's priority other than 0 is refused;
    "priority": each worker admits waiting requests by their priority (lower first, vLLM's
    meaning) and preempts running ones of a higher value when a lower one needs the room."""
    in_batch_prefix_tokens: int = _at_least(32, 0)
    """Under fcfs, a waiting request whose prompt begins with at least this many tokens (and a
    page) that a running prompt of its namespace is computing now waits for that prompt to be
    cached and reads them from there, instead of computing them a second time (SGLang's
    in-batch prefix check); 0: never waits."""
    num_speculative_tokens: int = _at_least(0, 0, MAX_SPECULATIVE_TOKENS)
    """Speculative decoding by n-gram lookup: a decoding request whose last tokens occurred
    before in its prompt or output has what followed them verified with its next token in one
    pass, up to this many (vLLM's speculative_config, method ngram); 0: off. Outputs do not
    change: every token is still drawn by the request's own sampler."""
    prompt_lookup_max: int = _at_least(4, 1)
    """The longest suffix an n-gram draft is matched by."""
    prompt_lookup_min: int = _at_least(2, 1)
    """The shortest (at most prompt_lookup_max)."""
    num_prediction_tokens: int = _at_least(16, 0, MAX_SPECULATIVE_TOKENS)
    """The longest draft a decoding request verifies in one pass from its predicted output
    (OpenAI's `prediction`), speculating or not; 0: predictions are ignored. Outputs do not
    change."""
    block_size: int = _at_least(16, 1)
    host_pages: int = _at_least(0, 0)
    """Pages of the host tier: evicted KV moves to CPU memory instead of vanishing, and a later
    match copies it back (0: off). Each page holds page_size positions of every layer."""
    copy_stream_min_bytes: int = _at_least(64 << 20, 0)
    """On CUDA, tier copies moving at least this many bytes run on a copy stream that the
    forward pass waits on layer by layer; smaller ones on the compute stream (worker/
    kv_copies.py's MIN_STREAM_BYTES, the same default)."""
    persist_dir: str | None = None
    """Where each worker saves its cache (a directory per worker under it) in the background
    and on drain, and loads it at start; null: no persistence."""
    persist_max_bytes: int = _at_least(8 << 30, 1)
    persist_interval_s: float = _at_least(60.0, 0)
    """Seconds between background saves; 0: only on drain."""
    persist_evicted: bool = True
    """With persist_dir: what eviction drops from the last tier that held it is written to disk
    as it goes, not only what the saves find in the tree."""
    max_stop_strings: int = _at_least(MAX_STOP_STRINGS, 0)
    """Stop strings one request may give (OpenAI allows 4); more are refused by name."""
    max_stop_chars: int = _at_least(MAX_STOP_CHARS, 1)
    """Characters of each stop string."""
    max_prompt_chars: int = _at_least(DEFAULT_MAX_PROMPT_CHARS, 1)
    """Characters of a text prompt (or of a chat's messages together), refused before any
    tokenising: the router and the workers check the same numbers."""
    max_loras: int = _at_least(4, 1)
    """LoRA adapters resident on a worker's device at once (slots of one batch); more are kept
    in host memory and swapped in least recently used first."""
    max_lora_rank: int = _at_least(64, 1)
    """The largest adapter rank a worker accepts (its slots are this wide)."""
    max_images: int = _at_least(DEFAULT_MAX_IMAGES, 1)
    """Images one request may send (a vision model's; a text model refuses any)."""
    max_image_pixels: int = _at_least(DEFAULT_MAX_IMAGE_PIXELS, 1)
    """Width x height of one image, read from its header before a pixel is decoded: a larger
    one (a decompression bomb) is refused by name."""
    max_image_bytes: int = _at_least(DEFAULT_MAX_IMAGE_BYTES, 1)
    """Size of one image's file (PNG, JPEG or WebP). The gRPC message limit and the HTTP body
    limit grow by max_images of these (router.max_message_bytes)."""
    encoder_cache_bytes: int = _at_least(DEFAULT_ENCODER_CACHE_BYTES, 0)
    """Vision encoder outputs a worker keeps by image, least recently used dropped first, for
    images whose KV was evicted (0: none)."""
    gpu_memory_utilization: float = _at_least(0.9, 0.01, 1.0)
    """With num_pages null on CUDA: the fraction of its GPU's memory a worker may fill,
    counting what is already on the device; the KV pool gets what the weights, the heaviest
    step's activations (measured at start) and the encoder cache leave of it (vLLM's rule)."""
    kv_cache_memory_bytes: int | None = _at_least(None, 1)
    """With num_pages null: each worker's KV pool in bytes, on either device (vLLM's option)."""

    def __post_init__(self) -> None:
        """What each worker's cache would refuse when it starts (a page size not a power of
        two, a block size not a multiple of it, ...) is refused here, naming the key."""
        if self.num_pages is not None and self.kv_cache_memory_bytes is not None:
            raise ConfigError(
                "kv_cache_memory_bytes: set with num_pages; the pool is sized by one of them"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"prompt_lookup_min: {self.prompt_lookup_min} is above prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        try:
            CacheConfig(
                num_pages=2 if self.num_pages is None else self.num_pages,
                page_size=self.page_size,
                max_sequences=self.max_running,
                block_size=self.block_size,
                host_pages=self.host_pages,
            )
        except ValueError as err:  # the cache's messages begin with the key's name
            key, _, problem = str(err).partition(" ")
            key = "max_running" if key == "max_sequences" else key
            raise ConfigError(f"{key}: {problem}") from None


@dataclass(frozen=True)
class WorkersSection:
    count: int | None = _at_least(None, 1)
    """None: one per GPU, or 2 CPU workers on a machine without GPUs."""
    cpus_per_worker: float = _at_least(1.0, 0)
    host: str = "127.0.0.1"
    """Where workers bind gRPC; 0.0.0.0 binds every interface and advertises the node's IP
    (multi-node clusters: the router reaches workers on other nodes)."""
    max_restarts: int = _at_least(-1, -1)
    """Ray restarts a dead worker this many times (-1: always)."""


@dataclass(frozen=True)
class TextIndexSection:
    mode: str = _one_of("exact", ("off", "exact", "anchored"))
    """How text and chat prompts reuse the texts the router has seen (docs/router.md):
    "exact" reuses ids only where they provably equal a full tokenization; "anchored" reuses the
    ids cached for the matched text, generated ones included (more hits; the ids may differ from
    a full tokenization); "off" tokenises every prompt in full. A request may ask for another."""
    max_chars: int = _at_least(16_000_000, 0)
    """Characters kept, least recently used dropped first, over every tenant (0: none)."""
    min_fraction: float = _at_least(0.8, 0.0, 1.0)
    """Anchored mode: a text that leaves a stored text reuses its ids up to the divergence only
    when it shares at least this fraction of it (seed 002's DIVERGE rule)."""


@dataclass(frozen=True)
class RouterSection:
    host: str = "127.0.0.1"
    port: int = _port(50051)
    """gRPC (radixmesh.v1.Serving); 0: any free port."""
    http_port: int | None = _port(8000)
    """The OpenAI- and Anthropic-compatible HTTP API on the same host, with the same tokens,
    TLS and limits; 0: any free port; null: off."""
    policy: str = _one_of("cache_aware", POLICIES)
    max_in_flight: int = _at_least(256, 1)
    """Requests beyond this are refused at once with RESOURCE_EXHAUSTED (backpressure)."""
    max_retries: int = _at_least(2, 0)
    """Other workers tried when a worker fails before a request's first token."""
    resource: str | None = None
    """A custom Ray resource that pins the router to the nodes offering it (e.g. the Kubernetes
    head pod, where the Service points); None: anywhere."""
    max_message_bytes: int = _at_least(4 << 20, 1)
    """Of a gRPC message, and of an HTTP request body (larger: 413), besides their images (a
    vision model's: engine.max_images x engine.max_image_bytes more, base64 in HTTP)."""
    max_concurrent_streams: int = _at_least(64, 1)
    """Per client connection."""
    max_restarts: int = _at_least(-1, -1)
    response_store_bytes: int = _at_least(256 << 20, 0)
    """The Responses API's stored responses (`store`, `previous_response_id`), in the router's
    memory: at most this many bytes of conversations, the largest tenant's least recently used
    dropped first (one tenant storing much pushes out its own, not another's); the
    stored chat completions (`store: true`) and the Conversations API's conversations have a
    store each of their own with the same bound (so up to three times this in all); 0: none
    stored (`store: true` is refused, and there are no conversations)."""
    state_dir: str | None = None
    """A directory where the Files and Batch APIs keep their files and batches, and the stored
    responses, chat completions and conversations are written too, so that they outlive a
    restart of the router (a running batch goes on where it was); on the
    router's node (on Kubernetes, the chart's routerState.persistence sets it to a claim in
    the head pod). None: in memory only."""
    files_bytes: int = _at_least(1 << 30, 0)
    """The Files API's files (batch inputs, and the batches' output files), in the router's
    memory: an upload past this is refused (413); 0: no Files or Batch API."""
    files_bytes_per_tenant: int = _at_least(0, 0)
    """The most of `files_bytes` one tenant's files may take: its upload past it is refused
    (413), and no batch of its starts while its files take it, so that one tenant cannot
    fill the files for every other; 0: no bound apart from `files_bytes`."""
    batch_max_in_flight: int = _at_least(16, 1)
    """A batch's requests running at once, every batch's together (each also counts against
    max_in_flight)."""
    batch_order: str = _one_of("prefix", BATCH_ORDERS)
    """prefix: a batch's requests run sorted by their prompts, so that those sharing a prefix
    run together while it is cached; file: in the file's order."""
    batch_priority: int = _at_least(1, -(2**31), 2**31 - 1)
    """Under engine.scheduling_policy priority: the priority of a batch's requests that set none
    (lower first; interactive requests default to 0, so a batch yields to them). Under fcfs
    every request runs at 0."""
    peer_kv_min_tokens: int = _at_least(256, 0)
    """When another worker's device holds at least this many more of a prompt's leading
    tokens than the worker a request is routed to holds, that worker is told so and may read
    their KV from it instead of recomputing them (it does when its learned rates price the
    read faster); 0: never. Only policies that track blocks (cache_aware, least_ttft) know."""
    peer_kv_rate: float = _at_least(0.0, 0.0)
    """Tokens per second a worker reads from another's cache (measure yours with
    benchmarks/peer_kv_bench.py): cache_aware then prices moving a request away from its
    prefix's holder as that read instead of a recompute, so it moves more readily off a busy
    holder; 0: moves are priced as recomputes (the reads still happen)."""
    text_index: TextIndexSection = field(default_factory=TextIndexSection)


@dataclass(frozen=True)
class SecuritySection:
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_tokens: dict[str, str] = field(default_factory=dict)
    """Bearer token -> the tenant it may use ("*": any). Empty: no token is required."""

    def __post_init__(self) -> None:
        """Half a TLS setting is refused: the servers speak TLS only with both tls_cert and
        tls_key, and would otherwise serve plaintext without a word. A token that is empty or
        padded with whitespace (a YAML slip no client would send) is refused, never quoted."""
        if self.tls_cert and not self.tls_key:
            raise ConfigError("tls_key: required with tls_cert (else the port speaks plaintext)")
        if self.tls_key and not self.tls_cert:
            raise ConfigError("tls_cert: required with tls_key (else the port speaks plaintext)")
        if self.tls_client_ca and not (self.tls_cert and self.tls_key):
            raise ConfigError("tls_client_ca: mutual TLS requires tls_cert and tls_key")
        for i, token in enumerate(self.auth_tokens):
            if not token or token != token.strip():
                raise ConfigError(
                    f"auth_tokens: token {i + 1} is empty or starts or ends with whitespace"
                )


@dataclass(frozen=True)
class MetricsSection:
    enabled: bool = True
    host: str = "127.0.0.1"
    router_port: int = _port(9400)
    worker_port: int = _port(9401)
    """Worker i serves its metrics on worker_port + i (0 for both: any free port)."""
    max_tenants: int = _at_least(256, 0)
    """The most tenants whose usage the router counts each under its own name (the metrics'
    `tenant` label, `radixmesh stats`); the calls of tenants past it are counted together.
    0: none by name."""


@dataclass(frozen=True)
class ClusterConfig:
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    router: RouterSection = field(default_factory=RouterSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    drain_timeout_s: float = _at_least(30.0, 0)

    def __post_init__(self) -> None:
        """Worker i's metrics port, metrics.worker_port + i, must be a port for every worker
        counted (a count left to the cluster is checked when the workers are placed)."""
        check_worker_ports(self, self.workers.count or 1)

    @property
    def endpoint(self) -> str:
        return f"{self.router.host}:{self.router.port}"

    @classmethod
    def load(cls, path: Path | str | None) -> ClusterConfig:
        if path is None:
            return cls()
        path = Path(path)
        try:
            raw = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}
        except yaml.MarkedYAMLError as err:  # one line: the file, the line, the problem
            raise ConfigError(f"{path}: {yaml_problem(err)}") from None
        except yaml.reader.ReaderError as err:  # a character YAML does not take
            raise ConfigError(
                f"{path}: position {err.position}: unacceptable character #x{err.character:04x}"
            ) from None
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
            raise ConfigError(f"{path}: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        return build(cls, raw, str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing a key given twice in one mapping: PyYAML keeps the last, so a
    second `engine:` section would silently replace the first whole."""


def _unique_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    first: dict[Any, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
            continue  # merge keys (<<) may be overridden; other keys are refused by `build`
        key = loader.construct_object(key_node)
        line = key_node.start_mark.line + 1
        if key in first:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} given twice (first on line {first[key]})",
                key_node.start_mark,
            )  # fmt: skip
        first[key] = line
    return loader.construct_mapping(node)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def yaml_problem(err: yaml.MarkedYAMLError) -> str:
    """A YAML error in one line: where (line and column) and what."""
    mark = err.problem_mark or err.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    context = f" ({err.context})" if err.context else ""
    return f"{where}{err.problem or 'cannot be parsed'}{context}"


def check_worker_ports(config: ClusterConfig, count: int) -> None:
    """Refuse `count` workers whose metrics ports (metrics.worker_port + index) pass 65535."""
    port = config.metrics.worker_port
    if config.metrics.enabled and port and port + count - 1 > 65535:
        raise ConfigError(
            f"metrics.worker_port: {port} + {count} workers passes port 65535 (worker i serves "
            "on worker_port + i): lower it, or set it to 0 (any free port)"
        )


def adapter_name_problem(name: str) -> str | None:
    """What is wrong with `name` as an adapter's name (None: nothing)."""
    if not name:
        return "must not be empty"
    if len(name) > MAX_ADAPTER_NAME_CHARS:  # first: the messages below quote the name
        return f"{len(name)} characters; at most {MAX_ADAPTER_NAME_CHARS}"
    if "@" in name:
        return f"{name!r} contains '@' (an adapter's cache identity is name@digest)"
    if not name.isprintable():
        return f"{name!r} contains control characters"
    if name != name.strip():
        return f"{name!r} starts or ends with whitespace"
    return None


def engine_options(config: ClusterConfig) -> dict[str, Any]:
    """A worker's engine keyword arguments: the engine section, and the adapters to load at
    start as (name, path) pairs (worker/engine.py EngineConfig)."""
    return {
        **dataclasses.asdict(config.engine),
        "adapters": [(a.name, a.path) for a in config.model.adapters],
    }


def grpc_message_bytes(config: ClusterConfig) -> int:
    """What the router's gRPC server receives in one message: router.max_message_bytes, and
    the most image bytes a request may carry (the rest is held to the first by the service)."""
    engine = config.engine
    return config.router.max_message_bytes + engine.max_images * engine.max_image_bytes


def build(kind: type[T], raw: dict[str, Any], where: str) -> T:
    """Build dataclass `kind` from `raw`, refusing unknown keys, wrongly typed values and values
    outside their field's range or choices."""
    hints = get_type_hints(kind)
    fields = {f.name: f for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    odd = [key for key in raw if not isinstance(key, str)]
    if odd:  # `2: 3` is read as an int: no key's name, and not sortable with the names
        raise ConfigError(
            f"{where}: key {odd[0]!r} is not a name; expected some of {sorted(fields)}"
        )
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(fields)}")
    missing = [
        name
        for name, f in fields.items()
        if name not in raw
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}")
    values = {}
    for name, value in raw.items():
        key = f"{where}.{name}" if where else name
        values[name] = _convert(hints[name], _switch(fields[name].metadata, value), key)
        _check_range(fields[name].metadata, values[name], key)
    try:
        return kind(**values)
    except ConfigError as err:  # a section's own check across its keys: name where it is
        raise ConfigError(f"{where}.{err}" if where else str(err)) from None


def _switch(metadata: Any, value: Any) -> Any:
    """ "off" ("on") for false (true) where it is a choice: YAML 1.1 reads them unquoted so."""
    if isinstance(value, bool) and ("on" if value else "off") in metadata.get("choices", ()):
        return "on" if value else "off"
    return value


def _check_range(metadata: Any, value: Any, where: str) -> None:
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not one of {sorted(map(str, choices))}")
    least, most = metadata.get("least"), metadata.get("most")
    if value is None or (least is None and most is None):
        return
    if value < least or (most is not None and value > most):
        bounds = f"from {least} to {most}" if most is not None else f"at least {least}"
        raise ConfigError(f"{where}: must be {bounds}, got {value!r}")


def _finite(value: int | float, where: str) -> float:
    """A float key's value, an int widened; refused, naming `where`, unless finite."""
    try:
        number = float(value)
    except OverflowError:  # an int past a float's range
        number = math.inf
    if not math.isfinite(number):
        got = repr(value) if isinstance(value, float) else "an int past a float's range"
        raise ConfigError(f"{where}: must be a finite number, got {got}")
    return number


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = get_args(hint)
        if value is None and type(None) in options:
            return None
        hint = next(o for o in options if o is not type(None))
        origin = get_origin(hint)
    if origin is tuple:  # tuple[X, ...]: a YAML list of X
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item = get_args(hint)[0]
        return tuple(_convert(item, each, f"{where}[{i}]") for i, each in enumerate(value))
    if dataclasses.is_dataclass(hint):
        if value is None:  # a section whose every key is commented out: its defaults
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return build(hint, value, where)  # type: ignore[arg-type]
    if origin is dict:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError(f"{where}: expected a mapping of strings, got {value!r}")
        return dict(value)
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return _finite(value, where)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value
