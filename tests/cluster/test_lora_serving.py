"""Multi-LoRA serving end to end: real PEFT adapter directories, real workers and router over
loopback gRPC, the Admin RPCs, the gRPC Generate with namespace.adapter, and the CLI.

An adapter loaded through the Admin service is served at once (the router refreshes its view),
its greedy output differs from the base model's and repeats from cache, ListAdapters shows it
on every worker, a worker that joins later gets it, and once unloaded it is refused by name. A
bad adapter is refused naming the file, on no worker loaded, and the cluster keeps serving.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cluster.client import Client, text_request
from cluster.config import AdapterSection, SecuritySection
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc
from tests.cluster.local_cluster import LocalCluster, start_cluster
from tests.worker.lora_fixtures import make_peft_adapter
from worker.loader import LoadedModel

PROMPT = list(range(5, 45))
EVERY_MODULE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def adapters(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "caps": make_peft_adapter(root / "caps", tiny.path, rank=8, seed=1, scale=1.0),
        "sql": make_peft_adapter(
            root / "sql", tiny.path, rank=4, seed=2, scale=1.0, target_modules=EVERY_MODULE
        ),
    }


@pytest.fixture
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    running = start_cluster(tiny, workers=2)
    yield running
    running.close()


def tokens(client: Client, adapter: str = "", prompt: list[int] = PROMPT) -> list[int]:
    request = text_request(token_ids=prompt, max_tokens=8, temperature=0, adapter=adapter)
    return [t for r in client.generate(request, timeout=60) for t in r.token_ids]


def last(client: Client, adapter: str, prompt: list[int] = PROMPT) -> serving_pb2.GenerateResponse:
    request = text_request(token_ids=prompt, max_tokens=4, temperature=0, adapter=adapter)
    return list(client.generate(request, timeout=60))[-1]


def refused(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_admin_load_generate_list_unload(cluster: LocalCluster, adapters: dict[str, Path]) -> None:
    client = Client(cluster.target)
    base = tokens(client)
    unknown = refused(lambda: tokens(client, "caps"))
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown adapter 'caps' (loaded: none)" in unknown.details()

    loaded = client.load_adapter("caps", str(adapters["caps"])).adapters
    assert sorted(info.worker for info in loaded) == ["worker-0", "worker-1"]
    identity = loaded[0].identity
    assert identity.startswith("caps@") and {i.identity for i in loaded} == {identity}
    assert cluster.links.adapters() == {"caps": identity}  # refreshed, not waiting for a poll

    with_caps = tokens(client, "caps")  # served right after the load
    assert with_caps != base
    again = last(client, "caps")
    assert again.cached_prompt_tokens > 0  # its own namespace, cached after the first
    assert tokens(client) == base  # the base model is untouched

    listed = client.list_adapters().adapters
    assert sorted((i.name, i.worker, i.rank) for i in listed) == [
        ("caps", "worker-0", 8),
        ("caps", "worker-1", 8),
    ]
    assert all(i.path == str(adapters["caps"]) for i in listed)

    gone = client.unload_adapter("caps")
    assert gone.workers == 2 and gone.pages_freed > 0
    after = refused(lambda: tokens(client, "caps"))
    assert after.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown adapter 'caps'" in after.details()
    missing = refused(lambda: client.unload_adapter("caps"))
    assert missing.code() == grpc.StatusCode.NOT_FOUND and "'caps'" in missing.details()
    assert not client.list_adapters().adapters
    cluster.wait_idle()
    client.close()


def test_router_hashes_in_the_identity_namespace_the_workers_accept(
    cluster: LocalCluster, adapters: dict[str, Path]
) -> None:
    """The router's predicted cache hits for an adapter come true: its hashes are the
    workers' (name@digest namespace), so the request goes where its prefix is cached."""
    client = Client(cluster.target)
    client.load_adapter("sql", str(adapters["sql"]))
    first = last(client, "sql")
    second = last(client, "sql")
    assert second.worker == first.worker and second.cached_prompt_tokens > 0
    # the worker's KV events (hashed by the worker in the adapter's namespace) matched the
    # router's hashes of the second request: its 2 complete 16-token blocks of 40
    assert client.stats().predicted_cached_tokens == 32
    client.close()


