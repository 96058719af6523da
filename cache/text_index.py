"""Texts the cache has seen, with their token boundaries, so a new text prompt tokenises only
what is new (seed 002, DESIGN section 3 "Text index").

A character radix tree per namespace. Each node is an edge label: a run of tokens (`ids`) and
the characters they spell (`text`), with per-token `ends` (the character just after the token,
counted from the start of the whole text) and `flags`:

    text   | H e l l o |   w o r l d | 1 | 2 |   <|im_start|> | u s e r | ...
    ids    |   9906    |    1917     | 16| 17|     ...
    flags  |  CUT SPLIT|  CUT SPLIT  | ..

`CUT`: the tokens so far spell whole characters (no UTF-8 character is split after it), so the
text may be cut there. `SPLIT`: a pre-tokenizer split point (or a special token's edge) of the
text the tokens came from. The index knows no tokenizer: the caller gives ids, ends and flags.

Matching compares characters, then backs off to a boundary, in one of two modes:

- `exact`: to a SPLIT point `b` followed by two more SPLIT points that end at least `margin`
  characters before the end of the match (`margin`: the longest special token, so no special
  token can straddle them). A pre-tokenizer piece is decided by its own characters and at most
  the next piece, so every piece before `b` is the same in any text that shares the matched
  characters: tokenising `text[b:]` alone and appending it to the ids before `b` gives exactly
  the ids of tokenising the whole text. Only nodes that a full tokenization inserted (`exact`)
  are used, with SPLIT flags those insertions agreed on.
- `anchored`: seed 002's rule. A match that reaches the end of a stored text (EXACT when the new
  text is that text, EXTEND when it continues it) reuses every id stored for it, generated
  tokens included; a match that stops inside a stored text (DIVERGE) reuses the ids up to the
  last CUT inside the match when the match covers at least `min_fraction` of that stored text,
  and otherwise falls back to the longest stored text it extends, or to the exact rule.

Memory is bounded by characters: least recently used leaves are dropped first, across every
namespace. Namespaces never share a node.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

CUT = 1
"""Flag: the text may be cut after this token (it ends on a character boundary)."""
SPLIT = 2
"""Flag: a pre-tokenizer split point (or a special token's edge) after this token."""
LOOKAHEAD_SPLITS = 2
"""SPLIT points that must follow an exact back-off point inside the match."""


class TextMatchMode(StrEnum):
    EXACT = "exact"
    ANCHORED = "anchored"


class TextOutcome(StrEnum):
    MISS = "miss"
    """Nothing reused."""
    EXACT = "exact"
    """The text is a stored text: every stored id reused."""
    EXTEND = "extend"
    """The text continues a stored text: every stored id reused, the rest to tokenise."""
    DIVERGE = "diverge"
    """The text leaves a stored text inside it: ids up to a boundary inside the match reused."""
    SPLIT = "split"
    """Exact mode (or anchored's fall-back): ids up to a proven split point reused."""


@dataclass(frozen=True, slots=True)
class TextMatch:
    outcome: TextOutcome
    matched_chars: int
    """Characters the new text shares with the stored texts."""
    reused_chars: int
    """Characters whose ids are reused: the text from here on is still to tokenise."""
    ids: array
    """The ids of `text[:reused_chars]` (`array("q")`), with their `ends` and `flags`."""
    ends: array
    flags: bytearray
    exact: bool
    """The ids are provably those of a full tokenization (exact rule, or nothing reused)."""


class TextNode:
    __slots__ = (
        "anchored",
        "children",
        "ends",
        "exact",
        "flags",
        "heap_version",
        "ids",
        "last_access",
        "parent",
        "start",
        "terminal",
        "text",
    )

    def __init__(
        self,
        parent: TextNode | None,
        start: int,
        text: str,
        ids: array,
        ends: array,
        flags: bytearray,
    ) -> None:
        self.parent = parent
        self.start = start
        self.text = text
        self.ids = ids
        self.ends = ends
        self.flags = flags
        self.children: dict[str, list[TextNode]] = {}
        self.exact = False
        """A full tokenization of some text passed through here (its flags are trusted)."""
        self.anchored = False
        """Anchored ids (generated, or reused by the anchored rule) passed through here."""
        self.terminal = False
        """A stored text ends exactly at this node's end."""
        self.last_access = 0
        self.heap_version = 0

    @property
    def end(self) -> int:
        return self.start + len(self.text)

    def add_child(self, child: TextNode) -> None:
        self.children.setdefault(child.text[0], []).append(child)

    def remove_child(self, child: TextNode) -> None:
        siblings = self.children[child.text[0]]
        siblings.remove(child)
        if not siblings:
            del self.children[child.text[0]]


def _miss(matched: int) -> TextMatch:
    return TextMatch(TextOutcome.MISS, matched, 0, array("q"), array("q"), bytearray(), True)


def _common_chars(label: str, text: str, pos: int) -> int:
    """Length of the common prefix of `label` and `text[pos:]` (memcmp-speed on long runs)."""
    if text.startswith(label, pos):
        return len(label)
    lo, hi = 0, min(len(label), len(text) - pos)
    while lo < hi:  # the largest l with label[:l] == text[pos:pos + l]
        mid = (lo + hi + 1) // 2
        if text.startswith(label[:mid], pos):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_ids(stored: array, ids: array, at: int) -> int:
    n = min(len(stored), len(ids) - at)
    if stored[:n] == ids[at : at + n]:
        return n
    k = 0
    while k < n and stored[k] == ids[at + k]:
        k += 1
    return k


@dataclass(frozen=True, slots=True)
class TextIndexStats:
    chars: int
    nodes: int
    namespaces: int
    evicted_chars: int


class TextIndex:
    """Stored texts per namespace (any hashable key: a tenant never sees another's), bounded
    to `max_chars` characters. Not thread-safe: one caller at a time."""

    def __init__(self, max_chars: int, min_fraction: float = 0.8) -> None:
        if max_chars < 0:
            raise ValueError(f"max_chars must be >= 0, got {max_chars}")
        if not 0.0 <= min_fraction <= 1.0:
            raise ValueError(f"min_fraction must be within [0, 1], got {min_fraction}")
        self.max_chars = max_chars
        self.min_fraction = min_fraction
        self._roots: dict[Hashable, TextNode] = {}
        self._heap: list[tuple[int, int, int, TextNode]] = []
        self._clock = 0
        self._counter = 0
        self.chars = 0
        self.nodes = 0
        self.evicted_chars = 0

    def stats(self) -> TextIndexStats:
        return TextIndexStats(self.chars, self.nodes, len(self._roots), self.evicted_chars)

    # -- match -------------------------------------------------------------------------------------
    def match(
        self, namespace: Hashable, text: str, mode: TextMatchMode, margin: int = 1
    ) -> TextMatch:
        """What of `text` is stored, backed off per `mode`. `margin` (>= 1): the longest special
        token of the tokenizer, in characters. Touches the matched nodes (LRU)."""
        if margin < 1:
            raise ValueError(f"margin must be >= 1, got {margin}")
        root = self._roots.get(namespace)
        if root is None or not text:
            return _miss(0)
        exact_only = TextMatchMode(mode) is TextMatchMode.EXACT  # "exact" the string too
        path, matched = self._walk(root, text, exact_only)
        self._touch(path)
        if exact_only:
            return self._exact(path, matched, matched, margin)
        return self._anchored(path, matched, text, margin)

    def _walk(self, root: TextNode, text: str, exact_only: bool) -> tuple[list[TextNode], int]:
        """The nodes the text runs through (the last may be matched only in part) and the
        characters matched. Among siblings the longest match wins; anchored ids win a tie."""
        node, pos, path = root, 0, []
        while pos < len(text):
            best, best_chars = None, 0
            for child in node.children.get(text[pos], ()):
                if exact_only and not child.exact:
                    continue
                chars = _common_chars(child.text, text, pos)
                better = chars > best_chars or (
                    chars == best_chars and best is not None and child.anchored > best.anchored
                )
                if better:
                    best, best_chars = child, chars
            if best is None:
                break
            path.append(best)
            pos += best_chars
            if best_chars < len(best.text):
                break
            node = best
        return path, pos

    def _exact(self, path: list[TextNode], matched: int, limit: int, margin: int) -> TextMatch:
        """Back off to a split point followed by LOOKAHEAD_SPLITS more, all within
        `limit - margin` characters (only exact nodes of `path` count)."""
        bound = limit - margin
        following = 0
        for depth in range(len(path) - 1, -1, -1):
            node = path[depth]
            if not node.exact:
                continue
            ends, flags = node.ends, node.flags
            for i in range(len(ends) - 1, -1, -1):
                if ends[i] > bound or not flags[i] & SPLIT:
                    continue
                if following < LOOKAHEAD_SPLITS:
                    following += 1
                    continue
                return self._reuse(TextOutcome.SPLIT, matched, path, depth, i + 1, exact=True)
        return _miss(matched)

    def _anchored(self, path: list[TextNode], matched: int, text: str, margin: int) -> TextMatch:
        if not path:
            return _miss(0)
        last = path[-1]
        if matched == last.end and last.terminal:  # a whole stored text
            outcome = TextOutcome.EXACT if matched == len(text) else TextOutcome.EXTEND
            return self._reuse(outcome, matched, path, len(path) - 1)
        stored = self._stored_end(last)
        if matched >= self.min_fraction * stored:
            for depth in range(len(path) - 1, -1, -1):
                node = path[depth]
                for i in range(len(node.ends) - 1, -1, -1):
                    if node.ends[i] <= matched and node.flags[i] & CUT:
                        return self._reuse(TextOutcome.DIVERGE, matched, path, depth, i + 1)
        for depth in range(len(path) - 2, -1, -1):  # the longest stored text it extends
            if path[depth].terminal:
                return self._reuse(TextOutcome.EXTEND, matched, path, depth)
        exact_part = 0
        while exact_part < len(path) and path[exact_part].exact:
            exact_part += 1
        limit = matched if exact_part == len(path) else path[exact_part].start
        return self._exact(path[:exact_part], matched, limit, margin)

    @staticmethod
    def _stored_end(node: TextNode) -> int:
        """Where the most recently used stored text through `node` ends."""
        while not node.terminal and node.children:
            node = max(
                (c for siblings in node.children.values() for c in siblings),
                key=lambda c: c.last_access,
            )
        return node.end

    @staticmethod
    def _reuse(
        outcome: TextOutcome,
        matched: int,
        path: list[TextNode],
        depth: int,
        tokens: int | None = None,
        exact: bool = False,
    ) -> TextMatch:
        """Reuse path[:depth] whole, then the first `tokens` of path[depth] (all: None)."""
        ids, ends, flags = array("q"), array("q"), bytearray()
        for node in path[:depth]:
            ids.extend(node.ids)
            ends.extend(node.ends)
            flags.extend(node.flags)
        last = path[depth]
        n = len(last.ids) if tokens is None else tokens
        ids.extend(last.ids[:n])
        ends.extend(last.ends[:n])
        flags.extend(last.flags[:n])
        return TextMatch(outcome, matched, ends[-1] if ends else 0, ids, ends, flags, exact)

    # -- insert ------------------------------------------------------------------------------------
    def insert(
        self,
        namespace: Hashable,
        text: str,
        ids: Sequence[int],
        ends: Sequence[int],
        flags: Sequence[int],
        exact: bool,
    ) -> None:
        """Store `text` tokenised as `ids`; `ends[i]` is the character after token i, `flags[i]`
        its CUT / SPLIT bits. `exact`: the ids are a full tokenization of `text` (its SPLIT flags
        are trusted by exact matches); otherwise they are anchored ids (generated, or reused)."""
        _check_tokens(text, ids, ends, flags)
        if self.max_chars == 0 or not ids:
            return
        keys = ids if isinstance(ids, array) and ids.typecode == "q" else array("q", ids)
        positions = ends if isinstance(ends, array) and ends.typecode == "q" else array("q", ends)
        root = self._roots.get(namespace)
        if root is None:
            root = TextNode(None, 0, "", array("q"), array("q"), bytearray())
            self._roots[namespace] = root
        node, at = root, 0
        self._clock += 1
        while at < len(ids):
            pos = ends[at - 1] if at else 0
            child, common = self._follow(node, keys, at, text[pos])
            if child is None:
                child = TextNode(
                    node,
                    pos,
                    text[pos:],
                    keys[at:],
                    positions[at:],
                    bytearray(flags[at:]),
                )
                node.add_child(child)
                self.chars += len(child.text)
                self.nodes += 1
                common = len(ids) - at
            elif child.ends[:common] != positions[at : at + common]:
                k = next(k for k in range(common) if child.ends[k] != positions[at + k])
                raise ValueError(
                    f"token {at + k} is stored ending at character {child.ends[k]}, given "
                    f"{positions[at + k]}: the same ids must spell the same characters"
                )
            elif common < len(child.ids):
                self._split(child, common)
            self._mark(child, flags, at, exact)
            child.last_access = self._clock
            at += common
            node = child
        node.terminal = True
        self._push(node)
        self._evict()

    @staticmethod
    def _follow(node: TextNode, ids: array, at: int, first: str) -> tuple[TextNode | None, int]:
        """The child the ids continue into and how many of its tokens they share, backed off
        to the last CUT (nodes only split between whole characters); (None, 0): none."""
        for child in node.children.get(first, ()):
            common = _common_ids(child.ids, ids, at)
            while common and not child.flags[common - 1] & CUT:
                common -= 1
            if common:
                return child, common
        return None, 0

    def _split(self, node: TextNode, tokens: int) -> None:
        """Cut `node` after its first `tokens` tokens; the rest becomes its only child."""
        cut = node.ends[tokens - 1] - node.start
        lower = TextNode(
            node,
            node.ends[tokens - 1],
            node.text[cut:],
            node.ids[tokens:],
            node.ends[tokens:],
            node.flags[tokens:],
        )
        lower.children, node.children = node.children, {}
        for siblings in lower.children.values():
            for child in siblings:
                child.parent = lower
        lower.exact, lower.anchored, lower.terminal = node.exact, node.anchored, node.terminal
        lower.last_access = node.last_access
        node.text, node.ids, node.ends = node.text[:cut], node.ids[:tokens], node.ends[:tokens]
        node.flags, node.terminal = node.flags[:tokens], False
        node.add_child(lower)
        self.nodes += 1
        if not lower.children:
            self._push(lower)

    @staticmethod
    def _mark(node: TextNode, flags: Sequence[int], at: int, exact: bool) -> None:
        if not exact:
            node.anchored = True
            return
        given = bytes(flags[at : at + len(node.flags)])
        if not node.exact:
            node.flags, node.exact = bytearray(given), True
        elif node.flags != given:  # a split point only where every full tokenization had one
            node.flags = bytearray(a & (b | CUT) for a, b in zip(node.flags, given, strict=True))

    # -- LRU ---------------------------------------------------------------------------------------
    def _touch(self, path: list[TextNode]) -> None:
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        if path and not path[-1].children:
            self._push(path[-1])

    def _push(self, node: TextNode) -> None:
        node.heap_version += 1
        self._counter += 1
        heapq.heappush(self._heap, (node.last_access, self._counter, node.heap_version, node))
        if len(self._heap) > 2 * self.nodes + 64:  # stale entries: rebuild from the leaves
            self._heap = [
                (n.last_access, self._counter + i, n.heap_version, n)
                for i, n in enumerate(self._leaves())
            ]
            self._counter += len(self._heap)
            heapq.heapify(self._heap)

    def _leaves(self) -> list[TextNode]:
        leaves, stack = [], list(self._roots.values())
        while stack:
            node = stack.pop()
            children = [c for siblings in node.children.values() for c in siblings]
            if not children and node.parent is not None:
                leaves.append(node)
            stack.extend(children)
        return leaves

    def _evict(self) -> None:
        while self.chars > self.max_chars and self._heap:
            _, _, version, node = heapq.heappop(self._heap)
            if version != node.heap_version or node.children or node.parent is None:
                continue
            parent = node.parent
            parent.remove_child(node)
            node.parent = None
            self.chars -= len(node.text)
            self.evicted_chars += len(node.text)
            self.nodes -= 1
            if parent.parent is None:
                if not parent.children:  # an empty namespace: drop its root
                    self._roots = {k: r for k, r in self._roots.items() if r is not parent}
            elif not parent.children:
                self._push(parent)

    # -- integrity ---------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Counts agree with the trees; every node's tokens tile its text; children hang off
        their parent's end at a character first letter they are filed under."""
        chars = nodes = 0
        for root in self._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                for first, siblings in node.children.items():
                    for child in siblings:
                        assert child.parent is node and child.start == node.end
                        assert child.text and child.text[0] == first
                        assert len(child.ids) == len(child.ends) == len(child.flags) > 0
                        assert child.ends[-1] == child.end and child.flags[-1] & CUT
                        assert list(child.ends) == sorted(child.ends)
                        chars += len(child.text)
                        nodes += 1
                        stack.append(child)
        assert (chars, nodes) == (self.chars, self.nodes), (chars, nodes, self.chars, self.nodes)
        assert self.chars <= self.max_chars


def _check_tokens(text: str, ids: Sequence[int], ends: Sequence[int], flags: Sequence[int]) -> None:
    if not (len(ids) == len(ends) == len(flags)):
        raise ValueError(
            f"ids, ends and flags differ in length: {len(ids)}, {len(ends)}, {len(flags)}"
        )
    if not ids:
        if text:
            raise ValueError(f"{len(text)} characters with no tokens")
        return
    if ends[-1] != len(text) or not flags[-1] & CUT:
        raise ValueError(
            f"the last token must end the text on a CUT: ends at {ends[-1]} of {len(text)}"
        )
    end = np.asarray(ends, dtype=np.int64)
    flag = np.asarray(flags, dtype=np.uint8)
    backwards = np.flatnonzero(end[1:] < end[:-1])
    if backwards.size:
        i = int(backwards[0]) + 1
        raise ValueError(f"token {i} ends at {end[i]}, before token {i - 1} ({end[i - 1]})")
    lone = np.flatnonzero((flag & SPLIT).astype(bool) & ~(flag & CUT).astype(bool))
    if lone.size:
        raise ValueError(f"token {int(lone[0])} is a SPLIT point but not a CUT")
    cuts = np.flatnonzero(flag & CUT)
    previous = np.concatenate(([0], end[cuts][:-1]))
    empty = np.flatnonzero(end[cuts] <= previous)
    if empty.size:
        i, cut = int(cuts[empty[0]]), int(previous[empty[0]])
        raise ValueError(f"token {i} cuts at {end[i]}: no character since the cut at {cut}")
