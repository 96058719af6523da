"""POST /v1/responses (OpenAI's Responses API, text and function calls, streamed or not) over
the same serving core as chat completions.

`input` (a string, or message, `reasoning`, `function_call` and `function_call_output` items)
and `instructions` become the chat; `tools`, `tool_choice` and `parallel_tool_calls` the core's;
`text.format` (json_object, json_schema) a structured output; `reasoning.effort` the chat
template's `reasoning_effort`. A thinking model's reasoning becomes a `reasoning` item (its text
in `content`, as vLLM serves it), the answer's text a `message` item and its calls
`function_call` items (worker/tool_calls.py reads them out of the text); `status` is
`incomplete` (reason `max_output_tokens`) when max_output_tokens cut it. The response object is
built in cluster/http/responses_output.py, its events in cluster/http/responses_stream.py.

A response is stored as it ends unless `store: false` (cluster/http/responses_chain.py; read,
deleted and cancelled by id in cluster/http/stored_routes.py), and `previous_response_id`
continues a stored one: its conversation comes before `input`; `conversation` continues a
conversation's items, and adds the response's to it (cluster/http/conversations.py).
`background: true` answers at once and generates apart from the request
(cluster/http/responses_background.py).
`truncation: "auto"` cuts a conversation the core refuses for its length
(cluster/http/responses_truncation.py).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response as HttpResponse

from cluster.http import stored_routes
from cluster.http.conversations import Conversation, check_new_ids, extend, joined
from cluster.http.errors import HttpError, Renames, renames
from cluster.http.openai_params import (
    effort_variables,
    refuse_unsupported,
    set_cache_salt,
    set_priority,
    wire_tool,
)
from cluster.http.openai_responses import collect, served_by
from cluster.http.response_store import Item, StoredResponse
from cluster.http.responses_chain import (
    UNFINISHED,
    continued,
    input_items,
    keep,
    owner,
    stored,
)
from cluster.http.responses_items import (
    chat_message,
    reasoning_text,
    tool_call,
    tool_output,
    unknown_kind,
)
from cluster.http.responses_output import (
    INCLUDES,
    done,
    message_logprobs,
    shell,
    wants_logprobs,
)
from cluster.http.responses_schema import REFUSED, NamedFunction, Response, ResponsesRequest
from cluster.http.responses_stream import events
from cluster.http.responses_truncation import Truncation, over_length
from cluster.http.sse import EventStream
from protos.radixmesh.v1 import serving_pb2
from worker.tool_calls import read_calls

if TYPE_CHECKING:
    from cluster.http.app import HttpApi
    from cluster.http.openai_responses import Responses
    from cluster.serving_call import Caller


def add_routes(app: FastAPI, api: HttpApi) -> None:
    async def responses(body: ResponsesRequest, request: Request) -> HttpResponse:
        caller = api.caller(request)
        tenant = owner(caller, api.tenant(request))
        adapter = api.check_model(body.model)
        rid = api.request_id(request)
        turn = Turn.of(api, body, tenant)
        try:
            return await _respond(api, body, request, caller, turn, rid, adapter)
        except BaseException:  # refused, or failed, before its end let its conversation go
            turn.release()
            raise

    app.add_api_route("/v1/responses", responses, methods=["POST"])
    stored_routes.add_routes(app, api)


@dataclass
class Turn:
    """What a response continues (a stored response, or a conversation it holds while it
    runs) and what its end keeps."""

    api: HttpApi
    tenant: str
    storing: bool
    earlier: StoredResponse | None
    talk: Conversation | None
    release: Callable[[], None]
    listed: list[Item]
    """The request's input items, with their ids (to store, or to add to the conversation)."""

    @functools.cached_property
    def inputs(self) -> tuple[bytes, ...]:
        """`listed` encoded, once however often the response is stored as it runs."""
        return tuple(map(StoredResponse.encoded, self.listed))

    @classmethod
    def of(cls, api: HttpApi, body: ResponsesRequest, tenant: str) -> Turn:
        storing = stored(body, api.responses)
        earlier = continued(body, api.responses, tenant)
        talk = joined(body, api.conversations, tenant)
        listed = input_items(body) if storing or talk is not None else []
        if talk is None:
            return cls(api, tenant, storing, earlier, None, lambda: None, listed)
        check_new_ids(body.input if isinstance(body.input, list) else [], "input", talk.ids)
        release = api.conversations.hold(tenant, talk.id)
        return cls(api, tenant, storing, earlier, talk, release, listed)

    def before(self) -> tuple[list[Item], list[str]]:
        """The items the response continues, and what a refusal calls each."""
        if self.earlier is not None:
            items = StoredResponse.decoded(self.earlier.conversation)
            return items, ["previous_response_id"] * len(items)
        if self.talk is not None:
            return self.talk.decoded(), [f"conversation.items[{i}]" for i in self.talk.ids]
        return [], []

    def dropped(self) -> int:
        """The truncation's cut it starts from."""
        if self.earlier is not None:
            return self.earlier.dropped
        return self.talk.dropped if self.talk is not None else 0

    def ended(self, answered: Response, truncation: Truncation | None) -> Response:
        """The response as it stands: stored unless the request said not to; as it ends, its
        items added to its conversation, which it lets go."""
        cut = truncation.dropped if truncation is not None else 0
        if answered.status not in UNFINISHED and self.talk is not None:
            extend(self.api.conversations, self.tenant, self.talk.id, self.listed, answered, cut)
            self.release()
        if not self.storing:
            return answered
        return keep(self.api.responses, self.tenant, self.inputs, answered, self.earlier, cut)


