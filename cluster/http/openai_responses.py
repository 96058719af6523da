"""The router's stream of GenerateResponse messages -> OpenAI's response objects: a whole chat or
text completion, or the chunks of its server-sent-event stream.

Usage counts the prompt once (every sample shares it), the completion tokens of every sample,
and, in `prompt_tokens_details.cached_tokens`, the prompt tokens the worker served from its
prefix cache: where a client sees its cache hits.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from cluster.http.errors import GenerationFailed, HttpError
from cluster.http.legacy_functions import LEGACY_FINISH, function_call_out
from cluster.http.openai_schema import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionTokensDetails,
    Delta,
    FunctionCall,
    PromptLogprobs,
    PromptTokensDetails,
    StreamOptions,
    TokenLogprob,
    ToolCallDelta,
    ToolCallOut,
    TopLogprob,
    Usage,
)
from cluster.http.prompt_logprobs import (
    ScoredPrompt,
    echoed,
    joined,
    top_dict,
    vllm_prompt_logprobs,
)
from cluster.http.token_texts import TokenTexts
from cluster.serving_call import ServingError
from protos.radixmesh.v1 import serving_pb2
from worker.tool_calls import BEGIN, ToolCall, find_calls, read_calls, taken_out

Responses = AsyncGenerator[serving_pb2.GenerateResponse, None]
"""A request's stream of messages from the serving core (`RouterService.generate`)."""
FINISH_ERROR = "error"
WORKER_HEADER = "x-radixmesh-worker"
PREDICTED_HEADER = "x-radixmesh-predicted-cached-tokens"
DONE = b"data: [DONE]\n\n"


@dataclass
class Reply:
    """What every response of one request shares."""

    id: str
    model: str
    texts: TokenTexts
    created: int = field(default_factory=lambda: int(time.time()))
    echo: list[str] | None = None
    """A completion's prompt texts, which each choice's text begins with (`echo: true`): one
    a prompt."""
    prompt_logprobs: bool = False
    """Whether the response carries vLLM's `prompt_logprobs`."""
    token_ids: bool = False
    """Whether it carries vLLM's `prompt_token_ids` and `token_ids` (`return_token_ids`)."""
    request_ids: list[str] = field(default_factory=list)
    """The generation of each prompt: a chat's one, or several in one completions request."""
    n: int = 1
    """Samples a prompt: choice i is sample i % n of prompt i // n."""
    call_ids: dict[tuple[int, int], str] = field(default_factory=dict)
    """Each choice's calls' ids, as first given (`call_id`)."""

    def call_id(self, index: int, k: int, drawn: str) -> str:
        """The id of choice `index`'s call k: `drawn` the first time it is asked for, the same
        one after (a stored completion built from its stream has the ids the stream gave)."""
        return self.call_ids.setdefault((index, k), drawn)

    def prompt_of(self, index: int) -> int:
        return index // self.n

    def echo_of(self, index: int) -> str | None:
        return None if self.echo is None else self.echo[self.prompt_of(index)]

    def scored(self, counts: Counts, index: int) -> ScoredPrompt | None:
        """The prompt logprobs of choice `index`'s prompt, once they came."""
        return counts.prompts.get(self.request_ids[self.prompt_of(index)])

    def prompt_ids(self, counts: Counts, index: int) -> list[int] | None:
        """Choice `index`'s prompt's token ids, when asked for (`token_ids`) and come."""
        scored = self.scored(counts, index) if self.token_ids else None
        return None if scored is None else scored.token_ids

    def ids(self, token_ids: list[int]) -> list[int] | None:
        """Generated token ids as a choice carries them: when asked for (`token_ids`)."""
        return token_ids if self.token_ids else None


def served_by(response: serving_pb2.GenerateResponse) -> dict[str, str]:
    """Response headers: the worker a generation went to, and the prompt tokens the router
    expected it to have cached (radixmesh's own; the load test reads them)."""
    return {WORKER_HEADER: response.worker, PREDICTED_HEADER: str(response.predicted_cached_tokens)}


