"""Stop strings over streamed text, holding back what could still become a stop string.

    text so far:  "... the answer is 42.\\n\\nUs"      stop = ("\\n\\nUser:",)
                                    ^^^^^^^^^ held back: it may be the start of "\\n\\nUser:"

What `feed` returns, concatenated (plus `flush` at the end), is the generated text cut just
before the first stop string to complete (the longest, where several end on the same
character), which is not included, as OpenAI's and vLLM's APIs do (vLLM's
`include_stop_str_in_output` keeps it: `include`). Text fed while the checker is not `armed`
(vLLM's `min_tokens` not yet generated) moves the automaton but ends nothing: a stop string that
ends there is passed over, one that ends later is found.

The strings are compiled once into an Aho-Corasick automaton (`StopStrings`, cached per small
set of strings) whose state is the longest tail of the text that begins some stop string: each
character costs one transition whatever the number of strings, the state's depth is exactly
what to hold back, and a state that ends a string is a stop.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache


class StopStrings:
    """The automaton of one set of stop strings. Immutable once built; shared by requests."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.children: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.ends = [0]
        """Length of the longest stop string ending at this state (0: none)."""
        for stop in stops:
            state = 0
            for char in stop:
                nxt = self.children[state].get(char)
                if nxt is None:
                    nxt = len(self.children)
                    self.children[state][char] = nxt
                    self.children.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.ends.append(0)
                state = nxt
            self.ends[state] = len(stop)
        self.fail = [0] * len(self.children)
        self._link()

    def _link(self) -> None:
        """Failure links, breadth first: a state's link is the longest proper suffix of its
        string that is also a state; `ends` inherits along them (a shorter stop inside)."""
        queue = deque(self.children[0].values())
        while queue:
            state = queue.popleft()
            self.ends[state] = self.ends[state] or self.ends[self.fail[state]]
            for char, child in self.children[state].items():
                link = self.fail[state]
                while link and char not in self.children[link]:
                    link = self.fail[link]
                found = self.children[link].get(char, 0)
                self.fail[child] = found if found != child else 0
                queue.append(child)

    def step(self, state: int, char: str) -> int:
        while True:
            nxt = self.children[state].get(char)
            if nxt is not None:
                return nxt
            if state == 0:
                return 0
            state = self.fail[state]


CACHED_CHARS = 512
"""Sets up to this many characters in all are kept once built (64 of them, a few MB at most);
larger ones (up to 16 x 256 characters: about 1 MB and 25 ms to build) are built per request."""


def compile_stops(stops: tuple[str, ...]) -> StopStrings:
    """The automaton of `stops`, built once per distinct small set (requests mostly repeat
    theirs)."""
    if sum(map(len, stops)) > CACHED_CHARS:
        return StopStrings(stops)
    return _compile_cached(stops)


@lru_cache(maxsize=64)
def _compile_cached(stops: tuple[str, ...]) -> StopStrings:
    return StopStrings(stops)


class StopChecker:
    """One sample's position in its request's stop strings."""

    def __init__(self, stops: StopStrings | tuple[str, ...], include: bool = False) -> None:
        self.strings = stops if isinstance(stops, StopStrings) else compile_stops(stops)
        self.include = include
        """Whether the stop string that ends the text is part of it."""
        self.state = 0
        self.pending = ""
        """Text not emitted yet: exactly the tail the state stands for."""
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the text, once one did."""

    def feed(self, delta: str, armed: bool = True) -> tuple[str, bool]:
        """Add decoded text; returns (text now safe to emit, whether a stop string ended it).
        Not `armed`, no stop string ends it."""
        if self.stopped:
            return "", True
        if not self.strings.stops:
            return delta, False
        text = self.pending + delta
        offset = len(self.pending)
        strings, state = self.strings, self.state
        for i, char in enumerate(delta):
            state = strings.step(state, char)
            if strings.ends[state] and armed:
                end = offset + i + 1
                self.stopped, self.pending = True, ""
                self.matched = text[end - strings.ends[state] : end]
                return text[: end if self.include else end - strings.ends[state]], True
        self.state = state
        keep = len(text) - strings.depth[state]
        self.pending = text[keep:]
        return text[:keep], False

    def flush(self) -> str:
        """Everything not yet emitted (generation ended for another reason)."""
        out, self.pending = self.pending, ""
        return "" if self.stopped else out
