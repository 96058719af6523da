"""The engine's bookkeeping for one request and each of its n samples.

A sample is what holds a cache sequence and generates tokens. Its positions:

    tokens:   [ prompt ............ | generated ... ]
    computed: KV written for tokens[:computed]; tokens[computed:] are computed next
              (one token while decoding, a chunk of the prompt while prefilling)

A request's samples are UNBORN until sample 0 is queued (`Scheduler.enqueue`, as the request is
added) and samples 1..n-1 until sample 0's prompt is complete; then they fork from it and share
its prompt pages.

A request's prompt keys are made once, on the thread that submits it (`prompt_keys`); a
sample starts the cache from them and the keys of the tokens it generated since (`cache_keys`).
A vision prompt's keys come from its cache tokens (worker/image_inputs.py: one ImageToken per
run of image positions) instead of its ids, and its samples never start with the router's block
hashes (they cannot stand for image keys; `BlockHasher.accepts` refuses typed keys anyway).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Protocol

from cache import CachedSequence, Keys, to_cache_keys
from worker.image_inputs import RequestImages
from worker.lora_adapter import LoraAdapter
from worker.predicted_output import PredictedOutput, PredictionCheck, PredictionCursor
from worker.reasoning import ReasoningSplit
from worker.request import GenerateRequest, RequestOutput, TokenLogprob
from worker.sampling import Sampler
from worker.speculation import NgramIndex
from worker.stop import StopChecker, StopStrings, compile_stops
from worker.thinking_tokens import ThinkingTokens

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from worker.disk_reads import PendingRead
    from worker.peer_reads import PendingPeerRead


class TextDecoder(Protocol):
    """Streams text for token ids: deltas whose concatenation (and finish) is the full text."""

    def step(self, token_id: int) -> str: ...

    def finish(self) -> str: ...


class Phase(Enum):
    UNBORN = "unborn"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class SampleState:
    request: RequestState
    index: int
    tokens: list[int]
    sampler: Sampler
    stop: StopChecker
    decoder: TextDecoder | None
    phase: Phase = Phase.WAITING
    seq: CachedSequence | None = None
    computed: int = 0
    generated: int = 0
    prefilled: bool = False
    """Whether the tokens known at admission are all computed (and committed to the cache)."""
    disk_checked: bool = False
    """Whether the saved cache was searched for this sample's prompt (once, at admission)."""
    disk_read: PendingRead | None = None
    """Its disk hit being read (worker/disk_reads.py): it waits queued until the read ends."""
    lora_slot: int = -1
    """The adapter slot this sample pins while it runs (-1: none: the base model, or not
    running)."""
    reasoning: ReasoningSplit | None = None
    """Its text told into reasoning and answer (a thinking model's, when asked); None: not."""
    thinking: ThinkingTokens | None = None
    """Its reasoning read from its raw text (a thinking model's, when told apart or given a
    budget): its tokens counted and closed at the budget; None: neither. Its sampler holds it
    too, to write what it forces."""
    ngrams: NgramIndex | None = None
    """Where the n-grams of its tokens occurred (speculative decoding; None: not yet, or off)."""
    draft: list[int] = field(default_factory=list)
    """Its latest draft (worker/speculation.py); a step verifies it only when planned so."""
    draft_predicted: bool = False
    """Whether `draft` came from its request's predicted output (else from an n-gram)."""
    prediction: PredictionCursor | None = None
    """Its place in its request's predicted output (None: none, or not drafted from yet)."""
    checking: PredictionCheck | None = None
    """The prediction draft its step is verifying (None: none)."""

    @property
    def pending(self) -> int:
        return len(self.tokens) - self.computed

    def cache_keys(self) -> Keys:
        """The cache keys of this sample's positions: the prompt's, made when it was submitted,
        then those of the tokens generated since (text ids, converted here). With nothing
        generated this is the request's own `prompt_keys`, shared by its samples: read it,
        never change it (`SequenceCache.start_keys` copies it)."""
        keys = self.request.prompt_keys
        if len(self.tokens) == len(keys):
            return keys
        return keys + to_cache_keys(self.tokens[len(keys) :])

    @property
    def block_hashes(self) -> tuple[int, ...]:
        """The router's block hashes of the prompt, if the cache may take them."""
        request = self.request
        return request.request.prompt_block_hashes if request.images is None else ()


