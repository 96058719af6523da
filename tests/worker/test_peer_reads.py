"""A worker reads a prompt's KV from the worker the router names (`kv_peer`) instead of
recomputing it, over real gRPC on loopback: the answer is the one it would have computed, every
page on both sides is accounted for, and whatever goes wrong with the peer (gone, another
layout, another tenant, a reader that leaves mid-stream) costs a recompute, never a request."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from cache import DEFAULT_NAMESPACE, to_cache_keys
from cache.integrity import check_sequence_cache
from cache.tiers import DEVICE
from protos.radixmesh.v1 import serving_pb2, worker_pb2, worker_pb2_grpc
from tests.worker.helpers import LLAMA, served_at
from worker import kv_export
from worker.engine import Engine, EngineConfig
from worker.kv_export import layout_to_proto
from worker.kv_persistence import StoreIdentity
from worker.request import GenerateRequest, KvPeer, RequestOutput
from worker.sampling_params import SamplingParams
from worker.tiny_model import tiny_model

PAGE = 4
PROMPT = list(range(1, 42))  # 41 tokens: 10 whole pages cached
HELD = len(PROMPT) // PAGE * PAGE
LONGER = [*PROMPT, 7, 8, 9]


def engine(name: str, **overrides: object) -> Engine:
    config = EngineConfig(num_pages=64, page_size=PAGE, **overrides)  # type: ignore[arg-type]
    return Engine(tiny_model(LLAMA, seed=2), None, config, source=name)


def request(
    request_id: str,
    tokens: list[int],
    peer: worker_pb2.KvPeer | None = None,
    tenant: str = "",
) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=request_id,
        token_ids=tokens,
        sampling=serving_pb2.SamplingParams(max_tokens=6, temperature=0.0),
        kv_peer=peer,
        namespace=serving_pb2.Namespace(tenant=tenant),
    )


async def answer(
    stub: worker_pb2_grpc.WorkerStub, message: worker_pb2.WorkerGenerateRequest
) -> tuple[list[int], int]:
    """The tokens of a request's answer, and the prompt positions it served from cache."""
    responses = [r async for r in stub.Generate(message)]
    return [t for r in responses for t in r.token_ids], responses[0].cached_prompt_tokens


def accounted(engine: Engine) -> None:
    """Nothing is left locked or private, and the pool's books balance (engine idle)."""
    pool = engine.cache.pool
    assert pool.num_private == 0
    assert pool.num_free + pool.num_cached == pool.usable_pages
    check_sequence_cache(engine.cache)
    assert engine.cache.tree.evictable_pages == pool.num_cached, "a lease was left locked"


@contextlib.asynccontextmanager
async def pair(
    reader: Engine | None = None, holder: Engine | None = None
) -> AsyncIterator[tuple[worker_pb2_grpc.WorkerStub, str, worker_pb2_grpc.WorkerStub, Engine]]:
    """The holder (serving PROMPT once, so that it caches its whole pages) and the reader:
    (holder's stub, its address, reader's stub, reader's engine)."""
    holder, reader = holder or engine("a"), reader or engine("b")
    async with served_at(holder, "a") as (a, address), served_at(reader, "b") as (b, _):
        await answer(a, request("warm", PROMPT))
        yield a, address, b, reader
        for each in (holder, reader):
            await asyncio.wrap_future(each.call(lambda each=each: accounted(each)))


async def refused(
    stub: worker_pb2_grpc.WorkerStub, ask: worker_pb2.ReadKvRequest
) -> grpc.aio.AioRpcError:
    """The error a ReadKv call ends with (it must end with one)."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.ReadKv(ask):
            pass
    return err.value


def peer(address: str, positions: int = len(LONGER) - 1) -> worker_pb2.KvPeer:
    return worker_pb2.KvPeer(worker="a", address=address, positions=positions)


def kv_of(engine: Engine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of the device pages `engine` caches for `tokens` (engine thread)."""
    match = engine.cache.tree.match(to_cache_keys(tokens), DEFAULT_NAMESPACE)
    assert match.length == len(tokens)
    return engine.runner.read_pages(DEVICE, match.pages)


def test_the_reader_answers_as_the_holder_does_from_the_pages_it_read() -> None:
    holder = engine("a")

    async def scenario() -> None:
        async with pair(holder=holder) as (a, address, b, reader):
            expected, held = await answer(a, request("on-a", LONGER))
            assert held == HELD
            tokens, cached = await answer(b, request("on-b", LONGER, peer(address)))
            assert (tokens, cached) == (expected, HELD)
            stats = reader.stats()
            assert (stats.peer_read_tokens, stats.peer_read_failures) == (HELD, 0)
            theirs = await asyncio.wrap_future(holder.call(lambda: kv_of(holder, PROMPT[:HELD])))
            ours = await asyncio.wrap_future(reader.call(lambda: kv_of(reader, PROMPT[:HELD])))
            assert all(torch.equal(x, y) for x, y in zip(ours, theirs, strict=True))
            # the read pages are the reader's own cache now: a second request hits them
            again, cached = await answer(b, request("again", LONGER))
            assert again == expected and cached >= HELD

    asyncio.run(scenario())


