"""A deliberately simple prefix cache: one token per node, plain LRU over tokens.

The yardstick the radix cache is measured against in the same run (throughput and hit rate),
and, with no capacity, the ideal infinite cache. It follows the same serving loop: match, lock,
make room (evicting least recently used leaves), insert the prompt, and at finish insert the
generated tokens and unlock. LRU order lives in an OrderedDict of the unlocked nodes, touched
leaf-first, so a node always comes after its descendants and the first entry is the least recently
used evictable leaf. A locked node leaves the order and rejoins it at the end when unlocked.
"""

from __future__ import annotations

from collections import OrderedDict


class TrieNode:
    __slots__ = ("children", "lock_ref", "parent", "token")

    def __init__(self, parent: TrieNode | None, token: int) -> None:
        self.parent = parent
        self.token = token
        self.children: dict[int, TrieNode] = {}
        self.lock_ref = 0


class SimpleTrie:
    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        """Tokens of KV the pool holds (cached + private); None is unbounded."""
        self.root = TrieNode(None, -1)
        self.lru: OrderedDict[TrieNode, None] = OrderedDict()
        self.cached = 0
        self.private = 0

    def match(self, tokens: list[int]) -> tuple[int, TrieNode]:
        node, path = self.root, []
        for token in tokens:
            child = node.children.get(token)
            if child is None:
                break
            path.append(child)
            node = child
        self._touch(path)
        return len(path), node

    def _touch(self, path: list[TrieNode]) -> None:
        if self.capacity is None:
            return
        for node in reversed(path):
            if node.lock_ref == 0:
                self.lru.move_to_end(node)

    def lock(self, node: TrieNode | None) -> None:
        while node is not None and node is not self.root:
            if node.lock_ref == 0 and self.capacity is not None:
                del self.lru[node]
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TrieNode | None) -> None:
        while node is not None and node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0 and self.capacity is not None:
                self.lru[node] = None
            node = node.parent

    def reserve(self, tokens: int) -> bool:
        """Make room for `tokens` private tokens, evicting; False if locks prevent it."""
        if self.capacity is not None:
            excess = self.cached + self.private + tokens - self.capacity
            while excess > 0:
                if not self.lru:
                    return False
                victim = next(iter(self.lru))
                assert not victim.children and victim.lock_ref == 0
                parent = victim.parent
                assert parent is not None
                del parent.children[victim.token]
                del self.lru[victim]
                self.cached -= 1
                excess -= 1
        self.private += tokens
        return True

    def insert(self, node: TrieNode, tokens: list[int], start: int) -> TrieNode:
        """Add tokens[start:] below `node` (which ends at `start`); private tokens become cached."""
        for token in tokens[start:]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = TrieNode(node, token)
                self.cached += 1
                if self.capacity is not None:
                    self.lru[child] = None
            node = child
        self.private -= len(tokens) - start
        if self.capacity is not None:  # leaf first, up to the root: ancestors stay behind
            current: TrieNode | None = node
            while current is not None and current is not self.root:
                if current.lock_ref == 0:
                    self.lru.move_to_end(current)
                current = current.parent
        return node
