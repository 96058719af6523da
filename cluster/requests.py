"""A public Generate request made ready to route: token ids, namespace, sampling, all checked.

The router tokenises (it must: routing keys are token-block hashes, the same the workers'
KV events carry) and validates with the same functions and limits the worker uses
(worker/validation.py). On top of those: an adapter no healthy worker holds is refused by
name, request ids are bounded, and a caller whose token is bound to a tenant can only use that
tenant: the tenant is the cache salt, never trusted to cross tenants. A sampled request without
a seed gets one here, at random: the router then knows every draw's seed, so a stream moved to
another worker mid-way continues exactly.

Images: refused (naming "images") unless the workers serve a vision model (`RequestLimits.
image_spec`, from their WorkerInfo.vision: cluster/model_vision.py). Each is decoded and checked
here, as the worker checks it again (worker/images.py), and placed (cluster/images.py):
the prompt's ids come out expanded, every image position in them, and the prompt routes by its
cache tokens' keys, image identities included. An image prompt bypasses the text index.

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from hashlib import blake2b
from typing import TYPE_CHECKING, Any

from cache import CacheNamespace
from cache.tokens import Keys
from cluster import images as router_images
from cluster.config import ANY_TENANT, MAX_ADAPTER_NAME_CHARS
from cluster.model_vision import ModelVision
from protos.radixmesh.v1 import serving_pb2
from worker import validation
from worker.errors import InvalidRequest
from worker.images import CheckedImage
from worker.request import EMBEDDING_SAMPLING, GenerateRequest, PoolingParams
from worker.sampling_params import SamplingParams
from worker.tool_calls import check_tools, tool_constraint
from worker.validation import RequestLimits
from worker.wire import pooling_from_proto, sampling_from_proto, tools_from_proto

if TYPE_CHECKING:
    from cluster.text_prompts import TextPrompts, TextTurn

MAX_REQUEST_ID_CHARS = 128
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_CHARS}}}")
REQUEST_ID_RULE = f"1-{MAX_REQUEST_ID_CHARS} characters of [A-Za-z0-9._:-]"
MAX_TENANT_CHARS = 256
"""A tenant names a cache namespace that every cached node of it keeps."""
MAX_SALT_CHARS = 1024
"""vLLM's cache_salt: the client's secret, long enough to be unguessable (256 bits is 43
characters of base64), not a store."""


class TenantRefused(PermissionError):
    """The caller's token does not allow the tenant the request names."""


@dataclass(frozen=True)
class ModelLimits:
    """What the workers told the router of their model (the smallest of each, over workers)."""

    vocab_size: int
    max_model_len: int
    vision: ModelVision | None = None
    """Their vision model (None: a text model, images refused)."""
    hidden_size: int = 0
    """An embedding's length (0: a worker did not say; embeddings are then refused)."""
    cache_salts: bool = True
    """Whether every worker keeps cache salts apart (False: one predates them, and a salted
    request is refused rather than served from an unsalted cache)."""


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
    images: tuple[bytes, ...] = ()
    """The image files, in the order of their runs in `token_ids` (what the worker takes)."""
    cache_keys: Keys | None = None
    """An image prompt's cache keys, one per position of `token_ids` (its routing blocks hash
    them); None: a text prompt, whose ids are its keys."""
    priority: int = 0
    """The client's scheduling priority, lower first (`limits.priorities` allowed it)."""
    pooling: PoolingParams | None = None
    """Set for an embedding request (serving.proto's GenerateRequest.pooling)."""

    @property
    def routing_keys(self) -> Sequence[int]:
        return self.token_ids if self.cache_keys is None else self.cache_keys


def valid_request_id(request_id: str) -> bool:
    return _REQUEST_ID.fullmatch(request_id) is not None


def suffixed(request_id: str, suffix: str) -> str:
    """`request_id` and `suffix` (one prompt's of several, a beam search step's) as one id of at
    most MAX_REQUEST_ID_CHARS: a long id is cut to make room, with a digest of it kept, so
    that two long ids that begin alike stay apart."""
    whole = request_id + suffix
    if len(whole) <= MAX_REQUEST_ID_CHARS:
        return whole
    digest = blake2b(request_id.encode(), digest_size=4).hexdigest()
    keep = MAX_REQUEST_ID_CHARS - len(suffix) - len(digest) - 1
    return f"{request_id[:keep]}.{digest}{suffix}"


