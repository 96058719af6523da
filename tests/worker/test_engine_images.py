"""The engine serving vision prompts, on the tiny Idefics3 checkpoint (vlm_fixtures.py).

transformers is the oracle: the engine's logits at each prompt's last position equal
Idefics3ForConditionalGeneration's on the processor's inputs for the same conversation (so the
image rows' embeddings reach the right positions, cold, warm, chunked or continued). A
conversation that re-sends its image hits the image's KV on every later turn: the cached
prompt tokens cover the image's positions, the vision encoder does not run again, and greedy
output equals a cold engine's on the same prompt. An image whose KV was evicted, or a cached
prefix that ends inside an image, comes from the encoder cache (no second encoder run; with
the cache off the encoder runs again, so the counters can tell). An image split over prefill
chunks is encoded once.
"""

from __future__ import annotations

import io
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from cache import CacheNamespace
from cache.integrity import check_sequence_cache
from tests.worker.helpers import drain, relative_error
from tests.worker.vlm_fixtures import build_tiny_vlm, png_bytes
from worker import validation
from worker.engine import Engine, EngineConfig
from worker.image_prompt import image_runs
from worker.images import CheckedImage, content_hash
from worker.loader import LoadedModel, load_model
from worker.metrics import EngineCollector
from worker.request import GenerateRequest, RequestOutput, Resume
from worker.sampling_params import SamplingParams

IMAGE = png_bytes(60, 40, seed=11)
"""A 2 x 2 grid plus the global image: 5 runs of 4 positions."""
QUESTIONS = ("What is in the picture?", "And its colours?", "Anything else?")
TOKENS = 6
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path: Path = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny", seed=5)
    return load_model(path)


class Oracle:
    """transformers on the same checkpoint: the prompt's ids and last position's logits."""

    def __init__(self, path: Path) -> None:
        self.processor = transformers.AutoProcessor.from_pretrained(path)
        model = transformers.Idefics3ForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32
        )
        self.model = model.eval()
        self.image = Image.open(io.BytesIO(IMAGE)).convert("RGB")

    def __call__(self, messages: list[dict[str, Any]]) -> tuple[list[int], torch.Tensor]:
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        inputs = self.processor(text=text, images=[self.image], return_tensors="pt")
        with torch.no_grad():
            logits = self.model(**inputs).logits[0, -1].float()
        return inputs["input_ids"][0].tolist(), logits


@pytest.fixture(scope="module")
def oracle(loaded: LoadedModel) -> Oracle:
    return Oracle(loaded.path)


class Served:
    """An engine driven step by step, with every output and the logits of each draw."""

    def __init__(self, loaded: LoadedModel, **config: Any) -> None:
        settings = {"num_pages": 256, "page_size": 4, "block_size": 4, **config}
        self.engine = Engine(
            loaded.model, loaded.tokenizer, EngineConfig(**settings), vision=loaded.vision
        )
        self.outputs: list[RequestOutput] = []
        self.logits: dict[str, torch.Tensor] = {}
        self.engine.observe_logits = self._observe

    def _observe(self, request_id: str, index: int, position: int, logits: torch.Tensor) -> None:
        self.logits.setdefault(request_id, logits.clone())  # the first draw's

    def run(self, request: GenerateRequest) -> tuple[list[int], RequestOutput]:
        self.engine.submit(request, self.outputs.append)
        drain(self.engine)
        mine = [o for o in self.outputs if o.request_id == request.request_id]
        assert mine[-1].finished and mine[-1].error is None, mine[-1]
        return [t for o in mine for t in o.token_ids], mine[-1]

    def prompt(self, request: GenerateRequest) -> list[int]:
        engine = self.engine
        return validation.prompt_ids(request, engine.tokenizer, engine.limits)

    def image_end(self, request: GenerateRequest) -> int:
        """The position after the request's last image position."""
        limits = self.engine.limits
        assert limits.image_spec is not None
        images = validation.prompt_images(validation.request_images(request, limits))
        runs = image_runs(self.prompt(request), images, limits.image_spec)
        return runs[-1][0] + limits.image_spec.image_seq_len

    def check_idle(self) -> None:
        cache = self.engine.cache
        assert not cache.live and cache.pool.num_private == 0
        assert cache.pool.num_free + cache.tree.cached_pages == cache.pool.usable_pages


def chat(request_id: str, turns: list[dict[str, Any]]) -> GenerateRequest:
    return GenerateRequest(
        request_id,
        messages=tuple(turns),
        images=(IMAGE,),
        sampling=SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True),
    )


