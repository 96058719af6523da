"""Builders and oracles shared by the engine tests."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from cache.integrity import check_sequence_cache
from protos.radixmesh.v1 import worker_pb2_grpc
from worker.engine import Engine, EngineConfig
from worker.grpc_server import start_server
from worker.model import CausalLM
from worker.model_runner import Chunk, ModelRunner
from worker.request import GenerateRequest, RequestOutput
from worker.sampling_params import SamplingParams
from worker.servicer import WorkerServicer
from worker.tiny_model import TINY_CONFIG, TINY_QWEN3_CONFIG

LLAMA = TINY_CONFIG
QWEN3 = TINY_QWEN3_CONFIG


def no_cache_greedy(
    model: CausalLM, prompt: Sequence[int], steps: int
) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens by recomputing the whole sequence from scratch at every step.

    Also returns the logits at the prompt's last position. This path shares no KV, no pages and
    no batching with the engine: only the model's weights.
    """
    tokens, first = list(prompt), None
    for _ in range(steps):
        runner = ModelRunner(model, num_pages=len(tokens) + 2, page_size=1)
        logits = runner.run([Chunk(tokens, 0, list(range(1, len(tokens) + 1)), True)])[0]
        first = logits if first is None else first
        tokens.append(int(torch.argmax(logits)))
    assert first is not None
    return tokens[len(prompt) :], first


@dataclass
class Recorder:
    """Collects every output of one engine, and the logits each token was drawn from."""

    outputs: list[RequestOutput] = field(default_factory=list)
    logits: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)
    """(request id, sample index, position of the token drawn) -> logits."""

    def observe(self, request_id: str, index: int, position: int, logits: torch.Tensor) -> None:
        self.logits[(request_id, index, position)] = logits.clone()

    def tokens(self, request_id: str, index: int = 0) -> list[int]:
        return [
            t
            for o in self.outputs
            if o.request_id == request_id and o.index == index
            for t in o.token_ids
        ]

    def final(self, request_id: str, index: int = 0) -> RequestOutput:
        (last,) = [
            o
            for o in self.outputs
            if o.request_id == request_id and o.index == index and o.finished
        ]
        return last

    def by_request(self) -> dict[str, list[RequestOutput]]:
        grouped: dict[str, list[RequestOutput]] = defaultdict(list)
        for output in self.outputs:
            grouped[output.request_id].append(output)
        return grouped


def recorded_engine(
    model: CausalLM, config: EngineConfig, tokenizer: object = None
) -> tuple[Engine, Recorder]:
    engine = Engine(model, tokenizer, config)  # type: ignore[arg-type]
    recorder = Recorder()
    engine.observe_logits = recorder.observe
    return engine, recorder


def greedy(
    request_id: str, prompt: Sequence[int], max_tokens: int, **sampling: object
) -> GenerateRequest:
    return GenerateRequest(
        request_id,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling),  # type: ignore[arg-type]
    )


def drain(engine: Engine, limit: int = 10_000) -> int:
    """Step until idle; returns the steps taken."""
    steps = 0
    while engine.step():
        steps += 1
        assert steps < limit, "the engine did not go idle"
    return steps


def run_all(engine: Engine, *requests: GenerateRequest) -> Recorder:
    """Every output of `requests`, submitted together, the engine stepped until idle and its
    cache then checked."""
    recorder = Recorder()
    for request in requests:
        engine.submit(request, recorder.outputs.append)
    drain(engine)
    check_sequence_cache(engine.cache)
    return recorder


def run_to_end(engine: Engine, request: GenerateRequest) -> list[RequestOutput]:
    """Every output of `request`, the engine stepped until idle and its cache then checked."""
    recorder = Recorder()
    engine.submit(request, recorder.outputs.append)
    drain(engine)
    check_sequence_cache(engine.cache)
    return recorder.outputs


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@contextlib.asynccontextmanager
async def served(engine: Engine) -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    """`engine` started behind a real worker gRPC server on loopback; a stub to it. The engine,
    the server and the channel are stopped on the way out."""
    async with served_at(engine) as (stub, _):
        yield stub


@contextlib.asynccontextmanager
async def served_at(
    engine: Engine, name: str = "w0"
) -> AsyncIterator[tuple[worker_pb2_grpc.WorkerStub, str]]:
    """`served`, as worker `name`, with the server's address."""
    engine.start()
    servicer = WorkerServicer(engine, name)
    register = [(worker_pb2_grpc.add_WorkerServicer_to_server, servicer, "radixmesh.v1.Worker")]
    server = await start_server(register, "127.0.0.1", 0)
    address = f"127.0.0.1:{server.port}"
    channel = grpc.aio.insecure_channel(address)
    try:
        yield worker_pb2_grpc.WorkerStub(channel), address
    finally:
        await channel.close()
        await server.stop(grace=0)
        engine.stop()
