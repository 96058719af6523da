"""A worker restarted with a persisted cache: its first request hits, and the router knows it;
what eviction drops while serving is on disk too.

One worker behind the real router over loopback gRPC; it serves a long prompt, is stopped (its
engine saves the cache on the way down, as a drain does), and comes back under the same name.
The next turn of the same conversation must be served from the loaded cache, and the router,
which rebuilt its index for the worker from the snapshot it takes on attach, must have
predicted that hit: no cold window after a restart.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from cluster.client import Client, text_request
from tests.cluster.local_cluster import ENGINE, start_cluster
from worker.loader import LoadedModel

CONVERSATION = "Persistence keeps what the cache learned across a restart of its worker. " * 6


def test_a_restarted_worker_hits_on_its_first_request(tiny: LoadedModel, tmp_path: Path) -> None:
    engine = replace(ENGINE, persist_dir=str(tmp_path), persist_interval_s=0.0)
    cluster = start_cluster(tiny, workers=1, engine=engine)
    try:
        client = Client(cluster.target)
        first = list(client.generate(text_request(CONVERSATION + "One?", max_tokens=4)))[-1]
        assert first.cached_prompt_tokens == 0
        cluster.wait_idle()
        cluster.kill_worker("worker-0")  # its engine saves on stop
        assert (tmp_path / "worker-0" / "manifest.json").exists()
        cluster.add_worker("worker-0")
        assert cluster.engines["worker-0"].loaded.nodes > 0
        second = list(client.generate(text_request(CONVERSATION + "Two?", max_tokens=4)))[-1]
        assert second.cached_prompt_tokens >= 64, second
        assert second.predicted_cached_tokens > 0, "the router's index started cold"
    finally:
        cluster.close()


def test_a_prefix_on_disk_alone_is_routed_to_and_read_back(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """The worker saved a conversation and then dropped it from its cache: its `saved` and
    `cleared` events reach the router over the real stream, the router still predicts the hit,
    and the worker reads it back from disk, saying so in its response."""
    engine = replace(ENGINE, persist_dir=str(tmp_path), persist_interval_s=0.0)
    cluster = start_cluster(tiny, workers=1, engine=engine)
    try:
        client = Client(cluster.target)
        list(client.generate(text_request(CONVERSATION + "One?", max_tokens=4)))
        cluster.wait_idle()
        worker = cluster.engines["worker-0"]

        def save_then_forget() -> None:
            assert worker.store is not None
            worker.store.save(worker)
            worker.publish_disk_blocks()
            worker.cache.tree.clear()
            worker.runner.copy_pages(worker.cache.take_tier_copies())

        worker.call(save_then_forget).result(timeout=30)
        index, seq = cluster.links.policy.index, worker.cache.events.seq
        deadline = time.monotonic() + 10
        while index._sets["worker-0"].seq < seq and time.monotonic() < deadline:
            time.sleep(0.01)  # the saved and cleared events have reached the router
        time.sleep(1.2)  # and the first request's route no longer counts (its 1 s of grace)
        second = list(client.generate(text_request(CONVERSATION + "Two?", max_tokens=4)))[-1]
        assert second.predicted_cached_tokens >= 64, "the router knew the disk held it"
        assert second.cached_prompt_tokens >= 64, second
        assert second.disk_cached_tokens == second.cached_prompt_tokens, second
        [stats] = client.stats().workers
        assert stats.disk_hit_tokens == second.disk_cached_tokens
        assert stats.disk_skipped_tokens == 0
    finally:
        cluster.close()


def test_a_conversation_evicted_from_both_tiers_before_any_save_comes_back_from_disk(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """No save runs (an hour apart): eviction drops the conversation from the host tier, the
    worker's saver thread writes it as it goes (`persist_evicted`), the `saved` events reach the
    router, and the next turn is routed to and read back from disk."""
    engine = replace(
        ENGINE, num_pages=96, host_pages=48, persist_dir=str(tmp_path), persist_interval_s=3600.0
    )
    cluster = start_cluster(tiny, workers=1, engine=engine)
    try:
        client = Client(cluster.target)
        list(client.generate(text_request(CONVERSATION + "One?", max_tokens=4)))
        for i in range(6):  # other conversations push it out of both tiers
            other = f"Topic {i} is unrelated to everything said before it, entirely. " * 6
            list(client.generate(text_request(other, max_tokens=4)))
        cluster.wait_idle()
        worker = cluster.engines["worker-0"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            [stats] = client.stats().workers
            seq = worker.call(lambda: worker.cache.events.seq).result(timeout=10)
            synced = cluster.links.policy.index._sets["worker-0"].seq >= seq
            if stats.disk_spilled_pages and worker.store and worker.store._listed and synced:
                break
            time.sleep(0.05)
        assert stats.disk_spilled_pages > 0 and stats.demoted_pages > 0, stats
        time.sleep(1.2)  # the routes before no longer count (their 1 s of grace)
        second = list(client.generate(text_request(CONVERSATION + "Two?", max_tokens=4)))[-1]
        assert second.cached_prompt_tokens >= 64, second
        assert second.disk_cached_tokens >= 64, "read back from disk, not from a tier"
        assert second.predicted_cached_tokens >= 64, "the router knew the disk held it"
    finally:
        cluster.close()