def first_turn() -> list[dict[str, Any]]:
    parts = [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]
    return [{"role": "user", "content": parts}]


def test_a_three_turn_conversation_hits_the_image_and_matches_a_cold_run(
    loaded: LoadedModel, oracle: Oracle
) -> None:
    warm = Served(loaded)
    assert loaded.tokenizer is not None
    messages = first_turn()
    for turn in range(3):
        request = chat(f"turn{turn}", messages)
        ids, expected = oracle(messages)
        assert warm.prompt(request) == ids
        tokens, final = warm.run(request)
        assert final.prompt_tokens == len(ids)
        assert relative_error(warm.logits[request.request_id], expected) < 1e-4
        stats = warm.engine.stats()
        assert stats.encoder_runs == 1  # turn 1 encoded the image; later turns never again
        if turn:
            assert final.cached_prompt_tokens >= warm.image_end(request), final
            assert final.cached_prompt_tokens < final.prompt_tokens
        else:
            assert final.cached_prompt_tokens == 0
        cold = Served(loaded)
        cold_tokens, cold_final = cold.run(request)
        assert cold_final.cached_prompt_tokens == 0 and cold.engine.stats().encoder_runs == 1
        assert tokens == cold_tokens
        assert (
            relative_error(warm.logits[request.request_id], cold.logits[request.request_id]) < 1e-4
        )
        answer = loaded.tokenizer.decode(tokens)
        messages = [
            *messages,
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            {"role": "user", "content": [{"type": "text", "text": QUESTIONS[(turn + 1) % 3]}]},
        ]
    warm.check_idle()
    assert warm.engine.stats().encoder_cache_hits == 0


@pytest.mark.parametrize("cache_bytes", [64 << 20, 0])
def test_an_image_whose_kv_was_evicted_comes_from_the_encoder_cache(
    loaded: LoadedModel, cache_bytes: int
) -> None:
    served = Served(loaded, encoder_cache_bytes=cache_bytes)
    tokens, _ = served.run(chat("a", first_turn()))
    tree = served.engine.cache.tree
    assert tree.evict(tree.evictable_pages) > 0 and tree.cached_pages == 0
    again, final = served.run(chat("b", first_turn()))
    assert final.cached_prompt_tokens == 0 and again == tokens
    stats = served.engine.stats()
    if cache_bytes:
        assert (stats.encoder_runs, stats.encoder_cache_hits) == (1, 1)
    else:
        assert (stats.encoder_runs, stats.encoder_cache_hits) == (2, 0)
    served.check_idle()


@pytest.mark.parametrize("cache_bytes", [64 << 20, 0])
def test_a_cached_prefix_ending_inside_an_image_continues_from_the_encoder_cache(
    loaded: LoadedModel, oracle: Oracle, cache_bytes: int
) -> None:
    served = Served(loaded, page_size=1, block_size=4, encoder_cache_bytes=cache_bytes)
    request = chat("a", first_turn())
    tokens, final = served.run(request)
    end = served.image_end(request)
    cut = end - 6  # in the global image's run, two positions into it
    tree = served.engine.cache.tree
    tree.evict(tree.cached_pages - cut)
    assert tree.cached_pages == cut
    again, final = served.run(chat("b", first_turn()))
    assert final.cached_prompt_tokens == cut and again == tokens
    _, expected = oracle(first_turn())
    assert relative_error(served.logits["b"], expected) < 1e-4
    stats = served.engine.stats()
    assert stats.encoder_runs == (1 if cache_bytes else 2)
    assert stats.encoder_cache_hits == (1 if cache_bytes else 0)
    served.check_idle()


def test_an_image_split_over_prefill_chunks_is_encoded_once(
    loaded: LoadedModel, oracle: Oracle
) -> None:
    whole = Served(loaded)
    tokens, _ = whole.run(chat("a", first_turn()))
    chunked = Served(loaded, max_prefill_chunk=3, token_budget=3, encoder_cache_bytes=0)
    chunked_tokens, _ = chunked.run(chat("a", first_turn()))
    assert chunked_tokens == tokens
    _, expected = oracle(first_turn())
    assert relative_error(chunked.logits["a"], expected) < 1e-4
    assert chunked.engine.stats().encoder_runs == 1
    chunked.check_idle()


