"""A KV pool sized from a byte budget (`engine.kv_cache_memory_bytes`, no `num_pages`), seen
from outside: the router is told each worker's pages, and a client the context they hold."""

from __future__ import annotations

from dataclasses import replace

import openai
import pytest

from tests.cluster.local_cluster import ENGINE, SERVED_NAME, start_cluster
from worker.loader import LoadedModel


def test_a_byte_budget_sizes_each_workers_pool_and_the_context_clients_see(
    tiny: LoadedModel,
) -> None:
    page = tiny.model.kv_page_bytes(ENGINE.page_size)
    engine = replace(ENGINE, num_pages=None, kv_cache_memory_bytes=100 * page + page // 2)
    cluster = start_cluster(tiny, workers=2, engine=engine, http=True)
    try:
        stats = cluster.stats()
        # 100 pages, the null page not counted
        assert sorted((w.worker, w.total_pages) for w in stats.workers) == [
            ("worker-0", 99), ("worker-1", 99),
        ]  # fmt: skip
        assert all(w.free_pages == 99 for w in stats.workers)
        with openai.OpenAI(base_url=f"{cluster.http_url}/v1", api_key="x", max_retries=0) as c:
            model = c.models.retrieve(SERVED_NAME)
            # 512 configured, cut to the 99 usable pages of 4 positions
            assert model.model_extra is not None
            assert model.model_extra["max_model_len"] == 99 * ENGINE.page_size
            reply = c.completions.create(
                model=SERVED_NAME, prompt="hello", max_tokens=3, temperature=0.0
            )
            assert reply.choices[0].finish_reason == "length"
            with pytest.raises(openai.BadRequestError, match="context"):  # 400 + 1 > 396
                c.completions.create(model=SERVED_NAME, prompt=[1] * 400, max_tokens=1)
    finally:
        cluster.close()
