"""Protocol buffers <-> the engine's dataclasses, one function each way; nothing else.

Absent optional fields take the engine's defaults; every conversion error names the proto field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cache import CacheNamespace
from protos.radixmesh.v1 import serving_pb2, worker_pb2
from worker.errors import InvalidRequest
from worker.request import KvPeer, PoolingParams, RequestOutput, Resume, TokenLogprob
from worker.sampling_params import SamplingParams, StructuredOutput
from worker.tool_calls import NO_PARAMETERS, Tool

if TYPE_CHECKING:  # the adapter record holds tensors; this module imports no torch
    from worker.lora_slots import AdapterState

DEFAULTS = SamplingParams()
_INT32 = 2**31 - 1


def namespace_from_proto(message: serving_pb2.Namespace) -> CacheNamespace:
    return CacheNamespace(
        adapter=message.adapter or None,
        tenant=message.tenant or None,
        salt=message.cache_salt or None,
    )


def namespace_to_proto(namespace: CacheNamespace) -> serving_pb2.Namespace:
    return serving_pb2.Namespace(
        adapter=namespace.adapter or "",
        tenant=namespace.tenant or "",
        cache_salt=namespace.salt or "",
    )


def sampling_from_proto(message: serving_pb2.SamplingParams) -> SamplingParams:
    def get(name: str) -> object:
        return getattr(message, name) if message.HasField(name) else getattr(DEFAULTS, name)

    for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
        for value in getattr(message, name):
            if not 0 <= value <= _INT32:
                raise InvalidRequest(f"sampling.{name}", f"{value} is not a token id")
    return SamplingParams(
        max_tokens=int(get("max_tokens")),  # type: ignore[call-overload]
        temperature=float(get("temperature")),  # type: ignore[arg-type]
        top_k=int(get("top_k")),  # type: ignore[call-overload]
        top_p=float(get("top_p")),  # type: ignore[arg-type]
        seed=int(message.seed) if message.HasField("seed") else None,
        n=int(get("n")),  # type: ignore[call-overload]
        stop=tuple(message.stop),
        stop_token_ids=tuple(int(t) for t in message.stop_token_ids),
        ignore_eos=bool(message.ignore_eos),
        presence_penalty=float(get("presence_penalty")),  # type: ignore[arg-type]
        frequency_penalty=float(get("frequency_penalty")),  # type: ignore[arg-type]
        repetition_penalty=float(get("repetition_penalty")),  # type: ignore[arg-type]
        logprobs=int(message.logprobs) if message.HasField("logprobs") else None,
        prompt_logprobs=int(message.prompt_logprobs)
        if message.HasField("prompt_logprobs")
        else None,
        bad_words=tuple(message.bad_words),
        return_prompt_token_ids=message.return_prompt_token_ids,
        prediction=message.prediction,
        structured=structured_from_proto(message.structured)
        if message.HasField("structured")
        else None,
        min_p=float(get("min_p")),  # type: ignore[arg-type]
        min_tokens=int(get("min_tokens")),  # type: ignore[call-overload]
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in message.logit_bias.items())),
        allowed_token_ids=tuple(int(t) for t in message.allowed_token_ids),
        include_stop_str_in_output=bool(message.include_stop_str_in_output),
        skip_special_tokens=bool(get("skip_special_tokens")),
        separate_reasoning=message.separate_reasoning,
        thinking_token_budget=int(message.thinking_token_budget)
        if message.HasField("thinking_token_budget")
        else None,
    )


def structured_from_proto(message: serving_pb2.StructuredOutput) -> StructuredOutput:
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidRequest("sampling.structured", "sets none of its kinds")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(message.choice.values))
    if kind == "json_object":
        if not message.json_object:
            raise InvalidRequest("sampling.structured.json_object", "must be true when set")
        return StructuredOutput("json_object")
    return StructuredOutput(kind, spec=getattr(message, kind))


def structured_to_proto(structured: StructuredOutput) -> serving_pb2.StructuredOutput:
    message = serving_pb2.StructuredOutput()
    if structured.kind == "choice":
        message.choice.values.extend(structured.choices)
    elif structured.kind == "json_object":
        message.json_object = True
    else:
        setattr(message, structured.kind, structured.spec)
    return message


def tools_from_proto(tools: Sequence[serving_pb2.Tool]) -> tuple[Tool, ...]:
    return tuple(
        Tool(
            tool.name,
            tool.description if tool.HasField("description") else None,
            tool.parameters or json.dumps(NO_PARAMETERS),
        )
        for tool in tools
    )


def resume_from_proto(message: worker_pb2.WorkerGenerateRequest) -> Resume | None:
    if not message.HasField("resume"):
        return None
    return Resume(message.resume.sample_index, message.resume.generated)


def kv_peer_from_proto(message: worker_pb2.WorkerGenerateRequest) -> KvPeer | None:
    if not message.HasField("kv_peer") or not message.kv_peer.address:
        return None
    peer = message.kv_peer
    return KvPeer(peer.worker, peer.address, peer.positions)


def resume_to_proto(resume: Resume) -> worker_pb2.Resume:
    return worker_pb2.Resume(sample_index=resume.sample_index, generated=resume.generated)


def pooling_from_proto(
    message: serving_pb2.GenerateRequest | worker_pb2.WorkerGenerateRequest,
) -> PoolingParams | None:
    """The request's pooling parameters; None: it generates (no `pooling` field)."""
    if not message.HasField("pooling"):
        return None
    pooling = message.pooling
    dimensions = pooling.dimensions if pooling.HasField("dimensions") else None
    normalize = not pooling.HasField("normalize") or pooling.normalize
    return PoolingParams(dimensions, normalize)


