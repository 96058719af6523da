"""The engine: one thread that owns the cache and the model and runs steps while work remains.

Other threads call `submit` (validates, then queues) and `abort`; everything else happens on
the engine thread, one step at a time:

    take new requests and aborts -> schedule (running first, then admissions) -> forward pass
    -> commit completed prefills (a second request with the same prefix now hits) -> n > 1 forks
    -> sample -> stop checks -> stream a RequestOutput per sample -> finish: cache what was
       computed, unlock, free

LoRA adapters (`EngineConfig.adapters`, `load_adapter`, `unload_adapter`; worker/lora_serving.py):
a request names its adapter in `namespace.adapter`; `submit` swaps the name for the adapter's
identity (`name@digest`), so the request's KV lives in that adapter's own trees. The scheduler
admits it once the adapter holds a device slot (worker/lora_slots.py); each chunk carries its
slot. An unloaded or replaced adapter's running requests finish; then its trees are dropped.

Images (a vision model: `vision`, worker/vision.py): `submit` checks a request's images and
places them (worker/image_inputs.py); its samples start the cache with the prompt's cache
tokens, so a repeated image matches its KV, and each prefill chunk over image positions carries
their embeddings, encoded lazily and kept in an encoder-output cache (`encoder_cache_bytes`).

`step()` can also be driven directly (no thread) for deterministic tests.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, cast

import torch

from cache import CacheConfig, KvEventKind, KvSnapshot, OutOfPages, OutOfSlots, SequenceCache
from cache.integrity import check_sequence_cache
from kernels.layout import cdiv
from worker import validation
from worker.bad_words import BadWords, bad_word_ids
from worker.disk_reads import DiskReads, PendingRead
from worker.disk_spill import DiskSpill
from worker.errors import EngineOverloaded, EngineStopped, InvalidRequest
from worker.image_inputs import ImageEmbedder, ImageEncoder, place
from worker.images import (
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    ImageLimits,
)
from worker.kv_copies import MIN_STREAM_BYTES
from worker.kv_persistence import BackgroundSaver, KvStore, LoadReport, StoreIdentity
from worker.kv_sizing import PoolSize, size_pool
from worker.latency_metrics import EngineLatencies
from worker.logit_shaping import LogitShaping
from worker.logprobs import prompt_logprobs, token_logprob
from worker.lora_serving import AdapterLifecycle, adapter_slots
from worker.lora_slots import AdapterState
from worker.lora_weights import LoraStacks
from worker.model import CausalLM
from worker.model_runner import Chunk, ModelRunner
from worker.peer_reads import PeerReads
from worker.penalties import Penalties
from worker.pooling import pooled
from worker.predicted_output import (
    PREDICTION_LOOKUP_MAX,
    PredictedOutput,
    PredictionCheck,
    PredictionCursor,
    predicted_output,
)
from worker.reasoning import (
    CLOSE,
    ReasoningSplit,
    may_hold_reasoning,
    prompt_opens,
    template_thinks,
)
from worker.request import (
    EMBEDDING_SAMPLING,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerateRequest,
    RequestOutput,
    TokenLogprob,
)
from worker.samples import Phase, RequestState, SampleState, TextDecoder
from worker.sampling import Sampler
from worker.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from worker.scheduler import IN_BATCH_SHARED, Scheduler, SchedulerConfig
from worker.speculation import NgramIndex, SpeculationConfig, draft_limit
from worker.stop import StopChecker
from worker.structured_output import Constraint, GrammarCompiler, GrammarRefused
from worker.thinking_tokens import ThinkingTokens
from worker.tier_costs import TierCosts
from worker.tokenizer import Tokenizer
from worker.validation import DEFAULT_MAX_PROMPT_CHARS, PromptTokenizer, RequestLimits

log = logging.getLogger(__name__)
T = TypeVar("T")
ENCODER_WAIT_S = 0.05
"""How long a step with nothing runnable but chunks waiting for the vision encoder blocks for it
before stepping again (new requests are taken between waits)."""
PROMPT_TAIL_TOKENS = 32
"""Of a prompt, what is read for an open `<think>` (the generation prompt's last tokens)."""


class TokenizerLike(PromptTokenizer, Protocol):
    """A prompt's tokenizer (encode, chat template) that also decodes what is generated."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> Sequence[int]: ...

    def incremental_decoder(self, skip_special_tokens: bool = True) -> TextDecoder: ...


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_pages: int | None = None
    """Pages of the KV pool, the null page included; None: sized from memory
    (worker/kv_sizing.py: `kv_cache_memory_bytes`, else on CUDA `gpu_memory_utilization`, else
    4096 on a CPU). The engine's `config` holds the count it got."""
    page_size: int = 16
    max_running: int = 64
    token_budget: int = 512
    max_prefill_chunk: int = 512
    max_model_len: int | None = None
    """Positions per sequence; defaults to the model's max_position_embeddings."""
    max_waiting: int = 1024
    scheduling_policy: str = "fcfs"
    """"fcfs", or "priority": requests by their `priority`, lower first, preempting running
    ones of a lower priority for room (worker/scheduler.py; vLLM's `--scheduling-policy`)."""
    in_batch_prefix_tokens: int = IN_BATCH_SHARED
    """Under fcfs, the uncached tokens (a page at least) a waiting sample must share with a
    prompt being computed to wait for it to be cached (worker/scheduler.py); 0: none waits."""
    num_speculative_tokens: int = 0
    """Speculative decoding by n-gram lookup (worker/speculation.py): the longest draft a
    decoding sample verifies in a step; 0: none (vLLM's `speculative_config`, method ngram)."""
    prompt_lookup_max: int = 4
    """The longest suffix of a sample's tokens an n-gram draft is matched by."""
    prompt_lookup_min: int = 2
    """The shortest: the n-grams indexed (an n-gram draft's `prompt_lookup_min`)."""
    num_prediction_tokens: int = 16
    """The longest draft a decoding sample verifies in a step from its request's predicted
    output (OpenAI's `prediction`: worker/predicted_output.py), with or without n-gram
    speculation; 0: predictions are ignored."""
    block_size: int = 16
    host_pages: int = 0
    """Pages of the host tier (CPU memory; pinned on CUDA hosts); 0: evicted pages are gone."""
    copy_stream: bool = True
    """On CUDA, tier copies that move at least `copy_stream_min_bytes` run on a stream of their
    own that the forward pass waits on layer by layer (worker/kv_copies.py); False: every copy on
    the compute stream (to measure against)."""
    copy_stream_min_bytes: int = MIN_STREAM_BYTES
    persist_dir: str | None = None
    """Where the cache persists (a directory per worker under it): loaded at start, saved in
    the background and on stop; None: the cache lives and dies with the process."""
    persist_max_bytes: int = 8 << 30
    """Disk the saved cache may use; the least recently used nodes are left out beyond it."""
    persist_interval_s: float = 60.0
    """Seconds between background saves while serving; 0: save only on stop."""
    persist_evicted: bool = True
    """With `persist_dir`: what eviction drops from the last tier that held it is written to
    disk as it goes (worker/disk_spill.py), not only what the saves find in the tree."""
    model_revision: str = ""
    debug_checks: bool = False
    """Run the cache's full integrity check whenever the engine goes idle."""
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    max_loras: int = 4
    """LoRA adapters resident on the device at once (slots); 0: no adapters."""
    max_lora_rank: int = 64
    """The highest adapter rank accepted (the slots' width)."""
    adapters: Sequence[tuple[str, str]] = ()
    """(name, PEFT directory) of the adapters loaded at start; also {name, path} mappings.
    A bad one fails the start with its `AdapterError`."""
    max_images: int = DEFAULT_MAX_IMAGES
    """Images one request may carry (a vision model; worker/images.py)."""
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Width x height of one image, read from its header before it is decoded."""
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """Size of one image's file."""
    encoder_cache_bytes: int = 64 << 20
    """Vision encoder outputs kept by image (device memory, least recently used out); 0: none."""
    gpu_memory_utilization: float = 0.9
    """With `num_pages` None on CUDA: the fraction of the device's memory this worker may fill
    (everything already on the device counted), the pool getting what the model, the
    activations of the heaviest step and the encoder cache leave (vLLM's rule)."""
    kv_cache_memory_bytes: int | None = None
    """With `num_pages` None: the pool's bytes, on either device (vLLM's option)."""

    def __post_init__(self) -> None:
        self.speculation  # noqa: B018 (raises ValueError naming the bad setting)
        pairs = []
        for entry in self.adapters:
            pair = (entry.get("name"), entry.get("path")) if isinstance(entry, Mapping) else entry
            name, path = pair
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise ValueError(f"adapters: {entry!r} is not a (name, path) pair")
            pairs.append((name, path))
        object.__setattr__(self, "adapters", tuple(pairs))
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError(
                f"max_loras must be >= 0 and max_lora_rank >= 1: "
                f"{self.max_loras}, {self.max_lora_rank}"
            )
        if self.num_pages is not None and self.kv_cache_memory_bytes is not None:
            raise ValueError(
                "num_pages and kv_cache_memory_bytes are both set: the pool is sized by one"
            )
        if self.kv_cache_memory_bytes is not None and (
            type(self.kv_cache_memory_bytes) is not int or self.kv_cache_memory_bytes < 1
        ):
            raise ValueError(
                f"kv_cache_memory_bytes must be an int >= 1, got {self.kv_cache_memory_bytes!r}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        for name in ("max_images", "max_image_pixels", "max_image_bytes", "encoder_cache_bytes"):
            value, least = getattr(self, name), 0 if name == "encoder_cache_bytes" else 1
            if type(value) is not int or value < least:
                raise ValueError(f"{name} must be an int >= {least}, got {value!r}")

    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.max_images, self.max_image_pixels, self.max_image_bytes)

    @property
    def speculation(self) -> SpeculationConfig:
        return SpeculationConfig(
            self.num_speculative_tokens,
            self.prompt_lookup_max,
            self.prompt_lookup_min,
            self.num_prediction_tokens,
        )


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    free_pages: int
    cached_pages: int
    private_pages: int
    evicted_pages: int
    host_total_pages: int
    host_cached_pages: int
    demoted_pages: int
    promoted_pages: int
    host_evicted_pages: int
    host_hit_tokens: int
    disk_hit_tokens: int
    """Prompt positions read back from the disk tier."""
    disk_skipped_tokens: int
    """Prompt positions found on disk and recomputed instead: that was priced faster."""
    peer_read_tokens: int
    """Prompt positions read from other workers' caches (the router's `kv_peer`)."""
    peer_read_failures: int
    """Reads from other workers that failed or brought less than asked (recomputed instead)."""
    peer_skipped_tokens: int
    """Prompt positions another worker held that were recomputed: that was priced faster."""
    disk_spilled_pages: int
    """Pages of nodes eviction dropped that were written to disk (`persist_evicted`)."""
    disk_spill_skipped_pages: int
    """Pages of dropped nodes not on disk that were not written: the write queue was full."""
    preemptions: int
    requests_finished: int
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    adapters_loaded: int = 0
    adapters_resident: int = 0
    adapter_swaps: int = 0
    adapter_swap_seconds: float = 0.0
    """Average time to copy an adapter into a slot (EWMA)."""
    adapter_swap_seconds_total: float = 0.0
    encoder_runs: int = 0
    """Images the vision encoder encoded."""
    encoder_cache_hits: int = 0
    """Images whose encoder output came from the encoder cache instead."""
    encoder_seconds: float = 0.0
    """Time spent in the vision encoder."""
    disk_bytes: int = 0
    """Bytes of KV the saved cache holds on disk (`persist_dir`)."""
    disk_bytes_bound: int = 0
    """The most it may hold: `persist_max_bytes`, lowered when the disk filled up."""
    draft_tokens: int = 0
    """Draft tokens verified (speculative decoding, `num_speculative_tokens`)."""
    accepted_draft_tokens: int = 0
    """Of those, the ones the sample drew too: each saved a step."""
    prediction_draft_tokens: int = 0
    """Of `draft_tokens`, those taken from a request's predicted output."""
    accepted_prediction_draft_tokens: int = 0
    """Of those, the ones the sample drew too (`prediction_draft_tokens` less these: the
    usage's `rejected_prediction_tokens`, summed)."""


def context_length(positions: int, config: EngineConfig, pool: PoolSize) -> int:
    """The context a request may fill: the model's `positions` (or `max_model_len`, if less),
    cut to what the KV pool can hold for one sequence, saying so. Uncut, a request with no
    max_tokens (OpenAI's default: to the end of the context) would be refused for pages its
    client was never told of."""
    wanted = min(config.max_model_len or positions, positions)
    held = (pool.pages - 1) * config.page_size  # every page but the null one
    if held < wanted:
        log.warning(
            "the context is cut from %d to %d positions: the KV pool holds %d pages of %d "
            "(engine.page_size; the pages: %s)",
            wanted, held, pool.pages - 1, config.page_size, pool.reason,
        )  # fmt: skip
    return min(wanted, held)


def check_kv_memory(model: CausalLM, config: EngineConfig, pool: PoolSize) -> None:
    """Refuse, before any allocation, KV tiers this machine's memory could never hold: CPU
    memory is committed as pages are first written, so an engine allocated past it starts
    fine and is killed by the kernel once serving fills its cache (then restarted, to be killed
    again). On CUDA the device tier's allocation fails by itself; the host tier is CPU memory.
    """
    page = model.kv_page_bytes(config.page_size)
    on_cpu = model.model.embed_tokens.weight.device.type == "cpu"
    pages = config.host_pages + (pool.pages if on_cpu else 0)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if pages * page > memory:
        keys = f"{pool.key} and engine.host_pages" if on_cpu else "engine.host_pages"
        raise ValueError(
            f"{keys}: {pages} pages of {page:,} bytes need {pages * page / 1e9:.1f} GB of KV, "
            f"more than this machine's {memory / 1e9:.1f} GB of memory"
        )


def sized(
    model: CausalLM, config: EngineConfig, lora: LoraStacks | None, vision: bool, source: str
) -> tuple[EngineConfig, PoolSize]:
    """`config` with the KV pool's page count filled in, and how it was reached; refused when
    the pool cannot be held (`check_kv_memory`)."""
    reserved = config.encoder_cache_bytes if vision else 0
    pool = size_pool(model, config, lora, reserved)
    check_kv_memory(model, config, pool)
    log.info(
        "%s: KV pool of %d pages of %d positions, %.2f GB (%s)",
        source, pool.pages, config.page_size, pool.bytes / 1e9, pool.reason,
    )  # fmt: skip
    return dataclasses.replace(config, num_pages=pool.pages, kv_cache_memory_bytes=None), pool


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: TokenizerLike | None,
        config: EngineConfig,
        source: str = "worker",
        vision: ImageEncoder | None = None,
    ) -> None:
        """`vision`: the model's vision encoder (`LoadedModel.vision`); None: a text model,
        whose requests with images are refused."""
        rank = config.max_lora_rank
        self.adapters, stacks = adapter_slots(model, config.max_loras, rank)
        """The adapters loaded and their device slots (changed on the engine thread only)."""
        # the KV pool's pages, and how their count was reached (worker/kv_sizing.py)
        config, self.pool = sized(model, config, stacks, vision is not None, source)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = context_length(model.config.max_position_embeddings, config, self.pool)
        self.vocab_size = model.config.vocab_size
        self.vision = vision
        self.eos_token_ids = frozenset(
            tokenizer.eos_token_ids if tokenizer is not None else model.config.eos_token_ids
        )
        self.limits = RequestLimits.of(
            self.vocab_size,
            self.max_model_len,
            config,
            vision.spec if vision is not None else None,
            config.image_limits(),
            self.eos_token_ids,
            model.config.hidden_size,
        )
        self._wake = threading.Event()
        self.embedder = (
            ImageEmbedder(vision, config.encoder_cache_bytes, self._wake.set)
            if vision is not None
            else None
        )
        self.grammars = GrammarCompiler(
            tokenizer if isinstance(tokenizer, Tokenizer) else None,
            self.vocab_size,
            sorted(self.eos_token_ids),
        )
        self.cache = SequenceCache(
            CacheConfig(
                self.pool.pages,
                config.page_size,
                config.max_running,
                config.block_size,
                config.model_revision,
                config.host_pages,
            ),
            source,
        )
        self.lora = AdapterLifecycle(self.adapters, self.cache, model.config, rank)
        for name, path in config.adapters:
            self.lora.install(self.lora.read(name, path))
        self.runner = ModelRunner(
            model,
            self.pool.pages,
            config.page_size,
            config.host_pages,
            stacks,
            config.copy_stream,
            config.copy_stream_min_bytes,
        )
        self.scheduler = Scheduler(
            self.cache,
            SchedulerConfig(
                config.token_budget,
                config.max_prefill_chunk,
                config.max_running,
                config.scheduling_policy,
                config.in_batch_prefix_tokens,
            ),
            self.runner.copy_pages,
            self._before_admission,
            self.adapters,
        )
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._requests: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._active_ids: dict[str, int] = {}  # submitted, not finished -> its priority
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._finished = self._prompt_tokens = self._cached_tokens = self._generated = 0
        self._drafted = self._accepted_drafts = 0  # draft tokens verified, and drawn too
        self._predicted_drafts = self._predicted_drafts_drawn = 0  # of those, a prediction's
        self.latencies = EngineLatencies()  # where requests' time went, for the metrics
        self.store: KvStore | None = None
        # what recomputing a position costs against reading it back from disk (learned)
        self.tier_costs = TierCosts()
        self.disk_reads: DiskReads | None = None
        self.peer_reads = PeerReads(StoreIdentity.of(self), self.tier_costs, self._wake.set)
        self._disk_blocks: frozenset[int] = frozenset()
        """The routing blocks the KV events have said are on disk (`saved` / `unsaved`)."""
        self.saver: BackgroundSaver | None = None
        self.spill: DiskSpill | None = None
        self.loaded = LoadReport(0, 0, 0)
        if config.persist_dir is not None:
            self._open_store(config.persist_dir, source)
        self.observe_logits: Callable[[str, int, int, torch.Tensor], None] | None = None
        """Called on the engine thread with (request id, sample index, position, logits) before
        each token is drawn (tests and logprobs)."""

    def _open_store(self, persist_dir: str | Path, source: str) -> None:
        """The saved cache in `persist_dir/source`: loaded now, read back, saved while serving."""
        config = self.config
        directory = Path(persist_dir) / source
        try:  # a directory we cannot write is a config error now, not a lost save later
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"persist_dir {persist_dir!r}: {err}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ValueError(f"persist_dir {persist_dir!r}: {directory} is not writable")
        self.store = KvStore(directory, config.persist_max_bytes)
        self.loaded = self.store.load(self)
        self.publish_disk_blocks()
        self.disk_reads = DiskReads(self.store, self.tier_costs, self._wake.set)
        if config.persist_evicted:
            self.spill = DiskSpill(self, self.store)
            self.cache.tree.on_drop = self.spill.on_drop
            self.runner.spill = self.spill.take
            self.runner.spill_lost = self.spill.lose
        if config.persist_interval_s > 0 or self.spill is not None:
            interval = config.persist_interval_s or math.inf
            self.saver = BackgroundSaver(self, self.store, interval, self.spill)

    # -- any thread ----------------------------------------------------------------------------
    def submit(self, request: GenerateRequest, sink: Callable[[RequestOutput], None]) -> int:
        """Validate and queue a request; returns its prompt length. Raises `InvalidRequest`,
        `EngineOverloaded` (never for a resumed sample) or `EngineStopped` without queueing
        anything."""
        began = time.perf_counter()
        if self._stopping.is_set():
            raise EngineStopped("the engine is stopping")
        with self._lock:  # first too: a refusal for load costs none of the work below
            self._check_admission(request)
        request, adapter = self.lora.bind(request)
        checked = validation.request_images(request, self.limits)
        prompt = validation.prompt_ids(request, self.tokenizer, self.limits, checked)
        request = validation.with_fim_ends(request, self.tokenizer)
        self._validate(request, prompt)
        if request.pooling is not None:  # checked: nothing of generation's was asked for
            request = dataclasses.replace(request, sampling=EMBEDDING_SAMPLING)
        structured = request.sampling.structured
        grammar = self.grammars.compile(structured) if structured is not None else None
        bad_words = bad_word_ids(request.sampling.bad_words, self.tokenizer, self.vocab_size)
        self._refuse_bans_of_all_allowed(request.sampling, bad_words)
        predicted = self._predicted(request)
        images = None
        if checked:
            assert self.limits.image_spec is not None
            original = len(prompt) - request.generated_before
            ns = request.namespace
            salt = ns.tenant if ns.salt is None else (ns.tenant, ns.salt)
            images = place(prompt, original, checked, self.limits.image_spec, salt)
        inside = self._reasoning_opened(request, prompt[: len(prompt) - request.generated_before])
        state = RequestState(request, prompt, sink, adapter, images, grammar, bad_words, inside)
        state.submitted = began
        state.predicted = predicted
        if self.speculation.enabled and request.sampling.max_tokens > 1 and not request.pooling:
            # its prompt's n-grams, indexed here, not on the engine thread (none to verify
            # for one token, or for an embedding)
            spec = self.speculation
            state.ngrams = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
            state.ngrams.extend(prompt, len(prompt))
        waits = bool(inside) and request.sampling.separate_reasoning  # the answer is apart
        state.grammar_waits = waits and not may_hold_reasoning(structured)
        with self._lock:  # the id taken last: a submit that raised before it holds none
            self._check_admission(request)
            self._active_ids[request.request_id] = request.priority
        self._inbox.put(("add", state))
        self._wake.set()
        return len(prompt)

    def _check_admission(self, request: GenerateRequest) -> None:
        """Refuse a request whose id runs, or one the engine is too busy for; under the lock."""
        if request.request_id in self._active_ids:
            raise InvalidRequest("request_id", f"{request.request_id!r} is already running")
        # a resumed sample was admitted by the cluster already (its worker died): refusing it
        # for load would end a stream its client has half received
        if request.resume is None and (why := self._overloaded(request.priority)):
            raise EngineOverloaded(why)

    def _refuse_bans_of_all_allowed(
        self, sampling: SamplingParams, bad_words: Sequence[Sequence[int]]
    ) -> None:
        """Refuse allowed tokens that one-token bad words ban and min_tokens holds back the rest
        of (held alone: `validation.validate`): the sample could draw nothing, its first token
        failing after its prefill."""
        allowed = sampling.allowed_token_ids
        banned = {s[0] for s in bad_words if len(s) == 1}
        held = sampling.held_tokens(self.limits.end_token_ids)
        if not allowed or not set(allowed) <= banned | held:
            return
        holds = held.intersection(allowed)
        rest = f", and min_tokens {sampling.min_tokens} holds back the rest" if holds else ""
        raise InvalidRequest("bad_words", f"bans every allowed token{rest}: nothing could be drawn")

    def _overloaded(self, priority: int) -> str | None:
        """Why the engine turns a new request of `priority` away (None: it takes it): see
        `validation.crowded`. Under fcfs every priority is 0, and a count does."""
        ids = self._active_ids
        held = Counter(ids.values()).items() if self.scheduler.by_priority else [(0, len(ids))]
        most = self.config.max_waiting + self.config.max_running
        return validation.crowded(held, priority, most, "the engine takes at most {}")

    def load_adapter(self, name: str, path: str) -> AdapterState:
        """Read the PEFT adapter at `path` (in the caller's thread: file reads never stall the
        engine) and serve it as `name`, replacing an adapter of that name. Raises
        `AdapterError` naming the file and tensor at fault, changing nothing."""
        adapter = self.lora.read(name, path)
        return self._on_engine_thread(lambda: self.lora.install(adapter))

    def unload_adapter(self, name: str) -> int:
        """Stop serving `name`: new requests for it are refused, its running ones finish, then
        its trees (every tenant's) are dropped from the cache. Returns the pages dropped now (0
        while requests of it still run). KeyError if `name` is not loaded."""
        return self._on_engine_thread(lambda: self.lora.unload(name))

    def adapter_states(self) -> list[AdapterState]:
        """Every adapter loaded, with its slot (engine thread: use `call`)."""
        return self.adapters.info()

    def _on_engine_thread(self, function: Callable[[], T]) -> T:
        if self._thread is None or threading.current_thread() is self._thread:
            return function()
        if self._stopping.is_set():
            raise EngineStopped("the engine is stopping")
        return self.call(function).result()

    def call(self, function: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `function` on the engine thread between steps (the cache is only safe there)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._inbox.put(("call", (function, future)))
        self._wake.set()
        return future

    @property
    def active_requests(self) -> frozenset[str]:
        """Ids of the requests the engine thread holds (engine thread: use `call`)."""
        return frozenset(self._requests)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or waiting but not yet computed (engine thread: use `call`)."""
        pending = sum(s.pending for s in self.scheduler.waiting)
        return pending + sum(s.pending for s in self.scheduler.running if not s.prefilled)

    def abort(self, request_id: str) -> None:
        """End a request at the next step boundary (its samples finish with reason `abort`)."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def generate(self, request: GenerateRequest) -> Iterator[RequestOutput]:
        """Submit and stream a request's outputs (needs the engine thread: `start()`)."""
        outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.submit(request, outputs.put)
        remaining = request.sampling.n
        while remaining:
            output = outputs.get()
            remaining -= output.finished
            yield output

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine is already running")
        self._thread = threading.Thread(target=self._loop, name="radixmesh-engine", daemon=True)
        self._thread.start()
        if self.saver is not None:
            self.saver.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight, stop the thread, and save the cache (with `persist_dir`)."""
        if self.saver is not None:
            self.saver.stop()
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error(
                    "the engine thread did not stop in %.0f s; the cache is not saved", timeout
                )
                return
            self._thread = None
        if self.embedder is not None:
            self.embedder.close()
        if self.disk_reads is not None:
            self.disk_reads.close()
        self.peer_reads.close()
        if self.store is not None:
            began = time.perf_counter()
            try:
                self.runner.copy_pages(self.cache.take_tier_copies())  # spills read their pages
                self._write_spills()
                saved = self.store.save(self)
                self.publish_disk_blocks()
            except OSError as err:  # a full or vanished disk must not fail the drain
                log.error("could not save the KV cache to %s: %s", self.store.directory, err)
                return
            log.info("saved %d cached nodes in %.2f s", saved, time.perf_counter() - began)

    def _write_spills(self) -> None:
        """Write what eviction dropped and the saver had not written (the drain); a failure is
        logged and the save goes on without it."""
        if self.spill is None:
            return
        try:
            self.spill.write_queued()
        except OSError as err:
            log.error("could not write the KV eviction dropped to disk: %s", err)

    def publish_disk_blocks(self) -> None:
        """Publish what the last save or load changed in the blocks on disk, as `saved` and
        `unsaved` events (engine thread, or with the engine stopped)."""
        if self.store is None:
            return
        now, before = self.store.disk_blocks, self._disk_blocks
        self._disk_blocks = now
        self.cache.events.publish(KvEventKind.UNSAVED, before - now)
        self.cache.events.publish(KvEventKind.SAVED, now - before)

    def kv_snapshot(self) -> KvSnapshot:
        """The cache's blocks by tier, the blocks on disk among them, as of the last event
        (engine thread)."""
        snapshot = self.cache.tree.snapshot()
        return dataclasses.replace(snapshot, disk_block_hashes=self._disk_blocks)

    def stats(self) -> EngineStats:
        pool, tree, host = self.cache.pool, self.cache.tree, self.cache.host_pool
        adapters = self.adapters
        encoder = self.embedder.stats if self.embedder is not None else None
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            free_pages=pool.num_free,
            cached_pages=pool.num_cached,
            private_pages=pool.num_private,
            evicted_pages=tree.evicted_pages,
            host_total_pages=host.usable_pages if host is not None else 0,
            host_cached_pages=tree.host_cached_pages,
            demoted_pages=tree.demoted_pages,
            promoted_pages=tree.promoted_pages,
            host_evicted_pages=tree.host_evicted_pages,
            host_hit_tokens=self.cache.stats.host_positions,
            disk_hit_tokens=self.store.disk_hit_tokens if self.store is not None else 0,
            disk_skipped_tokens=self.tier_costs.skipped_positions,
            peer_read_tokens=self.peer_reads.read_tokens,
            peer_read_failures=self.peer_reads.failures,
            peer_skipped_tokens=self.tier_costs.peer.skipped_positions,
            disk_spilled_pages=self.spill.spilled_pages if self.spill is not None else 0,
            disk_spill_skipped_pages=self.spill.skipped_pages if self.spill is not None else 0,
            preemptions=self.scheduler.preemptions,
            requests_finished=self._finished,
            prompt_tokens=self._prompt_tokens,
            cached_prompt_tokens=self._cached_tokens,
            generated_tokens=self._generated,
            adapters_loaded=len(adapters.adapters),
            adapters_resident=len(adapters.resident()),
            adapter_swaps=adapters.swaps,
            adapter_swap_seconds=adapters.swap_seconds,
            adapter_swap_seconds_total=adapters.swap_seconds_total,
            encoder_runs=encoder.runs if encoder is not None else 0,
            encoder_cache_hits=encoder.cache_hits if encoder is not None else 0,
            encoder_seconds=encoder.seconds if encoder is not None else 0.0,
            disk_bytes=self.store.held_bytes() if self.store is not None else 0,
            disk_bytes_bound=self.store.max_bytes if self.store is not None else 0,
            draft_tokens=self._drafted,
            accepted_draft_tokens=self._accepted_drafts,
            prediction_draft_tokens=self._predicted_drafts,
            accepted_prediction_draft_tokens=self._predicted_drafts_drawn,
        )

    # -- validation (caller's thread) ----------------------------------------------------------
    def _predicted(self, request: GenerateRequest) -> PredictedOutput | None:
        """The request's predicted output, tokenized and indexed (None: none, or nothing to
        draft from it: one token asked for, an embedding, or `num_prediction_tokens` 0)."""
        spec = self.speculation
        if not spec.num_prediction_tokens or request.pooling or request.sampling.max_tokens < 2:
            return None
        return predicted_output(
            request.sampling.prediction,
            self.tokenizer,
            self.vocab_size,
            self.max_model_len,
            spec.prompt_lookup_min,
            max(spec.prompt_lookup_max, PREDICTION_LOOKUP_MAX),
        )

    def _validate(self, request: GenerateRequest, prompt: list[int]) -> None:
        validation.validate(request, prompt, self.limits)
        positions = len(prompt) - request.generated_before
        if request.pooling is None:
            positions += request.sampling.max_tokens
        pages = cdiv(positions, self.config.page_size)
        if pages > self.cache.pool.usable_pages:
            field, what = (
                ("max_tokens", "prompt and max_tokens")
                if request.pooling is None
                else ("input", "the input")
            )
            raise InvalidRequest(
                field, f"{what} need {pages} pages; the pool holds {self.cache.pool.usable_pages}"
            )

    # -- the engine thread ---------------------------------------------------------------------
    def _before_admission(self, sample: SampleState) -> bool | None:
        """At admission: the KV another worker holds (`_from_peer`), then the saved KV
        (`_from_disk`). True: start the sample; False: its read is in flight (it waits; the
        samples behind it may pass); None: no read may begin now (nothing behind it passes)."""
        ready = self._from_peer(sample)
        if ready and self.disk_reads is not None:
            return self._from_disk(sample)
        return ready

    def _from_peer(self, sample: SampleState) -> bool | None:
        """Begin reading the KV the request's `kv_peer` holds of its prompt past both tiers, if
        reading pays (worker/peer_reads.py), and once it is in put it into the cache. A failed
        read is logged and its positions recomputed."""
        request, reads = sample.request, self.peer_reads
        peer = request.request.kv_peer
        if peer is None or request.peer_checked:
            return True
        pending = request.peer_read
        try:
            if pending is None:
                if request.images is not None or request.scoring_prompt:
                    request.peer_checked = True
                    return True
                disk = self.disk_reads.pending if self.disk_reads is not None else 0
                if len(self.scheduler.running) + reads.pending + disk >= self.config.max_running:
                    request.peer_checked = True  # each read holds its tensors until its
                    return True  # request starts: past the bound, recompute
                keys, namespace = sample.cache_keys(), request.request.namespace
                pending = reads.begin(self, keys, namespace, sample.tokens, peer)
                if pending is None:
                    request.peer_checked = True
                    return True
                request.peer_read = pending
            if not pending.done():
                return False
            request.peer_checked, request.peer_read = True, None
            if pending.namespace == request.request.namespace:  # not an adapter replaced since
                request.peer_cached_tokens = reads.finish(self, pending)
            reads.release(pending)
        except Exception:  # a peer's cache must never fail a request
            log.exception("reading KV from a peer for %s failed", request.request.request_id)
            if request.peer_read is not None:
                reads.release(request.peer_read)
            request.peer_checked, request.peer_read = True, None
        return True

    def _from_disk(self, sample: SampleState) -> bool | None:
        """At admission: begin reading the saved KV that continues the sample's prompt past
        both tiers, if reading pays (worker/disk_reads.py), and once it is read put it into
        the cache. True: start the sample; False while its read is in flight (it waits; the
        samples behind it may pass); None: no read may begin now (reads begun and samples
        running fill `max_running`: it waits, and nothing behind it passes). A failed read is
        logged and its positions recomputed."""
        assert self.disk_reads is not None
        reads, pending = self.disk_reads, sample.disk_read
        try:
            if pending is not None:
                return self._finish_disk_read(sample, pending)
            if sample.disk_checked or sample.request.scoring_prompt:  # the latter reuses nothing
                return True
            keys, namespace = sample.cache_keys(), sample.request.request.namespace
            full = len(self.scheduler.running) + reads.pending >= self.config.max_running
            if full and self.store is not None and self.store.wanted(self, keys, namespace)[0]:
                return None  # each read holds its tensors until its sample starts
            sample.disk_checked = True
            sample.disk_read = reads.begin(self, keys, namespace)
            return sample.disk_read is None
        except Exception:  # the cache on disk must never fail a request
            log.exception("reading saved KV for %s failed", sample.request.request.request_id)
            if sample.disk_read is not None:
                reads.release(sample.disk_read)
                sample.disk_read = None
            return True

    def _finish_disk_read(self, sample: SampleState, pending: PendingRead) -> bool:
        """Put what `pending` read into the cache once it is done (False until then). When the
        tiers lost part of the prompt during the read, read what is missing, once."""
        assert self.disk_reads is not None
        if not pending.done():
            return False
        reads, namespace = self.disk_reads, sample.request.request.namespace
        sample.disk_read = None
        if pending.namespace != namespace:  # its adapter was replaced meanwhile
            reads.release(pending)
            return True
        added, lost = reads.finish(self, pending)
        if not sample.request.admitted:
            sample.request.disk_cached_tokens = max(sample.request.disk_cached_tokens, added)
        if lost and pending.tries == 1:
            sample.disk_read = reads.begin(self, pending.keys, namespace, tries=2)
        return sample.disk_read is None

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                busy = self.step()
            except Exception:  # a bug: fail loudly in the log, keep the thread alive
                log.exception("engine step failed")
                busy = False
            if not busy:
                self._wake.wait(0.05)
                self._wake.clear()
            else:
                # Hand the GIL to whoever streams this step's outputs (gRPC loop, client
                # threads) before computing the next step: on a small model a step is mostly
                # Python and would otherwise hold it (measured: +5 -> +3 ms TTFT through gRPC).
                time.sleep(0)
        self._drain_inbox()
        for state in list(self._requests.values()):
            self._abort(state, FINISH_ABORT)

    def step(self) -> bool:
        """Run one step; False when there was nothing to do."""
        self._drain_inbox()
        awaiting = self._awaiting_images()
        plan = self.scheduler.schedule(awaiting)
        if self.scheduler.refused:
            self._end_refused()
        if not plan:
            return self._nothing_planned(awaiting)
        if self.speculation.enabled or any(s.request.predicted is not None for s, _ in plan):
            self._draft(plan)
        if any(sample.lora_slot >= 0 for sample, _ in plan):
            plan.sort(key=lambda item: item[0].lora_slot)  # one adapter segment per slot
        plan, chunks = self._chunks(plan)
        if not plan:
            return True
        try:
            # pages demoted while growing: read before this pass may write them again
            self.runner.copy_pages(self.cache.take_tier_copies())
            began = time.perf_counter()
            hidden = None
            if any(sample.request.request.pooling is not None for sample, _ in plan):
                logits, hidden = self.runner.run_pooled(chunks)
            else:
                logits = self.runner.run(chunks)
        except Exception as err:
            log.exception("forward pass failed; failing the %d samples of the step", len(plan))
            for sample, _ in plan:
                self._abort(sample.request, FINISH_ERROR, f"forward pass failed: {err}")
            return True
        self._sample_all(plan, chunks, logits, hidden)
        # after sampling, which waits for the device: the pass's whole time
        computed, seconds = sum(take for _, take in plan), time.perf_counter() - began
        self.tier_costs.observe_pass(computed, seconds)
        self.latencies.step(computed, seconds)
        return True

    def _sample_all(
        self,
        plan: list[tuple[SampleState, int]],
        chunks: list[Chunk],
        logits: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> None:
        """Account each sample's computed positions; score the prompt of each whose chunk has
        a row per token; draw the next token of each that has a row of logits (a chunk that
        ends its prompt, or a decode), or pool an embedding request's from `hidden`, the
        final hidden states the logits were read from, row for row."""
        at, computed = 0, []
        for (sample, take), chunk in zip(plan, chunks, strict=True):
            sample.computed += take
            computed.append((sample, chunk, at))
            at += chunk.rows
        if any(chunk.drafted for chunk in chunks):  # drafted samples first: the pages past
            computed.sort(key=lambda item: not item[1].drafted)  # what they keep go back before
            # a fork takes any
        for sample, chunk, at in computed:
            if sample.phase is not Phase.RUNNING or not chunk.rows:
                continue
            last = hidden[at + chunk.rows - 1] if hidden is not None else None
            try:
                self._sample_chunk(sample, chunk, logits[at : at + chunk.rows], last)
            except Exception as err:  # this request's outputs cannot be made: end it alone
                log.exception("sampling or decoding for %s failed", sample.request.request_id)
                self._abort(sample.request, FINISH_ERROR, f"{type(err).__name__}: {err}")

    def _sample_chunk(
        self, sample: SampleState, chunk: Chunk, rows: torch.Tensor, last: torch.Tensor | None
    ) -> None:
        """What one chunk's logits `rows` (and its last row's hidden state) give its sample."""
        if chunk.drafted:
            self._verify(sample, chunk, rows)
            return
        if chunk.every_row:
            self._score_prompt(sample.request, chunk, rows)
        if not chunk.sample:
            return
        if sample.request.request.pooling is None:
            self._sampled(sample, rows[-1])
        else:
            assert last is not None, "a step with an embedding request pools its hidden states"
            self._pooled(sample, last)

    @staticmethod
    def _score_prompt(state: RequestState, chunk: Chunk, rows: torch.Tensor) -> None:
        """The logprobs of the prompt tokens this chunk's rows predict (row i, position
        start + i, predicts token start + i + 1), those not scored before (a preempted sample
        computes its prompt again)."""
        top = state.request.sampling.prompt_logprobs
        assert top is not None
        lo = len(state.prompt_scores) - chunk.start  # the row predicting the next unscored one
        hi = min(len(chunk.token_ids), len(state.prompt_ids) - 1 - chunk.start)
        assert lo >= 0, "a scored prompt is computed from its first position"
        if hi > lo:
            targets = state.prompt_ids[chunk.start + lo + 1 : chunk.start + hi + 1]
            state.prompt_scores += prompt_logprobs(rows[lo:hi], targets, top)

    def _nothing_planned(self, awaiting: set[SampleState]) -> bool:
        """No sample can run this step. When only the image encoder or a disk or peer read has
        work, wait for it a while (instead of spinning); False when there is no work."""
        if awaiting:
            self._wait_for_images(awaiting)
            return True
        if self.peer_reads.pending or (self.disk_reads is not None and self.disk_reads.pending):
            # every read that ends sets _wake (so does a new request): no spinning meanwhile
            self._wake.wait(ENCODER_WAIT_S)
            self._wake.clear()
            return True
        if self.config.debug_checks and not self.scheduler.has_work():
            check_sequence_cache(self.cache)
        return self.scheduler.has_work()

    def _chunks(
        self, plan: list[tuple[SampleState, int]]
    ) -> tuple[list[tuple[SampleState, int]], list[Chunk]]:
        """The step's chunks. A sample whose images are still being encoded (on the encoder's
        thread: worker/image_inputs.py) sits this step out; when no sample can run, the step
        waits up to ENCODER_WAIT_S for the encoder first. A request whose images cannot be
        encoded ends here, alone."""
        runnable = [self._images_ready(sample, take) for sample, take in plan]
        waiting = [s for (s, _), ready in zip(plan, runnable, strict=True) if ready is False]
        if waiting and not any(runnable):
            self._wait_for_images(waiting)
            runnable = [
                ready or (ready is False and self._images_ready(*item))
                for item, ready in zip(plan, runnable, strict=True)
            ]
        kept = [
            item
            for item, ready in zip(plan, runnable, strict=True)
            if ready and item[0].phase is Phase.RUNNING
        ]
        return kept, [self._chunk(sample, take) for sample, take in kept]

    def _wait_for_images(self, samples: Iterable[SampleState]) -> None:
        """Block until one of `samples`' encoder runs ends, at most ENCODER_WAIT_S."""
        assert self.embedder is not None
        held = [images for s in samples if (images := s.request.images) is not None]
        self.embedder.wait(held, ENCODER_WAIT_S)

    def _awaiting_images(self) -> set[SampleState]:
        """Running samples whose next chunk covers images still being encoded (their runs
        started): the scheduler leaves them out, so they take no budget from the others. A
        request whose images cannot be encoded ends here."""
        awaiting: set[SampleState] = set()
        if self.embedder is None:
            return awaiting
        chunk = self.config.max_prefill_chunk
        for sample in list(self.scheduler.running):
            if self._images_ready(sample, min(sample.pending, chunk)) is False:
                awaiting.add(sample)
        return awaiting

    def _images_ready(self, sample: SampleState, take: int) -> bool | None:
        """Whether the images the sample's next chunk covers are encoded (True without any);
        None when encoding them failed, which ends the request."""
        images = sample.request.images
        if images is None or sample.computed >= images.end:
            return True
        assert self.embedder is not None
        try:
            return self.embedder.ready(images, sample.computed, sample.computed + take)
        except Exception as err:
            log.exception("encoding the images of %s failed", sample.request.request_id)
            self._abort(sample.request, FINISH_ERROR, f"image encoder failed: {err}")
            return None

    def _chunk(self, sample: SampleState, take: int) -> Chunk:
        assert sample.seq is not None
        start = sample.computed
        tokens = sample.tokens[start : start + take]
        drafted = take - len(tokens)  # `_draft` gave it more than its pending token
        if drafted:
            tokens.extend(sample.draft[:drafted])
        pages = self.cache.table.row(sample.seq.slot)
        offsets: list[int] = []
        embeds = None
        images = sample.request.images
        if images is not None and start < images.end:
            assert self.embedder is not None
            offsets, embeds = self.embedder.chunk_embeds(images, start, start + take)
        return Chunk(
            tokens,
            start,
            pages,
            sample=start + take >= len(sample.tokens),
            every_row=sample.request.scoring_prompt,
            drafted=drafted,
            lora_slot=sample.lora_slot,
            embed_offsets=offsets,
            embeds=embeds,
        )

    def _draft(self, plan: list[tuple[SampleState, int]]) -> None:
        """Give the plan's decoding samples a draft each to verify with their pending token
        (`_proposal`), within the budget the plan leaves (and a prefill chunk's length) and
        the free pages: a draft is cut to what they hold, and evicts nothing."""
        room = self.config.token_budget - sum(take for _, take in plan)
        longest = self.config.max_prefill_chunk - 1
        for i, (sample, take) in enumerate(plan):
            if room <= 0:
                return
            if take != 1 or sample.pending != 1 or not sample.prefilled:
                continue
            assert sample.seq is not None
            mapped = len(self.cache.table.row(sample.seq.slot)) + self.cache.pool.num_free
            fits = mapped * self.config.page_size - sample.computed - 1  # with no eviction
            draft = self._proposal(sample, min(room, longest, fits))
            if not draft:
                continue
            self.cache.grow(sample.seq, sample.computed + 1 + len(draft))
            sample.draft = draft
            plan[i] = (sample, 1 + len(draft))
            room -= len(draft)

    def _proposal(self, sample: SampleState, limit: int) -> list[int]:
        """A decoding sample's draft of at most `limit` tokens: what its request's predicted
        output says comes next (worker/predicted_output.py), else an n-gram lookup's
        (worker/speculation.py); `sample.draft_predicted` says which."""
        sampling, spec = sample.request.request.sampling, self.speculation
        context, generated = self.max_model_len - len(sample.tokens), sample.generated
        sample.draft_predicted = False
        if sample.prediction is not None:  # made at its first token (`_follow_prediction`)
            most = draft_limit(spec.num_prediction_tokens, generated, sampling.max_tokens, context)
            draft = sample.prediction.propose(min(limit, most))
            if draft:
                sample.draft_predicted = True
                return draft
        if not spec.enabled:
            return []
        most = draft_limit(spec.num_speculative_tokens, generated, sampling.max_tokens, context)
        if min(limit, most) <= 0:
            return []
        if sample.ngrams is None:  # the prompt's index: sample 0's own when it is alone
            prompt = sample.request.ngrams
            assert prompt is not None
            sample.ngrams = prompt if sampling.n == 1 else prompt.copy()
        return sample.ngrams.propose(sample.tokens, min(limit, most))

    def _verify(self, sample: SampleState, chunk: Chunk, rows: torch.Tensor) -> None:
        """Draw a drafted sample's tokens from its rows in order, while each equals the draft
        token at its place; its computed positions end after the last draft token kept, and
        the pages past its next position go back to the pool."""
        draft = chunk.token_ids[1:]
        sample.computed = chunk.start + 1
        self._drafted += len(draft)
        predicted = sample.draft_predicted
        if predicted:  # `_accept` counts its tokens for the sample's usage as they are drawn
            self._predicted_drafts += len(draft)
            sample.checking = PredictionCheck(draft, len(sample.tokens))
        try:
            for i, row in enumerate(rows):
                token = self._draw(sample, row)
                if token is None:
                    return
                accepted = i < len(draft) and token == draft[i]
                self._accepted_drafts += accepted
                self._predicted_drafts_drawn += accepted and predicted
                if not accepted or sample.phase is not Phase.RUNNING:
                    break
                sample.computed += 1  # the draft token's KV, written this step, is the sample's
        finally:
            sample.checking = None
        if sample.seq is not None:  # still running: as many pages as decoding would hold
            self.cache.trim(sample.seq, sample.computed + 1)

    def _sampled(self, sample: SampleState, logits: torch.Tensor) -> None:
        if not sample.prefilled:
            self._prefilled(sample)
        siblings = self._fork(sample) if not sample.request.forked else []
        for each in (sample, *siblings):
            if self._draw(each, logits) is None:
                return

    def _prefilled(self, sample: SampleState) -> None:
        """The sample's prompt is computed: into the cache with it."""
        assert sample.seq is not None
        self.cache.commit(sample.seq, sample.computed)
        sample.prefilled = True
        if sample.request.images is not None:  # its image positions are all computed
            sample.request.images.encoded.clear()

    def _pooled(self, sample: SampleState, hidden: torch.Tensor) -> None:
        """An embedding request's end, at its prompt's end: its one output is the embedding
        pooled from the last token's final hidden state (worker/pooling.py); its prompt's KV
        stays in the cache as any finished prompt's does."""
        self._prefilled(sample)
        params = sample.request.request.pooling
        assert params is not None
        embedding = pooled(hidden, params)
        self._finish_sample(sample, FINISH_STOP)
        self._emit(sample, (), "", FINISH_STOP, embedding=embedding)

    def _draw(self, sample: SampleState, logits: torch.Tensor) -> int | None:
        """Draw the sample's next token from a logits row and accept it; None when a
        structured output's grammar allowed nothing (its request is then ended)."""
        position = len(sample.tokens)
        if self.observe_logits is not None:
            self.observe_logits(sample.request.request_id, sample.index, position, logits)
        try:
            token = sample.sampler(logits, position)
        except GrammarRefused as err:
            self._abort(sample.request, FINISH_ERROR, f"structured output: {err}")
            return None
        top = sample.request.request.sampling.logprobs
        logprobs = () if top is None else (token_logprob(logits, token, top),)
        self._accept(sample, token, logprobs)
        return token

    def _fork(self, parent: SampleState) -> list[SampleState]:
        """At the end of sample 0's prompt, the other n - 1 samples start from its pages."""
        request = parent.request
        request.forked = True
        born = []
        for sibling in request.samples[1:]:
            sibling.tokens = list(parent.tokens)
            if len(self.scheduler.running) < self.config.max_running:
                try:
                    assert parent.seq is not None
                    sibling.seq = self.cache.fork(parent.seq)
                except (OutOfPages, OutOfSlots):
                    sibling.seq = None
            if sibling.seq is None:  # no room now: it prefills later, mostly from the cache
                born.append(sibling)
                continue
            self.runner.copy_pages(self.cache.take_page_copies(sibling.seq))
            self.scheduler.hold_slot(sibling, parent.lora_slot)
            sibling.computed, sibling.prefilled = parent.computed, True
            sibling.phase = Phase.RUNNING
            self.scheduler.add_running(sibling)
            born.append(sibling)
        return born

    def _accept(self, sample: SampleState, token: int, logprobs: tuple[TokenLogprob, ...]) -> None:
        """Append a sampled token; stream it (with its logprobs, if asked); finish the sample
        if it stops here."""
        sampling = sample.request.request.sampling
        sample.tokens.append(token)
        sample.generated += 1
        self._generated += 1
        if sample.seq is not None:
            self.cache.append(sample.seq, [token])
        text, reason = "", None
        if (
            (token in self.eos_token_ids and not sampling.ignore_eos)
            or token in sample.request.stop_token_ids
            or sample.sampler.complete
        ):
            reason = FINISH_STOP
            counted = int(sample.thinking is not None and sample.thinking.split.reasoning)
            if sampling.include_stop_str_in_output and sample.decoder is not None:
                # vLLM writes the stop token's text then (a special token's only when
                # skip_special_tokens is false)
                text, _ = sample.stop.feed(sample.decoder.step(token), armed=False)
        else:
            delta = sample.decoder.step(token) if sample.decoder is not None else ""
            counted = sample.thinking.step(token, delta) if sample.thinking is not None else 0
            text, hit = sample.stop.feed(delta, armed=sample.generated > sampling.min_tokens)
            reason = FINISH_STOP if hit else None
        if reason is None and (
            sample.generated >= sampling.max_tokens or len(sample.tokens) >= self.max_model_len
        ):
            reason = FINISH_LENGTH
        if reason is not None and not sample.stop.stopped:
            tail = sample.decoder.finish() if sample.decoder is not None else ""
            more, _ = sample.stop.feed(tail)
            text += more + sample.stop.flush()
        thought = ""
        if sample.reasoning is not None:  # a thinking model's reasoning, told from its answer
            thought, text = sample.reasoning.feed(text)
            if reason is not None:
                more_thought, more_text = sample.reasoning.flush()
                thought, text = thought + more_thought, text + more_text
        if sample.seq is None and reason is None:  # a sibling with no room yet: queue it
            self.scheduler.enqueue(sample)
        if reason is not None:  # released before the client hears it ended (see _emit)
            self._finish_sample(sample, reason)
        predicted = (0, 0)
        if sample.request.predicted is not None:
            predicted = self._follow_prediction(sample, token, reason is not None)
        request = sample.request.request
        scored = (  # the first token of the first sample of a request that scores its prompt
            (sampling.prompt_logprobs is not None or sampling.return_prompt_token_ids)
            and request.resume is None
            and sample.index == 0
            and sample.generated == 1
        )
        self._emit(
            sample, (token,), text, reason, logprobs=logprobs, scored_prompt=scored,
            thought=thought, thinking=counted if sample.reasoning is not None else 0,
            predicted=predicted,
        )  # fmt: skip

    @staticmethod
    def _follow_prediction(sample: SampleState, token: int, ended: bool) -> tuple[int, int]:
        """The sample's cursor in its request's prediction past `token`, just appended:
        (accepted, rejected) prediction tokens for its usage (worker/predicted_output.py)."""
        if sample.prediction is None:  # its first token (a resumed sample's first here)
            request, predicted = sample.request, sample.request.predicted
            assert predicted is not None
            start = len(request.prompt_ids) - request.request.generated_before
            sample.prediction = PredictionCursor(predicted, sample.tokens[start:-1])
        accepted = sample.prediction.follow(token)
        checking = sample.checking  # a prediction's draft is being verified
        position = len(sample.tokens) - 1
        rejected = checking.rejected(position, token, ended) if checking is not None else 0
        return int(accepted), rejected

    def _emit(
        self,
        sample: SampleState,
        token_ids: tuple[int, ...],
        text: str,
        reason: str | None,
        error: str | None = None,
        logprobs: tuple[TokenLogprob, ...] = (),
        scored_prompt: bool = False,
        thought: str = "",
        thinking: int = 0,
        embedding: tuple[float, ...] = (),
        predicted: tuple[int, int] = (0, 0),
    ) -> None:
        """Stream one output (`thought`: its reasoning, apart from `text`; `thinking`: how many
        tokens it makes the reasoning's; `embedding`: an embedding request's). A sample's last one
        goes out after the sample is finished: its pages are back in the pool and its request
        id free by the time a client sees the end."""
        request = sample.request
        self._time(request, bool(token_ids or embedding), reason)
        output = RequestOutput(
            request_id=request.request_id,
            index=sample.index,
            token_ids=token_ids,
            text=text,
            prompt_tokens=request.prompt_tokens,
            cached_prompt_tokens=request.cached_prompt_tokens,
            host_cached_tokens=request.host_cached_tokens,
            disk_cached_tokens=request.disk_cached_tokens,
            peer_cached_tokens=request.peer_cached_tokens,
            finished=reason is not None,
            finish_reason=reason,
            error=error,
            logprobs=logprobs,
            stop_string=sample.stop.matched if reason is not None else None,
            prompt_logprobs=tuple(request.prompt_scores) if scored_prompt else (),
            prompt_token_ids=tuple(request.prompt_ids) if scored_prompt else (),
            reasoning_text=thought,
            reasoning_tokens=thinking,
            embedding=embedding,
            accepted_prediction_tokens=predicted[0],
            rejected_prediction_tokens=predicted[1],
        )
        try:
            request.sink(output)
        except Exception:  # a broken consumer must not take the engine down
            log.exception("output sink of %s failed", request.request_id)

    def _time(self, request: RequestState, computed: bool, reason: str | None) -> None:
        """Time a request's first output (`computed`: a token or an embedding goes out) and its
        end by a stop or its length (worker/latency_metrics.py)."""
        if request.first_output_at is None and computed:
            assert request.admitted_at is not None, "an output is computed after admission"
            request.first_output_at = self.latencies.first_output(
                request.submitted, request.admitted_at, request.timed_from_start
            )
        ended = reason in (FINISH_STOP, FINISH_LENGTH) and request.finished
        if ended and request.timed_from_start and request.first_output_at is not None:
            self.latencies.finished(request.submitted, request.first_output_at)

    def _finish_sample(self, sample: SampleState, reason: str) -> None:
        if sample.phase in (Phase.RUNNING, Phase.WAITING):
            self.scheduler.remove(sample)
        if sample.disk_read is not None:  # ended while its disk hit was read: let go of it
            assert self.disk_reads is not None
            self.disk_reads.release(sample.disk_read)
            sample.disk_read = None
        if sample.seq is not None:
            if reason == FINISH_ERROR:
                self.cache.abort(sample.seq)
            else:
                self.cache.finish(sample.seq, sample.computed)
            sample.seq = None
            self.scheduler.release_slot(sample)
        sample.phase = Phase.FINISHED
        if sample.request.request.namespace.adapter in self.lora.retired:
            self.lora.drop_retired()  # a retired adapter's last sequence may have ended
        request = sample.request
        if request.finished:
            self._requests.pop(request.request_id, None)
            if request.peer_read is not None:  # ended while its peer read ran: let go of it
                self.peer_reads.release(request.peer_read)
                request.peer_read = None
            with self._lock:
                self._active_ids.pop(request.request_id, None)
            self._finished += 1
            self._prompt_tokens += request.prompt_tokens
            self._cached_tokens += request.cached_prompt_tokens

    def _abort(self, request: RequestState, reason: str, error: str | None = None) -> None:
        if request.images is not None and self.embedder is not None:
            self.embedder.release(request.images)
        for sample in request.samples:
            if sample.phase is not Phase.FINISHED:
                self._finish_sample(sample, reason)
                self._emit(sample, (), "", reason, error)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                assert isinstance(payload, RequestState)
                try:
                    self._add(payload)
                except Exception as err:  # a bug: this request fails alone, its id freed
                    log.exception("adding %s failed", payload.request_id)
                    self._not_added(payload, f"{type(err).__name__}: {err}")
            elif kind == "call":
                function, future = cast(
                    tuple[Callable[[], object], concurrent.futures.Future[object]], payload
                )
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(function())
                    except Exception as err:  # handed to the caller, who decides
                        future.set_exception(err)
            else:
                state = self._requests.get(str(payload))
                if state is not None:
                    self._abort(state, FINISH_ABORT)

    def _end_refused(self) -> None:
        """End the requests the scheduler refused: their adapter was unloaded, or replaced
        after they began (their tokens so far came from weights that are gone)."""
        for sample in self.scheduler.take_refused():
            state = sample.request
            failed = self.scheduler.swap_failures.pop(state.request_id, None)
            if sample.phase is not Phase.FINISHED and state.adapter is not None:
                self._abort(state, FINISH_ERROR, failed or self.lora.why_gone(state.adapter))

    def _not_added(self, state: RequestState, error: str) -> None:
        """End a request `_add` failed on: its samples made so far as `_abort` ends them, and
        an error message for each one it did not make, so its stream ends."""
        self._requests.pop(state.request_id, None)
        made = {sample.index for sample in state.samples}
        for sample in state.samples:
            if sample.phase is not Phase.FINISHED:
                self._finish_sample(sample, FINISH_ERROR)
                self._emit(sample, (), "", FINISH_ERROR, error)
        with self._lock:
            self._active_ids.pop(state.request_id, None)
        request = state.request
        first = request.resume.sample_index if request.resume is not None else 0
        for index in range(first, first + request.sampling.n):
            if index not in made:
                output = RequestOutput(
                    request.request_id, index, (), "", state.prompt_tokens, 0, finished=True,
                    finish_reason=FINISH_ERROR, error=error,
                )  # fmt: skip
                try:
                    state.sink(output)
                except Exception:
                    log.exception("output sink of %s failed", state.request_id)

    def _add(self, state: RequestState) -> None:
        request = state.request
        first = request.resume.sample_index if request.resume is not None else 0
        sampling = request.sampling
        shaping = LogitShaping.create(
            sampling, self.eos_token_ids, self.vocab_size, self.runner.device
        )
        inside = state.reasoning_inside
        for index in range(first, first + sampling.n):
            thinking = self._thinking_tokens(state)
            sample = SampleState(
                request=state,
                index=index,
                tokens=list(state.prompt_ids),
                sampler=Sampler.create(
                    sampling,
                    index,
                    self._penalties(state),
                    Constraint(state.grammar) if state.grammar is not None else None,
                    shaping,
                    BadWords.create(state.bad_words),
                    thinking,
                ),
                stop=StopChecker(state.stops, include=sampling.include_stop_str_in_output),
                decoder=self.tokenizer.incremental_decoder(sampling.skip_special_tokens)
                if self.tokenizer
                else None,
                phase=Phase.UNBORN,  # until queued (the first) or forked from the first
                reasoning=ReasoningSplit(inside)
                if inside is not None and sampling.separate_reasoning
                else None,
                thinking=thinking,
            )
            state.samples.append(sample)
        state.forked = sampling.n == 1
        self._requests[state.request_id] = state
        self.scheduler.enqueue(state.samples[0])
        if request.resume is not None:
            first_sample = state.samples[0]
            try:
                self._replay(first_sample, state.prompt_ids[state.prompt_tokens :])
            except GrammarRefused as err:
                self._abort(state, FINISH_ERROR, f"structured output: the resumed tokens: {err}")
                return
            if first_sample.stop.stopped:  # it had already ended: nothing more to send
                self._abort(state, FINISH_STOP)

    @functools.cached_property
    def speculation(self) -> SpeculationConfig:
        """Speculative decoding's settings (worker/speculation.py)."""
        return self.config.speculation

    @functools.cached_property
    def thinks(self) -> bool:
        """A thinking model's (worker/reasoning.py): a request may have its reasoning told
        from its answer."""
        tokenizer = self.tokenizer
        return isinstance(tokenizer, Tokenizer) and template_thinks(tokenizer.chat_template)

    def _thinking_tokens(self, state: RequestState) -> ThinkingTokens | None:
        """A new sample's thinking tokens (None: its model does not think, or the request
        neither tells its reasoning apart nor gives it a budget)."""
        inside = state.reasoning_inside
        if inside is None:
            return None
        budget = state.request.sampling.thinking_token_budget
        close = self._think_close_ids if budget is not None else ()
        return ThinkingTokens(budget, close, inside, grammar_waits=state.grammar_waits)

    @functools.cached_property
    def _think_close_ids(self) -> tuple[int, ...]:
        """The tokens a thinking budget forces: the tokenizer's `</think>`."""
        assert isinstance(self.tokenizer, Tokenizer)  # only a thinking model's samples ask
        return tuple(self.tokenizer.encode(CLOSE, add_special_tokens=False))

    def _reasoning_opened(self, request: GenerateRequest, prompt: Sequence[int]) -> bool | None:
        """Whether the request's samples start inside their reasoning (worker/reasoning.py:
        its `prompt` ends with `<think>`); None: its text is not split and its reasoning has
        no budget (neither asked for, or not a thinking model's). In the submitting thread,
        never the engine's."""
        tokenizer = self.tokenizer
        sampling = request.sampling
        asked = sampling.separate_reasoning or sampling.thinking_token_budget is not None
        if not (asked and self.thinks):
            return None
        assert isinstance(tokenizer, Tokenizer)  # `thinks` says so
        if sampling.thinking_token_budget is not None:
            _ = self._think_close_ids  # tokenized here, not on the engine's thread
        if not (sampling.separate_reasoning or may_hold_reasoning(sampling.structured)):
            return False  # held to its grammar from the first token: the answer, all of it
        # a grammar of the answer alone (JSON, a required call) of a prompt that opened the
        # reasoning waits for the reasoning's end, if the answer is told apart (`submit`)
        tail = prompt[-PROMPT_TAIL_TOKENS:]
        # an id past the tokenizer's, in a model's padded vocabulary (Qwen3's 151,936 ids of
        # 151,669), has no text: only the tokens after the last one can end with `<think>`
        unknown = [i for i, token in enumerate(tail) if token >= tokenizer.vocab_size]
        known = tail[unknown[-1] + 1 :] if unknown else tail
        return prompt_opens(tokenizer.decode(known, skip_special_tokens=False))

    def _penalties(self, state: RequestState) -> Penalties | None:
        """A new sample's penalty state (None if its request penalizes nothing)."""
        sampling = state.request.sampling
        return Penalties.create(sampling, state.prompt_ids, self.vocab_size, self.runner.device)

    @staticmethod
    def _replay(sample: SampleState, generated: Sequence[int]) -> None:
        """Bring a resumed sample to where its stream was cut: its penalties count the tokens
        it generated; the decoder and the stop strings are fed them one by one, as the first
        worker fed them, so they hold back and emit exactly what they would have (their text
        already reached the client)."""
        sample.generated = len(generated)
        sample.sampler.replay(generated)
        if sample.decoder is None:  # no text, so no stop strings to bring along
            return
        min_tokens = sample.request.request.sampling.min_tokens
        for count, token in enumerate(generated, 1):
            delta = sample.decoder.step(token)
            if sample.thinking is not None:
                if sample.thinking.grammar_waits:  # the grammar follows the answer's tokens
                    sample.sampler.follow(token)
                sample.thinking.step(token, delta)
            text, _ = sample.stop.feed(delta, armed=count > min_tokens)
            if sample.reasoning is not None:
                sample.reasoning.feed(text)