def test_a_bad_adapter_is_refused_naming_the_file_and_serving_goes_on(
    cluster: LocalCluster, adapters: dict[str, Path], tmp_path: Path
) -> None:
    client = Client(cluster.target)
    broken = tmp_path / "broken"
    shutil.copytree(adapters["caps"], broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a truncated file
    err = refused(lambda: client.load_adapter("broken", str(broken)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(weights) in err.details() and "worker-0" in err.details(), err.details()
    nowhere = refused(lambda: client.load_adapter("void", str(tmp_path / "absent")))
    assert nowhere.code() == grpc.StatusCode.INVALID_ARGUMENT and "absent" in nowhere.details()
    bad_name = refused(lambda: client.load_adapter("a@b", str(adapters["caps"])))
    assert bad_name.code() == grpc.StatusCode.INVALID_ARGUMENT and "'@'" in bad_name.details()
    assert not client.list_adapters().adapters  # nothing stayed loaded anywhere
    assert len(tokens(client)) == 8  # still serving
    cluster.wait_idle()
    client.close()


def test_a_worker_that_joins_gets_the_admin_loaded_adapters(
    cluster: LocalCluster, adapters: dict[str, Path]
) -> None:
    client = Client(cluster.target)
    client.load_adapter("caps", str(adapters["caps"]))
    client.load_adapter("sql", str(adapters["sql"]))
    client.unload_adapter("sql")
    cluster.add_worker("worker-2")
    held = {(i.worker, i.name) for i in client.list_adapters().adapters}
    assert held == {("worker-0", "caps"), ("worker-1", "caps"), ("worker-2", "caps")}
    for name in ("worker-0", "worker-1"):  # the newcomer alone may now serve it
        cluster.kill_worker(name)
        cluster.loop.run(cluster.links.detach(name))
    response = last(client, "caps")
    assert response.worker == "worker-2" and response.finish_reason
    client.close()


def test_adapters_in_the_config_are_served_from_the_start(
    tiny: LoadedModel, adapters: dict[str, Path]
) -> None:
    preloaded = (AdapterSection("caps", str(adapters["caps"])),)
    running = start_cluster(tiny, workers=1, adapters=preloaded)
    try:
        client = Client(running.target)
        assert [i.name for i in client.list_adapters().adapters] == ["caps"]
        assert tokens(client, "caps") != tokens(client)
        client.close()
    finally:
        running.close()


def test_adapter_admin_needs_a_token_for_every_tenant(
    tiny: LoadedModel, adapters: dict[str, Path]
) -> None:
    security = SecuritySection(auth_tokens={"tenant-token": "acme", "admin-token": "*"})
    running = start_cluster(tiny, workers=1, security=security)
    try:
        tenant = Client(running.target, token="tenant-token")
        err = refused(lambda: tenant.load_adapter("caps", str(adapters["caps"])))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        admin = Client(running.target, token="admin-token")
        admin.load_adapter("caps", str(adapters["caps"]))
        assert len(tokens(tenant, "caps")) == 8  # any tenant may use a loaded adapter
        tenant.close()
        admin.close()
    finally:
        running.close()


def test_cli_generate_with_an_adapter_and_adapters_commands(
    cluster: LocalCluster, adapters: dict[str, Path]
) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:  # `radixmesh ...` of this tree
        return subprocess.run(
            [sys.executable, "-m", "cluster.cli", *args, "--target", cluster.target],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    loaded = run("adapters", "load", "caps", str(adapters["caps"]))
    assert loaded.returncode == 0 and "loaded caps (caps@" in loaded.stdout, loaded.stderr
    listed = run("adapters", "list")
    assert listed.returncode == 0 and listed.stdout.count("caps@") == 2
    generate = ("generate", "The router", "--raw", "--max-tokens", "12")
    with_caps, base = run(*generate, "--adapter", "caps"), run(*generate)
    assert with_caps.returncode == 0 and base.returncode == 0
    assert with_caps.stdout.strip() and with_caps.stdout != base.stdout
    unknown = run(*generate, "--adapter", "nope")
    assert unknown.returncode == 1 and "unknown adapter 'nope' (loaded: caps)" in unknown.stderr
    assert run("adapters", "unload", "caps").returncode == 0
    usage = run("adapters", "load", "caps")
    assert usage.returncode == 2 and "load NAME PATH" in usage.stderr


def test_the_router_learns_adapters_from_load_polls_and_routes_only_to_holders(
    cluster: LocalCluster, adapters: dict[str, Path]
) -> None:
    """An adapter loaded on one worker behind the router's back (not through the Admin
    service) is learned from that worker's next Load, and its requests go to it alone."""
    stub = cluster.links.links["worker-1"].stub
    request = serving_pb2.LoadAdapterRequest(name="sql", path=str(adapters["sql"]))

    async def load() -> serving_pb2.AdapterInfo:
        return await stub.LoadAdapter(request, timeout=60)

    identity = cluster.loop.run(load()).identity
    deadline = time.monotonic() + 5
    while cluster.links.adapters() != {"sql": identity}:
        assert time.monotonic() < deadline, "the Load poll never reported the adapter"
        time.sleep(0.05)
    client = Client(cluster.target)
    prompts = [list(range(k, k + 30)) for k in (60, 100, 140, 180, 220, 260)]  # new prefixes
    served = {last(client, "sql", prompt).worker for prompt in prompts}
    assert served == {"worker-1"}  # worker-0 would refuse the name
    # a policy that knows nothing of adapters is kept to holders too (and a new policy is
    # told the adapters at once): round robin would send every other request to worker-0
    admin = serving_pb2_grpc.AdminStub(client.channel)
    admin.SetPolicy(serving_pb2.SetPolicyRequest(policy="round_robin"), timeout=30)
    served = {last(client, "sql", [p + 1 for p in prompt]).worker for prompt in prompts}
    assert served == {"worker-1"}
    assert {last(client, "", prompt).worker for prompt in prompts} == {"worker-0", "worker-1"}
    client.close()
    cluster.wait_idle()
