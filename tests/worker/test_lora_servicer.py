"""The worker's adapter RPCs over real gRPC on loopback, with real PEFT adapter directories.

LoadAdapter serves an adapter that Generate then uses by name; GetLoad reports it (resident or
not) and the swap time; every bad adapter is refused with INVALID_ARGUMENT naming the file, and
the worker keeps serving with every page accounted for; UnloadAdapter drops the adapter's trees
and the removal reaches a KV event subscriber; an unknown one is NOT_FOUND.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from cache.integrity import check_sequence_cache
from protos.radixmesh.v1 import serving_pb2, worker_pb2, worker_pb2_grpc
from tests.worker.helpers import served
from tests.worker.lora_fixtures import make_peft_adapter
from tests.worker.test_lora_adapter import BAD
from worker.engine import Engine, EngineConfig
from worker.lora_adapter import CONFIG_FILE

PROMPT = list(range(3, 40))


@pytest.fixture(scope="module")
def dirs(tiny: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served")
    return {
        "caps": make_peft_adapter(root / "caps", tiny.path, rank=8, seed=1),
        "sql": make_peft_adapter(root / "sql", tiny.path, rank=4, alpha=8, seed=2),
        "wide": make_peft_adapter(root / "wide", tiny.path, rank=16, alpha=16, seed=3),
    }


@contextlib.asynccontextmanager
async def _serve(
    tiny: Any, **config: Any
) -> AsyncIterator[tuple[worker_pb2_grpc.WorkerStub, Engine]]:
    settings: dict[str, Any] = dict(num_pages=64, page_size=4, block_size=4, max_lora_rank=8)
    settings.update(config)
    engine = Engine(tiny.model, None, EngineConfig(**settings))
    async with served(engine) as stub:
        yield stub, engine


def _request(request_id: str, adapter: str = "", tokens: list[int] = PROMPT) -> Any:
    return worker_pb2.WorkerGenerateRequest(
        request_id=request_id,
        token_ids=tokens,
        namespace=serving_pb2.Namespace(adapter=adapter),
        sampling=serving_pb2.SamplingParams(max_tokens=4, temperature=0.0),
    )


async def _generate(stub: worker_pb2_grpc.WorkerStub, request: Any) -> list[Any]:
    return [r async for r in stub.Generate(request)]


async def _idle_and_whole(engine: Engine) -> None:
    def check() -> None:
        check_sequence_cache(engine.cache)
        pool = engine.cache.pool
        assert pool.num_private == 0 and pool.num_free + pool.num_cached == pool.usable_pages

    for _ in range(100):  # the last output goes out as the request ends; let the loop catch up
        if not await asyncio.wrap_future(engine.call(engine.scheduler.has_work)):
            break
        await asyncio.sleep(0.02)
    await asyncio.wrap_future(engine.call(check))


def test_load_generate_report_and_unload(tiny: Any, dirs: dict[str, Path]) -> None:
    async def scenario() -> None:
        async with _serve(tiny, max_loras=1) as (stub, engine):
            events = stub.StreamKvEvents(worker_pb2.StreamKvEventsRequest())
            await stub.Describe(worker_pb2.DescribeRequest())
            info = await stub.LoadAdapter(
                serving_pb2.LoadAdapterRequest(name="caps", path=str(dirs["caps"]))
            )
            assert (info.name, info.rank, info.worker, info.path) == (
                "caps",
                8,
                "w0",
                str(dirs["caps"]),
            )
            assert info.identity.startswith("caps@") and list(info.target_modules) == [
                "q_proj",
                "v_proj",
            ]
            assert not info.resident  # loaded to host memory; a slot is taken by a request
            await stub.LoadAdapter(
                serving_pb2.LoadAdapterRequest(name="sql", path=str(dirs["sql"]))
            )

            caps = await _generate(stub, _request("a", "caps"))
            base = await _generate(stub, _request("b"))
            again = await _generate(stub, _request("c", "caps"))
            assert caps[-1].finished and base[-1].finished
            tokens = [[t for r in rs for t in r.token_ids] for rs in (caps, base, again)]
            assert tokens[0] != tokens[1] and tokens[0] == tokens[2]
            assert again[-1].cached_prompt_tokens == len(PROMPT) - 1

            load = await stub.GetLoad(worker_pb2.GetLoadRequest())
            held = {a.name: a for a in load.adapters}
            assert set(held) == {"caps", "sql"} and held["caps"].resident
            assert not held["sql"].resident and held["caps"].identity == info.identity
            assert load.adapter_swap_seconds > 0

            unloaded = await stub.UnloadAdapter(serving_pb2.UnloadAdapterRequest(name="caps"))
            assert unloaded.workers == 1 and unloaded.pages_freed == (len(PROMPT) + 3) // 4
            stored: list[int] = []
            removed: list[int] = []
            while not removed:  # the stream, up to the removal
                batch = await asyncio.wait_for(events.read(), timeout=5)
                for event in batch.events:
                    target = stored if event.kind == "stored" else removed
                    target.extend(event.block_hashes)
            assert len(removed) == (len(PROMPT) + 3) // 4  # caps's blocks of 4 positions
            assert set(removed) < set(stored)  # the adapter's blocks, not the base's
            events.cancel()

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(stub, _request("d", "caps"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "unknown adapter 'caps' (loaded: sql)" in (err.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.UnloadAdapter(serving_pb2.UnloadAdapterRequest(name="caps"))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert "'caps' is not loaded (loaded: sql)" in (err.value.details() or "")
            load = await stub.GetLoad(worker_pb2.GetLoadRequest())
            assert [a.name for a in load.adapters] == ["sql"]
            await _idle_and_whole(engine)

    asyncio.run(scenario())


def test_every_bad_adapter_is_refused_and_the_worker_keeps_serving(
    tiny: Any, dirs: dict[str, Path], tmp_path: Path
) -> None:
    cases = {name: case for name, case in BAD.items() if name != "rank-above-max"}

    async def scenario() -> None:
        async with _serve(tiny) as (stub, engine):
            await stub.LoadAdapter(
                serving_pb2.LoadAdapterRequest(name="sql", path=str(dirs["sql"]))
            )
            for i, (case, (edit, file, named)) in enumerate(cases.items()):
                directory = Path(shutil.copytree(dirs["caps"], tmp_path / case))
                edit(directory)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.LoadAdapter(
                        serving_pb2.LoadAdapterRequest(name="sql", path=str(directory))
                    )
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
                message = err.value.details() or ""
                assert str(directory / file) in message, (case, message)
                for part in named:
                    assert part in message, (case, part, message)
                # the worker serves on, the adapter of that name is still the good one
                served = await _generate(stub, _request(f"after-{i}", "sql", PROMPT[: 9 + i]))
                assert served[-1].finish_reason == "length", case
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.LoadAdapter(
                    serving_pb2.LoadAdapterRequest(name="wide", path=str(dirs["wide"]))
                )
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert str(dirs["wide"] / CONFIG_FILE) in (err.value.details() or "")
            assert "rank 16 is above the configured maximum 8" in (err.value.details() or "")
            for request in (
                serving_pb2.LoadAdapterRequest(name="", path=str(dirs["caps"])),
                serving_pb2.LoadAdapterRequest(name="x", path=""),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.LoadAdapter(request)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            load = await stub.GetLoad(worker_pb2.GetLoadRequest())
            assert [(a.name, a.path) for a in load.adapters] == [("sql", str(dirs["sql"]))]
            assert (await _generate(stub, _request("last")))[-1].finished
            await _idle_and_whole(engine)

    asyncio.run(scenario())
