"""A small synchronous client of radixmesh.v1.Serving and the adapter calls of radixmesh.v1.Admin
(the CLI and the tests use it)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from cluster.client_auth import token_or_env
from cluster.client_tls import ClientTls
from protos.radixmesh.v1 import serving_pb2, serving_pb2_grpc

DEFAULT_TARGET = "127.0.0.1:50051"


@dataclass
class Client:
    target: str = DEFAULT_TARGET
    token: str | None = None
    tls: ClientTls | None = None
    channel: grpc.Channel = field(init=False)
    stub: serving_pb2_grpc.ServingStub = field(init=False)
    admin: serving_pb2_grpc.AdminStub = field(init=False)

    def __post_init__(self) -> None:
        self.token = token_or_env(self.token)
        if self.tls is not None:
            self.channel = grpc.secure_channel(
                self.target, self.tls.credentials(), options=self.tls.options()
            )
        else:
            self.channel = grpc.insecure_channel(self.target)
        self.stub = serving_pb2_grpc.ServingStub(self.channel)
        self.admin = serving_pb2_grpc.AdminStub(self.channel)

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.token}")] if self.token else []

    def generate(
        self, request: serving_pb2.GenerateRequest, timeout: float | None = None
    ) -> Iterator[serving_pb2.GenerateResponse]:
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata)

    def stats(self, timeout: float = 10) -> serving_pb2.GetStatsResponse:
        return self.stub.GetStats(
            serving_pb2.GetStatsRequest(), timeout=timeout, metadata=self.metadata
        )

    def abort(self, request_id: str) -> bool:
        response = self.stub.Abort(
            serving_pb2.AbortRequest(request_id=request_id), metadata=self.metadata
        )
        return bool(response.found)

    def load_adapter(
        self, name: str, path: str, timeout: float = 300
    ) -> serving_pb2.LoadAdapterResponse:
        request = serving_pb2.LoadAdapterRequest(name=name, path=path)
        return self.admin.LoadAdapter(request, timeout=timeout, metadata=self.metadata)

    def unload_adapter(self, name: str, timeout: float = 60) -> serving_pb2.UnloadAdapterResponse:
        request = serving_pb2.UnloadAdapterRequest(name=name)
        return self.admin.UnloadAdapter(request, timeout=timeout, metadata=self.metadata)

    def list_adapters(self, timeout: float = 10) -> serving_pb2.ListAdaptersResponse:
        return self.admin.ListAdapters(
            serving_pb2.ListAdaptersRequest(), timeout=timeout, metadata=self.metadata
        )

    def close(self) -> None:
        self.channel.close()


def text_request(
    text: str | None = None,
    chat: Sequence[tuple[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    *,
    request_id: str = "",
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: int | None = None,
    tenant: str = "",
    n: int = 1,
    adapter: str = "",
    images: Sequence[bytes] = (),
    priority: int = 0,
) -> serving_pb2.GenerateRequest:
    """`adapter`: a LoRA adapter's name ("": the base model). `images`: image files (PNG, JPEG,
    WebP) for a vision model; in a chat they come before the text of the last user message, in
    a text they go where its "<image>" placeholders are, in token ids at its image token ids.
    `priority`: lower is served earlier (a cluster serving with scheduling_policy priority)."""
    sampling = serving_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n)
    if seed is not None:
        sampling.seed = seed
    request = serving_pb2.GenerateRequest(
        request_id=request_id,
        sampling=sampling,
        namespace=serving_pb2.Namespace(tenant=tenant, adapter=adapter),
        images=images,
        priority=priority,
    )
    if text is not None:
        request.text = text
    elif chat is not None:
        request.chat.messages.extend(serving_pb2.ChatMessage(role=r, content=c) for r, c in chat)
        if images:
            _place_images(request.chat.messages, len(images))
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    return request


def _place_images(messages: Sequence[serving_pb2.ChatMessage], count: int) -> None:
    """The images as parts of the last user message, before its text."""
    last = next((m for m in reversed(messages) if m.role == "user"), None)
    if last is None:
        raise ValueError("a chat with images needs a user message to carry them")
    parts = [serving_pb2.ChatPart(image=k) for k in range(count)]
    parts.append(serving_pb2.ChatPart(text=last.content))
    last.content = ""
    last.parts.extend(parts)