@dataclass(eq=False)
class RequestState:
    request: GenerateRequest
    prompt_ids: list[int]
    sink: Callable[[RequestOutput], None]
    adapter: LoraAdapter | None = None
    """The adapter the request runs with (its identity is `request.namespace.adapter`)."""
    images: RequestImages | None = None
    """A vision prompt's images, placed (None: a text prompt)."""
    grammar: CompiledGrammar | None = None
    """A structured output's grammar, compiled in the submitting thread (None: free text)."""
    bad_words: tuple[tuple[int, ...], ...] = ()
    """The token sequences of the request's bad words, spelled in the submitting thread."""
    reasoning_inside: bool | None = None
    """Whether its samples start inside their reasoning (worker/reasoning.py), decided in the
    submitting thread; None: their text is not split and their reasoning has no budget."""
    grammar_waits: bool = False
    """Its structured output's grammar starts where the reasoning ends (a JSON answer or a
    required call, of a prompt that opened the reasoning: worker/thinking_tokens.py)."""
    samples: list[SampleState] = field(default_factory=list)
    cached_prompt_tokens: int = 0
    """Prompt positions served from the cache when sample 0 was first admitted (of the prompt as
    the client sent it: `prompt_tokens` at most)."""
    host_cached_tokens: int = 0
    """Of those, the positions that came back from the host tier."""
    disk_cached_tokens: int = 0
    """Of those, the positions read back from the disk tier for it."""
    peer_read: PendingPeerRead | None = None
    """Its prompt's KV being read from the router's `kv_peer` (worker/peer_reads.py): its samples
    wait queued until the read ends."""
    peer_checked: bool = False
    """Whether its peer was asked (or found not worth asking), once, at first admission."""
    peer_cached_tokens: int = 0
    """Of `cached_prompt_tokens`, the positions read from its peer (the router's `kv_peer`)."""
    admitted: bool = False
    forked: bool = False
    submitted: float = field(default_factory=time.perf_counter)
    """When the worker received it (`time.perf_counter`; `Engine.submit` sets it as it begins)."""
    admitted_at: float | None = None
    """When its first sample was admitted (None: not yet)."""
    first_output_at: float | None = None
    """When its first token (or its embedding) went out (None: not yet)."""
    queue_order: int = -1
    """When it was first queued, among all requests (the scheduler sets it; -1: not yet)."""
    ngrams: NgramIndex | None = None
    """Its prompt's n-grams, indexed at submission when the engine speculates (None: off)."""
    predicted: PredictedOutput | None = None
    """Its predicted output (OpenAI's `prediction`), tokenized and indexed at submission."""
    prompt_scores: list[TokenLogprob] = field(default_factory=list)
    """The prompt's logprobs so far (`SamplingParams.prompt_logprobs`), of its tokens 1, 2, ..."""
    stops: StopStrings = field(init=False)
    """The request's stop strings, compiled (in the submitting thread: never on the engine's)."""
    stop_token_ids: frozenset[int] = field(init=False)
    prompt_keys: Keys = field(init=False)
    """The prompt's cache keys (one per position; an image's positions keyed by the image),
    made in the submitting thread so that the engine thread's admission converts nothing."""

    def __post_init__(self) -> None:
        self.stops = compile_stops(self.request.sampling.stop)
        self.stop_token_ids = frozenset(self.request.sampling.stop_token_ids)
        images = self.images
        prompt = self.prompt_ids if images is None else images.cache_tokens(self.prompt_ids)
        self.prompt_keys = to_cache_keys(prompt)

    def rebind(self, adapter: LoraAdapter) -> None:
        """Run with `adapter` instead (its name's new weights; only before any sample ran)."""
        namespace = replace(self.request.namespace, adapter=adapter.identity)
        self.request = replace(self.request, namespace=namespace, prompt_block_hashes=())
        self.adapter = adapter

    @property
    def scoring_prompt(self) -> bool:
        """Whether the prompt's logprobs are still being computed: asked for, and not all
        there yet. Not for a resumed sample: its client had them with the first token."""
        request = self.request
        return (
            request.sampling.prompt_logprobs is not None
            and request.resume is None
            and len(self.prompt_scores) < len(self.prompt_ids) - 1
        )

    @property
    def prompt_tokens(self) -> int:
        """The prompt as the client sent it (a resumed sample's ids end with generated ones)."""
        return len(self.prompt_ids) - self.request.generated_before

    @property
    def timed_from_start(self) -> bool:
        """Whether its time to first token and its end-to-end time are the client's: a
        generation, not a sample resumed on this worker after another failed."""
        return self.request.pooling is None and self.request.resume is None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def finished(self) -> bool:
        return all(s.phase is Phase.FINISHED for s in self.samples)