def test_a_peer_that_is_gone_costs_a_recompute_not_the_request() -> None:
    async def scenario() -> None:
        async with pair() as (a, _, b, reader):
            expected, _ = await answer(a, request("on-a", LONGER))
            gone = peer("127.0.0.1:9")  # nothing listens on the discard port
            tokens, cached = await answer(b, request("on-b", LONGER, gone))
            assert (tokens, cached) == (expected, 0)
            stats = reader.stats()
            assert (stats.peer_read_tokens, stats.peer_read_failures) == (0, 1)

    asyncio.run(scenario())


def test_a_peer_with_another_layout_is_refused_by_name_and_recomputed() -> None:
    async def scenario() -> None:
        other = engine("a", model_revision="another-revision")
        async with pair(holder=other) as (a, address, b, reader):
            ask = worker_pb2.ReadKvRequest(
                token_ids=PROMPT, layout=layout_to_proto(StoreIdentity.of(reader))
            )
            err = await refused(a, ask)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "model_revision" in (err.details() or "")
            expected, _ = await answer(a, request("on-a", LONGER))
            tokens, cached = await answer(b, request("on-b", LONGER, peer(address)))
            assert cached == 0 and reader.stats().peer_read_failures == 1
            assert len(tokens) == len(expected)

    asyncio.run(scenario())


def test_another_tenants_prefix_is_never_read() -> None:
    async def scenario() -> None:
        async with pair() as (a, address, b, reader):
            tokens, cached = await answer(b, request("t2", LONGER, peer(address), tenant="t2"))
            assert cached == 0, "the holder cached PROMPT for the default tenant only"
            assert reader.stats().peer_read_tokens == 0
            expected, _ = await answer(a, request("t2-on-a", LONGER, tenant="t2"))
            assert tokens == expected

    asyncio.run(scenario())


def test_a_reader_that_leaves_mid_stream_ends_the_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_export, "CHUNK_BYTES", 1)  # a page a message

    async def scenario() -> None:
        async with pair() as (a, _, _, reader):
            ask = worker_pb2.ReadKvRequest(
                token_ids=PROMPT, start=PAGE, layout=layout_to_proto(StoreIdentity.of(reader))
            )
            call = a.ReadKv(ask)
            first = await call.read()
            assert (first.start, first.positions) == (PAGE, PAGE)
            call.cancel()
            await asyncio.sleep(0.2)  # the lease ends on the holder's engine thread
            whole = [m async for m in a.ReadKv(ask)]
            assert [m.start for m in whole] == list(range(PAGE, HELD, PAGE))

    asyncio.run(scenario())


def test_a_start_inside_a_page_or_a_bad_token_is_invalid_argument() -> None:
    async def scenario() -> None:
        async with pair() as (a, _, _, reader):
            layout = layout_to_proto(StoreIdentity.of(reader))
            for ask, named in (
                (worker_pb2.ReadKvRequest(token_ids=PROMPT, start=3, layout=layout), "start"),
                (worker_pb2.ReadKvRequest(token_ids=[1, -5], layout=layout), "token_ids"),
            ):
                err = await refused(a, ask)
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert named in (err.details() or "")

    asyncio.run(scenario())


def test_a_read_priced_slower_than_recomputing_is_not_made() -> None:
    reader = engine("b")
    costs = reader.tier_costs
    for i in range(12):  # recomputing: a microsecond a position
        tokens = 16 * (1 + i % 4)
        costs.observe_pass(tokens, 1e-6 * tokens)
    costs.observe_read(10, 100.0, costs.peer)  # a peer read: 10 s a position

    async def scenario() -> None:
        async with pair(reader=reader) as (a, address, b, _):
            expected, _ = await answer(a, request("on-a", LONGER))
            tokens, cached = await answer(b, request("on-b", LONGER, peer(address)))
            assert (tokens, cached) == (expected, 0)
            stats = reader.stats()
            assert (stats.peer_skipped_tokens, stats.peer_read_tokens) == (HELD, 0)
            assert stats.disk_skipped_tokens == 0, "the disk's rate and count are its own"

    asyncio.run(scenario())


def gated(reader: Engine) -> threading.Event:
    """Hold `reader`'s peer reads on their thread until the returned event is set (then they
    fail: the positions are recomputed). Stands in for a peer that is slow to answer."""
    gate = threading.Event()

    def slow(*_: object) -> None:
        gate.wait(10)

    reader.peer_reads._read = slow  # type: ignore[method-assign, assignment]
    return gate


def generate(request_id: str, tokens: list[int], priority: int = 0) -> GenerateRequest:
    return GenerateRequest(
        request_id,
        tuple(tokens),
        sampling=SamplingParams(max_tokens=2, temperature=0.0),
        priority=priority,
        kv_peer=KvPeer("a", "127.0.0.1:9", len(tokens) - 1),
    )