@dataclass
class Counts:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    """Of `completion_tokens`, a thinking model's reasoning's."""
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    """What became of a predicted output's drafts (serving.proto's GenerateResponse)."""
    first: serving_pb2.GenerateResponse | None = None
    prompts: dict[str, ScoredPrompt] = field(default_factory=dict)
    """Each generation's prompt logprobs, when the request asked for them."""
    generations: dict[str, tuple[int, int]] = field(default_factory=dict)
    """The generations seen (one a prompt), whose prompts count once each: their prompt
    tokens and of those the cached."""

    def served_by(self) -> dict[str, str]:
        return served_by(self.first) if self.first is not None else {}

    def record(self, response: serving_pb2.GenerateResponse) -> None:
        if self.first is None:
            self.first = response
        if response.request_id not in self.generations:
            # the hit the request had when first admitted, not a resumption's
            self.generations[response.request_id] = (
                response.prompt_tokens,
                response.cached_prompt_tokens,
            )
            self.prompt_tokens += response.prompt_tokens
            self.cached_tokens += response.cached_prompt_tokens
        scored = ScoredPrompt.of(response)
        if scored is not None:
            self.prompts[response.request_id] = scored
        self.completion_tokens += len(response.token_ids)
        self.reasoning_tokens += response.reasoning_tokens
        self.accepted_prediction_tokens += response.accepted_prediction_tokens
        self.rejected_prediction_tokens += response.rejected_prediction_tokens

    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
            completion_tokens_details=CompletionTokensDetails(
                reasoning_tokens=self.reasoning_tokens,
                accepted_prediction_tokens=self.accepted_prediction_tokens,
                rejected_prediction_tokens=self.rejected_prediction_tokens,
            ),
        )


