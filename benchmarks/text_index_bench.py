"""What the router's text index (cache/text_index.py, cluster/text_prompts.py) saves on plain-text
multi-turn conversations, on the default model's tokenizer (SmolLM2-135M-Instruct).

A conversation is plain text: turn 1 is an opening text and a user message; every later turn is
the previous prompt + the previous answer + a new user message, appended without a separator.
The text is English from the repository's own docs (docs/*.md), seeded: it changes when they
do, so compare numbers within one run (each comes with its same-run baseline); `paragraphs`
gives another text (the tests pin one, so that a docs edit cannot move their workload). An answer's
ids are what a model would emit: `tokenizer.encode(answer)`, except where a boundary kind says
the model emitted its last newlines one by one.

- `time`: router tokenization time per request, with histories of --history-chars characters
  and more (every measured request is a later turn, so its history is at least that long): a
  full tokenization (`tokenizer.encode(text)`, what the router did without the index) against
  `TextPrompts.encode(ns, text, mode)` (match, back-off, tokenization of the rest, insert),
  after `finished` added the previous answer. In `exact` mode the ids must equal the full
  tokenization's for every request (asserted). Median and p90 of each, their ratio (target:
  exact >= 10x faster than a full tokenization) and the back-off in tokens per turn (matched
  tokens tokenised again). `finished`'s own time (the router runs it on a thread after the
  stream) is reported apart.
- `hits`: cache hits when the turns' boundaries change the merges: every turn has one of
  BOUNDARIES (the prompt ends with a space the answer's first word would merge with; the prompt
  ends inside a word the answer completes; the answer ends with "\\n\\n" as one token where the
  next text splits it; the answer's "\\n"s were generated one by one where the next text merges
  them), and the answers end mid-word, glued to the next message. The worker's cache is the real
  one (cache.SequenceCache over a PagePool, pages of --page-size, large enough that nothing is
  evicted): each request starts with its ids, commits its prompt, appends its generated ids and
  finishes with every position but the last sampled one, as a worker does; its cached tokens
  are `start`'s reused positions (whole pages, the tree caches no partial page). Per mode: off
  (a full tokenization, what the router did before), exact, anchored, and the ideal (the
  previous turn's prompt and generated ids continued by the new message's: every token the
  worker holds). Hit rate = cached prompt tokens / prompt tokens; anchored's gap to the ideal in
  tokens per turn (target: within one page). Exact's ids are a full tokenization's, so its hits
  equal off's by construction (reported, and its ids asserted equal).

Prints one JSON object (and --output), then tables on stderr.
Run: `python benchmarks/text_index_bench.py [--sections time hits] [--conversations N]`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from cache import CacheConfig, CacheNamespace, SequenceCache
from cluster.progress import progress_bar
from cluster.text_prompts import OFF, TextPrompts
from worker.tokenizer import Tokenizer

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("time", "hits")
MODES = ("exact", "anchored")
IDEAL = "ideal"
TIME_TARGET = 10.0
"""The issue's target: exact-mode tokenization at least this many times faster than a full one."""
BOUNDARIES = ("trailing-space", "split-word", "newline-token", "newline-steps")
"""How a turn's boundaries change the merges (see `build_conversations`)."""


# -- the workload ------------------------------------------------------------------------------
def corpus(root: Path = ROOT) -> list[str]:
    """Paragraphs of English: the repository's docs/*.md, split on blank lines."""
    paragraphs: list[str] = []
    for path in sorted((root / "docs").glob("*.md")):
        blocks = (block.strip() for block in path.read_text().split("\n\n"))
        paragraphs.extend(block for block in blocks if len(block) >= 40)
    if not paragraphs:
        raise ValueError(f"no text in {root / 'docs'}/*.md")
    return paragraphs