async def _respond(
    api: HttpApi,
    body: ResponsesRequest,
    request: Request,
    caller: Caller,
    turn: Turn,
    rid: str,
    adapter: str | None,
) -> HttpResponse:
    before, names = turn.before()
    message, origins = generate_request(body, rid, api.tenant(request), before, names)
    message.namespace.adapter = adapter or ""
    started = shell(body, f"resp_{rid}", adapter or api.model, turn.storing)
    if turn.talk is not None:
        started.conversation = {"id": turn.talk.id}
    tools = (
        frozenset(t.name for t in body.tools or []) if body.tool_choice != "none" else frozenset()
    )
    truncation = truncated(body, message, origins, turn.dropped())

    def ended(answered: Response) -> Response:
        return turn.ended(answered, truncation)

    _background(body, turn.storing)
    rename = refusal_names(body, origins)
    texts = api.token_texts() if wants_logprobs(body) else None
    stream = served(api, message, caller, truncation)
    if body.background:
        queued = started.model_copy(update={"status": "queued"})
        reply, written = await api.background.start(
            turn.tenant,
            queued,
            stream,
            tools,
            rename,
            ended,
            streamed=bool(body.stream),
            texts=texts,
        )
        if body.stream:
            return EventStream(written.follow())
        return HttpResponse(reply.model_dump_json(), media_type="application/json")
    if body.stream:
        first = await api.finish(request, anext(stream), rename)  # a refusal: a status
        return EventStream(
            events(started, first, stream, tools, ended, rename, texts), served_by(first)
        )
    samples, counts = await api.finish(request, collect(stream), rename)
    sample = samples[0]
    text = "".join(sample.text)
    content, calls = read_calls(text, tools) if tools else (text, [])
    logprobs = message_logprobs(texts, sample, tools) if texts is not None else None
    reply = done(
        started, content, calls, sample.finish_reason, counts,
        thought="".join(sample.reasoning), logprobs=logprobs,
    )  # fmt: skip
    return HttpResponse(
        ended(reply).model_dump_json(), media_type="application/json", headers=counts.served_by()
    )


def truncated(
    body: ResponsesRequest,
    message: serving_pb2.GenerateRequest,
    origins: list[str],
    dropped: int = 0,
) -> Truncation | None:
    """The request's truncation with `truncation: "auto"`, starting from the cut `dropped` of
    what it continues (None: it is never cut)."""
    if body.truncation != "auto":
        return None
    reserve = body.max_output_tokens or 1
    return Truncation(message, origins, reserve, dropped)


def served(
    api: HttpApi,
    message: serving_pb2.GenerateRequest,
    caller: Caller,
    truncation: Truncation | None,
) -> Responses:
    """The request's stream; cut and sent again with a truncation, if the core refuses it for its
    length."""
    limits = api.service.request_limits()
    if truncation is None or limits is None:  # no worker: the core says so
        return api.start(message, caller, fill_context=True)  # a draining router: 503 now
    # a refusal for its length is cut and sent again, or counted by `serve` if nothing fits
    stream = api.start(message, caller, fill_context=True, uncounted=over_length)

    async def count(trial: serving_pb2.GenerateRequest) -> int:
        return len(await api.service.count_prompt(trial, caller))

    return truncation.serve(
        stream,
        # not api.start: a draining router serves the calls it took, cut or not
        lambda cut: api.service.generate(cut, caller, fill_context=True),
        count,
        limits.max_model_len,
        api.service.count_failure,
    )


def _background(body: ResponsesRequest, storing: bool) -> None:
    """A background response is polled from the store: refused when not stored."""
    if body.background and not storing:
        raise HttpError.invalid(
            "background", "a background response is polled from the store: leave store true"
        )


def refusal_names(body: ResponsesRequest, origins: list[str]) -> Renames:
    """The Responses API's names of the fields the serving core may refuse: a turn of the chat
    is named by the item it came from (`origins`, from `conversation`)."""
    fields = {
        "sampling.structured.json_schema": "text.format.schema",
        "sampling.structured.json_object": "text.format",
        "sampling.structured.structural_tag": "tools",
        "max_tokens": "max_output_tokens",
        "messages": "input",
        "prompt": "input",
    }
    if isinstance(body.tool_choice, NamedFunction):
        fields["tool_choice"] = "tool_choice.name"  # the function it names
    named = renames(fields)

    def rename(param: str) -> str | None:
        turn = _TURN.fullmatch(param)
        if turn is not None and int(turn[1]) < len(origins):
            return origins[int(turn[1])] + turn[2]
        return named(param)

    return rename


_TURN = re.compile(r"messages\[(\d+)\](.*)")