def test_a_request_aborted_while_its_read_runs_lets_go_of_it() -> None:
    reader = engine("b", max_running=1)
    gate = gated(reader)
    outputs: list[RequestOutput] = []
    reader.submit(generate("r", PROMPT), outputs.append)
    reader.step()
    assert reader.peer_reads.pending == 1
    reader.abort("r")
    reader.step()
    assert reader.peer_reads.pending == 0, "the aborted request's read no longer counts"
    gate.set()
    reader.submit(generate("next", PROMPT), outputs.append)
    reader.submit(
        GenerateRequest("plain", (5, 6, 7), sampling=SamplingParams(max_tokens=2)), outputs.append
    )
    deadline = time.monotonic() + 10
    while not {"next", "plain"} <= {o.request_id for o in outputs if o.finished}:
        assert time.monotonic() < deadline, "admission stalled behind a leaked read"
        reader.step()
    accounted(reader)


def test_reads_past_the_bound_recompute_instead_of_blocking_the_queue() -> None:
    reader = engine("b", max_running=2, scheduling_policy="priority")
    gate = gated(reader)
    outputs: list[RequestOutput] = []
    for i in range(2):
        reader.submit(generate(f"low{i}", PROMPT, priority=5), outputs.append)
    reader.step()
    assert reader.peer_reads.pending == 2
    reader.submit(generate("high", PROMPT[:30]), outputs.append)
    reader.step()
    assert [o.request_id for o in outputs if o.finished] == [], "high runs, its read skipped"
    gate.set()
    deadline = time.monotonic() + 10
    while sum(o.finished for o in outputs) < 3:
        assert time.monotonic() < deadline, [o.request_id for o in outputs if o.finished]
        reader.step()
    assert reader.peer_reads.pending == 0 and reader.stats().peer_read_failures == 2
    accounted(reader)


def test_a_hung_peer_times_out_and_is_left_alone_for_a_while(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def hung(*_: object) -> None:
        time.sleep(1.5)  # on the holder's engine thread: it answers nothing meanwhile

    monkeypatch.setattr(kv_export, "lease", hung)
    reader = engine("b")
    reader.peer_reads.timeout_s = 0.3

    async def scenario() -> None:
        async with pair(reader=reader) as (a, address, b, _):
            expected, _ = await answer(a, request("on-a", LONGER))
            other = list(range(100, 141))
            await answer(a, request("other-on-a", other))
            began = time.monotonic()
            tokens, cached = await answer(b, request("on-b", LONGER, peer(address)))
            assert (tokens, cached) == (expected, 0)
            assert time.monotonic() - began < 1.4, "the reader gave up at its deadline"
            _, cached = await answer(b, request("again", [*other, 1], peer(address, 40)))
            assert cached == 0
            assert reader.stats().peer_read_failures == 1, "not asked again at once"

    asyncio.run(scenario())


def test_a_request_that_ends_mid_read_cancels_it_and_the_lease_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_export, "CHUNK_BYTES", 1)  # a page a message
    real = kv_export.read

    def slow(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.3)  # the whole read: 3 s
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(kv_export, "read", slow)
    holder = engine("a")

    async def scenario() -> None:
        async with pair(holder=holder) as (_, address, b, reader):
            call = b.Generate(request("r", LONGER, peer(address)))
            deadline = time.monotonic() + 5
            while not reader.peer_reads.pending:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.4)  # a page or two sent
            call.cancel()
            deadline = time.monotonic() + 1.0  # well before the read would have ended
            pool = holder.cache.pool
            while holder.cache.tree.evictable_pages != pool.num_cached:  # the lease ends
                assert time.monotonic() < deadline, "the holder's lease outlived the read"
                await asyncio.sleep(0.01)
            assert reader.peer_reads.pending == 0 and reader.stats().peer_read_tokens == 0

    asyncio.run(scenario())


def test_a_holder_serving_its_most_reads_refuses_more_and_the_reader_recomputes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_export, "MAX_READS", 0)

    async def scenario() -> None:
        async with pair() as (a, address, b, reader):
            ask = worker_pb2.ReadKvRequest(
                token_ids=PROMPT, layout=layout_to_proto(StoreIdentity.of(reader))
            )
            assert (await refused(a, ask)).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            expected, _ = await answer(a, request("on-a", LONGER))
            tokens, cached = await answer(b, request("on-b", LONGER, peer(address)))
            assert (tokens, cached) == (expected, 0)
            assert reader.stats().peer_read_failures == 1

    asyncio.run(scenario())


def test_a_peer_that_held_less_than_named_is_read_what_it_has_and_asked_again() -> None:
    async def scenario() -> None:
        async with pair() as (a, address, b, reader):
            other = list(range(100, 141))
            await answer(a, request("other-on-a", other))
            more = [*PROMPT, *range(60, 68)]  # the holder has PROMPT's 40 positions, not 48
            _, cached = await answer(b, request("short", [*more, 1], peer(address, len(more))))
            stats = reader.stats()
            assert (cached, stats.peer_read_tokens, stats.peer_read_failures) == (HELD, HELD, 1)
            _, cached = await answer(b, request("again", [*other, 1], peer(address, 41)))
            assert cached == HELD, "a short read is no failure of the peer: it is asked again"
            assert reader.stats().peer_read_tokens == 2 * HELD

    asyncio.run(scenario())