def pooling_to_proto(params: PoolingParams) -> serving_pb2.PoolingParams:
    message = serving_pb2.PoolingParams(normalize=params.normalize)
    if params.dimensions is not None:
        message.dimensions = params.dimensions
    return message


def sampling_to_proto(params: SamplingParams) -> serving_pb2.SamplingParams:
    message = serving_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        n=params.n,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias),
        allowed_token_ids=list(params.allowed_token_ids),
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        separate_reasoning=params.separate_reasoning,
        bad_words=list(params.bad_words),
        return_prompt_token_ids=params.return_prompt_token_ids,
        prediction=params.prediction,
    )
    if params.seed is not None:
        message.seed = params.seed
    if params.logprobs is not None:
        message.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        message.prompt_logprobs = params.prompt_logprobs
    if params.thinking_token_budget is not None:
        message.thinking_token_budget = params.thinking_token_budget
    if params.structured is not None:
        message.structured.CopyFrom(structured_to_proto(params.structured))
    return message


def output_to_proto(
    output: RequestOutput, worker: str, predicted_cached_tokens: int = 0
) -> serving_pb2.GenerateResponse:
    return serving_pb2.GenerateResponse(
        request_id=output.request_id,
        index=output.index,
        token_ids=list(output.token_ids),
        text=output.text,
        finished=output.finished,
        finish_reason=output.finish_reason or "",
        prompt_tokens=output.prompt_tokens,
        cached_prompt_tokens=output.cached_prompt_tokens,
        host_cached_tokens=output.host_cached_tokens,
        disk_cached_tokens=output.disk_cached_tokens,
        peer_cached_tokens=output.peer_cached_tokens,
        predicted_cached_tokens=predicted_cached_tokens,
        worker=worker,
        logprobs=[logprob_to_proto(each) for each in output.logprobs],
        stop_string=output.stop_string or "",
        prompt_logprobs=[logprob_to_proto(each) for each in output.prompt_logprobs],
        prompt_token_ids=list(output.prompt_token_ids),
        reasoning_text=output.reasoning_text,
        reasoning_tokens=output.reasoning_tokens,
        accepted_prediction_tokens=output.accepted_prediction_tokens,
        rejected_prediction_tokens=output.rejected_prediction_tokens,
        embedding=output.embedding,
    )


def logprob_to_proto(logprob: TokenLogprob) -> serving_pb2.TokenLogprob:
    return serving_pb2.TokenLogprob(
        logprob=logprob.logprob,
        top_ids=[token for token, _ in logprob.top],
        top_logprobs=[value for _, value in logprob.top],
        rank=logprob.rank,
    )


def adapter_info_to_proto(state: AdapterState, worker: str) -> serving_pb2.AdapterInfo:
    return serving_pb2.AdapterInfo(
        name=state.name,
        identity=state.identity,
        rank=state.rank,
        target_modules=list(state.target_modules),
        resident=state.resident,
        path=state.path,
        worker=worker,
    )
