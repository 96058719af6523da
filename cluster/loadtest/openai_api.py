"""The load test over the OpenAI API (`--api openai`): each request one streamed POST to the
router's HTTP API, `/v1/chat/completions` for chat workloads and `/v1/completions` for text and
token-id prompts, with `stream_options.include_usage`.

    probe     GET /health (a 404 is a server without one; a 503 ends the command), then
              GET /v1/models with the token: the model id (unless --model names one) and its
              max_model_len
    request   temperature 0, ignore_eos (vLLM's extension), max_tokens, text_match with
              --text-match (radixmesh's extension); the bearer token, X-Radixmesh-Tenant for a
              named tenant, X-Request-Id (the run's request id)
    record    TTFT: the first chunk carrying text or a finish reason; an inter-token gap: the
              time between two such chunks. The server sends no chunk for a token whose text is
              not complete yet (half of a multi-byte character), so a gap may span tokens.
              Output, prompt and cached tokens come from the final usage chunk; the worker and
              the router's predicted cached tokens from the response's X-Radixmesh-Worker and
              X-Radixmesh-Predicted-Cached-Tokens headers (unknown from a server without them).
    failures  HTTP_<status> (refused before the stream began), STREAM_ERROR (an error event
              in a 200 stream: the generation failed mid-way), TIMEOUT (past the request's
              timeout), DISCONNECTED (the connection broke, or the stream ended without
              [DONE]), PROTOCOL_ERROR (a chunk that is not OpenAI's JSON)

The client is httpx2 itself, not the `openai` SDK: streaming the same chunks from a stub server
on the other core, the SDK spent 223 us of client CPU per token and httpx2 with json.loads 57 us
(the SDK builds pydantic objects for every chunk), and the load generator shares the machine
with the server it measures. As gRPC's wait_for_ready does, a request whose connection is
refused (nothing was sent: the router is restarting) tries again, every 50 ms up to every 1 s,
until its timeout; the probe does not, so a wrong URL fails within seconds.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx2

from cluster.client_auth import TOKEN_ENV
from cluster.client_tls import ClientTls, TlsOptionsError
from cluster.loadtest.control import PROBE_TIMEOUT_S, ServerError
from cluster.loadtest.records import RequestRecord
from cluster.loadtest.workloads import RequestSpec, Session

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
TENANT_HEADER = "x-radixmesh-tenant"
STREAM_ERROR, TIMEOUT, DISCONNECTED, PROTOCOL_ERROR = (
    "STREAM_ERROR",
    "TIMEOUT",
    "DISCONNECTED",
    "PROTOCOL_ERROR",
)
RETRY_FIRST_S, RETRY_MAX_S = 0.05, 1.0
HEALTH_TIMEOUT_S = 2.0


def base_url(text: str) -> str:
    """`http[s]://host[:port]`, from the URL given (a trailing `/` or `/v1` is dropped: the
    address `radixmesh serve` prints ends in /v1); ValueError for anything else."""
    parts = urlsplit(text.strip())
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path.rstrip("/") not in ("", "/v1")
        or parts.query
        or parts.fragment
    ):
        raise ValueError(
            f"--target {text!r} is not the HTTP API's base URL (http:// or https://, host and "
            "port, e.g. http://127.0.0.1:8000)"
        )
    return f"{parts.scheme}://{parts.netloc}"


def ssl_context(tls: ClientTls | None) -> ssl.SSLContext | bool:
    """What verifies an https:// target: the --tls-ca (and the --tls-cert/--tls-key client
    certificate); without --tls-ca, the system's CAs. A file that is not PEM fails here."""
    if tls is None:
        return True
    try:
        context = ssl.create_default_context(cafile=str(tls.ca))
    except (ssl.SSLError, OSError) as err:
        raise TlsOptionsError(f"--tls-ca {tls.ca}: not a CA certificate ({err})") from err
    if tls.cert is not None and tls.key is not None:
        try:
            context.load_cert_chain(tls.cert, tls.key)
        except (ssl.SSLError, OSError) as err:
            raise TlsOptionsError(
                f"--tls-cert {tls.cert} / --tls-key {tls.key}: not a certificate and its key "
                f"({err})"
            ) from err
    return context