def prepare(
    message: serving_pb2.GenerateRequest,
    tokenizer: validation.PromptTokenizer | None,
    limits: RequestLimits,
    allowed_tenant: str = ANY_TENANT,
    fill_context: bool = False,
    text_prompts: TextPrompts | None = None,
    adapters: Mapping[str, str] | None = None,
    image_fields: Sequence[str] = (),
    counting: bool = False,
    fill_cap: int | None = None,
) -> PreparedRequest:
    """Raises InvalidRequest (naming the field) or TenantRefused. With `fill_context`, a request
    that gives no max_tokens may generate up to the end of the context (OpenAI's default) instead
    of the proto's default of 16. With `text_prompts`, a text or chat prompt is tokenised
    through the router's text index, in the mode the request asks for. `adapters`: the
    adapters the healthy workers hold, name -> identity (None: none). `image_fields`: what
    refusals call each of `message.images` (default "images[k]"). `counting`: the prompt is
    only counted (vLLM's /tokenize, Anthropic's count_tokens), so neither its length against
    the context nor the sampling parameters are checked: a count may exceed the context, as a
    text prompt's does. `fill_cap`: a request that gives no max_tokens generates at most this
    many, cut to the room the prompt leaves (SGLang's default of 128, as its scheduler cuts
    it)."""
    request_id = message.request_id or uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(request_id):
        raise InvalidRequest("request_id", REQUEST_ID_RULE)
    fields = _image_fields(message, limits, image_fields)
    adapter = message.namespace.adapter or None
    adapter_identity(adapter, adapters)  # refused before any tokenising
    validation.check_priority(message.priority, limits)
    tenant = message.namespace.tenant
    if len(tenant) > MAX_TENANT_CHARS:
        raise InvalidRequest("namespace.tenant", f"at most {MAX_TENANT_CHARS} characters")
    check_salt(message.namespace.cache_salt, limits)
    if allowed_tenant != ANY_TENANT and tenant and tenant != allowed_tenant:
        raise TenantRefused(f"namespace.tenant: this token may only use tenant {allowed_tenant!r}")
    prompt, order = _prompt(message)
    fields = [fields[k] for k in order]
    request = GenerateRequest(
        request_id,
        namespace=request_namespace(message, allowed_tenant, adapters),
        sampling=sampling_from_proto(message.sampling),
        images=tuple(message.images[k] for k in order),
        tools=tools_from_proto(message.tools),
        template_variables=validation.template_variables(message.chat_template_kwargs),
        continue_final_message=message.continue_final_message,
        add_generation_prompt=_add_generation_prompt(message),
        priority=message.priority,
        pooling=pooling_from_proto(message),
        suffix=message.suffix or None,
        **prompt,
    )
    if request.template_variables is not None and request.messages is None:
        raise InvalidRequest("chat_template_kwargs", "is for a chat's template; send messages")
    _check_turn_end(message, request)
    request = _with_tools(message, request)
    if message.text_match not in serving_pb2.TextMatch.values():
        raise InvalidRequest(
            "text_match", f"{message.text_match} is not one of {serving_pb2.TextMatch.keys()}"
        )
    images = _checked_images(request, limits, fields)
    encoder = None
    if text_prompts is not None and not images and message.WhichOneof("prompt") in ("text", "chat"):
        encoder = text_prompts.encoder(request.namespace, text_prompts.mode(_text_match(message)))
    ids = validation.prompt_ids(request, encoder or tokenizer, _reading(message, limits), images)
    cut = truncated_prompt(message, ids, limits, images)
    if cut is not None:  # the text index's turn would name ids the worker never saw
        ids, encoder = cut, None
    request = validation.with_fim_ends(request, tokenizer)
    filled = (fill_context or fill_cap) and not request.pooling
    if filled and not message.sampling.HasField("max_tokens"):
        room = max(1, limits.max_model_len - len(ids))
        room = room if fill_cap is None else min(room, fill_cap)
        request = replace(request, sampling=replace(request.sampling, max_tokens=room))
    if not counting:
        validation.validate(request, ids, limits)
    sampling = _served_sampling(request)
    keys = None
    if images:
        assert limits.image_spec is not None
        keys = router_images.image_cache_keys(ids, images, limits.image_spec)
    turn = None
    if encoder is not None:  # accepted: the prompt joins the text index
        encoder.keep()
        turn = encoder.turn if request.suffix is None else None  # no prompt reads on past a middle
    return PreparedRequest(
        request_id,
        tuple(ids),
        request.namespace,
        sampling,
        turn,
        adapter,
        request.images,
        keys,
        request.priority,
        request.pooling,
    )