@dataclass
class Sample:
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    """A thinking model's reasoning (GenerateResponse.reasoning_text), apart from `text`."""
    logprobs: list[serving_pb2.TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None
    spans: list[tuple[int, int]] = field(default_factory=list)
    """(tokens, characters of text) of each message, for completion logprobs' text offsets."""
    reasoning_tokens: int = 0
    """Of `token_ids`, the first so many are a thinking model's reasoning."""

    def take(self, response: serving_pb2.GenerateResponse) -> None:
        """One more message of this sample."""
        self.text.append(response.text)
        if response.reasoning_text:
            self.reasoning.append(response.reasoning_text)
        self.token_ids.extend(response.token_ids)
        self.logprobs.extend(response.logprobs)
        self.spans.append((len(response.token_ids), len(response.text)))
        self.reasoning_tokens += response.reasoning_tokens
        if response.finished:
            self.finish_reason = response.finish_reason
            self.stop_string = response.stop_string or None


async def read(stream: Responses, counts: Counts) -> Responses:
    """The request's messages, each counted; a sample that failed raises GenerationFailed.
    Consume it under `contextlib.aclosing`: closing it closes the request's stream (the worker
    call cancelled, its pages freed) however the consumer ends, not when the GC gets to it."""
    async with contextlib.aclosing(stream):
        async for response in stream:
            if response.finished and response.finish_reason == FINISH_ERROR:
                raise GenerationFailed(f"sample {response.index} failed on {response.worker}")
            counts.record(response)
            yield response


async def guarded(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A failure after the stream began: an error event (the SDKs raise it), then [DONE]."""
    try:
        async for event in events:
            yield event
    except (ServingError, GenerationFailed) as err:
        failure = HttpError.of(err)
        body = json.dumps(failure.openai_body(), ensure_ascii=False, separators=(",", ":"))
        yield b"data: " + body.encode() + b"\n\n"
        yield DONE
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def prepend(first: serving_pb2.GenerateResponse, rest: Responses) -> Responses:
    """The stream again, with the first message that was taken from it in front."""
    try:
        yield first
        async for response in rest:
            yield response
    finally:
        await rest.aclose()


async def without_reasoning(stream: Responses) -> Responses:
    """The stream with a thinking model's reasoning text left out (vLLM's `include_reasoning:
    false`; its tokens are still counted)."""
    try:
        async for response in stream:
            if response.reasoning_text:
                response.reasoning_text = ""
            yield response
    finally:
        await stream.aclose()


def worth_a_chunk(response: serving_pb2.GenerateResponse, logprobs: bool) -> bool:
    """False for a message whose text is held back (a possible stop string, half a character)
    and that carries nothing else a client asked for."""
    return bool(
        response.text
        or response.reasoning_text
        or response.finished
        or (logprobs and response.token_ids)
    )


class PendingIds:
    """Each choice's generated token ids not yet in a chunk: a message whose text is held back
    makes no chunk, and its tokens go with the next one (vLLM's streamed `token_ids`)."""

    def __init__(self) -> None:
        self._ids: dict[int, list[int]] = {}

    def add(self, response: serving_pb2.GenerateResponse) -> None:
        self._ids.setdefault(response.index, []).extend(response.token_ids)

    def take(self, index: int) -> list[int]:
        return self._ids.pop(index, [])


async def collect(stream: Responses) -> tuple[dict[int, Sample], Counts]:
    samples: dict[int, Sample] = {}
    counts = Counts()
    async with contextlib.aclosing(read(stream, counts)) as responses:
        async for response in responses:
            samples.setdefault(response.index, Sample()).take(response)
    return samples, counts


# -- chat ------------------------------------------------------------------------------------
def chat_logprobs(
    texts: TokenTexts, token_ids: list[int], logprobs: list[serving_pb2.TokenLogprob]
) -> ChoiceLogprobs:
    def entry(token: int, logprob: float) -> TopLogprob:
        text = texts.text(token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    content = []
    for token, each in zip(token_ids, logprobs, strict=True):
        top = [entry(t, lp) for t, lp in zip(each.top_ids, each.top_logprobs, strict=True)]
        chosen = entry(token, each.logprob)
        content.append(TokenLogprob(**chosen.model_dump(), top_logprobs=top))
    return ChoiceLogprobs(content=content)


def chat_completion(
    reply: Reply,
    samples: dict[int, Sample],
    counts: Counts,
    logprobs: bool,
    tools: frozenset[str] = frozenset(),
    legacy: bool = False,
) -> ChatCompletion:
    """`tools`: the names of the functions the model may call (their calls are read out of
    the text into `tool_calls`, or `function_call` when `legacy`: the request gave
    `functions`)."""
    choices = []
    for index, s in sorted(samples.items()):
        text = "".join(s.text)
        content, calls = read_calls(text, tools) if tools else (text, [])
        reasoning = "".join(s.reasoning) if s.reasoning else None
        outs = [_call_out(c, reply.call_id(index, k, c.id)) for k, c in enumerate(calls)]
        choices.append(
            ChatChoice(
                index=index,
                message=AssistantMessage(
                    content=content if calls else text,
                    tool_calls=None if legacy else outs or None,
                    function_call=function_call_out(outs) if legacy else None,
                    reasoning_content=reasoning,
                    reasoning=reasoning,
                ),
                logprobs=chat_logprobs(reply.texts, s.token_ids, s.logprobs) if logprobs else None,
                finish_reason=_finish(s.finish_reason, calls, legacy),
                token_ids=reply.ids(s.token_ids),
            )
        )
    return ChatCompletion(
        id=reply.id,
        created=reply.created,
        model=reply.model,
        choices=choices,
        usage=counts.usage(),
        prompt_logprobs=_vllm_prompt_logprobs(reply, counts, 0),
        prompt_token_ids=reply.prompt_ids(counts, 0),
    )


def _vllm_prompt_logprobs(reply: Reply, counts: Counts, index: int) -> PromptLogprobs | None:
    """Choice `index`'s prompt's, in vLLM's shape (None: not asked for)."""
    scored = reply.scored(counts, index)
    if not reply.prompt_logprobs or scored is None:
        return None
    return vllm_prompt_logprobs(reply.texts, scored)


def _call_out(call: ToolCall, call_id: str) -> ToolCallOut:
    return ToolCallOut(id=call_id, function=FunctionCall(name=call.name, arguments=call.arguments))


def _finish(reason: str | None, calls: Sequence[object], legacy: bool = False) -> str | None:
    if calls and reason == "stop":
        return LEGACY_FINISH if legacy else "tool_calls"
    return reason


class HeldCalls:
    """One streamed choice's text with its calls held back: what may begin a `<tool_call>`
    waits, from a whole one on everything waits for the end, where the calls are read, and
    whitespace waits until something else comes (an answer of calls alone has no content).
    What it lets out, and then `finish`'s content, are the content `read_calls` reads."""

    def __init__(self, tools: frozenset[str]) -> None:
        self.tools = tools
        self.held = ""
        self.calling = False
        self.emitted = False
        self.sent = 0
        """How many characters of the text were let out."""
        self.spans: list[tuple[int, int]] = []
        """Once finished: where each call lies in the whole text (from its tag to the end of its
        closing tag)."""

    def feed(self, text: str) -> str:
        """The part of the text so far that is content for certain."""
        self.held += text
        if self.calling:
            return ""
        at = self.held.find(BEGIN)
        if at >= 0:
            self.calling = True
            cut = at
        else:
            tail = min(len(BEGIN) - 1, len(self.held))
            keep = next((n for n in range(tail, 0, -1) if self.held.endswith(BEGIN[:n])), 0)
            cut = len(self.held) - keep
        if not self.emitted and not self.held[:cut].strip():
            return ""  # only whitespace so far: it is content only if more than calls follows
        out, self.held = self.held[:cut], self.held[cut:]
        self.emitted = True
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest of the content, and the calls."""
        found = find_calls(self.held, self.tools)
        self.spans = [(self.sent + begin, self.sent + end) for _, begin, end in found]
        content, calls = taken_out(self.held, found), [call for call, _, _ in found]
        if calls and not self.emitted and not content.strip():
            return "", calls  # calls alone: no content, as read_calls says
        return content, calls


async def chat_chunks(
    reply: Reply,
    stream: Responses,
    options: StreamOptions,
    logprobs: bool,
    tools: frozenset[str] = frozenset(),
    legacy: bool = False,
) -> AsyncIterator[bytes]:
    """The stream's events: a first chunk per choice with the role, then its text as it comes
    (the last with finish_reason), a usage chunk if asked, then [DONE]. Closing it closes the
    request's stream. With `tools`, a choice's calls come whole in the chunk before its last
    (as its `function_call` when `legacy`), its finish_reason in a chunk of its own."""
    counts = Counts()
    started: set[int] = set()
    held: dict[int, HeldCalls] = {}
    pending = PendingIds()
    include_usage, continuous = options.include_usage, options.continuous_usage_stats

    def chunk(choice: ChunkChoice, prompt_ids: list[int] | None = None) -> bytes:
        message = ChatCompletionChunk(
            id=reply.id,
            created=reply.created,
            model=reply.model,
            choices=[choice],
            usage=counts.usage() if continuous else None,
            prompt_token_ids=prompt_ids,
        )
        return _event(message.model_dump_json(exclude=_without_usage(include_usage, continuous)))

    async with contextlib.aclosing(read(stream, counts)) as responses:
        async for response in responses:
            index = response.index
            pending.add(response)
            if index not in started:
                started.add(index)
                role = ChunkChoice(index=index, delta=Delta(role="assistant", content=""))
                # each choice's first chunk, as vLLM's (the first sample draws first: its
                # first token, which brings them, comes before any other choice's)
                yield chunk(role, reply.prompt_ids(counts, 0))
            if not worth_a_chunk(response, logprobs):
                continue
            text, calls = response.text, list[ToolCall]()
            thought = response.reasoning_text or None
            if tools:
                calling = held.setdefault(index, HeldCalls(tools))
                text = calling.feed(text)
                if response.finished:
                    rest, calls = calling.finish()
                    text += rest
                elif not text and not thought and not logprobs:
                    continue
            ids, values = list(response.token_ids), list(response.logprobs)
            deltas = [
                ToolCallDelta(
                    index=k,
                    id=reply.call_id(index, k, c.id),
                    function=FunctionCall(name=c.name, arguments=c.arguments),
                )
                for k, c in enumerate(calls)
            ]
            ended = _finish(response.finish_reason, calls, legacy) if response.finished else None
            # calls end their choice in a chunk of its own, as OpenAI's do: the SDK's stream
            # helper tells a call done only once a later chunk of its choice comes
            apart = ended if deltas else None
            choice = ChunkChoice(
                index=index,
                delta=Delta(
                    content=text if text or not (deltas or thought) else None,
                    tool_calls=None if legacy else deltas or None,
                    function_call=function_call_out(deltas) if legacy else None,
                    reasoning_content=thought,
                ),
                logprobs=chat_logprobs(reply.texts, ids, values) if logprobs else None,
                finish_reason=None if apart else ended,
                token_ids=reply.ids(pending.take(index)),
            )
            yield chunk(choice)
            if apart:
                yield chunk(ChunkChoice(index=index, delta=Delta(), finish_reason=apart))
    if include_usage:
        final = ChatCompletionChunk(
            id=reply.id, created=reply.created, model=reply.model, choices=[], usage=counts.usage()
        )
        yield _event(final.model_dump_json())
    yield DONE


# -- text completions ------------------------------------------------------------------------
def token_offsets(
    texts: TokenTexts, token_ids: list[int], start: int, emitted: int, widthless: int = 0
) -> list[int]:
    """Where each token of one message starts in the completion's text: from `start` (the text
    before the message), each token as wide as its own text, within the `emitted` characters
    the message added. The message's tokens are placed as late as both readings allow: from
    the message's start (text of its tokens held back, a possible stop string, comes later)
    and back from its end (text held from earlier tokens came with it). The first `widthless`
    tokens add no text (a thinking model's reasoning, apart from the text)."""
    widths = [0 if k < widthless else len(texts.text(t)) for k, t in enumerate(token_ids)]
    end = start + emitted
    left, right = start, end - sum(widths)
    offsets = []
    for width in widths:
        offsets.append(min(max(left, right), end))
        left, right = left + width, right + width
    return offsets


def sample_offsets(texts: TokenTexts, sample: Sample, start: int = 0) -> list[int]:
    """Where each of the sample's tokens starts in its text (after `start` characters), message
    by message as `token_offsets` places them; its reasoning's tokens (the first) add none."""
    out: list[int] = []
    for tokens, chars in sample.spans:
        ids = sample.token_ids[len(out) : len(out) + tokens]
        reasoning = min(max(sample.reasoning_tokens - len(out), 0), tokens)
        out += token_offsets(texts, ids, start, chars, reasoning)
        start += chars
    return out


def completion_logprobs(
    texts: TokenTexts,
    token_ids: list[int],
    logprobs: list[serving_pb2.TokenLogprob],
    offsets: list[int],
) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[texts.text(token) for token in token_ids],
        token_logprobs=[each.logprob for each in logprobs],
        top_logprobs=[
            top_dict(texts, token, each) for token, each in zip(token_ids, logprobs, strict=True)
        ],
        text_offset=offsets,
    )


def echo_logprobs(
    reply: Reply, counts: Counts, logprobs: bool, index: int
) -> CompletionLogprobs | None:
    """Choice `index`'s echoed prompt's logprobs (None: no echo, or no logprobs)."""
    scored = reply.scored(counts, index)
    if reply.echo is None or not logprobs or scored is None:
        return None
    return echoed(reply.texts, scored)


def _after(prompt: CompletionLogprobs | None, echoed: int) -> int:
    """Where the completion's first token starts in the text offsets: after the prompt's
    tokens, counted as its offsets count them (token by token: a tokenizer's BOS counts), else
    after the `echoed` characters."""
    return echoed if prompt is None else sum(len(token) for token in prompt.tokens)


def completion(
    reply: Reply, samples: dict[int, Sample], counts: Counts, logprobs: bool
) -> Completion:
    choices = []
    for index, s in sorted(samples.items()):
        echo = reply.echo_of(index) or ""
        prompt = echo_logprobs(reply, counts, logprobs, index)
        start = _after(prompt, len(echo))
        choices.append(
            CompletionChoice(
                index=index,
                text=echo + "".join(s.text),
                logprobs=joined(
                    prompt,
                    completion_logprobs(
                        reply.texts, s.token_ids, s.logprobs, sample_offsets(reply.texts, s, start)
                    ),
                )
                if logprobs
                else None,
                finish_reason=s.finish_reason,
                prompt_logprobs=_vllm_prompt_logprobs(reply, counts, index),
                prompt_token_ids=reply.prompt_ids(counts, index),
                token_ids=reply.ids(s.token_ids),
            )
        )
    return Completion(
        id=reply.id, created=reply.created, model=reply.model, choices=choices, usage=counts.usage()
    )


async def completion_chunks(
    reply: Reply,
    stream: Responses,
    options: StreamOptions,
    logprobs: bool,
) -> AsyncIterator[bytes]:
    """As chat_chunks, for text completions (no role chunk)."""
    counts = Counts()
    offsets: dict[int, int] = {}
    pending = PendingIds()
    async with contextlib.aclosing(read(stream, counts)) as responses:
        async for response in responses:
            pending.add(response)
            if worth_a_chunk(response, logprobs):
                ids = pending.take(response.index)
                yield _completion_chunk(reply, response, logprobs, offsets, counts, options, ids)
    if options.include_usage:
        final = Completion(
            id=reply.id, created=reply.created, model=reply.model, choices=[], usage=counts.usage()
        )
        yield _event(final.model_dump_json())
    yield DONE


def _completion_chunk(
    reply: Reply,
    response: serving_pb2.GenerateResponse,
    logprobs: bool,
    offsets: dict[int, int],
    counts: Counts,
    options: StreamOptions,
    generated: list[int],
) -> bytes:
    """A choice's chunk: `generated`, the tokens since its last chunk (some messages make
    none: their text is held back)."""
    index, ids, text = response.index, list(response.token_ids), response.text
    prompt = None
    echo = reply.echo_of(index)
    first = index not in offsets
    if first and echo is not None:  # a choice's first chunk: its prompt
        text = echo + text
        prompt = echo_logprobs(reply, counts, logprobs, index)
    offset = offsets.get(index, _after(prompt, len(text) - len(response.text)))
    offsets[index] = offset + len(response.text)
    choice = CompletionChoice(
        index=index,
        text=text,
        logprobs=joined(
            prompt,
            completion_logprobs(
                reply.texts,
                ids,
                list(response.logprobs),
                token_offsets(reply.texts, ids, offset, len(response.text)),
            ),
        )
        if logprobs
        else None,
        finish_reason=response.finish_reason if response.finished else None,
        prompt_token_ids=reply.prompt_ids(counts, index) if first else None,
        token_ids=reply.ids(generated),
    )
    continuous = options.continuous_usage_stats
    message = Completion(
        id=reply.id,
        created=reply.created,
        model=reply.model,
        choices=[choice],
        usage=counts.usage() if continuous else None,
    )
    return _event(
        message.model_dump_json(exclude=_without_usage(options.include_usage, continuous))
    )


def _without_usage(include_usage: bool, continuous: bool) -> set[str] | None:
    """A chunk has `usage` (null until the last) when the client asked for usage."""
    return None if include_usage or continuous else {"usage"}


def _event(data: str) -> bytes:
    return b"data: " + data.encode() + b"\n\n"
