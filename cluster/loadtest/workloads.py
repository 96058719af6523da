"""The load test's workloads: seeded sessions of requests.

A session is what one user does: a sequence of requests, each sent after the previous answer
arrived. Most workloads are one request per session; `multi-turn` resends the whole
conversation every turn, the server's real answers included (as text), which is what makes a
chat hit the cache turn after turn.

    shared-prefix     K system prompts x short questions
    multi-turn        conversations: every turn = the history so far + a new question
    plain-multi-turn  the same as one plain text: every turn = the previous prompt + the
                      server's answer + a new message, appended without a separator; each
                      message ends with "Answer: " and the next one starts right after the
                      answer's last character: where the answer starts with a letter or ends
                      inside a word, a full tokenization merges across the join and leaves the
                      ids the worker cached, which the router's text index (anchored) keeps
    few-shot          long few-shot templates + a question
    random            unrelated prompts: nothing to share
    trace             a Mooncake-format trace (token ids), arrival times and lengths scaled

Namespaces are drawn per session from weighted tenant and adapter mixes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from cluster.loadtest.trace import MOONCAKE_TRACE, BlockExpander, read_trace

_PARAGRAPH = (
    "the cache router worker prefix token page radix tree request answer question system model "
    "prompt stream latency throughput memory batch decode prefill attention kernel policy load "
    "cluster node tenant adapter block hash event index snapshot queue budget chunk sample seed "
    "time first second fast slow small large every each which where when what why how because "
    "and or but not only also then so if it is was are be has have had do does can will would "
    "should may might must shall one two three four five many few more most less least all none "
    "some any other same different new old long short high low good better best simple clear "
    "read write keep send receive route share reuse compute evict lock free hold move split merge"
)
WORDS = _PARAGRAPH.split()
WORKLOADS = ("shared-prefix", "multi-turn", "plain-multi-turn", "few-shot", "random", "trace")
TEXT_MATCHES = ("exact", "anchored", "off")
"""How the router's text index tokenises a text or chat prompt (serving.proto TextMatch)."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What to send; exactly one of text, chat and token_ids."""

    max_tokens: int
    text: str | None = None
    chat: tuple[tuple[str, str], ...] | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass
class Session:
    session_id: int
    tenant: str = ""
    adapter: str = ""
    arrival_s: float | None = None
    """When the session starts, for trace-timed arrivals."""
    turns: list[RequestSpec] = field(default_factory=list)
    """Fixed requests, sent in order (single-turn workloads and traces)."""
    questions: list[str] = field(default_factory=list)
    """Multi-turn: the user's messages; each turn adds the previous answer to the history."""
    system: str | None = None
    max_tokens: int = 32
    history: list[tuple[str, str]] = field(default_factory=list)
    plain: bool = False
    """Multi-turn as one text: `system`, then each message and answer appended as they are."""
    text: str = ""
    """Plain multi-turn: the text sent last."""
    text_match: str | None = None
    """One of TEXT_MATCHES, sent with every request; None: the router's own mode."""
    prefix: str = ""
    """Put before every text prompt (a chat's first message): marks a run's texts apart."""

    @property
    def length(self) -> int:
        return len(self.questions) or len(self.turns)

    def request(self, turn: int, previous_answer: str | None) -> RequestSpec:
        """The `turn`-th request, given the answer to the previous one."""
        if not self.questions:
            return _marked(self.turns[turn], self.prefix)
        if self.plain:
            if turn == 0:
                self.text = self.system or ""
            else:
                self.text += previous_answer or ""
            self.text += self.questions[turn]
            return RequestSpec(self.max_tokens, text=self.prefix + self.text)
        if turn == 0:
            self.history = [("system", self.system)] if self.system else []
        else:
            self.history.append(("assistant", previous_answer or ""))
        self.history.append(("user", self.questions[turn]))
        return _marked(RequestSpec(self.max_tokens, chat=tuple(self.history)), self.prefix)


def _marked(spec: RequestSpec, prefix: str) -> RequestSpec:
    if not prefix:
        return spec
    if spec.text is not None:
        return replace(spec, text=prefix + spec.text)
    if spec.chat:
        (role, content), *rest = spec.chat
        return replace(spec, chat=((role, prefix + content), *rest))
    return spec  # token ids: nothing to mark


def with_text_match(sessions: list[Session], mode: str | None, prefix: str = "") -> list[Session]:
    """Fresh copies of `sessions` whose requests ask for the text match `mode`, their texts
    after `prefix`."""
    return [replace(s, text_match=mode, prefix=prefix, history=[], text="") for s in sessions]


