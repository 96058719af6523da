"""The SGLang-style baseline: its approximate tree and its published decision rule."""

from __future__ import annotations

from router.approx_tree import ApproxTree
from router.sglang import SglangApproxTree
from tests.router.helpers import BLOCK, CONFIG, Clock, prompt, request


def test_tree_match_insert_and_lru_eviction_by_size() -> None:
    tree = ApproxTree(block_tokens=4)
    tree.insert((1, 2, 3), "a", now=1.0)
    tree.insert((1, 2, 9), "b", now=2.0)
    tree.insert((7,), "a", now=3.0)
    assert tree.match((1, 2, 3, 4), now=4.0) == (3, "a")
    assert tree.match((1, 2), now=4.0) == (2, "a")  # the first worker recorded there
    assert tree.match((5,), now=4.0) == (0, None)
    assert tree.size == {"a": 16, "b": 12}
    tree.evict(max_tokens=8)  # a: drop its least recently used leaves until 8 tokens
    assert tree.size == {"a": 8, "b": 8}
    assert tree.match((1, 2, 3), now=5.0) == (2, "a")  # a lost 7, then 3 (its LRU leaves)
    assert tree.match((7,), now=5.0) == (0, None)
    tree.remove_tenant("b")
    assert tree.size == {"a": 8} and tree.match((1, 2, 9), now=6.0) == (2, "a")


def test_cache_threshold_smallest_tree_and_imbalance() -> None:
    clock = Clock()
    policy = SglangApproxTree(CONFIG, clock, cache_threshold=0.5, balance_abs_threshold=2)
    for w in ("w0", "w1", "w2"):
        policy.add_worker(w, 1000)
    first = policy.route(request("a", prompt(1, 40)))
    # a long match (> 50 % of the prompt) follows the tree
    assert policy.route(request("b", prompt(2, 44, prompt(1, 40)))).worker == first.worker
    # a short match goes to the worker with the smallest tree, which is not the first
    other = policy.route(request("c", prompt(3, 80, prompt(1, 8))))
    assert other.worker != first.worker and other.predicted_cached_tokens == 0
    # imbalance: max - min > 2 and max > 1.5 x min -> the least loaded worker, tree or not
    for i in range(4):
        policy.route(request(f"x{i}", prompt(2, 44 + BLOCK * i, prompt(1, 40))))
    loads = {w: policy.loads.workers[w].running for w in ("w0", "w1", "w2")}
    assert max(loads.values()) - min(loads.values()) <= 3