@dataclass(frozen=True)
class HttpTarget:
    """The router's HTTP API."""

    url: str
    """Its root, `base_url`'s form."""
    token: str | None = None
    tls: ClientTls | None = None
    model: str = ""
    """The model id the requests name (the probe's, or --model)."""

    api = "openai"

    def client(self, timeout: float | None) -> httpx2.AsyncClient:
        """Connections without limit (one per request in flight, kept alive); no proxy from the
        environment: the times measured are the target's."""
        return httpx2.AsyncClient(
            base_url=self.url,
            headers={"authorization": f"Bearer {self.token}"} if self.token else {},
            verify=ssl_context(self.tls),
            timeout=timeout,
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None),
            trust_env=False,
        )

    @property
    def extensions(self) -> dict[str, Any]:
        """--tls-server-name: the name the server's certificate must carry (and SNI)."""
        if self.tls is None or self.tls.server_name is None:
            return {}
        return {"sni_hostname": self.tls.server_name}

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[HttpConnection]:
        async with self.client(timeout=None) as client:  # each request's own timeout bounds it
            yield HttpConnection(client, self)


def request_body(
    spec: RequestSpec, model: str, text_match: str | None = None
) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of `spec`: chat messages to chat completions, a text or token ids
    to completions, streamed with usage; `text_match` as radixmesh's body field."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if text_match is not None:
        body["text_match"] = text_match
    if spec.chat is not None:
        body["messages"] = [{"role": role, "content": content} for role, content in spec.chat]
        return CHAT_PATH, body
    body["prompt"] = spec.text if spec.text is not None else list(spec.token_ids or ())
    return COMPLETIONS_PATH, body


class _Events:
    """What a stream's chunks say, into a record."""

    def __init__(self, record: RequestRecord, chat: bool) -> None:
        self.record = record
        self.chat = chat
        self.parts: list[str] = []
        self.usage = False
        self.done = False

    def feed(self, data: str, stamp: float) -> bool:
        """One event's data; False once the stream is over ([DONE], or an error event)."""
        if data == "[DONE]":
            self.done = True
            return False
        chunk = json.loads(data)
        if "error" in chunk:
            self.record.status = STREAM_ERROR
            return False
        record = self.record
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            text = delta.get("content") if self.chat else choice.get("text")
            thought = delta.get("reasoning_content")  # a thinking model's: tokens all the same
            finish = choice.get("finish_reason")
            if text or thought or finish:
                if record.first_token is None:
                    record.first_token = stamp
                record.token_times.append(stamp)
                if not self.usage:
                    record.output_tokens += 1  # until the usage says how many tokens they were
            if text:
                self.parts.append(text)
            if finish:
                record.finish_reason = finish
        usage = chunk.get("usage")
        if usage:
            self.usage = True
            record.output_tokens = usage["completion_tokens"]
            record.prompt_tokens = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            record.cached_prompt_tokens = details.get("cached_tokens") or 0
        return True


class HttpConnection:
    def __init__(self, client: httpx2.AsyncClient, target: HttpTarget) -> None:
        self.client = client
        self.target = target

    async def generate(
        self,
        spec: RequestSpec,
        session: Session,
        record: RequestRecord,
        now: Callable[[], float],
        timeout: float,
    ) -> None:
        record.predicted_cached_tokens = None  # unless the response says (radixmesh's headers)
        model = session.adapter or self.target.model  # an adapter is a model (vLLM's way)
        path, body = request_body(spec, model, session.text_match)
        headers = {"x-request-id": record.request_id}
        if session.tenant:
            headers[TENANT_HEADER] = session.tenant
        request = self.client.build_request(
            "POST", path, json=body, headers=headers, extensions=self.target.extensions
        )
        events = _Events(record, chat=spec.chat is not None)
        try:
            async with asyncio.timeout(timeout):
                response = await self._send(request)
                try:
                    if response.status_code != 200:
                        record.status = f"HTTP_{response.status_code}"
                        return
                    _served_by(response.headers, record)
                    async for line in response.aiter_lines():
                        if line.startswith("data:") and not events.feed(line[5:].strip(), now()):
                            break
                finally:
                    await response.aclose()
            if record.ok and not events.done:
                record.status = DISCONNECTED
        except (TimeoutError, httpx2.TimeoutException):
            record.status = TIMEOUT
        except httpx2.TransportError:
            record.status = DISCONNECTED
        except (ValueError, KeyError, TypeError, AttributeError):
            record.status = PROTOCOL_ERROR
        finally:
            record.answer = "".join(events.parts)

    async def _send(self, request: httpx2.Request) -> httpx2.Response:
        """The response (its body still to read); a refused connection is tried again until the
        caller's timeout cancels this."""
        pause = RETRY_FIRST_S
        while True:
            try:
                return await self.client.send(request, stream=True)
            except httpx2.ConnectError:
                await asyncio.sleep(pause)
                pause = min(RETRY_MAX_S, 2 * pause)

    async def healthy_workers(self) -> int:
        """The workers GET /health counts; -1 when it does not answer with a count."""
        try:
            response = await self.client.get(
                "/health", timeout=HEALTH_TIMEOUT_S, extensions=self.target.extensions
            )
            body = response.json()
        except (httpx2.HTTPError, ValueError):
            return -1
        workers = body.get("workers") if isinstance(body, dict) else None
        return workers if isinstance(workers, int) else -1


