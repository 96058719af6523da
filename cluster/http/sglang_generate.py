"""SGLang's native `POST /generate`: what SGLang's own clients and the RL frameworks built on it
(token ids in, token ids and logprobs out) send, served by the same serving core as the
completions API (the request is read as a text completion: cluster/http/sglang_schema.py).

One prompt with one sample answers an object, several prompts or samples a list (choice p x n
+ i is sample i of prompt p), each as SGLang writes it:

    {"text": ..., "output_ids": [...], "meta_info": {"id", "finish_reason": {"type": "length",
     "length": N} | {"type": "stop", "matched": <stop string or token id>} | {"type": "abort"},
     "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
     with return_logprob: "output_token_logprobs": [[logprob, id, text | null], ...],
     "output_top_logprobs" (top_logprobs_num > 0), "input_token_logprobs" /
     "input_top_logprobs" (empty unless logprob_start_len >= 0 asks for the prompt's from
     there; the first prompt token's logprob null)}}

A stream sends `data: {...}` events of the same shape, the text and ids so far (SGLang's
default), `finish_reason` null until the sample ends (an `index` with several), then
`data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cluster.http import openai_params
from cluster.http.errors import HttpError
from cluster.http.image_parts import MEDIA_TYPES, data_url_bytes, signature_format
from cluster.http.openai_responses import (
    DONE,
    Counts,
    Responses,
    Sample,
    collect,
    guarded,
    prepend,
    read,
    served_by,
)
from cluster.http.prompt_logprobs import LEAST_LOGPROB, ScoredPrompt
from cluster.http.several_prompts import merged
from cluster.http.sglang_schema import (
    DEFAULT_MAX_NEW_TOKENS,
    AbortRequest,
    GenerateRequest,
    as_completion,
    at_prompt,
    per_prompt,
    sglang_names,
)
from cluster.http.sse import EventStream
from cluster.http.token_texts import TokenTexts
from cluster.requests import suffixed
from protos.radixmesh.v1 import serving_pb2

if TYPE_CHECKING:
    from cluster.http.app import HttpApi


@dataclass
class Answer:
    """How the request's samples are written (one per choice index)."""

    body: GenerateRequest
    request_ids: list[str]
    n: int
    texts: TokenTexts
    began: float = field(default_factory=time.monotonic)
    built: dict[int, tuple[list[Any], list[Any]]] = field(default_factory=dict)
    """Each sample's logprob entries written so far: the chosen tokens', their top ones'."""

    def item(self, index: int, sample: Sample, counts: Counts) -> dict[str, Any]:
        request_id = self.request_ids[index // self.n]
        prompt, cached = counts.generations.get(request_id, (0, 0))
        ids = sample.token_ids
        meta: dict[str, Any] = {
            "id": request_id,
            "finish_reason": _finish(sample),
            "prompt_tokens": prompt,
            "completion_tokens": len(ids),
            "cached_tokens": cached,
            "e2e_latency": time.monotonic() - self.began,
        }
        if self.body.return_logprob:
            meta.update(self._output_logprobs(index, ids, sample.logprobs))
            meta.update(self._input_logprobs(counts.prompts.get(request_id)))
        return {"text": "".join(sample.text), "output_ids": list(ids), "meta_info": meta}

    def _output_logprobs(
        self, index: int, ids: Sequence[int], scores: Sequence[serving_pb2.TokenLogprob]
    ) -> dict[str, Any]:
        """The answer's logprobs, each token's written once (a stream repeats them all in
        every event: SGLang's cumulative events)."""
        chosen, tops = self.built.setdefault(index, ([], []))
        for token, score in zip(ids[len(chosen) :], scores[len(chosen) :], strict=True):
            chosen.append(self._entry(score.logprob, token))
            tops.append(self._top(score))
        out: dict[str, Any] = {"output_token_logprobs": chosen}
        if self.body.top > 0:
            out["output_top_logprobs"] = tops
        return out

    def _input_logprobs(self, prompt: ScoredPrompt | None) -> dict[str, Any]:
        """The prompt's from `logprob_start_len` on (none before it, nor at its default)."""
        out: dict[str, Any] = {"input_token_logprobs": []}
        if self.body.top > 0:
            out["input_top_logprobs"] = []
        start = self.body.start
        if prompt is None or start < 0:
            return out
        if start >= len(prompt.token_ids):
            raise HttpError.invalid(
                "logprob_start_len", f"{start} is past the prompt's {len(prompt.token_ids)} tokens"
            )
        first = [None, *(s.logprob for s in prompt.scores)]
        scored = list(zip(prompt.token_ids, first, strict=True))[start:]
        out["input_token_logprobs"] = [self._entry(lp, t) for t, lp in scored]
        if self.body.top > 0:
            out["input_top_logprobs"] = [None, *(self._top(s) for s in prompt.scores)][start:]
        return out

    def _entry(self, logprob: float | None, token: int) -> list[Any]:
        """SGLang's (logprob, token id, text) triple; the text only when asked for."""
        text = self.texts.text(token) if self.body.return_text_in_logprobs else None
        return [None if logprob is None else max(logprob, LEAST_LOGPROB), token, text]

    def _top(self, score: serving_pb2.TokenLogprob) -> list[list[Any]]:
        if self.body.top == 0:
            return []
        return [self._entry(lp, t) for t, lp in zip(score.top_ids, score.top_logprobs, strict=True)]

    def whole(self, samples: dict[int, Sample], counts: Counts) -> Any:
        items = [self.item(index, sample, counts) for index, sample in sorted(samples.items())]
        return items if self.body.listed else items[0]

    async def events(self, stream: Responses) -> AsyncIterator[bytes]:
        counts = Counts()
        samples: dict[int, Sample] = {}
        async with contextlib.aclosing(read(stream, counts)) as responses:
            async for response in responses:
                sample = samples.setdefault(response.index, Sample())
                sample.take(response)
                if not (response.text or response.token_ids or response.finished):
                    continue
                item = self.item(response.index, sample, counts)
                if self.body.listed:
                    item["index"] = response.index
                yield b"data: " + json.dumps(item).encode() + b"\n\n"
        yield DONE


def _finish(sample: Sample) -> dict[str, Any] | None:
    """SGLang's finish reason: null while the sample runs."""
    reason = sample.finish_reason
    if reason is None:
        return None
    if reason == "length":
        return {"type": "length", "length": len(sample.token_ids)}
    if reason == "stop":
        matched = sample.stop_string or (sample.token_ids[-1] if sample.token_ids else None)
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": reason}


def add_routes(app: FastAPI, api: HttpApi) -> None:
    async def generate(body: GenerateRequest, request: Request) -> Response:
        caller = api.caller(request)
        names = sglang_names(body)
        try:
            adapter = api.check_model(body.lora_path or api.model)
            parts = per_prompt(body)
            rid = body.rid if isinstance(body.rid, str) else api.request_id(request)
        except HttpError as err:  # named as the completions API names it
            raise err.renamed(names) from None
        messages, n = [], 1
        alone = not isinstance(body.sampling_params, list)
        for p, part in enumerate(parts):  # the request, or a prompt each with its own sampling
            try:
                completion = as_completion(part, api.model)
                n = completion.n or 1
                messages += openai_params.completion_requests(
                    completion, rid if alone else f"{rid}-{p}", api.tenant(request)
                )
            except HttpError as err:
                raise err.renamed(names if alone else at_prompt(names, p)) from None
        try:
            _name(messages, body.rid)
        except HttpError as err:
            raise err.renamed(names) from None
        fields = _images(messages, body)
        for message in messages:
            message.namespace.adapter = adapter or ""
        answer = Answer(body, [m.request_id for m in messages], n, api.token_texts())
        cap = DEFAULT_MAX_NEW_TOKENS  # without max_new_tokens, cut to the room left
        started = [
            api.start(
                m, caller, image_fields=f, fill_cap=cap, metered=body.log_metrics is not False
            )
            for m, f in zip(messages, fields, strict=True)
        ]
        stream = merged(started, n)
        if body.stream:
            first = await api.finish(request, anext(stream), names)  # a refusal: a status
            return EventStream(guarded(answer.events(prepend(first, stream))), served_by(first))
        samples, counts = await api.finish(request, collect(stream), names)

        def encode() -> bytes:
            return json.dumps(answer.whole(samples, counts)).encode()

        # with logprobs it can be megabytes: written on a thread, off the loop streams share
        body_bytes = await asyncio.to_thread(encode) if body.return_logprob else encode()
        headers = counts.served_by()
        return Response(body_bytes, media_type="application/json", headers=headers)

    async def model_info(request: Request) -> JSONResponse:
        """SGLang's `GET /get_model_info`, which its client checks before the first call."""
        api.caller(request)
        return JSONResponse(
            {"model_path": api.model, "tokenizer_path": api.model, "is_generation": True}
        )

    async def abort_request(body: AbortRequest, request: Request) -> JSONResponse:
        """SGLang's `POST /abort_request`: a request in flight by its `rid`, or every one the
        caller's token may end (`abort_all`: the caller's tenant's, or all for an operator)."""
        caller = api.caller(request)
        if not (body.rid or body.abort_all):
            raise HttpError.invalid("rid", "give a rid, or abort_all: true")
        rids = list(api.service.in_flight) if body.abort_all else [body.rid]
        aborts = (api.service.abort(rid, caller.tenant) for rid in rids)
        ended = await asyncio.gather(*aborts, return_exceptions=True)  # a worker gone: not ended
        return JSONResponse({"aborted": [r for r, e in zip(rids, ended, strict=True) if e is True]})

    app.add_api_route("/generate", generate, methods=["POST"])
    app.add_api_route("/get_model_info", model_info, methods=["GET"])
    app.add_api_route("/abort_request", abort_request, methods=["POST"])


def _name(messages: list[serving_pb2.GenerateRequest], rid: str | list[str] | None) -> None:
    """SGLang's request ids: one each from a list, or `{rid}_{i}` for prompt i of a batch
    (where the completions API writes `{rid}-{i}`)."""
    if isinstance(rid, list):
        if len(rid) != len(messages):
            raise HttpError.invalid(
                "rid", f"{len(rid)} ids for {len(messages)} prompts: give one each"
            )
        for message, each in zip(messages, rid, strict=True):
            message.request_id = each
    elif rid is not None and len(messages) > 1:
        for i, message in enumerate(messages):
            message.request_id = suffixed(rid, f"_{i}")


def _images(messages: list[serving_pb2.GenerateRequest], body: GenerateRequest) -> list[list[str]]:
    """Each prompt's `image_data` decoded into its message's images; what refusals call each
    (`image_data`, `image_data[k]`, or `image_data[p]` / `image_data[p][k]` in a batch). As in
    SGLang, a null image is none, and one image given for a batch goes with every prompt."""
    data = body.image_data
    if not data:  # null, or []
        return [[] for _ in messages]
    if not body.several:
        entries: list[Any] = [data]
        prefixes = ["image_data"]
    elif isinstance(data, str):
        entries, prefixes = [data] * len(messages), ["image_data"] * len(messages)
    elif len(data) == len(messages):
        entries, prefixes = data, [f"image_data[{p}]" for p in range(len(messages))]
    else:
        raise HttpError.invalid("image_data", f"give one entry per prompt ({len(messages)})")
    fields = []
    for message, entry, prefix in zip(messages, entries, prefixes, strict=True):
        named = (
            [(entry, prefix)]
            if isinstance(entry, str)
            else [
                (image, f"{prefix}[{k}]")
                for k, image in enumerate(entry or [])
                if image is not None
            ]
        )
        for image, name in named:
            if not isinstance(image, str):
                raise HttpError.invalid(name, "an image is a data URL or base64, not a list")
            message.images.append(_image(image, name))
        fields.append([name for _, name in named])
    return fields


def _image(data: str, where: str) -> bytes:
    """A data URL's file, or bare base64 of a PNG, JPEG or WebP file (as SGLang takes it)."""
    if ":" in data[:16]:  # a URL of some scheme: only data URLs are read
        return data_url_bytes(data, where)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise HttpError.invalid(where, f"neither a data URL nor base64 ({err})") from None
    if signature_format(raw) not in MEDIA_TYPES.values():
        raise HttpError.invalid(where, "the base64 data is no PNG, JPEG or WebP file")
    return raw
