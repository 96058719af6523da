"""The cluster's configuration: frozen sections built once from a YAML file (or the defaults).

    model:    source ("default" = SmolLM2-135M-Instruct, a checkpoint dir, a .gguf), device
    engine:   the worker engine (pages, page size, batching limits, context)
    workers:  how many (default: one per GPU, else 2 CPU workers), CPUs each, bind host
    router:   the public endpoint, routing policy, admission and message limits, retries
    security: TLS files, bearer tokens (each bound to a tenant, or "*" for any)
    metrics:  Prometheus ports of the router and of each worker (port + index)

Unknown keys and wrongly typed values are refused with an error that names them: a typo must
not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

T = TypeVar("T")
ANY_TENANT = "*"


class ConfigError(ValueError):
    """A configuration file that cannot be used as written; the message names the key."""


@dataclass(frozen=True)
class ModelSection:
    source: str = "default"
    device: str = "auto"
    """"auto" (CUDA when the node has GPUs, else CPU), "cpu" or "cuda"."""
    dtype: str | None = None
    """float32, bfloat16, float16; default: bfloat16 on CUDA, the checkpoint's own on CPU."""


@dataclass(frozen=True)
class EngineSection:
    num_pages: int = 4096
    page_size: int = 16
    max_running: int = 32
    token_budget: int = 512
    max_prefill_chunk: int = 512
    max_model_len: int | None = 2048
    max_waiting: int = 256
    block_size: int = 16


@dataclass(frozen=True)
class WorkersSection:
    count: int | None = None
    """None: one per GPU, or 2 CPU workers on a machine without GPUs."""
    cpus_per_worker: float = 1.0
    host: str = "127.0.0.1"
    """Where workers bind gRPC; 0.0.0.0 binds every interface and advertises the node's IP
    (multi-node clusters: the router reaches workers on other nodes)."""
    max_restarts: int = -1
    """Ray restarts a dead worker this many times (-1: always)."""


@dataclass(frozen=True)
class RouterSection:
    host: str = "127.0.0.1"
    port: int = 50051
    policy: str = "cache_aware"
    max_in_flight: int = 256
    """Requests beyond this are refused at once with RESOURCE_EXHAUSTED (backpressure)."""
    max_retries: int = 2
    """Other workers tried when a worker fails before a request's first token."""
    resource: str | None = None
    """A custom Ray resource that pins the router to the nodes offering it (e.g. the Kubernetes
    head pod, where the Service points); None: anywhere."""
    max_message_bytes: int = 4 << 20
    max_concurrent_streams: int = 64
    """Per client connection."""
    max_restarts: int = -1


@dataclass(frozen=True)
class SecuritySection:
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_tokens: dict[str, str] = field(default_factory=dict)
    """Bearer token -> the tenant it may use ("*": any). Empty: no token is required."""


@dataclass(frozen=True)
class MetricsSection:
    enabled: bool = True
    host: str = "127.0.0.1"
    router_port: int = 9400
    worker_port: int = 9401
    """Worker i serves its metrics on worker_port + i (0 for both: any free port)."""


@dataclass(frozen=True)
class ClusterConfig:
    model: ModelSection = field(default_factory=ModelSection)
    engine: EngineSection = field(default_factory=EngineSection)
    workers: WorkersSection = field(default_factory=WorkersSection)
    router: RouterSection = field(default_factory=RouterSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    drain_timeout_s: float = 30.0

    @property
    def endpoint(self) -> str:
        return f"{self.router.host}:{self.router.port}"

    @classmethod
    def load(cls, path: Path | str | None) -> ClusterConfig:
        if path is None:
            return cls()
        path = Path(path)
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"{path}: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        return build(cls, raw, str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build(kind: type[T], raw: dict[str, Any], where: str) -> T:
    """Build dataclass `kind` from `raw`, refusing unknown keys and wrongly typed values."""
    hints = get_type_hints(kind)
    names = {f.name for f in dataclasses.fields(kind)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; expected some of {sorted(names)}")
    values = {}
    for name, value in raw.items():
        values[name] = _convert(hints[name], value, f"{where}.{name}" if where else name)
    return kind(**values)


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = get_args(hint)
        if value is None and type(None) in options:
            return None
        hint = next(o for o in options if o is not type(None))
        origin = get_origin(hint)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return build(hint, value, where)  # type: ignore[arg-type]
    if origin is dict:
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise ConfigError(f"{where}: expected a mapping of strings, got {value!r}")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value