def test_the_same_image_in_two_tenants_shares_neither_pages_nor_encoder_outputs(
    loaded: LoadedModel,
) -> None:
    served = Served(loaded)
    acme = chat("acme", first_turn())
    acme = replace(acme, namespace=CacheNamespace(tenant="acme"))
    other = replace(acme, request_id="other", namespace=CacheNamespace(tenant="other"))
    tokens, _ = served.run(acme)
    other_tokens, final = served.run(other)
    assert final.cached_prompt_tokens == 0 and other_tokens == tokens
    stats = served.engine.stats()
    assert (stats.encoder_runs, stats.encoder_cache_hits) == (2, 0)
    _, final = served.run(replace(acme, request_id="acme-again"))
    assert final.cached_prompt_tokens > served.image_end(acme)  # each tenant hits its own
    served.check_idle()


def test_n_samples_and_a_resumed_sample_of_an_image_prompt(loaded: LoadedModel) -> None:
    """n = 2 forks after the image is computed; a sample resumed on a fresh engine (its ids end
    with the tokens already streamed) continues exactly as the whole run."""
    sampling = SamplingParams(max_tokens=TOKENS, temperature=0.9, seed=3, n=2, ignore_eos=True)
    request = replace(chat("n2", first_turn()), sampling=sampling)
    served = Served(loaded)
    served.engine.submit(request, served.outputs.append)
    drain(served.engine)
    samples = [[t for o in served.outputs if o.index == i for t in o.token_ids] for i in (0, 1)]
    assert all(len(s) == TOKENS for s in samples)
    assert served.engine.stats().encoder_runs == 1
    served.check_idle()
    prompt = served.prompt(request)
    cut = 2
    resumed = GenerateRequest(
        "resumed",
        prompt_token_ids=(*prompt, *samples[1][:cut]),
        images=(IMAGE,),
        sampling=replace(sampling, n=1),
        resume=Resume(1, cut),
    )
    fresh = Served(loaded)
    fresh.engine.submit(resumed, fresh.outputs.append)
    drain(fresh.engine)
    assert [t for o in fresh.outputs for t in o.token_ids] == samples[1][cut:]
    assert fresh.outputs[-1].prompt_tokens == len(prompt)
    fresh.check_idle()


class FailingVision:
    """The checkpoint's vision model, failing on one image (as a device error would)."""

    def __init__(self, vision: Any, fails_on: int) -> None:
        self.vision = vision
        self.spec = vision.spec
        self.fails_on = fails_on

    def encode(self, image: CheckedImage) -> torch.Tensor:
        if image.content_hash == self.fails_on:
            raise RuntimeError("the encoder failed")
        return self.vision.encode(image)


def test_an_encoder_failure_ends_its_request_alone(loaded: LoadedModel) -> None:
    other_image = png_bytes(60, 40, seed=12)
    failing = FailingVision(loaded.vision, content_hash(other_image))
    config = EngineConfig(num_pages=256, page_size=4, block_size=4)
    engine = Engine(loaded.model, loaded.tokenizer, config, vision=failing)
    outputs: list[RequestOutput] = []
    good = chat("good", first_turn())
    engine.submit(replace(good, request_id="bad", images=(other_image,)), outputs.append)
    engine.submit(good, outputs.append)
    drain(engine)
    bad = [o for o in outputs if o.request_id == "bad"]
    assert bad[-1].finish_reason == "error" and "the encoder failed" in (bad[-1].error or "")
    fine = [o for o in outputs if o.request_id == "good"]
    assert fine[-1].finish_reason == "length" and sum(len(o.token_ids) for o in fine) == TOKENS
    assert not engine.cache.live and engine.cache.pool.num_private == 0
    check_sequence_cache(engine.cache)