def _reading(message: serving_pb2.GenerateRequest, limits: RequestLimits) -> RequestLimits:
    """The limits a prompt is tokenized under: a prompt to be cut (`truncate_prompt_tokens`) is
    read whole, within max_prompt_chars, not refused by its head as one past the context is."""
    if not message.HasField("truncate_prompt_tokens"):
        return limits
    return replace(limits, max_model_len=max(limits.max_model_len, limits.max_prompt_chars))


def truncated_prompt(
    message: serving_pb2.GenerateRequest,
    ids: list[int],
    limits: RequestLimits,
    images: Sequence[object],
) -> list[int] | None:
    """The prompt's last `truncate_prompt_tokens` ids (vLLM's), or None where it asks none or
    the prompt is no longer. -1: as many as the context holds, with room for `max_tokens` (or
    one token) when it generates."""
    if not message.HasField("truncate_prompt_tokens"):
        return None
    keep = message.truncate_prompt_tokens
    if keep == -1:
        generates = not message.HasField("pooling")
        asked = message.sampling.max_tokens if message.sampling.HasField("max_tokens") else 1
        keep = max(1, limits.max_model_len - (max(asked, 1) if generates else 0))
    if keep < 1:
        raise InvalidRequest("truncate_prompt_tokens", f"must be -1 or at least 1, got {keep}")
    if keep > limits.max_model_len:
        raise InvalidRequest(
            "truncate_prompt_tokens",
            f"{keep} is over the model's context length, {limits.max_model_len}",
        )
    if images or message.suffix:
        what = "images" if images else "a suffix"
        raise InvalidRequest("truncate_prompt_tokens", f"is not served with {what}")
    return ids[-keep:] if len(ids) > keep else None


def _text_match(message: serving_pb2.GenerateRequest) -> int:
    """How a text prompt reuses the text index: as asked; an embedding that does not ask takes
    `exact`, whatever the router's default (under `anchored`, the same text could embed
    differently after another conversation left generated ids for it)."""
    if message.text_match or not message.HasField("pooling"):
        return message.text_match
    return serving_pb2.TEXT_MATCH_EXACT


def _served_sampling(request: GenerateRequest) -> SamplingParams:
    """What the workers get of a checked request's sampling: a seed drawn for a random one (so
    a migrated sample goes on as it began); nothing of it for an embedding."""
    if request.pooling is not None:
        return EMBEDDING_SAMPLING
    sampling = request.sampling
    if sampling.seed is None and not sampling.greedy:
        sampling = replace(sampling, seed=secrets.randbits(63))
    return sampling


def _add_generation_prompt(message: serving_pb2.GenerateRequest) -> bool:
    """As the request says; by default true, but for an embedding (an embedded chat is not
    answered: vLLM's default)."""
    if message.HasField("add_generation_prompt"):
        return message.add_generation_prompt
    return not message.HasField("pooling")


def _image_fields(
    message: serving_pb2.GenerateRequest, limits: RequestLimits, given: Sequence[str]
) -> list[str]:
    """What refusals call each image; refuses any image of a text model, and too many images
    before decoding one."""
    fields = router_images.image_fields(len(message.images), given)
    if message.images and limits.image_spec is None:  # named by the client's part, if any
        where = given[0] if given else "images"
        raise InvalidRequest(where, "this model has no vision encoder; send text only")
    if message.images:
        router_images.check_count(fields, limits.images.max_images)
    return fields


def _checked_images(
    request: GenerateRequest, limits: RequestLimits, fields: Sequence[str]
) -> list[CheckedImage]:
    """The request's images decoded and checked, a bad one refused as the client named it."""
    try:
        return validation.request_images(request, limits)
    except InvalidRequest as err:
        raise router_images.renamed(err, fields) from None