def generate_request(
    body: ResponsesRequest,
    request_id: str,
    tenant: str,
    earlier: Sequence[dict[str, Any]] = (),
    names: Sequence[str] = (),
) -> tuple[serving_pb2.GenerateRequest, list[str]]:
    """The request, and the field each turn of its chat came from (`earlier`: the items it
    continues, of a stored response or a conversation, as `names` call them)."""
    refuse_unsupported(body, REFUSED)
    for i, asked in enumerate(body.include or ()):
        if asked not in INCLUDES:
            raise HttpError.invalid(f"include[{i}]", f"{asked!r}: only {INCLUDES} can be included")
    message = serving_pb2.GenerateRequest(request_id=request_id)
    if wants_logprobs(body):
        message.sampling.logprobs = body.top_logprobs or 0
    # a thinking model's reasoning is a reasoning item, apart from the answer's message
    message.sampling.separate_reasoning = True
    variables = effort_variables(body.reasoning.effort if body.reasoning is not None else None)
    if variables:
        message.chat_template_kwargs = json.dumps(variables)
    origins = conversation(body, message.chat.messages, earlier, names)
    for name, value in (
        ("max_tokens", body.max_output_tokens),
        ("temperature", body.temperature),
        ("top_p", body.top_p),
    ):
        if value is not None:
            if name == "max_tokens" and not 0 <= value <= 2**31 - 1:
                raise HttpError.invalid("max_output_tokens", f"{value} is out of range")
            setattr(message.sampling, name, value)
    _format(body, message.sampling)
    message.tools.extend(
        wire_tool(tool.name, tool.description, tool.parameters) for tool in body.tools or []
    )
    choice = body.tool_choice
    if choice is not None:
        message.tool_choice = choice if isinstance(choice, str) else choice.name
    if body.parallel_tool_calls is not None:
        message.parallel_tool_calls = body.parallel_tool_calls
    message.namespace.tenant = tenant
    set_cache_salt(message, body.cache_salt)
    set_priority(message, body.priority)
    return message, origins


def _format(body: ResponsesRequest, params: serving_pb2.SamplingParams) -> None:
    form = body.text.format if body.text is not None else None
    if form is None or form.type == "text":
        return
    if form.type == "json_object":
        params.structured.json_object = True
        return
    for name in ("name", "schema_"):
        if getattr(form, name) is None:
            raise HttpError.invalid(
                f"text.format.{name.rstrip('_')}", "is required with type json_schema"
            )
    params.structured.json_schema = json.dumps(form.schema_)


def conversation(
    body: ResponsesRequest,
    turns: Any,
    earlier: Sequence[dict[str, Any]] = (),
    names: Sequence[str] = (),
) -> list[str]:
    """Append `instructions` as the system message, then the items the request continues
    (`earlier`: of the stored response `previous_response_id` names, or of its `conversation`,
    each called as `names` says; by default "previous_response_id"), then `input`'s items, as
    the chat's turns, to `turns`; returns the field each turn came from. A string is one user
    turn; consecutive `function_call` items are one assistant turn's calls (with the assistant
    message before them, if any); a `function_call_output` is a tool turn. A `reasoning` item's
    text is the reasoning of the assistant turn it comes with (`reasoning_content`, which the
    template may write back); one with no assistant turn after it is left out."""
    origins = []
    if body.instructions is not None:
        turns.append(serving_pb2.ChatMessage(role="system", content=body.instructions))
        origins.append("instructions")
    if isinstance(body.input, str):
        items = [{"role": "user", "content": body.input}]
        named = ["input"]
    elif not body.input:
        raise HttpError.invalid("input", "is empty; send at least one item")
    else:
        items, named = body.input, [f"input[{i}]" for i in range(len(body.input))]
    said = False  # whether `input` gave a turn, or calls to the turn before it
    thoughts: list[str] = []  # reasoning items waiting for their assistant turn
    called = list(names) or ["previous_response_id"] * len(earlier)
    for k, (item, where) in enumerate(zip([*earlier, *items], called + named, strict=True)):
        kind = item.get("type", "message")
        if kind == "reasoning":
            thoughts.append(reasoning_text(item, where))
            continue
        said |= k >= len(earlier)
        if kind == "message":
            turns.append(chat_message(item, where))
        elif kind == "function_call":
            call = tool_call(item, where)
            if len(turns) and turns[-1].role == "assistant":
                turns[-1].tool_calls.append(call)  # one turn with what came before it
                _think(turns[-1], thoughts)
                continue
            turns.append(serving_pb2.ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            turns.append(tool_output(item, where))
        else:
            raise unknown_kind(kind, where)
        if turns[-1].role == "assistant":
            _think(turns[-1], thoughts)
        thoughts.clear()
        origins.append(where)
    if not said:
        raise HttpError.invalid(
            "input",
            "holds no message or function call (a reasoning item goes with the turn after it)",
        )
    return origins


def _think(turn: serving_pb2.ChatMessage, thoughts: list[str]) -> None:
    """Add the reasoning items before it to an assistant turn's reasoning."""
    turn.reasoning_content = "\n".join(t for t in (turn.reasoning_content, *thoughts) if t)
    thoughts.clear()