@dataclass(frozen=True)
class WorkloadOptions:
    requests: int
    seed: int = 0
    max_tokens: int = 32
    tenants: Sequence[tuple[str, float]] = (("", 1.0),)
    adapters: Sequence[tuple[str, float]] = (("", 1.0),)
    trace: Path = MOONCAKE_TRACE
    trace_block_tokens: int = 32
    trace_time_scale: float = 1.0
    """Multiplies the trace's timestamps (0.1: ten times faster)."""
    vocab_size: int = 49_152
    max_model_len: int = 2048
    turns: int = 4


def _budget(o: WorkloadOptions) -> int:
    """Words a prompt may spend: a quarter of the context (tokenizers spend ~1-3 tokens a word),
    so prompts, conversation histories and answers fit whatever model is served."""
    return max(16, o.max_model_len // 4)


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _pick(rng: random.Random, weighted: Sequence[tuple[str, float]]) -> str:
    names, weights = zip(*weighted, strict=True)
    return rng.choices(names, weights=weights)[0]


def build(name: str, options: WorkloadOptions) -> list[Session]:
    """Sessions holding `options.requests` requests in all."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {WORKLOADS}")
    rng = random.Random(options.seed)
    sessions = _trace(options) if name == "trace" else _BUILDERS[name](rng, options)
    for session in sessions:
        session.tenant = _pick(rng, options.tenants)
        session.adapter = _pick(rng, options.adapters)
    return sessions


def _shared_prefix(rng: random.Random, o: WorkloadOptions) -> list[Session]:
    systems = [_words(rng, _budget(o) // 2) + "." for _ in range(4)]
    return [
        Session(
            i,
            turns=[
                RequestSpec(
                    o.max_tokens, text=f"{rng.choice(systems)} {_words(rng, rng.randint(8, 24))}?"
                )
            ],
        )
        for i in range(o.requests)
    ]


def _multi_turn(rng: random.Random, o: WorkloadOptions, plain: bool = False) -> list[Session]:
    conversations = max(1, o.requests // o.turns)
    longest = max(4, min(40, _budget(o) // (2 * o.turns)))
    sessions = []
    for i in range(conversations):
        turns = o.turns if i < conversations - 1 else o.requests - o.turns * (conversations - 1)
        questions = [
            _words(rng, rng.randint(longest // 2, longest)) + "?" for _ in range(max(1, turns))
        ]
        system = _words(rng, 20)
        if plain:  # no separator: the answer follows the space, the next message the answer
            questions = [f"{question} Answer: " for question in questions]
            system += ".\n"
        sessions.append(
            Session(i, questions=questions, system=system, max_tokens=o.max_tokens, plain=plain)
        )
    return sessions


def _plain_multi_turn(rng: random.Random, o: WorkloadOptions) -> list[Session]:
    return _multi_turn(rng, o, plain=True)


def _few_shot(rng: random.Random, o: WorkloadOptions) -> list[Session]:
    shots = max(2, int(0.6 * _budget(o)) // 45)  # a shot is ~45 words
    templates = [
        "\n".join(f"Q: {_words(rng, 20)}? A: {_words(rng, 25)}." for _ in range(shots))
        for _ in range(2)
    ]
    return [
        Session(
            i,
            turns=[
                RequestSpec(o.max_tokens, text=f"{rng.choice(templates)}\nQ: {_words(rng, 20)}? A:")
            ],
        )
        for i in range(o.requests)
    ]


def _random(rng: random.Random, o: WorkloadOptions) -> list[Session]:
    return [
        Session(
            i,
            turns=[
                RequestSpec(
                    o.max_tokens, text=_words(rng, rng.randint(_budget(o) // 5, _budget(o) // 2))
                )
            ],
        )
        for i in range(o.requests)
    ]


def _trace(o: WorkloadOptions) -> list[Session]:
    expander = BlockExpander(o.trace_block_tokens, o.vocab_size)
    sessions = []
    for i, record in enumerate(read_trace(o.trace, o.requests)):
        output = min(expander.scaled(record.output_length), o.max_tokens)
        length = min(expander.scaled(record.input_length), o.max_model_len - output - 1)
        prompt = tuple(expander.prompt(record.hash_ids, length))
        sessions.append(
            Session(
                i,
                arrival_s=record.timestamp_ms / 1000.0 * o.trace_time_scale,
                turns=[RequestSpec(output, token_ids=prompt)],
            )
        )
    if not sessions:
        raise ValueError(f"the trace {o.trace} holds no records")
    return sessions


_BUILDERS = {
    "shared-prefix": _shared_prefix,
    "multi-turn": _multi_turn,
    "plain-multi-turn": _plain_multi_turn,
    "few-shot": _few_shot,
    "random": _random,
}
