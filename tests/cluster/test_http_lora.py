"""LoRA adapters over the HTTP API, driven by the official `openai` SDK and plain HTTP on
loopback: vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, `model` = the
adapter's name (vLLM's convention), /v1/models listing every adapter with its parent, the
Anthropic API likewise; unknown models are 404 as OpenAI answers, bad adapters 400 naming
the file, and loading needs a token bound to every tenant."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from cluster.client import Client
from cluster.config import SecuritySection
from cluster.loadtest.cli import add_arguments
from cluster.loadtest.cli import main as loadtest_main
from tests.cluster.local_cluster import SERVED_NAME, LocalCluster, start_cluster
from tests.worker.lora_fixtures import make_peft_adapter
from worker.loader import LoadedModel

PROMPT = "The router sends each request to"


@pytest.fixture(scope="module")
def caps(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_peft_adapter(
        tmp_path_factory.mktemp("adapters") / "caps", tiny.path, seed=4, scale=1.0
    )


@pytest.fixture(scope="module")
def cluster(tiny: LoadedModel) -> Iterator[LocalCluster]:
    running = start_cluster(tiny, workers=2, http=True)
    yield running
    running.close()


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="none", max_retries=0) as c:
        yield c


def complete(client: openai.OpenAI, model: str) -> tuple[str, str]:
    answer = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    return answer.choices[0].text, answer.model


def test_load_generate_list_unload_over_http(
    client: openai.OpenAI, cluster: LocalCluster, caps: Path
) -> None:
    with pytest.raises(openai.NotFoundError, match="model 'caps' does not exist"):
        complete(client, "caps")
    loaded = httpx.post(
        f"{cluster.http_url}/v1/load_lora_adapter",
        json={"lora_name": "caps", "lora_path": str(caps)},
        timeout=120,
    )
    assert loaded.status_code == 200, loaded.text
    assert "caps" in loaded.text

    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {SERVED_NAME, "caps"}
    assert models["caps"].parent == SERVED_NAME and models["caps"].root == str(caps)  # type: ignore[attr-defined]
    assert getattr(models[SERVED_NAME], "parent", None) is None
    assert client.models.retrieve("caps").parent == SERVED_NAME  # type: ignore[attr-defined]

    base_text, base_model = complete(client, SERVED_NAME)
    caps_text, caps_model = complete(client, "caps")
    assert (base_model, caps_model) == (SERVED_NAME, "caps")
    assert caps_text != base_text  # a real random adapter changes the greedy answer
    assert complete(client, "caps")[0] == caps_text  # and repeats it
    chat = client.chat.completions.create(
        model="caps", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0
    )
    assert chat.model == "caps" and chat.choices[0].message.content is not None
    stream = client.chat.completions.create(
        model="caps",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == chat.choices[0].message.content

    anthropic = httpx.post(
        f"{cluster.http_url}/v1/messages",
        json={
            "model": "caps",
            "max_tokens": 6,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}],
        },
        timeout=60,
    )
    assert anthropic.status_code == 200, anthropic.text
    assert anthropic.json()["model"] == "caps"
    assert anthropic.json()["content"][0]["text"] == chat.choices[0].message.content

    unloaded = httpx.post(
        f"{cluster.http_url}/v1/unload_lora_adapter", json={"lora_name": "caps"}, timeout=60
    )
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError, match=r"this cluster serves \['tiny'\]"):
        complete(client, "caps")
    assert {m.id for m in client.models.list().data} == {SERVED_NAME}
    again = httpx.post(
        f"{cluster.http_url}/v1/unload_lora_adapter", json={"lora_name": "caps"}, timeout=60
    )
    assert again.status_code == 404 and "unknown adapter 'caps'" in again.json()["error"]["message"]
    cluster.wait_idle()


def test_a_bad_adapter_is_400_naming_the_file_and_serving_goes_on(
    client: openai.OpenAI, cluster: LocalCluster, caps: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(caps, broken)
    weights = broken / "adapter_model.safetensors"
    weights.write_bytes(b"\x00" * 64)
    answer = httpx.post(
        f"{cluster.http_url}/v1/load_lora_adapter",
        json={"lora_name": "broken", "lora_path": str(broken)},
        timeout=120,
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert str(weights) in error["message"] and error["type"] == "invalid_request_error"
    unknown_field = httpx.post(
        f"{cluster.http_url}/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": str(caps), "rank": 4},
        timeout=30,
    )
    assert unknown_field.status_code == 400 and "rank" in unknown_field.text
    assert {m.id for m in client.models.list().data} == {SERVED_NAME}
    assert complete(client, SERVED_NAME)[0]  # still serving


def test_loading_needs_a_token_for_every_tenant(tiny: LoadedModel, caps: Path) -> None:
    security = SecuritySection(auth_tokens={"t-acme": "acme", "t-admin": "*"})
    running = start_cluster(tiny, workers=1, http=True, security=security)
    try:
        body = {"lora_name": "caps", "lora_path": str(caps)}
        url = f"{running.http_url}/v1/load_lora_adapter"
        anonymous = httpx.post(url, json=body, timeout=30)
        tenant = httpx.post(url, json=body, headers={"authorization": "Bearer t-acme"}, timeout=30)
        admin = httpx.post(url, json=body, headers={"authorization": "Bearer t-admin"}, timeout=120)
        assert (anonymous.status_code, tenant.status_code, admin.status_code) == (401, 403, 200)
        with openai.OpenAI(
            base_url=f"{running.http_url}/v1", api_key="t-acme", max_retries=0
        ) as acme:  # a tenant's token may use the adapter, in its own cache namespace
            assert complete(acme, "caps")[1] == "caps"
    finally:
        running.close()


def test_the_load_test_draws_zipf_adapters_over_grpc_and_the_openai_api(
    cluster: LocalCluster, caps: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RADIXMESH_TOKEN", raising=False)
    admin = Client(cluster.target)
    for k in range(3):
        admin.load_adapter(f"lora-{k}", str(caps))
    flags = ["--workload", "shared-prefix", "--num-requests", "12", "--concurrency", "3"]
    flags += ["--adapters", "zipf:3", "--max-tokens", "4", "--warmup", "0"]
    over = {
        "grpc": ["--target", cluster.target],
        "openai": ["--api", "openai", "--target", cluster.http_url],
    }
    for api, target in over.items():
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        out = tmp_path / api
        assert loadtest_main(parser.parse_args(["--output-dir", str(out), *target, *flags])) == 0
        (run,) = json.loads((out / "report.json").read_text())["runs"]
        assert run["summary"]["requests"] == {"sent": 12, "completed": 12, "errored": 0}, api
        drawn = {r["adapter"] for r in run["requests"]}
        assert drawn <= {"lora-0", "lora-1", "lora-2"} and "lora-0" in drawn, (api, drawn)
    for k in range(3):
        admin.unload_adapter(f"lora-{k}")
    admin.close()
    cluster.wait_idle()
