"""llama.cpp on the same GGUF file, for prefill_bench's `--against llama.cpp`.

Uses `llama-cpp-python` (module `llama_cpp`) when it is importable and builds nothing itself:
it is not a radixmesh dependency. Install it by hand to compare, e.g.
`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36` (builds llama.cpp from
source, ~10 minutes on 2 cores). `unavailable()` says in one line why it cannot run.

What is measured is what radixmesh's side measures, token ids in, so both see the same tokens:

- `cold_ttft(prompt)`: the KV state emptied, then the prompt evaluated and one token sampled;
- `decode(prompt, n)`: greedy tokens after the prompt (top-k 1), tokens/s from the first token
  to the last, as the engine's side counts them;
- `chat_ttfts(turns)`: the turns of interleaved conversations in order, each a whole prompt (the
  conversation so far): llama.cpp keeps one sequence's KV and reuses the longest common prefix
  with the previous prompt, so a switch to the other conversation recomputes it, as a
  one-slot llama.cpp server does.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path
from typing import Any

MODULE = "llama_cpp"


def unavailable() -> str | None:
    """None when llama-cpp-python imports, else why not (one line)."""
    try:
        importlib.import_module(MODULE)
    except ImportError as err:
        return f"llama-cpp-python is not installed ({err.msg})"
    return None


class LlamaCpp:
    """One llama.cpp model on a GGUF file, `threads` CPU threads, a context of `n_ctx`."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        llama_cpp = importlib.import_module(MODULE)
        self.version = str(getattr(llama_cpp, "__version__", "?"))
        self.llm: Any = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def _first_token(self, prompt: list[int]) -> int:
        """Evaluate what of `prompt` is not already in the KV state (generate() keeps the longest
        common prefix with the tokens evaluated before), sample greedily."""
        for token in self.llm.generate(prompt, top_k=1, temp=0.0):
            return int(token)
        raise RuntimeError("llama.cpp generated nothing")

    def cold_ttft(self, prompt: list[int]) -> float:
        """Seconds to the first token of `prompt` with nothing cached."""
        self.llm.reset()  # no prefix to reuse: the next eval overwrites the KV from 0
        began = time.perf_counter()
        self._first_token(prompt)
        return time.perf_counter() - began

    def decode(self, prompt: list[int], new_tokens: int) -> dict[str, Any]:
        """Greedy `new_tokens` after `prompt`: tokens/s between the first and the last."""
        self.llm.reset()
        stamps, tokens = [], []
        for token in self.llm.generate(prompt, top_k=1, temp=0.0):
            stamps.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == new_tokens:
                break
        return {
            "tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "tokens": tokens,
        }

    def chat_ttfts(self, turns: list[list[int]]) -> list[float]:
        """Seconds to the first token of each prompt, in order, nothing cached before the first
        (llama.cpp reuses whatever prefix the previous prompt left in its one sequence)."""
        self.llm.reset()
        seconds = []
        for prompt in turns:
            began = time.perf_counter()
            self._first_token(prompt)
            seconds.append(time.perf_counter() - began)
        return seconds
