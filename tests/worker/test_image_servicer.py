"""A vision worker over real gRPC on loopback: Describe reports its VisionInfo, Generate takes
images, and every bad image is refused with INVALID_ARGUMENT naming the part, after which the
worker keeps serving with every page accounted for."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import grpc
import pytest
from PIL import Image

from cache.integrity import check_sequence_cache
from protos.radixmesh.v1 import serving_pb2, worker_pb2, worker_pb2_grpc
from tests.worker.helpers import LLAMA, served
from tests.worker.vlm_fixtures import build_tiny_vlm, png_bytes
from worker.engine import Engine, EngineConfig
from worker.loader import LoadedModel, load_model
from worker.tiny_model import tiny_model

GOOD = png_bytes(60, 40, seed=4)
BIG = png_bytes(120, 90, seed=5)
"""10,800 pixels: over the worker's limit below."""


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path: Path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny", seed=7)
    return load_model(path)


def _engine(loaded: LoadedModel) -> Engine:
    config = EngineConfig(num_pages=128, page_size=4, max_images=2, max_image_pixels=10_000)
    return Engine(loaded.model, loaded.tokenizer, config, vision=loaded.vision)


def _request(
    request_id: str, ids: list[int], images: list[bytes]
) -> worker_pb2.WorkerGenerateRequest:
    sampling = serving_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return worker_pb2.WorkerGenerateRequest(
        request_id=request_id, token_ids=ids, sampling=sampling, images=images
    )


def _bmp() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, format="BMP")
    return out.getvalue()


async def _generate(
    stub: worker_pb2_grpc.WorkerStub, request: worker_pb2.WorkerGenerateRequest
) -> list[serving_pb2.GenerateResponse]:
    return [r async for r in stub.Generate(request)]


def test_bad_images_are_invalid_argument_naming_the_part(loaded: LoadedModel) -> None:
    assert loaded.tokenizer is not None and loaded.vision is not None
    spec = loaded.vision.spec
    text = loaded.tokenizer.encode("Describe this:", add_special_tokens=False)
    one = [*text, spec.image_token_id, *text]  # one image token: the worker expands it
    two = [*text, spec.image_token_id, spec.image_token_id]
    bad = [
        ("not-an-image", one, [b"certainly not a picture"], "images[0]", "not an image"),
        ("truncated", one, [GOOD[: len(GOOD) // 2]], "images[0]", "truncated"),
        ("bmp", one, [_bmp()], "images[0]", "BMP images are not accepted"),
        ("bomb", two, [GOOD, BIG], "images[1]", "120x90 = 10800 pixels"),
        ("too-many", two, [GOOD, GOOD, GOOD], "images", "3 images; at most 2"),
        ("uncounted", one, [GOOD, GOOD], "images", "1 image tokens"),
        ("empty", one, [b""], "images[0]", "empty"),
    ]
    engine = _engine(loaded)

    async def scenario() -> None:
        async with served(engine) as stub:
            info = await stub.Describe(worker_pb2.DescribeRequest())
            assert info.HasField("vision")
            assert (info.vision.image_token_id, info.vision.image_seq_len) == (
                spec.image_token_id,
                spec.image_seq_len,
            )
            assert (info.vision.tile_size, info.vision.longest_edge) == (32, 64)
            assert info.vision.do_image_splitting
            assert (info.vision.max_images, info.vision.max_image_pixels) == (2, 10_000)
            assert info.vision.max_image_bytes == EngineConfig().max_image_bytes
            first = await _generate(stub, _request("first", one, [GOOD]))
            for name, ids, images, field, why in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _generate(stub, _request(name, ids, images))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                details = err.value.details() or ""
                assert details.startswith(f"{field}: ") and why in details, (name, details)
            again = await _generate(stub, _request("again", one, [GOOD]))
            assert [r.token_ids for r in again] == [r.token_ids for r in first]
            last, n = again[-1], again[-1].prompt_tokens  # every whole page hits, image included
            assert last.finished and last.cached_prompt_tokens == min(n - 1, n - n % 4)
            assert sum(len(r.token_ids) for r in again) == 4

            def accounted() -> None:
                cache = engine.cache
                assert not cache.live and not engine.active_requests
                assert cache.pool.num_free + cache.tree.cached_pages == cache.pool.usable_pages
                check_sequence_cache(cache)

            await asyncio.wrap_future(engine.call(accounted))
            assert engine.stats().encoder_runs == 1

    asyncio.run(scenario())


def test_a_text_worker_refuses_images_and_describes_no_vision() -> None:
    engine = Engine(tiny_model(LLAMA, seed=2), None, EngineConfig(num_pages=64, page_size=4))

    async def scenario() -> None:
        async with served(engine) as stub:
            info = await stub.Describe(worker_pb2.DescribeRequest())
            assert not info.HasField("vision")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await _generate(stub, _request("a", [1, 2, 3], [GOOD]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith("images: ")
            served_ok = await _generate(stub, _request("b", [1, 2, 3], []))
            assert served_ok[-1].finished

    asyncio.run(scenario())