def test_the_encoder_counters_reach_prometheus_and_bad_limits_are_refused(
    loaded: LoadedModel,
) -> None:
    served = Served(loaded)
    served.run(chat("a", first_turn()))
    families = {f.name: f for f in EngineCollector(served.engine, "w0").collect()}
    runs = families["radixmesh_worker_encoder_runs"].samples[0]
    assert runs.name == "radixmesh_worker_encoder_runs_total" and runs.value == 1
    assert families["radixmesh_worker_encoder_cache_hits"].samples[0].value == 0
    assert families["radixmesh_worker_encoder_seconds"].samples[0].value > 0
    for bad in ({"max_images": 0}, {"max_image_pixels": -1}, {"encoder_cache_bytes": -1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineConfig(**bad)  # type: ignore[arg-type]


def test_an_images_kv_saved_on_disk_serves_it_after_a_restart(
    loaded: LoadedModel, tmp_path: Path
) -> None:
    """The saved cache keeps image keys like any other: a restarted worker serves the image's
    positions from disk and never runs the encoder for them."""
    settings = {"persist_dir": str(tmp_path), "persist_interval_s": 0.0}
    first = Served(loaded, model_revision=loaded.revision, **settings)
    tokens, _ = first.run(chat("a", first_turn()))
    first.engine.stop()
    restarted = Served(loaded, model_revision=loaded.revision, **settings)
    assert restarted.engine.loaded.nodes > 0
    request = chat("b", first_turn())
    again, final = restarted.run(request)
    assert again == tokens and final.cached_prompt_tokens >= restarted.image_end(request)
    assert restarted.engine.stats().encoder_runs == 0
    restarted.engine.stop()


class GatedVision:
    """The checkpoint's vision model behind a gate the test opens (a slow encoder, on cue);
    refuses to wait past GATE_S, so an engine that encodes on its own thread fails fast."""

    GATE_S = 5.0

    def __init__(self, vision: Any) -> None:
        self.vision = vision
        self.spec = vision.spec
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.threads: set[str] = set()
        self.encoded: list[int] = []

    def encode(self, image: CheckedImage) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        self.encoded.append(image.content_hash)
        self.entered.set()
        if not self.gate.wait(self.GATE_S):
            raise RuntimeError("the encoder was held past the test's gate")
        return self.vision.encode(image)


@pytest.mark.parametrize("image_first", [False, True], ids=["text first", "image first"])
def test_other_streams_decode_while_an_image_is_encoded(
    loaded: LoadedModel, image_first: bool
) -> None:
    """The encoder runs off the engine thread: while an image request's encoder is held, a text
    request keeps decoding, step after step, whichever came first (a waiting image chunk takes
    none of the step's budget: here the budget is one chunk); once released, the image request
    gives the tokens an engine with an ungated encoder gives, and every page is accounted
    for."""
    gated = GatedVision(loaded.vision)
    config = EngineConfig(
        num_pages=256, page_size=4, block_size=4, token_budget=16, max_prefill_chunk=16
    )
    engine = Engine(loaded.model, loaded.tokenizer, config, vision=gated)
    outputs: list[RequestOutput] = []
    story = ({"role": "user", "content": "Tell me a long story."},)
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = GenerateRequest("text", messages=story, sampling=sampling)
    image = chat("image", first_turn())
    measure = Engine(loaded.model, loaded.tokenizer, config, vision=loaded.vision)
    assert measure.submit(image, lambda _: None) > 16, "the image prompt fills a step's budget"
    for request in (image, text) if image_first else (text, image):
        engine.submit(request, outputs.append)

    def decoded() -> int:
        return sum(len(o.token_ids) for o in outputs if o.request_id == "text")

    for _ in range(30):
        assert engine.step()
        if decoded() >= 10:
            break
    assert gated.entered.is_set(), "the image's encoder never started"
    assert threading.current_thread().name not in gated.threads, "encoded on the engine's thread"
    assert decoded() >= 10, (
        f"the text request decoded {decoded()} tokens while the encoder was held"
    )
    assert not [o for o in outputs if o.request_id == "image"], "the image request ran early"
    gated.gate.set()
    drain(engine)
    image = [o for o in outputs if o.request_id == "image"]
    assert image[-1].finish_reason == "length", image[-1].error
    reference = Served(loaded)
    reference.engine.submit(chat("image", first_turn()), reference.outputs.append)
    drain(reference.engine)
    assert [t for o in image for t in o.token_ids] == [
        t for o in reference.outputs for t in o.token_ids
    ]
    assert engine.stats().encoder_runs == 1
    assert not engine.cache.live and engine.cache.pool.num_private == 0
    check_sequence_cache(engine.cache)
    engine.stop()


def test_an_aborted_requests_queued_encoder_run_is_cancelled(loaded: LoadedModel) -> None:
    """Two image requests: the first one's run holds the encoder; the second, queued behind it,
    is aborted: its run never happens, and nothing is left waiting for it."""
    gated = GatedVision(loaded.vision)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(num_pages=256), vision=gated)
    outputs: list[RequestOutput] = []
    other = png_bytes(50, 30, seed=31)
    engine.submit(chat("first", first_turn()), outputs.append)
    engine.submit(replace(chat("second", first_turn()), images=(other,)), outputs.append)
    for _ in range(3):
        engine.step()
    assert gated.entered.is_set()
    engine.abort("second")
    engine.step()
    assert [o.finish_reason for o in outputs if o.request_id == "second"] == ["abort"]
    gated.gate.set()
    drain(engine)
    assert gated.encoded == [content_hash(IMAGE)], "the aborted request's image was encoded"
    assert engine.stats().encoder_runs == 1
    assert engine.embedder is not None and not engine.embedder._running
    assert not engine.embedder._holders
    check_sequence_cache(engine.cache)
    engine.stop()
