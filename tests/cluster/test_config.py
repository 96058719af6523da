"""The config file is refused at load, naming the key, for values the cluster cannot run with;
`radixmesh serve` says so in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError, ModelSection, build, engine_options


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # range(max_retries + 1) is empty below 0: every request ended OK with no token
        ("router: {max_retries: -1}", "router.max_retries: must be at least 0, got -1"),
        ("router: {max_in_flight: 0}", "router.max_in_flight: must be at least 1, got 0"),
        ("router: {port: 70000}", "router.port: must be from 0 to 65535, got 70000"),
        ("router: {policy: fastest}", "router.policy: 'fastest' is not one of ['cache_aware'"),
        ("model: {device: gpu}", "model.device: 'gpu' is not one of ['auto', 'cpu', 'cuda']"),
        ("model: {dtype: fp8}", "model.dtype: 'fp8' is not one of"),
        ("model: {weights: q4_0}", "model.weights: 'q4_0' is not one of ['auto', 'bf16'"),
        ("workers: {count: 0}", "workers.count: must be at least 1, got 0"),
        ("workers: {cpus_per_worker: -1}", "workers.cpus_per_worker: must be at least 0"),
        ("engine: {num_pages: 1}", "engine.num_pages: must be at least 2, got 1"),
        ("engine: {gpu_memory_utilization: 0}", "engine.gpu_memory_utilization: must be from"),
        ("engine: {kv_cache_memory_bytes: 0}", "engine.kv_cache_memory_bytes: must be at least 1"),
        (
            "engine: {num_pages: 64, kv_cache_memory_bytes: 1000000}",
            "engine.kv_cache_memory_bytes: set with num_pages; the pool is sized by one of them",
        ),
        # what a worker's cache would refuse at start, refused before any actor is placed
        ("engine: {page_size: 3}", "engine.page_size: must be a power of two, got 3"),
        ("engine: {page_size: 4, block_size: 6}", "engine.block_size: must be a positive multiple"),
        ("engine: {host_pages: 1}", "engine.host_pages: must be 0 (no host tier) or >= 2"),
        ("engine: {num_speculative_tokens: 65}", "engine.num_speculative_tokens: must be from 0"),
        (
            "engine: {in_batch_prefix_tokens: -1}",
            "engine.in_batch_prefix_tokens: must be at least 0",
        ),
        ("engine: {prompt_lookup_min: 0}", "engine.prompt_lookup_min: must be at least 1, got 0"),
        (
            "engine: {prompt_lookup_min: 5}",
            "engine.prompt_lookup_min: 5 is above prompt_lookup_max (4)",
        ),
        ("metrics: {worker_port: -1}", "metrics.worker_port: must be from 0 to 65535"),
        ("drain_timeout_s: -5", "drain_timeout_s: must be at least 0, got -5.0"),
        ("router: {text_index: {mode: fuzzy}}", "router.text_index.mode: 'fuzzy' is not one of"),
        ("router: {text_index: {max_chars: -1}}", "router.text_index.max_chars: must be at least"),
        ("router: {text_index: {min_fraction: 1.5}}", "router.text_index.min_fraction: must be"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_its_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "radixmesh.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        ClusterConfig.load(path)
    assert str(err.value).startswith(f"{path}.") and expected in str(err.value)


def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "radixmesh.yaml"
    path.write_bytes(b"router: {port: 1}\n\xff\xfe: 1\n")
    with pytest.raises(ConfigError, match=f"^{path}: 'utf-8' codec can't decode byte 0xff"):
        ClusterConfig.load(path)


def test_the_weight_formats_are_the_loaders(tmp_path: Path) -> None:
    """cluster/config.py spells the formats out (the router must not import torch)."""
    from cluster.config import WEIGHT_FORMATS
    from worker.quantized_weights import WEIGHT_FORMATS as LOADER_FORMATS

    assert WEIGHT_FORMATS == LOADER_FORMATS
    path = tmp_path / "radixmesh.yaml"
    for fmt in WEIGHT_FORMATS:
        path.write_text(f"model: {{source: /models/unmeasured, weights: {fmt}}}\n")
        assert ClusterConfig.load(path).model.weights == fmt
    assert ModelSection().weights == "auto"


def test_auto_weights_are_the_first_format_measured_to_keep_quality_on_a_cpu() -> None:
    """weights: auto is bf16 for the default model on a CPU (measured -0.04 %), float32 on CUDA
    and for a checkpoint never measured; a format measured past the threshold is skipped for
    the next in AUTO_CPU_ORDER; an explicit format is served as written."""
    from worker import weight_quality
    from worker.weight_quality import FormatQuality

    default = ModelSection()
    assert default.weights_for("cpu") == "bf16"
    assert default.weights_for("cuda") == "float32"
    assert ModelSection(source="/models/unmeasured").weights_for("cpu") == "float32"
    assert ModelSection(weights="bf16").weights_for("cpu") == "bf16"
    assert ModelSection(weights="int8").weights_for("cuda") == "int8"
    measured = weight_quality.MEASURED
    saved = dict(measured)
    try:
        bad = FormatQuality(perplexity_increase=0.05, identical_token_share=0.3)
        good = FormatQuality(perplexity_increase=0.001, identical_token_share=0.9)
        measured["lossy"] = {"bf16": bad, "int4": good, "int8": good}
        assert ModelSection(source="/models/lossy").weights_for("cpu") == "int4"
        measured["lossy"] = {"bf16": bad, "int4": bad}
        assert ModelSection(source="/models/lossy").weights_for("cpu") == "float32"
    finally:
        measured.clear()
        measured.update(saved)


def test_the_edges_of_each_range_load(tmp_path: Path) -> None:
    path = tmp_path / "radixmesh.yaml"
    path.write_text(
        "model: {device: cuda, dtype: null}\n"
        "engine: {max_model_len: null, max_waiting: 0}\n"
        "workers: {count: null, max_restarts: -1, cpus_per_worker: 0.5}\n"
        "router: {port: 0, max_retries: 0, max_in_flight: 1, policy: round_robin}\n"
        "metrics: {router_port: 65535, worker_port: 0}\n"
        "drain_timeout_s: 0\n"
    )
    config = ClusterConfig.load(path)
    assert (config.router.port, config.router.max_retries, config.router.policy) == (
        0, 0, "round_robin",
    )  # fmt: skip
    assert config.engine.max_model_len is None and config.workers.count is None


def serve_with(tmp_path: Path, text: str) -> subprocess.CompletedProcess[str]:
    """`radixmesh serve --config` on a file holding `text` (refused before Ray starts)."""
    path = tmp_path / "radixmesh.yaml"
    path.write_text(text)
    script = Path(sys.executable).parent / "radixmesh"
    return subprocess.run(
        [script, "serve", "--config", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_serve_refuses_a_bad_config_in_one_line(tmp_path: Path) -> None:
    out = serve_with(tmp_path, "router: {max_retries: -1}\n")
    assert out.returncode == 2
    assert "router.max_retries: must be at least 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_cuda_workers_without_a_gpu_or_a_count_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cluster import serve

    monkeypatch.setattr(serve, "gpu_count", lambda: 0)
    config = ClusterConfig(model=ModelSection(device="cuda"))
    with pytest.raises(ConfigError, match=r"model\.device is cuda but the Ray cluster has no GPU"):
        serve.place_workers(config)


@pytest.mark.parametrize(
    ("model", "name"),
    [
        (ModelSection(), "SmolLM2-135M-Instruct"),
        (ModelSection(source="/models/Qwen2.5-7B-Instruct/"), "Qwen2.5-7B-Instruct"),
        (ModelSection(source="/models/smol-q8.gguf"), "smol-q8"),
        (ModelSection(source="/models/x.gguf", served_name="chat"), "chat"),
    ],
)
def test_the_served_model_name(model: ModelSection, name: str) -> None:
    assert model.name == name


@pytest.mark.parametrize(
    ("adapters", "expected"),
    [
        ("[{name: '', path: /a}]", "model.adapters[0].name: must not be empty"),
        ("[{name: 'x@1', path: /a}]", "model.adapters[0].name: 'x@1' contains '@'"),
        (f"[{{name: {'a' * 129}, path: /a}}]", "model.adapters[0].name: 129 characters"),
        ("[{name: a, path: /a}, {name: a, path: /b}]", "model.adapters[1].name: 'a' is listed"),
        ("[{name: SmolLM2-135M-Instruct, path: /a}]", "is the base model's served name"),
        ("[{name: a}]", "model.adapters[0]: missing key(s) ['path']"),
        ("[{name: a, path: 3}]", "model.adapters[0].path: expected str, got 3"),
        ("[{name: a, path: ''}]", "model.adapters[0].path: must not be empty"),
        ("[{name: a, path: /a, rank: 8}]", "model.adapters[0]: unknown key(s) ['rank']"),
        ("{name: a, path: /a}", "model.adapters: expected a list"),
    ],
)
def test_a_bad_adapter_list_is_refused_naming_the_entry(
    tmp_path: Path, adapters: str, expected: str
) -> None:
    path = tmp_path / "radixmesh.yaml"
    path.write_text(f"model: {{adapters: {adapters}}}\n")
    with pytest.raises(ConfigError) as err:
        ClusterConfig.load(path)
    assert str(err.value).startswith(f"{path}.") and expected in str(err.value), str(err.value)


@pytest.mark.parametrize("text", ["engine: {max_loras: 0}", "engine: {max_lora_rank: 0}"])
def test_lora_slots_and_rank_are_at_least_one(tmp_path: Path, text: str) -> None:
    path = tmp_path / "radixmesh.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError, match=r"engine\.max_lora.*: must be at least 1, got 0"):
        ClusterConfig.load(path)


def test_adapters_reach_each_worker_engine_as_name_path_pairs(tmp_path: Path) -> None:
    path = tmp_path / "radixmesh.yaml"
    path.write_text(
        "model: {adapters: [{name: shouty, path: /a/shouty}, {name: terse, path: /a/terse}]}\n"
        "engine: {max_loras: 2, max_lora_rank: 16}\n"
    )
    config = ClusterConfig.load(path)
    assert [a.name for a in config.model.adapters] == ["shouty", "terse"]
    # what the router actor rebuilds from (Ray passes the dict) is the same config
    assert build(ClusterConfig, config.to_dict(), "") == config
    options = engine_options(config)
    assert options["adapters"] == [("shouty", "/a/shouty"), ("terse", "/a/terse")]
    assert (options["max_loras"], options["max_lora_rank"]) == (2, 16)
    assert ClusterConfig().engine.max_loras == 4 and ClusterConfig().engine.max_lora_rank == 64
    assert engine_options(ClusterConfig())["adapters"] == []


def test_the_in_batch_prefix_setting_reaches_each_worker_engine(tmp_path: Path) -> None:
    (tmp_path / "radixmesh.yaml").write_text("engine: {in_batch_prefix_tokens: 0}\n")
    options = engine_options(ClusterConfig.load(tmp_path / "radixmesh.yaml"))
    assert options["in_batch_prefix_tokens"] == 0
    assert engine_options(ClusterConfig())["in_batch_prefix_tokens"] == 32


def _load(tmp_path: Path, text: str) -> ClusterConfig:
    path = tmp_path / "radixmesh.yaml"
    path.write_text(text)
    return ClusterConfig.load(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{tls_cert: /c.pem}", r"security\.tls_key: required with tls_cert"),
        ("{tls_key: /k.pem}", r"security\.tls_cert: required with tls_key"),
        ("{tls_client_ca: /ca.pem}", r"security\.tls_client_ca: mutual TLS requires tls_cert"),
        ("{tls_client_ca: /ca.pem, tls_cert: /c.pem}", r"security\.tls_key: required with"),
    ],
)
def test_half_a_tls_setting_is_refused_naming_the_missing_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    """The servers speak TLS only with tls_cert and tls_key both: a file without the other (or
    a client CA without both) loaded fine and the public ports spoke plaintext without a word."""
    with pytest.raises(ConfigError, match=expected):
        _load(tmp_path, f"security: {text}\n")
    config = _load(tmp_path, "security: {tls_cert: /c.pem, tls_key: /k.pem, tls_client_ca: /a}\n")
    assert config.security.tls_client_ca == "/a"


@pytest.mark.parametrize("token", ["''", "' s3cret'", '"s3cret\\t"'])
def test_an_empty_or_padded_token_is_refused_without_quoting_it(tmp_path: Path, token: str) -> None:
    """No client sends such a token (an HTTP header's value is trimmed): a YAML slip, refused
    at load; the message never repeats a token."""
    with pytest.raises(ConfigError, match=r"security\.auth_tokens: token 2 is empty or") as err:
        _load(tmp_path, f'security: {{auth_tokens: {{good: "*", {token}: acme}}}}\n')
    assert "s3cret" not in str(err.value)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("engine: {gpu_memory_utilization: .nan}", "engine.gpu_memory_utilization"),
        ("workers: {cpus_per_worker: .nan}", "workers.cpus_per_worker"),
        ("workers: {cpus_per_worker: .inf}", "workers.cpus_per_worker"),
        ("drain_timeout_s: .nan", "drain_timeout_s"),
        ("drain_timeout_s: .inf", "drain_timeout_s"),
        ("router: {text_index: {min_fraction: .nan}}", "router.text_index.min_fraction"),
        ("router: {peer_kv_rate: -.inf}", "router.peer_kv_rate"),
        ("engine: {persist_interval_s: .inf}", "engine.persist_interval_s"),
    ],
)
def test_a_number_that_is_not_finite_is_refused_naming_its_key(
    tmp_path: Path, text: str, key: str
) -> None:
    """NaN passes every comparison and infinity every lower bound: they loaded, then failed
    after Ray started (int(nan) placing workers), at router start (an infinite drain timeout
    overflowed the HTTP server) or not at all (a NaN drain never waited)."""
    with pytest.raises(ConfigError, match=rf"\.{key}: must be a finite number, got -?(nan|inf)"):
        _load(tmp_path, text + "\n")


@pytest.mark.parametrize(
    ("text", "where"), [("foo: 1\n2: 3\n", ""), ("router: {2: 3}\n", ".router")]
)
def test_a_key_that_is_not_a_name_is_refused(tmp_path: Path, text: str, where: str) -> None:
    """`2: 3` is an int key: sorting it with the names for the unknown-key message raised a
    TypeError traceback."""
    path = tmp_path / "radixmesh.yaml"
    with pytest.raises(ConfigError, match=rf"^{path}{where}: key 2 is not a name; expected"):
        _load(tmp_path, text)


def test_serve_refuses_a_key_that_is_not_a_name_in_one_line(tmp_path: Path) -> None:
    """`radixmesh serve` on such a file: one line, exit 2, no traceback."""
    out = serve_with(tmp_path, "foo: 1\n2: 3\n")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "key 2 is not a name" in out.stderr


def test_an_unquoted_off_is_the_text_index_mode_off(tmp_path: Path) -> None:
    """YAML 1.1 reads `off` unquoted as false; "off" is a documented choice of the mode, so
    false is taken as "off" there, and a boolean is still refused where it is no choice."""
    assert _load(tmp_path, "router: {text_index: {mode: off}}\n").router.text_index.mode == "off"
    assert _load(tmp_path, 'router: {text_index: {mode: "off"}}\n').router.text_index.mode == "off"
    with pytest.raises(ConfigError, match=r"router\.text_index\.mode: expected str, got True"):
        _load(tmp_path, "router: {text_index: {mode: on}}\n")
    with pytest.raises(ConfigError, match=r"model\.dtype: expected str, got False"):
        _load(tmp_path, "model: {dtype: off}\n")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("engine: {page_size: 32}\nengine: {max_running: 4}\n", "line 2, column 1: key 'engine'"),
        ("router:\n  port: 1\n  port: 2\n", "line 3, column 3: key 'port' given twice"),
    ],
)
def test_a_key_given_twice_is_refused_naming_it_and_its_line(
    tmp_path: Path, text: str, expected: str
) -> None:
    """PyYAML keeps the last of a repeated key: a second `engine:` section silently replaced
    the first whole. Merge keys (<<) may still be overridden."""
    path = tmp_path / "radixmesh.yaml"
    with pytest.raises(ConfigError, match=rf"^{path}: {expected}.*\(first on line"):
        _load(tmp_path, text)
    merged = (
        "router: {port: 1}\nmetrics:\n  <<: {router_port: 1, worker_port: 2}\n  worker_port: 3\n"
    )
    assert _load(tmp_path, merged).metrics.worker_port == 3


def test_a_yaml_syntax_error_is_one_line_naming_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "radixmesh.yaml"
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, "router: {port: 1}\nengine: {page_size: [\n")
    message = str(err.value)
    assert message.startswith(f"{path}: line 3, column 1: ") and "\n" not in message, message


def test_worker_metrics_ports_past_65535_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker i serves its metrics on worker_port + i: a count that runs past port 65535 is
    refused at load, and a count left to the cluster (one per GPU) when the workers are placed."""
    from cluster import serve

    with pytest.raises(ConfigError, match=r"metrics\.worker_port: 65534 \+ 3 workers passes"):
        _load(tmp_path, "metrics: {worker_port: 65534}\nworkers: {count: 3}\n")
    assert _load(tmp_path, "metrics: {worker_port: 65534}\nworkers: {count: 2}\n")
    assert _load(tmp_path, "metrics: {enabled: false, worker_port: 65535}\nworkers: {count: 9}\n")
    config = _load(tmp_path, "metrics: {worker_port: 65535}\nmodel: {device: cuda}\n")
    monkeypatch.setattr(serve, "gpu_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"metrics\.worker_port: 65535 \+ 2 workers passes"):
        serve.place_workers(config)


def test_worker_metrics_bind_metrics_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """metrics.host is where the worker's Prometheus server binds, as the router's does; it
    used to bind workers.host, ignoring metrics.host (the actor's arguments are captured)."""
    from cluster import serve

    config = _load(tmp_path, "metrics: {host: 127.0.0.2}\nworkers: {count: 2, host: 127.0.0.3}\n")
    placed: list[tuple[tuple[object, ...], dict[str, object]]] = []

    class Placed:
        def options(self, **_: object) -> Placed:
            return self

        def remote(self, *args: object, **kwargs: object) -> object:
            placed.append((args, kwargs))
            return object()

    monkeypatch.setattr(serve, "gpu_count", lambda: 0)
    monkeypatch.setattr(serve.ray, "cluster_resources", lambda: {"CPU": 4.0})
    monkeypatch.setattr(serve.ray, "remote", lambda cls: Placed())
    serve.place_workers(config)
    assert [kwargs["metrics_host"] for _, kwargs in placed] == ["127.0.0.2", "127.0.0.2"]
    assert [args[5:7] for args, _ in placed] == [("127.0.0.3", 9401), ("127.0.0.3", 9402)]


def test_a_character_yaml_refuses_and_an_integer_past_a_float_are_one_line(
    tmp_path: Path,
) -> None:
    """Neither is a marked syntax error nor a float: each still says what is wrong in one
    line, naming the file and the position or key."""
    bell = tmp_path / "bell.yaml"
    bell.write_text("router: {port: 1}\x07\n")
    with pytest.raises(ConfigError) as refused:
        ClusterConfig.load(bell)
    assert "\n" not in str(refused.value) and "unacceptable character #x0007" in str(refused.value)
    huge = tmp_path / "huge.yaml"
    huge.write_text("drain_timeout_s: 1" + "0" * 400 + "\n")
    with pytest.raises(ConfigError, match="drain_timeout_s: must be a finite number"):
        ClusterConfig.load(huge)


def test_a_section_whose_every_key_is_commented_out_takes_its_defaults(tmp_path: Path) -> None:
    """YAML reads `engine:` with nothing after it as null: the section as if left out."""
    path = tmp_path / "c.yaml"
    path.write_text("engine:\n  # page_size: 32\nrouter:\n  port: 50052\n")
    config = ClusterConfig.load(path)
    assert config.engine == ClusterConfig().engine and config.router.port == 50052
    path.write_text("engine: 5\n")
    with pytest.raises(ConfigError, match="engine: expected a mapping, got 5"):
        ClusterConfig.load(path)