def check_salt(salt: str, limits: RequestLimits) -> None:
    if len(salt) > MAX_SALT_CHARS:
        raise InvalidRequest("namespace.cache_salt", f"at most {MAX_SALT_CHARS} characters")
    if salt and not limits.cache_salts:
        raise salt_unkept()


def salt_unkept() -> InvalidRequest:
    """The refusal of a salted request that a worker without salts would serve from the
    unsalted cache: at its check, or when routed to one attached since (cluster/router_service)."""
    return InvalidRequest(
        "namespace.cache_salt",
        "a worker of this cluster predates cache salts and would serve the request from the "
        "unsalted cache: upgrade it, or send no salt",
    )


def salt_digest(salt: str) -> str:
    """What a cache salt is kept as from the router on (the namespace's `salt`): a digest of a
    fixed 32 characters, so a client's secret is neither written to a saved cache nor held
    at its length in every tree and index."""
    return blake2b(salt.encode(), digest_size=16, person=b"radixmesh-salt").hexdigest()


def request_namespace(
    message: serving_pb2.GenerateRequest,
    allowed_tenant: str,
    adapters: Mapping[str, str] | None = None,
) -> CacheNamespace:
    """The cache namespace a request runs in: a token bound to a tenant always uses that one;
    a LoRA request's adapter is its identity. Raises InvalidRequest for an unknown adapter."""
    tenant = message.namespace.tenant if allowed_tenant == ANY_TENANT else allowed_tenant
    identity = adapter_identity(message.namespace.adapter or None, adapters)
    raw = message.namespace.cache_salt
    salt = salt_digest(raw) if raw else None
    return CacheNamespace(adapter=identity, tenant=tenant or None, salt=salt)


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


def _with_tools(message: serving_pb2.GenerateRequest, request: GenerateRequest) -> GenerateRequest:
    """The request with its tools checked and the constraint of their calls in its sampling."""
    choice = message.tool_choice or "auto"
    if not request.tools:
        if choice not in ("auto", "none"):
            raise InvalidRequest("tool_choice", f"{choice!r} needs tools, and none are given")
        if message.HasField("parallel_tool_calls"):
            raise InvalidRequest("parallel_tool_calls", "needs tools, and none are given")
        return request
    if request.messages is None:
        raise InvalidRequest("tools", "are shown to a chat's model; send the prompt as messages")
    check_tools(request.tools)
    parallel = message.parallel_tool_calls if message.HasField("parallel_tool_calls") else True
    constraint = tool_constraint(request.tools, choice, parallel)
    if constraint is None:
        return request
    if request.sampling.structured is not None:
        raise InvalidRequest(
            "tool_choice" if message.tool_choice else "tools",
            f"{choice!r} constrains the calls, and the request asks for a structured output "
            'too; give one of them (tool_choice "none" leaves the output to it)',
        )
    return replace(request, sampling=replace(request.sampling, structured=constraint))


def _prompt(message: serving_pb2.GenerateRequest) -> tuple[dict[str, Any], list[int]]:
    """The prompt's GenerateRequest fields, and the order in which its images are placed (a
    chat's image parts may name them in any order; text and ids place them as sent)."""
    which = message.WhichOneof("prompt")
    in_order = list(range(len(message.images)))
    if which == "text":
        return {"prompt": message.text}, in_order
    if which == "token_ids":
        return {"prompt_token_ids": tuple(message.token_ids.ids)}, in_order
    if which == "chat":
        messages, order = router_images.chat_messages(message.chat, len(message.images))
        return {"messages": messages}, order
    raise InvalidRequest("prompt", "set one of text, token_ids or chat")


def _check_turn_end(message: serving_pb2.GenerateRequest, request: GenerateRequest) -> None:
    """continue_final_message and add_generation_prompt: for a chat, and not both (vLLM's
    rule: a continued turn is left open, so no reply opens after it)."""
    asked = {
        "continue_final_message": message.continue_final_message,
        "add_generation_prompt": message.HasField("add_generation_prompt"),
    }
    for name, given in asked.items():
        if given and request.messages is None:
            raise InvalidRequest(name, "is for a chat's template; send messages")
    if message.continue_final_message and message.add_generation_prompt:
        raise InvalidRequest(
            "add_generation_prompt",
            "true with continue_final_message: a continued turn is left open, so no reply "
            "opens after it; leave add_generation_prompt out or false",
        )
