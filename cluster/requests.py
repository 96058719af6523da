"""A public Generate request made ready to route: token ids, namespace, sampling, all checked.

The router tokenises (it must: routing keys are token-block hashes, the same the workers'
KV events carry) and validates with the same functions and limits the worker uses
(worker/validation.py). On top of those: images are refused (no model here has a vision
encoder), an adapter no healthy worker holds is refused by name, request ids are bounded, and
a caller whose
token is bound to a tenant can only use that tenant: the tenant is the cache salt, never trusted
to cross tenants. A sampled request without a seed gets one here, at random: the router then
knows every draw's seed, so a stream moved to another worker mid-way continues exactly.

A LoRA request names its adapter (`namespace.adapter`, the OpenAI `model`); the router hashes,
routes and indexes its text in the namespace of the adapter's identity ("name@digest", from
the workers' reports), and forwards the NAME: each worker maps it to the weights it holds.

`prepare` tokenises: the router calls it off its event loop (it may take a second on a large
prompt, and the tokenizer releases the GIL meanwhile).
"""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from cache import CacheNamespace
from cluster.config import ANY_TENANT, MAX_ADAPTER_NAME_CHARS
from protos.radixmesh.v1 import serving_pb2
from worker import validation
from worker.errors import InvalidRequest
from worker.request import GenerateRequest
from worker.sampling_params import SamplingParams
from worker.validation import RequestLimits
from worker.wire import sampling_from_proto

if TYPE_CHECKING:
    from cluster.text_prompts import TextPrompts, TextTurn

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
MAX_TENANT_CHARS = 256
"""A tenant names a cache namespace that every cached node of it keeps."""


class TenantRefused(PermissionError):
    """The caller's token does not allow the tenant the request names."""


@dataclass(frozen=True)
class ModelLimits:
    """What the workers told the router of their model (the smallest of each, over workers)."""

    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    token_ids: tuple[int, ...]
    namespace: CacheNamespace
    sampling: SamplingParams
    text_turn: TextTurn | None = None
    """The text prompt as the router's text index took it (None: ids given, or index off)."""
    adapter: str | None = None
    """The LoRA adapter's name, as the workers know it (`namespace.adapter` is its identity)."""


def prepare(
    message: serving_pb2.GenerateRequest,
    tokenizer: validation.PromptTokenizer | None,
    limits: RequestLimits,
    allowed_tenant: str = ANY_TENANT,
    fill_context: bool = False,
    text_prompts: TextPrompts | None = None,
    adapters: Mapping[str, str] | None = None,
) -> PreparedRequest:
    """Raises InvalidRequest (naming the field) or TenantRefused. With `fill_context`, a request
    that gives no max_tokens may generate up to the end of the context (OpenAI's default) instead
    of the proto's default of 16. With `text_prompts`, a text or chat prompt is tokenised
    through the router's text index, in the mode the request asks for. `adapters`: the
    adapters the healthy workers hold, name -> identity (None: none)."""
    request_id = message.request_id or uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(request_id):
        raise InvalidRequest("request_id", "1-128 characters of [A-Za-z0-9._:-]")
    if message.images:
        raise InvalidRequest("images", "this model has no vision encoder; send text only")
    adapter = message.namespace.adapter or None
    adapter_identity(adapter, adapters)  # refused before any tokenising
    tenant = message.namespace.tenant
    if len(tenant) > MAX_TENANT_CHARS:
        raise InvalidRequest("namespace.tenant", f"at most {MAX_TENANT_CHARS} characters")
    if allowed_tenant != ANY_TENANT and tenant and tenant != allowed_tenant:
        raise TenantRefused(f"namespace.tenant: this token may only use tenant {allowed_tenant!r}")
    request = GenerateRequest(
        request_id,
        namespace=request_namespace(message, allowed_tenant, adapters),
        sampling=sampling_from_proto(message.sampling),
        **_prompt(message),  # type: ignore[arg-type]
    )
    if message.text_match not in serving_pb2.TextMatch.values():
        raise InvalidRequest(
            "text_match", f"{message.text_match} is not one of {serving_pb2.TextMatch.keys()}"
        )
    encoder = None
    if text_prompts is not None and message.WhichOneof("prompt") in ("text", "chat"):
        encoder = text_prompts.encoder(request.namespace, text_prompts.mode(message.text_match))
    ids = validation.prompt_ids(request, encoder or tokenizer, limits)
    if fill_context and not message.sampling.HasField("max_tokens"):
        room = max(1, limits.max_model_len - len(ids))
        request = replace(request, sampling=replace(request.sampling, max_tokens=room))
    validation.validate(request, ids, limits)
    sampling = request.sampling
    if sampling.seed is None and not sampling.greedy:
        sampling = replace(sampling, seed=secrets.randbits(63))
    turn = None
    if encoder is not None:  # accepted: the prompt joins the text index
        encoder.keep()
        turn = encoder.turn
    return PreparedRequest(request_id, tuple(ids), request.namespace, sampling, turn, adapter)


def request_namespace(
    message: serving_pb2.GenerateRequest,
    allowed_tenant: str,
    adapters: Mapping[str, str] | None = None,
) -> CacheNamespace:
    """The cache namespace a request runs in: a token bound to a tenant always uses that one;
    a LoRA request's adapter is its identity. Raises InvalidRequest for an unknown adapter."""
    tenant = message.namespace.tenant if allowed_tenant == ANY_TENANT else allowed_tenant
    identity = adapter_identity(message.namespace.adapter or None, adapters)
    return CacheNamespace(adapter=identity, tenant=tenant or None)


def adapter_identity(name: str | None, adapters: Mapping[str, str] | None) -> str | None:
    """The identity ("name@digest") of adapter `name` (None: the base model), or
    InvalidRequest naming the adapters that are loaded."""
    if name is None:
        return None
    identity = (adapters or {}).get(name)
    if identity is None:
        if len(name) > MAX_ADAPTER_NAME_CHARS:  # never quoted whole: a detail of 20 KB became
            raise InvalidRequest(  # RESOURCE_EXHAUSTED (metadata size) instead of this
                "namespace.adapter", f"{len(name)} characters; at most {MAX_ADAPTER_NAME_CHARS}"
            )
        loaded = ", ".join(sorted(adapters or {})) or "none"
        raise InvalidRequest("namespace.adapter", f"unknown adapter {name!r} (loaded: {loaded})")
    return identity


def _prompt(message: serving_pb2.GenerateRequest) -> dict[str, object]:
    which = message.WhichOneof("prompt")
    if which == "text":
        return {"prompt": message.text}
    if which == "token_ids":
        return {"prompt_token_ids": tuple(message.token_ids.ids)}
    if which == "chat":
        return {
            "messages": tuple({"role": m.role, "content": m.content} for m in message.chat.messages)
        }
    raise InvalidRequest("prompt", "set one of text, token_ids or chat")
