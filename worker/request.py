"""What goes into the engine and what comes out of it, one dataclass each."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cache import DEFAULT_NAMESPACE, CacheNamespace
from worker.sampling_params import SamplingParams
from worker.tool_calls import Tool

FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


@dataclass(frozen=True, slots=True)
class KvPeer:
    """Another worker whose cache holds the prompt's first `positions` positions, as the
    router's index says (worker/peer_reads.py reads them from it)."""

    worker: str
    address: str
    positions: int


@dataclass(frozen=True, slots=True)
class Resume:
    """A sample continued here after the worker streaming it died (cluster/router_service.py).

        prompt_token_ids:  [ original prompt ........ | generated (the client has them) ]
                                                        ^^^^^^^^^ `generated` tokens

    Generation goes on from the next token as sample `sample_index` would have: its seed and
    output index are that sample's, `max_tokens` counts the tokens already generated, and the
    stop strings see the text already streamed.
    """

    sample_index: int
    generated: int


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """An embedding request's (vLLM's pooling parameters): the prompt's last token's final
    hidden state is its output, and no token is generated (worker/pooling.py)."""

    dimensions: int | None = None
    """Keep the first this many values (a Matryoshka-trained model's shorter embedding);
    None: all of the model's hidden size."""
    normalize: bool = True
    """Scale to unit L2 norm (after the cut), as vLLM's embed task does by default."""


EMBEDDING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)
"""What an embedding request runs with once checked (it draws nothing): whatever else its
sampling fields held is dropped, so nothing of generation's is built from them."""


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Exactly one of `prompt_token_ids`, `prompt` (text) or `messages` (chat) is set."""

    request_id: str
    prompt_token_ids: tuple[int, ...] | None = None
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    """Chat messages: a `role` and a `content`, either text or a list of parts
    ({"type": "text", "text": ...} / {"type": "image"}: the next of `images`)."""
    namespace: CacheNamespace = DEFAULT_NAMESPACE
    sampling: SamplingParams = field(default_factory=SamplingParams)
    resume: Resume | None = None
    """Set (with token ids and n = 1) when this continues a sample begun elsewhere."""
    prompt_block_hashes: tuple[int, ...] = ()
    """The prompt's block hashes as the router computed them: the cache checks and uses them
    instead of hashing the prompt on the scheduler thread (`SequenceCache.start`)."""
    images: tuple[bytes, ...] = ()
    """Image files of a vision prompt (worker/images.py checks them, worker/image_prompt.py
    places them): in the order of their placeholders (or, in expanded ids, their runs)."""
    tools: tuple[Tool, ...] = ()
    """Tools a chat's model is shown (worker/tool_calls.py); the constraint their calls are
    generated under is `sampling.structured`."""
    template_variables: Mapping[str, Any] | None = None
    """More variables for a chat's template (`validation.template_variables` checks them)."""
    continue_final_message: bool = False
    """A chat's last message is continued (worker/chat_continuation.py), not answered."""
    add_generation_prompt: bool = True
    """Whether a chat's template writes the reply's opening (off when continuing)."""
    priority: int = 0
    """Lower is served earlier, under the `priority` scheduling policy (vLLM's); any other
    value than 0 is refused under `fcfs` (worker/scheduler.py)."""
    pooling: PoolingParams | None = None
    """Set for an embedding request: the prompt's embedding is its one output (`sampling`
    is not used but for `n`, which must be 1)."""
    kv_peer: KvPeer | None = None
    """A worker to read the prompt's cached KV from rather than recompute it (the router's)."""
    suffix: str | None = None
    """Fill in the middle: the text after the insertion point, the prompt (text or token ids)
    being what comes before it; the model's form writes both (worker/fill_in_middle.py)."""

    @property
    def generated_before(self) -> int:
        return self.resume.generated if self.resume is not None else 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The log-probability of one generated token, and the most likely tokens at its position
    (the request's `logprobs` of them, most likely first), from the raw distribution."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) pairs."""
    rank: int = 0
    """The token's rank at its position, 1 the most likely (prompt tokens'; 0: not
    computed)."""


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One streamed message of one sample (`index` < n) of a request."""

    request_id: str
    index: int
    token_ids: tuple[int, ...]
    """Tokens generated since the previous message."""
    text: str
    """Text generated since the previous message (stop strings and special tokens excluded)."""
    prompt_tokens: int
    cached_prompt_tokens: int
    """Prompt positions whose KV came from the prefix cache (at the sample's first admission)."""
    host_cached_tokens: int = 0
    """Of `cached_prompt_tokens`, those copied back from the host tier."""
    disk_cached_tokens: int = 0
    """Of `cached_prompt_tokens`, those read back from the disk tier for this request."""
    peer_cached_tokens: int = 0
    """Of `cached_prompt_tokens`, those read from another worker's cache for this request."""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    """One per token of `token_ids` when the request asked for logprobs, else empty."""
    stop_string: str | None = None
    """On a sample's last output: the stop string that ended it (None: another reason)."""
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    """On the first output of the request's first sample, when it asked for them: one per
    prompt token after the first (`SamplingParams.prompt_logprobs`)."""
    prompt_token_ids: tuple[int, ...] = ()
    """With `prompt_logprobs`: the prompt's ids, the first included."""
    reasoning_text: str = ""
    """With `separate_reasoning`, of a thinking model: the reasoning generated since the
    previous message (`text` holds only what comes after its `</think>`)."""
    reasoning_tokens: int = 0
    """Of `token_ids`, those of the reasoning (with `separate_reasoning`, of a thinking model)."""
    accepted_prediction_tokens: int = 0
    """Of `token_ids`, those drawn from a draft of the request's predicted output."""
    rejected_prediction_tokens: int = 0
    """Tokens of the predicted output's drafts computed with this message's and not drawn."""
    embedding: tuple[float, ...] = ()
    """An embedding request's output, on its one (finished) message."""
