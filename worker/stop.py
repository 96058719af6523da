"""Stop strings over streamed text, holding back what could still become a stop string.

    text so far:  "... the answer is 42.\\n\\nUs"      stop = ("\\n\\nUser:",)
                                    ^^^^^^^^^ held back: it may be the start of "\\n\\nUser:"

What `feed` returns, concatenated (plus `flush` at the end), is the generated text cut just
before the first stop string (which is not included), as OpenAI's and vLLM's APIs do.
"""

from __future__ import annotations


class StopChecker:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add decoded text; returns (text now safe to emit, whether a stop string ended it)."""
        if self.stopped:
            return "", True
        before = len(self.text)
        self.text += delta
        found = -1
        for stop in self.stops:
            at = self.text.find(stop, max(0, before - len(stop) + 1))
            if at != -1 and (found == -1 or at < found):
                found = at
        if found != -1:
            self.stopped = True
            return self._emit(found), True
        return self._emit(len(self.text) - self._held_back()), False

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text, longest = self.text, 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def flush(self) -> str:
        """Everything not yet emitted (generation ended for another reason)."""
        return "" if self.stopped else self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self.emitted:
            return ""
        out = self.text[self.emitted : upto]
        self.emitted = upto
        return out
