"""The HTTP API as a FastAPI app over the router's serving core.

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models     (OpenAI)
    GET /v1/chat/completions    GET, POST, DELETE /v1/chat/completions/{id}[/messages]  (stored)
    /v1/conversations...        (OpenAI's Conversations API: cluster/http/conversations.py)
    POST /v1/embeddings         POST /v1/score, /score   POST /v1/rerank, /rerank, /v2/rerank
    POST /v1/responses          GET, DELETE /v1/responses/{id}[/input_items]
                                POST /v1/responses/{id}/cancel
    POST, GET /v1/files         GET, DELETE /v1/files/{id}   GET /v1/files/{id}/content
    POST, GET /v1/batches       GET /v1/batches/{id}         POST /v1/batches/{id}/cancel
    POST /v1/messages           POST /v1/messages/count_tokens            (Anthropic)
    /v1/messages/batches...     (Anthropic's Message Batches: cluster/http/message_batches.py)
    POST /tokenize              POST /detokenize    GET /tokenizer_info   (vLLM's)
    POST /v1/load_lora_adapter  POST /v1/unload_lora_adapter              (vLLM's; admin)
    POST /generate   GET /get_model_info   POST /abort_request   (SGLang's native API)
    POST /reset_prefix_cache (vLLM's)   GET, POST /flush_cache (SGLang's)  (admin)
    GET  /health, GET or POST /ping (vLLM's, SageMaker's)   (no token: probes carry none)
    GET  /health_generate (SGLang's: a one-token generation)  (no token either; its reasons
                                                               and worker: an operator's)
    GET  /version               (vLLM's)

A request's `model` is the base model's served name, or a LoRA adapter's name (vLLM's
convention): the request then runs with that adapter (gRPC's namespace.adapter). Any other
name is 404, as OpenAI answers. /v1/models lists the base model and every adapter a worker
holds (`parent`: the base model). Loading and unloading adapters, and emptying the caches,
need a token bound to every tenant ("*"), as the Admin gRPC service does (403 otherwise).

Every call but the probes (/health, /ping, /health_generate) needs a known bearer token when
`security.auth_tokens` is set (`Authorization: Bearer <token>`, or Anthropic's `x-api-key:
<token>`), and uses the tenant the token allows; `X-Radixmesh-Tenant` names a tenant for tokens
bound to "*" (or with no tokens). `X-Request-Id` sets the request id (as for vLLM), which gRPC's
Abort takes. A generation's response names the worker that served it (`X-Radixmesh-Worker`) and
the prompt tokens the router expected it to find cached (`X-Radixmesh-Predicted-Cached-Tokens`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster.auth import known_token
from cluster.config import ANY_TENANT, ClusterConfig
from cluster.http import (
    anthropic_routes,
    batch_routes,
    beam_search,
    conversations,
    legacy_functions,
    message_batches,
    openai_params,
    responses_routes,
    scores,
    sglang_generate,
    stored_completions,
)
from cluster.http.anthropic_schema import ModelInfo, ModelInfoList
from cluster.http.batch_runner import BatchRunner
from cluster.http.batches import Batches
from cluster.http.body_limit import BodyLimit
from cluster.http.conversations import ConversationStore
from cluster.http.embeddings import (
    embed_all,
    embedding_calls,
    embedding_requests,
    embedding_response,
)
from cluster.http.embeddings_schema import EmbeddingRequest
from cluster.http.errors import GenerationFailed, HttpError, Renames, renames
from cluster.http.file_store import FileStore
from cluster.http.generation_probe import GenerationProbe, ProbeFailed
from cluster.http.image_parts import image_body_bytes
from cluster.http.json_answer import answer
from cluster.http.openai_responses import (
    Counts,
    Reply,
    Responses,
    Sample,
    chat_chunks,
    chat_completion,
    collect,
    completion,
    completion_chunks,
    guarded,
    prepend,
    served_by,
    without_reasoning,
)
from cluster.http.openai_schema import (
    LONE_SURROGATE,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    GenerationParams,
    LoadLoraAdapterRequest,
    ModelCard,
    ModelList,
    StreamOptions,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    UnloadLoraAdapterRequest,
)
from cluster.http.prompt_logprobs import prompt_alone
from cluster.http.response_store import ResponseStore
from cluster.http.responses_background import BackgroundResponses
from cluster.http.responses_chain import owner
from cluster.http.several_prompts import merged
from cluster.http.sse import ClientGone, EventStream, until_disconnected
from cluster.http.state_files import subdirectory
from cluster.http.stored_completions import (
    CompletionStore,
    Keep,
    answered_whole,
    kept_at_the_end,
)
from cluster.http.token_texts import TokenTexts
from cluster.requests import REQUEST_ID_RULE, valid_request_id
from cluster.router_admin import clear_caches
from cluster.router_service import RouterService, every_failure, no_failure
from cluster.serving_call import Caller, ServingError
from protos.radixmesh.v1 import serving_pb2
from worker.reasoning import template_thinks
from worker.tokenizer import Tokenizer, TokenizerError
from worker.validation import RequestLimits

T = TypeVar("T")
log = logging.getLogger(__name__)
UPLOAD_LIMIT = "router.files_bytes less the files kept, at most 200 MiB an upload"
TENANT_HEADER = "x-radixmesh-tenant"
CLIENT_GONE = 499
"""What the log says of a request whose client left (nginx's code; nobody receives it)."""


class HttpApi:
    """The handlers, over one RouterService."""

    def __init__(self, service: RouterService, config: ClusterConfig) -> None:
        self.service = service
        self.config = config
        self.model = config.model.name
        self.started = int(time.time())
        self.draining = False
        """Set when the router drains: /health says 503 and new generations are refused."""
        self._texts: tuple[Tokenizer | None, TokenTexts] | None = None
        kept, state = config.router.response_store_bytes, config.router.state_dir
        self.responses = ResponseStore(kept, subdirectory(state, "responses"))
        """The Responses API's stored responses."""
        self.chat_store = CompletionStore(kept, subdirectory(state, "chat_completions"))
        """The stored chat completions (`store: true`)."""
        self.conversations = ConversationStore(kept, subdirectory(state, "conversations"))
        """OpenAI's Conversations API's conversations, in a store of their own."""
        for store in (self.responses, self.chat_store, self.conversations):
            store.restore()  # what a router before this one kept (router.state_dir)
        self.background = BackgroundResponses()
        """The Responses API's background generations running."""
        self.embedding_calls = asyncio.Semaphore(embedding_calls(config.router.max_in_flight))
        """The embeddings API's inputs in flight, all its requests together."""
        router = config.router
        self.files = FileStore(
            router.files_bytes,
            subdirectory(router.state_dir, "files"),
            router.files_bytes_per_tenant,
        )
        """The Files API's files: batch inputs and outputs."""
        by_priority = config.engine.scheduling_policy == "priority"
        self.batch_runner = BatchRunner(
            router.batch_max_in_flight,
            router.batch_order,
            accepting=lambda: not self.draining,
            priority=router.batch_priority if by_priority else None,
            workers=lambda: bool(self.service.links.links),
        )
        """Runs every batch's requests through this app (`build_app`), both APIs' together."""
        self.batches = Batches(
            self.files, self.batch_runner, subdirectory(router.state_dir, "batches")
        )
        """OpenAI's Batch API's batches."""
        self.probe = GenerationProbe(
            lambda message: self.start(message, Caller(ANY_TENANT), metered=False),
            lambda: self.service.forwarded_at,
        )
        """SGLang's /health_generate."""

    # -- who calls, and about what ---------------------------------------------------------------
    def caller(self, request: Request) -> Caller:
        """The tenant the caller's token allows (401 without a known token, when tokens are
        configured); "*" when no token is configured."""
        tokens = self.config.security.auth_tokens
        if not tokens:
            return Caller(ANY_TENANT)
        given = _bearer(request.headers.get("authorization")) or request.headers.get("x-api-key")
        token = known_token(given, self.config.security)
        if token is None:
            raise HttpError(
                401,
                "a valid token is required (header 'Authorization: Bearer <token>' or "
                "'x-api-key: <token>')",
            )
        return Caller(tokens[token])

    @staticmethod
    def tenant(request: Request) -> str:
        """The tenant the request names (X-Radixmesh-Tenant; "" for the token's own, or none):
        the serving core refuses one the token does not allow (403), as for gRPC."""
        return request.headers.get(TENANT_HEADER, "")

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model); 404 for a model not served."""
        if model is None or model == self.model:
            return None
        adapters = self.service.links.adapters()
        if model in adapters:
            return model
        served = [self.model, *sorted(adapters)]
        raise HttpError(
            404, f"model {model!r} does not exist; this cluster serves {served}", "model"
        )

    def may_upload(self, headers: dict[bytes, bytes]) -> bool:
        """Whether a request's raw headers carry a known token (or none is configured): only
        then may its body be an upload's size, read before the handler checks the token."""
        tokens = self.config.security.auth_tokens
        if not tokens:
            return True
        given = _bearer(headers.get(b"authorization", b"").decode("latin-1"))
        given = given or headers.get(b"x-api-key", b"").decode("latin-1") or None
        return known_token(given, self.config.security) is not None

    def is_operator(self, request: Request) -> bool:
        """Whether the caller's token is bound to every tenant (or no token is configured)."""
        try:
            return self.caller(request).tenant == ANY_TENANT
        except HttpError:
            return False

    def require_admin(self, request: Request) -> None:
        """403 unless the caller's token is bound to every tenant (the Admin service's rule)."""
        if self.caller(request).tenant != ANY_TENANT:
            raise HttpError(403, "this call needs a token bound to tenant '*' (an operator's)")

    def request_id(self, request: Request) -> str:
        """The client's `X-Request-Id` (refused, naming it, unless it can be an id), or a new
        one."""
        given = request.headers.get("x-request-id")
        if not given:
            return uuid.uuid4().hex
        if not valid_request_id(given):
            raise HttpError.invalid("X-Request-Id", REQUEST_ID_RULE)
        return given

    def token_texts(self) -> TokenTexts:
        tokenizer = self.service.links.tokenizer
        if self._texts is None or self._texts[0] is not tokenizer:  # a router restart's new one
            self._texts = (tokenizer, TokenTexts(tokenizer))
        return self._texts[1]

    def start(
        self,
        message: serving_pb2.GenerateRequest,
        caller: Caller,
        fill_context: bool = False,
        image_fields: Sequence[str] = (),
        fill_cap: int | None = None,
        metered: bool = True,
        uncounted: Callable[[ServingError], bool] = no_failure,
    ) -> Responses:
        """The request's stream. `fill_context`: without max_tokens, generate up to the end of
        the context (chat, as OpenAI's chat API does) instead of 16 (legacy completions);
        `fill_cap`: at most so many of it. `image_fields`: the part each of the message's
        images came in (for refusals). `metered`, `uncounted`: RouterService.generate's."""
        if self.draining:
            raise HttpError(503, "the router is draining; retry on another")
        return self.service.generate(
            message, caller, fill_context, image_fields, fill_cap, metered, uncounted
        )

    # -- OpenAI ------------------------------------------------------------------------------------
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        caller = self.caller(request)
        adapter = self.check_model(body.model)
        rid = self.request_id(request)
        keep = self._keeper(body, caller, request)
        body = legacy_functions.modern(body)
        message, image_fields = openai_params.chat_request(body, rid, self.tenant(request))
        message.namespace.adapter = adapter or ""
        reply = Reply(
            f"chatcmpl-{rid}",
            adapter or self.model,
            self.token_texts(),
            prompt_logprobs=body.prompt_logprobs is not None,
            token_ids=bool(body.return_token_ids),
            request_ids=[message.request_id],
            n=body.n or 1,
        )
        logprobs = bool(body.logprobs)
        options = body.stream_options or StreamOptions()
        tools = openai_params.callable_tools(body)
        old = legacy_functions.legacy(body)  # its call comes back as function_call
        if body.use_beam_search:
            top = (body.top_logprobs or 0) if logprobs else 0
            stream = self.beam_searched(body, [message], caller, True, top)
        else:
            stream = self.start(message, caller, fill_context=True, image_fields=image_fields)
        if not body.include_reasoning:
            stream = without_reasoning(stream)
        return await self.respond(
            request,
            stream,
            body,
            lambda stream: chat_chunks(reply, stream, options, logprobs, tools, old),
            lambda samples, counts: chat_completion(reply, samples, counts, logprobs, tools, old),
            logprobs,
            openai_params.refusal_names(body),
            keep,
        )

    def beam_searched(
        self,
        body: GenerationParams,
        messages: list[serving_pb2.GenerateRequest],
        caller: Caller,
        fill_context: bool,
        top: int,
    ) -> Responses:
        """vLLM's beam search of each prompt (cluster/http/beam_search.py), its best beams as the
        finished samples of a stream; what it does not do refused here, by name. Each step is
        a request of its own through the router, not metered: each prompt's search is metered
        as one call (RouterService.metered_whole)."""
        beam_search.check(body, any(m.images for m in messages))
        if self.draining:
            raise HttpError(503, "the router is draining; retry on another")
        tokenizer, limits = self.tokenizer()
        given = messages[0].sampling
        if given.HasField("max_tokens") and given.max_tokens < 1:
            raise HttpError.invalid("max_tokens", "at least 1 with use_beam_search")
        default = None if fill_context else beam_search.DEFAULT_MAX_TOKENS
        asked = beam_search.asked_search(
            body, given.max_tokens if given.HasField("max_tokens") else default, top
        )
        eos = frozenset(tokenizer.eos_token_ids)
        if given.separate_reasoning and template_thinks(tokenizer.chat_template):
            raise HttpError.invalid(
                "use_beam_search",
                "a thinking model's reasoning is not told apart from its beams: send "
                "separate_reasoning false for their whole text",
            )
        steps = asyncio.Semaphore(beam_search.STEPS_IN_FLIGHT)

        async def run(message: serving_pb2.GenerateRequest) -> tuple[dict[int, Sample], Counts]:
            # not self.start: a draining router finishes the searches it took, as any call
            step = self.service.generate(message, caller, metered=False, uncounted=every_failure)
            async with steps:
                return await collect(step)

        async def decode(ids: list[int]) -> str:
            return await asyncio.to_thread(tokenizer.decode, ids, body.skip_special_tokens)

        searches = [
            functools.partial(beam_search.search, run, m, asked, eos, limits.max_model_len)
            for m in messages
        ]
        found = beam_search.responses(searches, decode, asked.width, bool(body.return_token_ids))
        named = messages[0].namespace.tenant
        tenant = named if caller.tenant == ANY_TENANT else caller.tenant
        return self.service.metered_whole(found, tenant or None, len(messages), asked.width)

    def _keeper(self, body: ChatCompletionRequest, caller: Caller, request: Request) -> Keep | None:
        """What keeps a chat completion asked to be stored (None: not asked)."""
        if not stored_completions.storing(body, self.chat_store):
            return None
        tenant = owner(caller, self.tenant(request))
        large = bool(body.logprobs or body.return_token_ids)
        place = self.chat_store.next_place()

        async def keep(completion: BaseModel) -> None:
            record = functools.partial(stored_completions.kept, body, completion, place)
            kept = await asyncio.to_thread(record) if large else record()
            self.chat_store.put(tenant, kept.key, kept)

        return keep

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        caller = self.caller(request)
        adapter = self.check_model(body.model)
        rid = self.request_id(request)
        messages = openai_params.completion_requests(body, rid, self.tenant(request))
        for message in messages:
            message.namespace.adapter = adapter or ""
        reply = Reply(
            f"cmpl-{rid}",
            adapter or self.model,
            self.token_texts(),
            echo=[await self.echo_text(m) for m in messages] if body.echo else None,
            prompt_logprobs=body.prompt_logprobs is not None,
            token_ids=bool(body.return_token_ids),
            request_ids=[m.request_id for m in messages],
            n=body.n or 1,
        )
        logprobs = body.logprobs is not None
        if body.use_beam_search:
            stream = self.beam_searched(body, messages, caller, False, body.logprobs or 0)
        else:
            stream = merged([self.start(m, caller) for m in messages], reply.n)
        if body.echo and body.max_tokens == 0:
            stream = prompt_alone(stream)
        options = body.stream_options or StreamOptions()
        return await self.respond(
            request,
            stream,
            body,
            lambda stream: completion_chunks(reply, stream, options, logprobs),
            lambda samples, counts: completion(reply, samples, counts, logprobs),
            logprobs,
            openai_params.refusal_names(body),
        )

    async def embeddings(self, body: EmbeddingRequest, request: Request) -> Response:
        """OpenAI's embeddings: one embedding request per input (cluster/http/embeddings.py)."""
        outputs, counts, model = await self.embedded(body, request)
        form = body.encoding_format
        return await answer(lambda: embedding_response(outputs, counts, form, model), counts, True)

    async def embedded(
        self, body: EmbeddingRequest, request: Request
    ) -> tuple[list[serving_pb2.GenerateResponse], Counts, str]:
        """Each input's finished response (its embedding), the counts, and the model's name
        (the embeddings API; score and rerank: cluster/http/scores.py)."""
        caller = self.caller(request)
        adapter = self.check_model(body.model)
        messages = embedding_requests(body, self.request_id(request), self.tenant(request))
        for message in messages:
            message.namespace.adapter = adapter or ""
        counts = Counts()
        start = functools.partial(self.start, caller=caller)
        work = embed_all(start, messages, counts, self.embedding_calls)
        return await self.finish(request, work), counts, adapter or self.model

    async def echo_text(self, message: serving_pb2.GenerateRequest) -> str:
        """The prompt as an echoing completion begins with it: as sent, or token ids decoded
        (special tokens written)."""
        tokenizer = self.service.links.tokenizer
        if message.WhichOneof("prompt") == "text" or tokenizer is None:  # none: refused anyway
            return message.text
        try:
            ids = list(message.token_ids.ids)
            return await asyncio.to_thread(tokenizer.decode, ids, skip_special_tokens=False)
        except TokenizerError as err:
            raise HttpError.invalid("prompt", str(err)) from err

    async def respond(
        self,
        request: Request,
        stream: Responses,
        body: GenerationParams,
        events: Callable[[Responses], AsyncIterator[bytes]],
        whole: Callable[[dict[int, Sample], Counts], BaseModel],
        large: bool,
        rename: Renames | None = None,
        keep: Keep | None = None,
    ) -> Response:
        """A generation's answer: its event stream, started once the first token is there (a
        refusal is still an HTTP status, not an event in a 200 stream), or the whole response.
        `rename`: the core's names of refused fields -> the request's (`HttpError.renamed`);
        `keep`: what stores the whole response once the generation ended (streamed: built from
        what the stream carried)."""
        if body.stream_options is not None and not body.stream:
            await stream.aclose()
            raise HttpError.invalid("stream_options", "is only allowed with stream: true")
        if body.stream:
            if keep is not None:
                stream = kept_at_the_end(stream, whole, keep, large)
            first = await self.finish(request, anext(stream), rename)
            return EventStream(guarded(events(prepend(first, stream))), served_by(first))
        samples, counts = await self.finish(request, collect(stream), rename)
        if keep is None or not answered_whole(samples):
            return await answer(lambda: whole(samples, counts), counts, large)
        built = await asyncio.to_thread(whole, samples, counts) if large else whole(samples, counts)
        await keep(built)
        return await answer(lambda: built, counts, large)

    async def finish(
        self, request: Request, work: Awaitable[T], rename: Renames | None = None
    ) -> T:
        try:
            return await until_disconnected(request, work)
        except (ServingError, GenerationFailed) as err:
            failure = HttpError.of(err)
            raise (failure.renamed(rename) if rename else failure) from err

    async def models(self, request: Request) -> Response:
        """Every model served (the base model, then each adapter), in the shape of the SDK that
        asks: Anthropic's when the request carries `anthropic-version`, else OpenAI's."""
        self.caller(request)
        cards = self._cards()
        if not anthropic_shaped(request.url.path, request.headers):
            return _json(ModelList(data=cards))
        infos = [self._model_info(card) for card in cards]
        first, last = (infos[0].id, infos[-1].id) if infos else (None, None)
        return _json(ModelInfoList(data=infos, first_id=first, last_id=last))

    async def retrieve_model(self, model_id: str, request: Request) -> Response:
        """One model served (`GET /v1/models/{id}`, the SDKs' `models.retrieve`), 404 naming
        those served for any other."""
        self.caller(request)
        card = next((card for card in self._cards() if card.id == model_id), None)
        if card is None:
            self.check_model(model_id)  # raises the 404
        assert card is not None
        if anthropic_shaped(request.url.path, request.headers):
            return _json(self._model_info(card))
        return _json(card)

    def _model_info(self, card: ModelCard) -> ModelInfo:
        created = datetime.fromtimestamp(card.created, UTC).isoformat().replace("+00:00", "Z")
        return ModelInfo(id=card.id, display_name=card.id, created_at=created)

    def _cards(self) -> list[ModelCard]:
        limits = self.service.links.limits
        max_model_len = limits.max_model_len if limits else None
        cards = [
            ModelCard(
                id=self.model,
                created=self.started,
                root=self.config.model.source,
                max_model_len=max_model_len,
            )
        ]
        paths = {}
        for link in self.service.links.links.values():
            paths.update({name: info.path for name, info in link.adapters.items()})
        cards += [
            ModelCard(
                id=name,
                created=self.started,
                root=paths.get(name, ""),
                parent=self.model,
                max_model_len=max_model_len,
            )
            for name in sorted(self.service.links.adapters())
        ]
        return cards

    # -- vLLM's LoRA endpoints -------------------------------------------------------------------
    async def load_lora_adapter(self, body: LoadLoraAdapterRequest, request: Request) -> Response:
        self.require_admin(request)
        try:
            await self.service.adapter_admin.load(body.lora_name, body.lora_path)
        except ServingError as err:
            raise HttpError.of(err) from err
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_lora_adapter(
        self, body: UnloadLoraAdapterRequest, request: Request
    ) -> Response:
        self.require_admin(request)
        try:
            await self.service.adapter_admin.unload(body.lora_name)
        except ServingError as err:
            raise HttpError.of(err) from err
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def clear_caches(self, request: Request) -> Response:
        """vLLM's `POST /reset_prefix_cache` and SGLang's `/flush_cache`: every worker's prefix
        cache and the router's text index emptied (Admin.ClearCaches), as benchmarks ask
        between runs; 409 while a worker has requests running."""
        self.require_admin(request)
        try:
            freed = await clear_caches(self.service.links, self.service.clear_text_index)
        except ServingError as err:
            raise HttpError.of(err) from err
        return JSONResponse({"pages_freed": freed})

    # -- vLLM's tokenizer endpoints ----------------------------------------------------------------
    async def tokenize(self, body: TokenizeRequest, request: Request) -> TokenizeResponse:
        caller = self.caller(request)
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise HttpError.invalid("prompt", "give exactly one of prompt and messages")
        if body.prompt is not None:
            if body.continue_final_message:
                raise HttpError.invalid("continue_final_message", "is for messages, not a prompt")
            text, name = body.prompt, "prompt"
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self.encode(text, special, name)
        else:
            messages = body.messages or []
            chat = openai_params.chat_prompt(legacy_functions.conversation(messages) or messages)
            tools = openai_params.wire_tools(body.tools)
            turns = any(
                m.tool_calls or m.role == "tool" or m.reasoning_content for m in chat.messages
            )
            if chat.images or tools or turns or body.continue_final_message:
                ids = await self.served_prompt_ids(body, chat, caller, self.tenant(request), tools)
            else:
                text = await self.render(chat.messages, body.add_generation_prompt)
                special = bool(body.add_special_tokens)  # the template wrote them (vLLM's)
                ids = await self.encode(text, special, "messages")
        limits = self.service.request_limits()
        max_model_len = limits.max_model_len if limits else 0
        return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids)

    async def served_prompt_ids(
        self,
        body: TokenizeRequest,
        chat: openai_params.ChatPrompt,
        caller: Caller,
        tenant: str,
        tools: Sequence[serving_pb2.Tool],
    ) -> list[int]:
        """The ids a chat request with images, tools or its last message continued is served
        with (each image's placeholder expanded into its tiles' image tokens, the tools and tool
        turns written as for the model's template), as a request would be rendered: with the
        generation prompt unless continued, and no extra special tokens, so other settings are
        refused by name."""
        opens_reply = body.add_generation_prompt
        if body.continue_final_message:  # vLLM's rule: not both
            if opens_reply and "add_generation_prompt" in body.model_fields_set:
                raise HttpError.invalid(
                    "add_generation_prompt", "true with continue_final_message: leave it out"
                )
        elif not opens_reply:
            raise HttpError.invalid("add_generation_prompt", "with images or tools it must be true")
        if body.add_special_tokens:
            raise HttpError.invalid(
                "add_special_tokens", "with images, tools or a continued message it must be false"
            )
        rename = renames({}, openai_params.TOOL_FIELDS)
        return await self.chat_prompt_ids(
            chat, caller, tenant, tools, rename, body.continue_final_message
        )

    async def chat_prompt_ids(
        self,
        chat: openai_params.ChatPrompt,
        caller: Caller,
        tenant: str,
        tools: Sequence[serving_pb2.Tool] = (),
        rename: Renames | None = None,
        continue_final: bool = False,
        template_kwargs: str = "",
    ) -> list[int]:
        """The prompt ids a chat request of `chat` (images and tools included; its last message
        continued with `continue_final`; `template_kwargs`: its chat_template_kwargs) would be
        served with (router_service.count_prompt:
        the request's own checks but the context's, refusals named, as the request named them
        with `rename`)."""
        message = serving_pb2.GenerateRequest(
            chat=serving_pb2.ChatMessages(messages=chat.messages),
            images=chat.images,
            tools=tools,
            continue_final_message=continue_final,
            chat_template_kwargs=template_kwargs,
        )
        message.namespace.tenant = tenant
        try:
            return await self.service.count_prompt(message, caller, chat.image_fields)
        except ServingError as err:
            failure = HttpError.of(err)
            raise (failure.renamed(rename) if rename else failure) from err

    async def detokenize(self, body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        self.caller(request)
        self.check_model(body.model)
        tokenizer, _ = self.tokenizer()
        try:
            text = await asyncio.to_thread(tokenizer.decode, body.tokens)
            return DetokenizeResponse(prompt=text)
        except TokenizerError as err:
            raise HttpError.invalid("tokens", str(err)) from err

    async def tokenizer_info(self, request: Request) -> TokenizerInfo:
        """vLLM's `GET /tokenizer_info`: what a client needs to tokenize and template prompts as
        the server does, with `/tokenize` and `/detokenize` (lm-evaluation-harness's
        `tokenizer_backend=remote`)."""
        self.caller(request)
        tokenizer, limits = self.tokenizer()
        return TokenizerInfo(
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
            chat_template=tokenizer.chat_template,
            model_max_length=limits.max_model_len,
        )

    def tokenizer(self) -> tuple[Tokenizer, RequestLimits]:
        limits = self.service.request_limits()
        tokenizer = self.service.links.tokenizer
        if limits is None:
            raise HttpError(503, "no healthy worker")
        if tokenizer is None:
            raise HttpError.invalid("prompt", "this model has no tokenizer")
        return tokenizer, limits

    async def render(
        self, messages: list[serving_pb2.ChatMessage], add_generation_prompt: bool = True
    ) -> str:
        """A conversation through the chat template, on a thread (400 if the template refuses)."""
        tokenizer, _ = self.tokenizer()
        limits = self.service.links.limits
        vision = limits is not None and limits.vision is not None  # its template renders parts
        chat = [
            {
                "role": m.role,
                "content": [{"type": "text", "text": m.content}] if vision else m.content,
                **({"name": m.name} if m.name else {}),
            }
            for m in messages
        ]
        try:
            return await asyncio.to_thread(
                tokenizer.apply_chat_template, chat, add_generation_prompt
            )
        except ValueError as err:
            raise HttpError.invalid("messages", str(err)) from err

    async def encode(self, text: str, special: bool, name: str) -> list[int]:
        """Token ids of `text`, on a thread; over engine.max_prompt_chars: 413 naming `name`."""
        tokenizer, limits = self.tokenizer()
        if len(text) > limits.max_prompt_chars:
            raise HttpError(
                413,
                f"{name}: {len(text)} characters; the limit is {limits.max_prompt_chars} "
                "(max_prompt_chars)",
                name,
            )
        return await asyncio.to_thread(tokenizer.encode, text, special)

    async def version(self, request: Request) -> JSONResponse:
        """vLLM's `GET /version`: the version of radixmesh serving."""
        self.caller(request)
        try:
            return JSONResponse({"version": package_version("radixmesh")})
        except PackageNotFoundError:  # run from a checkout that was never installed
            return JSONResponse({"version": "unknown"})

    async def health(self) -> Response:
        workers = len(self.service.links.links)
        if self.draining or not workers:
            status = "draining" if self.draining else "no healthy worker"
            return JSONResponse({"status": status, "workers": workers}, status_code=503)
        return JSONResponse({"status": "ok", "workers": workers})

    async def health_generate(self, request: Request) -> Response:
        """SGLang's probe: 200 once a one-token generation answered, or, busy, once any
        generation streamed (cluster/http/generation_probe.py); else 503, as /health says it.
        Probes carry no token, so the reason (which may name workers and limits) and the worker
        that answered are told only to an operator's token (or where no token is set)."""
        unhealthy = await self.health()
        if unhealthy.status_code != 200:
            return unhealthy
        told = self.is_operator(request)
        try:
            answer = await self.probe.check()
        except ProbeFailed as err:
            log.warning("GET /health_generate failed: %s", err)  # told to operators alone
            workers = len(self.service.links.links)
            status = str(err) if told else "the probe's generation failed"
            return JSONResponse({"status": status, "workers": workers}, status_code=503)
        if not told:
            return JSONResponse({"status": "ok"})
        if answer.busy is not None:  # its own generation did not answer, others' streamed
            return JSONResponse({"status": "ok", "busy": answer.busy})
        return JSONResponse({"status": "ok", "worker": answer.worker})


def build_app(service: RouterService, config: ClusterConfig) -> tuple[ASGIApp, HttpApi]:
    """The ASGI app (the FastAPI routes behind the status counter and the body limit) and its
    handlers (`HttpApi.draining` is the router's to set)."""
    api = HttpApi(service, config)
    app = FastAPI(title="radixmesh", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/embeddings", api.embeddings, methods=["POST"])
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.retrieve_model, methods=["GET"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    app.add_api_route("/tokenizer_info", api.tokenizer_info, methods=["GET"])
    app.add_api_route("/reset_prefix_cache", api.clear_caches, methods=["POST"])
    app.add_api_route("/flush_cache", api.clear_caches, methods=["GET", "POST"])
    app.add_api_route("/v1/load_lora_adapter", api.load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", api.unload_lora_adapter, methods=["POST"])
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/ping", api.health, methods=["GET", "POST"])
    app.add_api_route("/health_generate", api.health_generate, methods=["GET"])
    app.add_api_route("/version", api.version, methods=["GET"])
    anthropic_routes.add_routes(app, api)
    responses_routes.add_routes(app, api)
    stored_completions.add_routes(app, api)
    conversations.add_routes(app, api)
    sglang_generate.add_routes(app, api)
    batch_routes.add_routes(app, api)
    message_batches.add_routes(app, api)
    scores.add_routes(app, api)

    async def http_error(request: Request, err: Exception) -> Response:
        assert isinstance(err, HttpError)
        body = error_body(request.url.path, err, request.headers)
        return JSONResponse(body, err.status, err.headers())

    async def invalid(request: Request, err: Exception) -> Response:
        assert isinstance(err, RequestValidationError)
        try:  # a caller without a known token learns nothing of the body's schema: 401 first
            api.caller(request)
        except HttpError as refused:
            return await http_error(request, refused)
        return await http_error(request, validation_error(err))

    async def client_gone(request: Request, err: Exception) -> Response:
        return Response(status_code=CLIENT_GONE)

    async def starlette_error(request: Request, err: Exception) -> Response:
        assert isinstance(err, StarletteHTTPException)
        if isinstance(err.__cause__, ClientDisconnect):  # gone while its body was being read
            return await client_gone(request, err)
        if err.status_code == 400:  # a body FastAPI could not parse: as `invalid`, 401 first
            try:
                api.caller(request)
            except HttpError as refused:
                return await http_error(request, refused)
        return await http_error(request, framework_error(request, err))

    app.add_exception_handler(HttpError, http_error)
    app.add_exception_handler(StarletteHTTPException, starlette_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(ClientGone, client_gone)

    def body_limit(path: str, headers: dict[bytes, bytes]) -> tuple[int, str]:
        uploads = ("/v1/files", "/v1/messages/batches")  # a batch's requests are a file too
        if path in uploads and api.files.enabled and api.may_upload(headers):
            # an upload, from a caller with a known token: what the files kept leave
            return api.files.room(), UPLOAD_LIMIT
        limits = service.links.limits
        images = image_body_bytes(limits.vision if limits else None)
        if not images:
            return config.router.max_message_bytes, "router.max_message_bytes"
        return (
            config.router.max_message_bytes + images,
            "router.max_message_bytes, and engine.max_images images of engine.max_image_bytes "
            "in base64",
        )

    limited = BodyLimit(app, body_limit, error_body)
    counted = StatusCounter(limited, service.counters.http_responses)  # 413s counted too
    api.batch_runner.app = counted  # a batch's requests are served as the same requests sent here
    return counted, api


ANTHROPIC_VERSION = "anthropic-version"


def error_body(
    path: str, err: HttpError, headers: Mapping[str, str] | None = None
) -> dict[str, Any]:
    anthropic = anthropic_shaped(path, headers or {})
    return err.anthropic_body() if anthropic else err.openai_body()


def anthropic_shaped(path: str, headers: Mapping[str, str]) -> bool:
    """Whether an answer (or an error) takes Anthropic's shape: the Messages API's, and the
    models endpoints' when the Anthropic SDK calls them (it always sends `anthropic-version`;
    OpenAI's never does)."""
    if path.startswith("/v1/messages"):
        return True
    return path.startswith("/v1/models") and ANTHROPIC_VERSION in headers


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def framework_error(request: Request, err: StarletteHTTPException) -> HttpError:
    """A refusal FastAPI or Starlette made (no such path or method, a body it could not parse),
    in the API's error shape: for a body, what was wrong with it."""
    if err.status_code == 404:
        return HttpError(404, f"no such endpoint: {request.method} {request.url.path}")
    if err.status_code == 405:
        message = f"{request.url.path} does not take {request.method}"
        return HttpError(405, message, headers=dict(err.headers or {}))  # Allow: what it takes
    cause = err.__cause__
    if err.status_code == 400 and isinstance(cause, UnicodeDecodeError):
        return HttpError.invalid("body", f"is not UTF-8 text (byte {cause.start}: {cause.reason})")
    if err.status_code == 400 and isinstance(cause, RecursionError):
        return HttpError.invalid("body", "is JSON nested too deeply to parse")
    if err.status_code == 400 and cause is not None:
        return HttpError.invalid("body", f"could not be parsed ({type(cause).__name__}: {cause})")
    return HttpError(err.status_code, str(err.detail))


UNION_TAG = re.compile(r"[a-z-]+\[.*\]|[A-Z]\w*|str|int|float|bool|bytes|none")
"""The name pydantic gives a union's member in an error's location (`literal['none','auto']`,
`NamedToolChoice`, `str`): not a field, so left out of the parameter named."""


def _fields(loc: Sequence[str | int]) -> tuple[str | int, ...]:
    """An error's location in the body: its fields and indexes, without union members' tags."""
    return tuple(p for p in loc[1:] if not (isinstance(p, str) and UNION_TAG.fullmatch(p)))


def _member(loc: Sequence[str | int], depth: int) -> str:
    """The union member an error's location names after `depth` fields ("" for none)."""
    fields = 0
    for p in loc[1:]:
        if isinstance(p, str) and UNION_TAG.fullmatch(p):
            if fields == depth:
                return p
        else:
            fields += 1
    return ""


def complaint(errors: Sequence[Any]) -> Any:
    """The complaint a refusal gives: of those about the first one's field, those of the union
    member with the fewest (the one the value nearly is; of equals, the one whose complaint
    goes deepest), and of these the deepest (`tool_choice.function: Field required` for an
    object without it, not that the object is not one of the strings; `prompt[2]` for the
    one number in a list of strings). The first 1,000 are read."""
    errors = errors[:1000]
    at = _fields(errors[0]["loc"])
    if not at:  # the body itself, or a key like a member's tag
        return errors[0]
    members: dict[str, list[Any]] = {}
    for e in errors:
        if _fields(e["loc"])[: len(at)] == at:
            members.setdefault(_member(e["loc"], len(at)), []).append(e)

    def depth(e: Any) -> int:
        return len(_fields(e["loc"]))

    nearest = min(members.values(), key=lambda m: (len(m), -max(map(depth, m))))
    return max(nearest, key=depth)  # max and min keep the first of equals


def validation_error(err: RequestValidationError) -> HttpError:
    """Pydantic's complaint (`complaint`), as one line naming the parameter."""
    first = complaint(err.errors())
    loc = _fields(first["loc"])
    where = ".".join(p if isinstance(p, str) else f"[{p}]" for p in loc)
    where = where.replace(".[", "[") or "body"
    if first["type"] == "extra_forbidden":
        return HttpError.invalid(where, "unknown parameter (radixmesh refuses what it does not do)")
    if first["type"] == "json_invalid":
        return HttpError.invalid("body", f"is not valid JSON ({first['msg']})")
    if first["type"] == LONE_SURROGATE:
        return HttpError.invalid(first["ctx"]["where"], first["msg"])
    return HttpError.invalid(where, f"{first['msg']} (got {first.get('input')!r:.80})")


class StatusCounter:
    """Counts every answer by path and status (radixmesh_router_http_responses_total)."""

    def __init__(self, app: ASGIApp, counts: dict[tuple[str, int], int]) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                key = (_route(scope["path"]), int(message["status"]))
                self.counts[key] = self.counts.get(key, 0) + 1
            await send(message)

        await self.app(scope, receive, counting)


_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/generate",
    "/get_model_info",
    "/abort_request",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/reset_prefix_cache",
    "/flush_cache",
    "/v1/score",
    "/score",
    "/v1/rerank",
    "/rerank",
    "/v2/rerank",
    "/v1/files",
    "/v1/batches",
    "/v1/messages/batches",
    "/v1/conversations",
    "/health",
    "/ping",
    "/health_generate",
    "/version",
)


def _route(path: str) -> str:
    """The path as a metric label: one of the routes, never what a client made up."""
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}"
    return _by_id(path) or (path if path in _ROUTES else "other")


_BY_ID = {
    "/v1/responses/": ("input_items", "cancel"),
    "/v1/files/": ("content",),
    "/v1/batches/": ("cancel",),
    "/v1/messages/batches/": ("cancel", "results"),
    "/v1/chat/completions/": ("messages",),
    "/v1/conversations/": ("items",),
}
"""The routes of a stored object by id, and what may follow the id."""


def _by_id(path: str) -> str | None:
    """The label of a route of a stored object by id (None: not one)."""
    for prefix, tails in _BY_ID.items():
        if path.startswith(prefix):
            key, *tail = path.removeprefix(prefix).split("/")
            if key and (not tail or (len(tail) == 1 and tail[0] in tails)):
                return prefix + "{id}" + "".join(f"/{t}" for t in tail)
            if key and len(tail) == 2 and tail[0] in tails and tail[1]:  # an item of it
                return prefix + "{id}/" + tail[0] + "/{item}"
    return None


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