# -- the probe ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Served:
    model: str
    max_model_len: int
    """0 when /v1/models does not say."""


def _message(response: httpx2.Response) -> str:
    """An error response's message (OpenAI's error object), else the start of its body."""
    try:
        body = response.json()
        message = body["error"]["message"]
        if isinstance(message, str):
            return message
    except (ValueError, KeyError, TypeError):
        pass
    return response.text[:200] or response.reason_phrase


async def _get(client: httpx2.AsyncClient, target: HttpTarget, path: str) -> httpx2.Response:
    try:
        return await client.get(path, extensions=target.extensions)
    except httpx2.TimeoutException as err:
        raise ServerError(
            f"cannot reach {target.url}: no answer to GET {path} within {PROBE_TIMEOUT_S:g} s"
        ) from err
    except httpx2.TransportError as err:
        raise ServerError(f"cannot reach {target.url}: {type(err).__name__}: {err}") from err


async def probe(target: HttpTarget, model: str | None = None) -> Served:
    """GET /health and GET /v1/models, within `PROBE_TIMEOUT_S` each: the model to name and
    its context, or a ServerError saying what is wrong (unreachable, not serving, credentials
    refused, no such model)."""
    url = target.url
    async with target.client(PROBE_TIMEOUT_S) as client:
        health = await _get(client, target, "/health")
        if health.status_code == 503:
            raise ServerError(f"{url} is not serving: GET /health: HTTP 503: {_message(health)}")
        if health.status_code not in (200, 404):  # 404: a server without /health
            raise ServerError(
                f"{url} failed the probe (GET /health): HTTP {health.status_code}: "
                f"{_message(health)}"
            )
        models = await _get(client, target, "/v1/models")
    if models.status_code in (401, 403):
        raise ServerError(
            f"{url} refused the credentials: HTTP {models.status_code}: {_message(models)} "
            f"(pass a token it knows with --token or ${TOKEN_ENV})"
        )
    if models.status_code != 200:
        raise ServerError(
            f"{url} failed the probe (GET /v1/models): HTTP {models.status_code}: "
            f"{_message(models)}"
        )
    return _choose(url, models, model)


def _choose(url: str, models: httpx2.Response, model: str | None) -> Served:
    try:
        cards = {card["id"]: card for card in models.json()["data"]}
    except (ValueError, KeyError, TypeError) as err:
        raise ServerError(
            f"{url} answered GET /v1/models with something else than OpenAI's list of models"
        ) from err
    if not cards:
        raise ServerError(f"{url} serves no model (GET /v1/models lists none)")
    if model is not None and model not in cards:
        raise ServerError(
            f"{url} does not serve the model {model!r} (--model); it serves {list(cards)}"
        )
    chosen = model if model is not None else next(iter(cards))
    length = cards[chosen].get("max_model_len")
    return Served(chosen, length if isinstance(length, int) else 0)


def _served_by(headers: httpx2.Headers, record: RequestRecord) -> None:
    """The worker and the router's prediction, from radixmesh's response headers."""
    record.worker = headers.get("x-radixmesh-worker", "")
    predicted = headers.get("x-radixmesh-predicted-cached-tokens", "")
    record.predicted_cached_tokens = int(predicted) if predicted.isdigit() else None
