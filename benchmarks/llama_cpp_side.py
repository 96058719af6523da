"""llama.cpp on the same GGUF file, for prefill_bench's `--against llama.cpp`.

Uses `llama-cpp-python` (module `llama_cpp`) when it is installed and builds nothing itself: it
is not a radixmesh dependency. Install it by hand to compare, e.g.
`CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36` (builds llama.cpp from
source, ~45 minutes on a shared 2-core machine with one compile job). `unavailable()` says in
one line why it cannot run.

llama.cpp runs in a process of its own (`measure_in_subprocess`: this module as a script, a
JSON job on stdin, a JSON result on stdout), never beside torch: both bring an OpenMP thread
pool, and in one process they spin against each other. Measured here, 2 threads each: llama.cpp
decoded 22.8 tokens/s and took 7.3 s for a cold 256-token prompt in a process that had imported
torch, 73.6 tokens/s and 1.3 s alone.

What is measured is what radixmesh's side measures, token ids in, so both see the same tokens:

- `cold_ttft(prompt)`: nothing reused from before, the prompt evaluated and one token sampled;
- `decode(prompt, n)`: greedy tokens after the prompt (top-k 1), tokens/s from the first token
  to the last, as the engine's side counts them;
- `chat_ttfts(turns)`: the turns of interleaved conversations in order, each a whole prompt (the
  conversation so far): llama.cpp keeps one sequence's KV and reuses the longest common prefix
  with the previous prompt, so a switch to the other conversation recomputes it, as a
  one-slot llama.cpp server does.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODULE = "llama_cpp"
REPO = Path(__file__).resolve().parents[1]


def unavailable() -> str | None:
    """None when llama-cpp-python is installed, else why not (one line). Does not import it."""
    try:
        found = importlib.util.find_spec(MODULE) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "llama-cpp-python is not installed (module llama_cpp not found)"


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


def measure(job: dict[str, Any]) -> dict[str, Any]:
    """Run a job: {"gguf", "threads", "n_ctx", "repeats", and any of "cold": [prompts],
    "decode": {"prompt", "new_tokens"}, "chats": [turn prompts]} -> the same keys measured."""
    llm = LlamaCpp(Path(job["gguf"]), job["threads"], job["n_ctx"])
    result: dict[str, Any] = {"llama_cpp_python": llm.version, "gguf": Path(job["gguf"]).name}
    prompts = [*job.get("cold", []), *job.get("chats", [])]
    prompts += [job["decode"]["prompt"]] if "decode" in job else []
    if prompts:
        llm.cold_ttft(prompts[0][:64])  # warm-up
    if "cold" in job:
        ms = {}
        for prompt in job["cold"]:
            times = [llm.cold_ttft(prompt) for _ in range(job["repeats"])]
            ms[str(len(prompt))] = 1000 * statistics.median(times)
        result["cold"] = {"ttft_ms": ms}
    if "decode" in job:
        result["decode"] = llm.decode(job["decode"]["prompt"], job["decode"]["new_tokens"])
    if "chats" in job:
        seconds = llm.chat_ttfts(job["chats"])
        result["chats"] = {"ttft_ms": [1000 * t for t in seconds], "sum_ttft_s": sum(seconds)}
    return result


def measure_in_subprocess(job: dict[str, Any]) -> dict[str, Any]:
    """`measure(job)` in a fresh Python process (no torch in it: module docstring)."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.llama_cpp_side"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama.cpp measurement failed ({done.returncode}): {tail[0]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    print(json.dumps(measure(json.load(sys.stdin))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