class TextSource:
    """Seeded English: runs of paragraphs and the words of the corpus."""

    def __init__(self, paragraphs: list[str], rng: random.Random) -> None:
        self.paragraphs = paragraphs
        self.rng = rng
        self.words = sorted(
            {w for p in paragraphs for w in p.split() if w.isalpha() and w.islower() and len(w) > 5}
        )

    def text(self, chars: int) -> str:
        """About `chars` characters of consecutive paragraphs, cut after a word, starting with a
        letter, ending with no whitespace."""
        start = self.rng.randrange(len(self.paragraphs))
        parts: list[str] = []
        size = 0
        while size < chars:
            part = self.paragraphs[(start + len(parts)) % len(self.paragraphs)]
            parts.append(part)
            size += len(part) + 2
        text = "\n\n".join(parts)
        cut = text.rfind(" ", 0, chars)
        text = text[: cut if cut > chars // 2 else chars].rstrip()
        first = next((i for i, c in enumerate(text) if c.isalpha()), 0)
        return text[first:]

    def word(self) -> str:
        return self.rng.choice(self.words)


@dataclass(frozen=True)
class Turn:
    message: str
    """Appended to the history as it is (turn 1: the opening text and the first message)."""
    answer: str
    generated: tuple[int, ...]
    """The ids the model emitted for `answer`."""
    boundary: str


@dataclass(frozen=True)
class Conversation:
    turns: tuple[Turn, ...]

    def prompts(self) -> Iterator[tuple[str, Turn]]:
        """Each turn's prompt text: the previous prompt + the previous answer + its message."""
        history = ""
        for turn in self.turns:
            history += turn.message
            yield history, turn
            history += turn.answer


@dataclass(frozen=True)
class Sizes:
    conversations: int
    turns: int
    opening_chars: int
    message_chars: int = 300
    answer_chars: int = 800


def _turn(
    source: TextSource, tokenizer: Tokenizer, sizes: Sizes, boundary: str, after: str
) -> Turn:
    """One turn's message and answer. `after`: the previous turn's boundary (its answer's end
    decides how this message starts)."""
    rng = source.rng
    lead = "\n" if after == "newline-steps" else ""  # merges with the "\n"s generated one by one
    message = lead + source.text(rng.randint(sizes.message_chars // 2, sizes.message_chars))
    answer = source.text(rng.randint(sizes.answer_chars // 2, sizes.answer_chars))
    if boundary == "trailing-space":  # " " + the answer's first word: one token when tokenised
        message += "\nAnswer: "
    elif boundary == "split-word":  # the answer completes the prompt's last word
        word = source.word()
        cut = rng.randint(2, len(word) - 2)
        message += " " + word[:cut]
        answer = word[cut:] + " " + answer
    else:
        message += "\n"
        answer += "\n\n"
    encode = tokenizer.encode
    if boundary == "newline-steps":
        generated = encode(answer[:-2], add_special_tokens=False) + 2 * encode("\n", False)
    else:
        generated = encode(answer, add_special_tokens=False)
    return Turn(message, answer, tuple(generated), boundary)


def build_conversations(
    tokenizer: Tokenizer, sizes: Sizes, seed: int, paragraphs: list[str] | None = None
) -> list[Conversation]:
    """Seeded conversations, each turn with a boundary of BOUNDARIES drawn at random:

    trailing-space  the message ends with "Answer: ", the answer starts with a word (a full
                    tokenization merges the space into it)
    split-word      the message ends inside a word, the answer completes it
    newline-token   the answer ends with "\\n\\n", generated as one token; the next message
                    starts with a letter (a full tokenization splits the "\\n\\n")
    newline-steps   the answer ends with "\\n\\n" generated one "\\n" at a time; the next message
                    starts with "\\n" (a full tokenization merges them)

    An answer that does not end in newlines ends after a word, where max_tokens would cut it,
    glued to the next message. Each conversation opens with a line of its own, so no two share
    a cached page."""
    rng = random.Random(seed)
    source = TextSource(corpus() if paragraphs is None else paragraphs, rng)
    conversations = []
    for c in range(sizes.conversations):
        opening = f"Conversation {c} ({rng.getrandbits(48):012x}).\n"
        opening += source.text(sizes.opening_chars) + "\n\n"
        turns, after = [], ""
        for _ in range(sizes.turns):
            boundary = rng.choice(BOUNDARIES)
            turns.append(_turn(source, tokenizer, sizes, boundary, after))
            after = boundary
        first = turns[0]
        turns[0] = Turn(opening + first.message, first.answer, first.generated, first.boundary)
        conversations.append(Conversation(tuple(turns)))
    return conversations


def requests(conversations: list[Conversation]) -> Iterator[tuple[int, int, str, Turn]]:
    """(conversation, turn, prompt text, turn) round-robin: every conversation's turn 1, then
    every turn 2, ... as concurrent users would send them."""
    walks = [c.prompts() for c in conversations]
    for t in range(max(len(c.turns) for c in conversations)):
        for i, walk in enumerate(walks):
            if t < len(conversations[i].turns):
                text, turn = next(walk)
                yield i, t, text, turn


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def boundary_changes(tokenizer: Tokenizer, conversations: list[Conversation]) -> dict:
    """How often a full tokenization of a later turn differs from the previous turn's prompt ids +
    generated ids inside them (the tokens a token-level cache loses there), per boundary kind of
    the previous turn."""
    kinds: dict[str, list[int]] = {}
    for conversation in conversations:
        previous: list[int] | None = None
        before: Turn | None = None
        for text, turn in conversation.prompts():
            ids = tokenizer.encode(text)
            if previous is not None and before is not None:
                lost = len(previous) - _common(ids, previous)
                kinds.setdefault(before.boundary, []).append(lost)
            previous, before = ids + list(turn.generated), turn
    every = [lost for losts in kinds.values() for lost in losts]
    return {
        "turns": len(every),
        "changed_fraction": sum(1 for lost in every if lost) / max(1, len(every)),
        "lost_tokens_per_turn": statistics.fmean(every) if every else 0.0,
        "by_boundary": {
            kind: {
                "turns": len(losts),
                "changed_fraction": sum(1 for lost in losts if lost) / len(losts),
                "lost_tokens_per_turn": statistics.fmean(losts),
            }
            for kind, losts in sorted(kinds.items())
        },
    }


# -- time --------------------------------------------------------------------------------------
def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": statistics.median(ordered),
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
        "mean": statistics.fmean(ordered),
        "max": ordered[-1],
    }


@dataclass
class TimeRun:
    mode: str
    full_ms: list[float] = field(default_factory=list)
    index_ms: list[float] = field(default_factory=list)
    parts_ms: dict[str, list[float]] = field(default_factory=dict)
    """Of `index_ms`: the index's match and insert, and the tokenization of the rest."""
    finished_ms: list[float] = field(default_factory=list)
    backoff: list[int] = field(default_factory=list)
    prompt_chars: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    mismatches: int = 0


PARTS = {"match": "index", "insert": "index", "spans": "spans"}
"""The calls `TextPrompts.encode` makes that `time_mode` times apart: TextIndex.match and
insert, TokenSpans.spans (the tokenization of what the index did not have)."""


def _timed(prompts: TextPrompts, spent: dict[str, int]) -> None:
    """Wrap the PARTS of `prompts` (its own instances) to add their nanoseconds to `spent`."""
    for name, owner in PARTS.items():
        target = getattr(prompts, owner)
        call = getattr(target, name)

        def timed(*args: Any, _call: Any = call, _name: str = name, **kwargs: Any) -> Any:
            began = time.perf_counter_ns()
            try:
                return _call(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter_ns() - began

        setattr(target, name, timed)


def time_mode(
    tokenizer: Tokenizer,
    conversations: list[Conversation],
    mode: str,
    progress: Progress | None = None,
) -> TimeRun:
    """Per later turn: a full tokenization and `TextPrompts.encode` of the same text, timed one
    after the other (and within the latter, its match, tokenization and insert); `finished`
    adds each answer. Exact mode's ids must equal the full one's."""
    prompts = TextPrompts(tokenizer, mode)
    spent = dict.fromkeys(PARTS, 0)
    _timed(prompts, spent)
    run = TimeRun(mode, parts_ms={name: [] for name in PARTS})
    clock = time.perf_counter_ns
    tokenizer.encode(conversations[0].turns[0].message)  # the tokenizer's first call is slower
    total = sum(len(c.turns) for c in conversations)
    task = progress.add_task(f"time: {mode}", total=total) if progress else None
    for _, t, text, turn in requests(conversations):
        began = clock()
        full = tokenizer.encode(text)
        between = clock()
        backoff = prompts.counters.backoff_tokens
        spent.update(dict.fromkeys(PARTS, 0))
        ids, taken = prompts.encode("bench", text, mode)
        ended = clock()
        if t:  # a later turn: its history is in the index
            run.full_ms.append((between - began) / 1e6)
            run.index_ms.append((ended - between) / 1e6)
            for name, ns in spent.items():
                run.parts_ms[name].append(ns / 1e6)
            run.backoff.append(prompts.counters.backoff_tokens - backoff)
            run.prompt_chars.append(len(text))
            run.prompt_tokens.append(len(full))
        if ids != full:
            run.mismatches += 1
            if mode == "exact":
                raise AssertionError(f"exact ids differ from a full tokenization at turn {t + 1}")
        assert taken is not None
        began = clock()
        prompts.finished(taken, [turn.generated])
        run.finished_ms.append((clock() - began) / 1e6)
        if progress is not None and task is not None:
            progress.advance(task)
    return run


def bench_time(
    tokenizer: Tokenizer,
    sizes: Sizes,
    seed: int,
    modes: Sequence[str],
    paragraphs: list[str] | None = None,
) -> dict:
    conversations = build_conversations(tokenizer, sizes, seed, paragraphs)
    runs = []
    with progress_bar(console=console, transient=True) as progress:
        for mode in modes:
            runs.append(time_mode(tokenizer, conversations, mode, progress))
    result: dict = {
        "conversations": sizes.conversations,
        "turns": sizes.turns,
        "history_chars": sizes.opening_chars,
        "requests": len(runs[0].full_ms),
        "prompt_chars": _ms([float(c) for c in runs[0].prompt_chars]),
        "prompt_tokens": _ms([float(n) for n in runs[0].prompt_tokens]),
        "full_ms": _ms(runs[0].full_ms),
        "target_ratio": TIME_TARGET,
        "modes": {},
    }
    for run in runs:
        full, index = statistics.median(run.full_ms), statistics.median(run.index_ms)
        full90, index90 = _ms(run.full_ms)["p90"], _ms(run.index_ms)["p90"]
        result["modes"][run.mode] = {
            "full_ms": _ms(run.full_ms),  # the same run's baseline
            "index_ms": _ms(run.index_ms),
            "index_parts_ms": {name: _ms(values) for name, values in run.parts_ms.items()},
            "finished_ms": _ms(run.finished_ms),
            "ratio_p50": full / index,
            "ratio_p90": full90 / index90,
            "backoff_tokens_per_turn": statistics.fmean(run.backoff),
            "ids_identical": run.mismatches == 0,
            "requests_with_other_ids": run.mismatches,
        }
    if "exact" in result["modes"]:
        result["within_target"] = result["modes"]["exact"]["ratio_p50"] >= TIME_TARGET
    return result


# -- hits --------------------------------------------------------------------------------------
@dataclass
class HitRun:
    mode: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    later_turns: int = 0
    later_cached_tokens: int = 0
    cached: list[int] = field(default_factory=list)
    """Per request, in `requests` order."""
    mismatches: int = 0
    """Requests whose ids differ from a full tokenization."""

    def row(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_rate": self.cached_tokens / max(1, self.prompt_tokens),
            "cached_tokens_per_later_turn": self.later_cached_tokens / max(1, self.later_turns),
            "requests_with_other_ids": self.mismatches,
        }


def _cache(conversations: list[Conversation], page_size: int) -> SequenceCache:
    """A worker's cache large enough for every request of the run: nothing is evicted (every
    request's whole text, histories counted again each turn: far more than the distinct
    tokens, even where a character takes a few byte tokens)."""
    chars = sum(len(text) + len(turn.answer) for c in conversations for text, turn in c.prompts())
    pages = chars // page_size + 2 * sum(len(c.turns) for c in conversations) + 64
    config = CacheConfig(pages, page_size, max_sequences=2, block_size=max(16, page_size))
    return SequenceCache(config)


def hit_mode(
    tokenizer: Tokenizer,
    conversations: list[Conversation],
    mode: str,
    page_size: int = 16,
    progress: Progress | None = None,
) -> HitRun:
    """The conversations' requests through one mode's ids and a worker's cache."""
    prompts = TextPrompts(tokenizer, mode if mode in MODES else "exact")
    cache = _cache(conversations, page_size)
    namespace = CacheNamespace()
    ideal: dict[int, list[int]] = {}
    run = HitRun(mode)
    total = sum(len(c.turns) for c in conversations)
    task = progress.add_task(f"hits: {mode}", total=total) if progress else None
    for c, t, text, turn in requests(conversations):
        full = tokenizer.encode(text)
        taken = None
        if mode in MODES:
            ids, taken = prompts.encode("bench", text, mode)
        elif mode == IDEAL:  # the previous turn's ids and generated ids, then the new message's
            before = ideal.get(c)
            ids = full if before is None else before + tokenizer.encode(turn.message, False)
            ideal[c] = ids + list(turn.generated)
        else:
            ids = full
        if ids != full:
            run.mismatches += 1
            if mode == "exact":
                raise AssertionError(f"exact ids differ from a full tokenization at turn {t + 1}")
        generated = list(turn.generated)
        seq = cache.start(ids, namespace, reserve=len(ids) + len(generated))
        cache.commit(seq, len(ids))
        cache.append(seq, generated)
        cache.finish(seq, len(ids) + len(generated) - 1)  # the last sampled token has no KV
        run.prompt_tokens += len(ids)
        run.cached_tokens += seq.reused
        run.cached.append(seq.reused)
        if t:
            run.later_turns += 1
            run.later_cached_tokens += seq.reused
        if taken is not None:
            prompts.finished(taken, [turn.generated])
        if progress is not None and task is not None:
            progress.advance(task)
    assert cache.tree.evicted_pages == 0, "the pool was too small: hits lost to eviction"
    return run


def bench_hits(
    tokenizer: Tokenizer,
    sizes: Sizes,
    seed: int,
    page_size: int,
    paragraphs: list[str] | None = None,
) -> dict:
    conversations = build_conversations(tokenizer, sizes, seed, paragraphs)
    runs = {}
    with progress_bar(console=console, transient=True) as progress:
        for mode in (OFF, *MODES, IDEAL):
            runs[mode] = hit_mode(tokenizer, conversations, mode, page_size, progress)
    later = runs[IDEAL].later_turns
    best = runs[IDEAL]
    modes = {}
    for mode, run in runs.items():
        modes[mode] = run.row()
        gaps = [b - m for b, m in zip(best.cached, run.cached, strict=True)]
        modes[mode]["gap_to_ideal_tokens_per_later_turn"] = sum(gaps) / max(1, later)
        modes[mode]["gap_to_ideal_tokens_max"] = max(gaps)
    gap = modes["anchored"]["gap_to_ideal_tokens_per_later_turn"]
    return {
        "conversations": sizes.conversations,
        "turns": sizes.turns,
        "opening_chars": sizes.opening_chars,
        "page_size": page_size,
        "requests": len(best.cached),
        "boundaries": boundary_changes(tokenizer, conversations),
        "modes": modes,
        "exact_equals_off": runs["exact"].cached == runs[OFF].cached,
        "target_gap_tokens": page_size,
        "within_target": gap <= page_size,
    }


# -- report ------------------------------------------------------------------------------------
def _identical(mode: str, row: dict) -> str:
    if row["ids_identical"]:
        return "yes"
    other = row["requests_with_other_ids"]
    return f"{other} differ (generated ids)" if mode == "anchored" else f"NO: {other} differ"


def time_table(result: dict) -> Table:
    table = Table(
        title=f"router tokenization per request: {result['requests']} later turns, histories "
        f"{result['prompt_chars']['p50']:,.0f} chars median (>= {result['history_chars']:,}), "
        f"target >= {result['target_ratio']:g}x"
    )
    for column in ("mode", "full p50/p90 ms", "index p50/p90 ms", "ratio p50/p90"):
        table.add_column(column, justify="right")
    table.add_column("of which match / tokenize / insert p50 ms", justify="right")
    for column in ("back-off tok/turn", "finished p50 ms", "ids = full tokenization"):
        table.add_column(column, justify="right")
    for mode, row in result["modes"].items():
        full, index, parts = row["full_ms"], row["index_ms"], row["index_parts_ms"]
        table.add_row(
            mode,
            f"{full['p50']:.2f} / {full['p90']:.2f}",
            f"{index['p50']:.3f} / {index['p90']:.3f}",
            f"{row['ratio_p50']:.1f}x / {row['ratio_p90']:.1f}x",
            " / ".join(f"{parts[name]['p50']:.3f}" for name in ("match", "spans", "insert")),
            f"{row['backoff_tokens_per_turn']:.1f}",
            f"{row['finished_ms']['p50']:.2f}",
            _identical(mode, row),
        )
    return table


def hit_table(result: dict) -> Table:
    b = result["boundaries"]
    table = Table(
        title=f"cache hits, {result['requests']} requests, pages of {result['page_size']}: "
        f"full tokenization changed the previous turn's ids in {b['changed_fraction']:.0%} of "
        f"later turns ({b['lost_tokens_per_turn']:.1f} tokens a turn); target: anchored within "
        f"{result['target_gap_tokens']} tokens of ideal"
    )
    for column in ("mode", "prompt tokens", "cached", "hit rate", "cached/later turn"):
        table.add_column(column, justify="right")
    table.add_column("gap to ideal tok/turn (max)", justify="right")
    table.caption = "full tokenization against the previous turn's ids, by its boundary: " + (
        ", ".join(
            f"{kind} {row['changed_fraction']:.0%} changed, {row['lost_tokens_per_turn']:.1f} "
            f"tokens lost"
            for kind, row in b["by_boundary"].items()
        )
    )
    names = {OFF: "off (today)"}
    for mode, row in result["modes"].items():
        table.add_row(
            names.get(mode, mode),
            f"{row['prompt_tokens']:,}",
            f"{row['cached_tokens']:,}",
            f"{row['hit_rate']:.1%}",
            f"{row['cached_tokens_per_later_turn']:.1f}",
            f"{row['gap_to_ideal_tokens_per_later_turn']:.1f} ({row['gap_to_ideal_tokens_max']})",
        )
    return table


def load_tokenizer(path: Path | None) -> Tokenizer:
    """--tokenizer DIR, else the default model's (converted once from its GGUF)."""
    if path is None:
        from worker.default_model import default_model_dir  # imports torch: only when needed

        path = default_model_dir()
    return Tokenizer.from_dir(path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--conversations", type=int, default=16, help="time: conversations")
    parser.add_argument("--turns", type=int, default=8, help="time: turns per conversation")
    parser.add_argument("--history-chars", type=int, default=50_000, help="time: opening text")
    parser.add_argument(
        "--time-modes", nargs="+", choices=MODES, default=list(MODES), help="time: modes"
    )
    parser.add_argument("--hit-conversations", type=int, default=32)
    parser.add_argument("--hit-turns", type=int, default=8)
    parser.add_argument("--hit-opening-chars", type=int, default=2_000)
    parser.add_argument("--message-chars", type=int, default=300)
    parser.add_argument("--answer-chars", type=int, default=800)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = load_tokenizer(args.tokenizer)
    result: dict = {"seed": args.seed}
    tables = []
    if "time" in args.sections:
        sizes = Sizes(
            args.conversations, args.turns, args.history_chars, args.message_chars,
            args.answer_chars,
        )  # fmt: skip
        result["time"] = bench_time(tokenizer, sizes, args.seed, args.time_modes)
        tables.append(time_table(result["time"]))
    if "hits" in args.sections:
        sizes = Sizes(
            args.hit_conversations, args.hit_turns, args.hit_opening_chars, args.message_chars,
            args.answer_chars,
        )  # fmt: skip
        result["hits"] = bench_hits(tokenizer, sizes, args.seed, args.page_size)
        tables.append(hit_table(result["hits"]))
    print(json.dumps(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    wide = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    for table in tables:
        wide.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
