"""OpenAI's Batch API on the router: a file of requests, run in the background, its answers
written to an output file (and the refusals to an error file) the client downloads.

Each request of a batch is sent to this router's own HTTP app, in the process (httpx2's
ASGI transport), with its creator's credentials and tenant: it is served as the same request
sent by the client would be (the endpoint's schema, limits, routing, errors, metrics; a
streamed or background body is refused with the file), and its answer is the line's
`response` (`status_code`, `request_id`, `body`). A request refused for load (429: the
router's or the workers' queues full) or for want of a worker (503: a router just restarted,
its workers not back yet) is sent again after a pause, for up to OVERLOAD_WAIT_S, before its
line records the refusal.

Order: the requests run `router.batch_order`: `prefix` (the default) sorted by their prompts,
so that requests sharing a prefix (a system prompt, a document asked several questions) run
one after another while their prefix is cached, wherever the file put them; `file` in the
file's order. `router.batch_max_in_flight` requests of all batches run at once, each also
counted against `router.max_in_flight` as any request is; under the `priority` scheduling
policy those that set no `priority` run at `router.batch_priority` (1: after interactive
requests, at 0 by default). The output file keeps the input's order whatever the order run.

Statuses: `in_progress` from creation (the file is read and checked then: a bad file makes the batch
`failed` at once, its errors naming each line at fault), `finalizing` while the files are written,
`completed`; `cancelling` from a cancel until the requests running have ended (their worker calls
closed, their pages freed), then `cancelled`, with the answers received so far. A router that drains
sends no more requests: its batches end `cancelled` once those running have, with an error saying
so; one that stops cancels them. An ended batch keeps only its object (its requests, answers and the
creator's credentials are let go), MAX_ENDED of them (past that, the oldest of the tenant with the
most ended is forgotten). Without `router.state_dir`, batches live in the router's memory: a restart
loses them (and their files), as vLLM's and SGLang's in-memory stores are lost. With it, a batch
outlives a restart: its object (with its creator's credentials while it runs) is written to
`batches/<id>.json` as it changes state, and each answered line is appended to
`batches/<id>.answers.jsonl` as it comes. A router that starts reads them back: an ended batch is
listed as it ended; a running one runs the lines that have no answer yet (those in flight when the
router went down run again), then writes its files as if it had never stopped. A router that stops
leaves its running batches to the next one instead of cancelling them. `completion_window` is
accepted and not enforced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

from cluster.http.batch_runner import BatchRunner
from cluster.http.batch_schema import (
    COMPLETION_WINDOW,
    ENDPOINTS,
    MESSAGES,
    Batch,
    BatchCreateRequest,
    BatchError,
    BatchErrors,
    BatchLine,
    BatchUsage,
    read_lines,
)
from cluster.http.errors import HttpError
from cluster.http.file_store import FileStore, StoredFile
from cluster.http.list_places import ListPlaces
from cluster.http.state_files import append_line, journal, remove, write_json, write_lines

log = logging.getLogger(__name__)

WINDOW_S = 24 * 3600
OUTPUT_PURPOSE = "batch_output"
INPUT_PURPOSE = "message_batch"
"""The purpose of an Anthropic batch's files, its requests and its results: kept and bounded as
files are, not listed or read by the Files API."""

ENDED = ("failed", "completed", "cancelled", "expired")
MAX_ENDED = 10_000
"""Ended batches kept (their objects, a kilobyte or two each; the oldest of the tenant with the
most forgotten first)."""


@dataclass
class RunningBatch:
    batch: Batch
    tenant: str
    headers: dict[str, str]
    """The creator's credentials and tenant (dropped once the batch ends)."""
    lines: list[BatchLine]
    answers: dict[int, dict[str, Any]] = field(default_factory=dict)
    """Line number -> its output or error line, as it ended (dropped once written)."""
    task: asyncio.Task[None] | None = None


class Batches:
    def __init__(
        self, files: FileStore, runner: BatchRunner, directory: Path | None = None
    ) -> None:
        self.files = files
        self.runner = runner
        """Sends the requests (shared with Anthropic's batches: one bound for both)."""
        self.directory = directory
        """Where each batch's object and answers are written (None: nowhere; module docstring)."""
        self._stopping = False
        """Set as the router stops: with a `directory`, the running batches are left to the
        next router, not ended."""
        self._batches: OrderedDict[tuple[str, str], RunningBatch] = OrderedDict()
        """(tenant, batch id) -> the batch, in the order created; at most MAX_ENDED ended
        (`_prune`)."""
        self.places = ListPlaces()
        """Each batch's place in that order, and those of the batches forgotten last."""

    # -- the API ---------------------------------------------------------------------------
    async def create(self, tenant: str, headers: dict[str, str], body: BatchCreateRequest) -> Batch:
        """The batch, running (or `failed` when its file is not a batch's requests)."""
        self.files.require()
        if body.endpoint not in ENDPOINTS:
            raise HttpError.invalid("endpoint", f"must be one of {list(ENDPOINTS)}")
        if body.completion_window != COMPLETION_WINDOW:
            raise HttpError.invalid("completion_window", f"must be {COMPLETION_WINDOW!r}")
        source = self.files.get(tenant, body.input_file_id)
        if source.card.purpose == INPUT_PURPOSE:  # not a file of the Files API's
            raise HttpError(404, f"no file {body.input_file_id!r}", "input_file_id")
        if source.card.purpose != "batch":
            raise HttpError.invalid(
                "input_file_id", f"{body.input_file_id!r} is a {source.card.purpose!r} file"
            )
        self._check_room(tenant)
        return await self._start(tenant, headers, body.endpoint, source, body.metadata)

    async def create_messages(
        self, tenant: str, headers: dict[str, str], content: bytes, lines: list[BatchLine]
    ) -> Batch:
        """Anthropic's Message Batch (cluster/http/message_batches.py): `content` is its
        requests as an input file's lines for MESSAGES, kept as a file of its own (INPUT_PURPOSE,
        not listed by the Files API) that counts against `router.files_bytes`; `lines`: the
        same requests read (not read again from `content`)."""
        self.files.require()
        self._check_room(tenant)
        card = self.files.upload(tenant, "message_batch_requests.jsonl", INPUT_PURPOSE, content)
        await self.files.save(tenant, card.id)
        source = self.files.get(tenant, card.id)
        return await self._start(tenant, headers, MESSAGES, source, None, "msgbatch", lines)

    def _check_room(self, tenant: str) -> None:
        full = self.files.full(tenant)
        if full is not None:  # its output would be kept past the bound
            raise HttpError(400, f"{full}: delete files before creating a batch")
        if not self.runner.accepting():
            raise HttpError(503, "the router is draining; retry on another")

    async def _start(
        self,
        tenant: str,
        headers: dict[str, str],
        endpoint: str,
        source: StoredFile,
        metadata: dict[str, str] | None,
        kind: str = "batch",
        read: list[BatchLine] | None = None,
    ) -> Batch:
        now = int(time.time())
        batch = Batch(
            id=f"{kind}_{uuid.uuid4().hex}",
            endpoint=endpoint,
            input_file_id=source.card.id,
            completion_window=COMPLETION_WINDOW,
            created_at=now,
            expires_at=now + WINDOW_S,
            metadata=metadata,
        )
        errors: list[BatchError] = []
        if read is not None:  # its requests, read as they were written
            lines = read
        else:  # a large file takes a while to read: off the loop every stream shares
            lines, errors = await asyncio.to_thread(read_lines, source.content, endpoint)
        running = RunningBatch(batch, tenant, headers, lines)
        self._keep(running)
        if errors:
            batch.status, batch.failed_at = "failed", now
            batch.errors = BatchErrors(data=errors)
            self._ended(running)
            self._save(running)
            self._prune()
            return batch.model_copy(deep=True)
        batch.status, batch.in_progress_at = "in_progress", now
        batch.request_counts.total = len(lines)
        batch.model = next((m for x in lines if isinstance(m := x.body.get("model"), str)), None)
        self._save(running)
        running.task = asyncio.ensure_future(self._run(running))
        return batch.model_copy(deep=True)

    def get(self, tenant: str, batch_id: str, messages: bool = False) -> Batch:
        return self._running(tenant, batch_id, messages).batch.model_copy(deep=True)

    def listed(self, tenant: str, messages: bool = False) -> list[Batch]:
        """The tenant's batches, most recent first: OpenAI's, or (`messages`) Anthropic's."""
        self.files.require()
        mine = [
            r.batch
            for (owner, _), r in self._batches.items()
            if owner == tenant and (r.batch.endpoint == MESSAGES) == messages
        ]
        return [b.model_copy(deep=True) for b in reversed(mine)]

    def delete(self, tenant: str, batch_id: str) -> None:
        """Forget an ended batch, with its files (Anthropic's delete; 400 while it runs)."""
        batch = self._running(tenant, batch_id, messages=True).batch
        if batch.status not in ENDED:
            raise HttpError.invalid(
                "message_batch_id", f"batch {batch_id!r} is {batch.status}: cancel it first"
            )
        del self._batches[(tenant, batch_id)]
        self._forget(tenant, batch, own_files=True)

    async def cancel(self, tenant: str, batch_id: str, messages: bool = False) -> Batch:
        """Stop a running batch (one that ended is answered as it stands)."""
        running = self._running(tenant, batch_id, messages)
        batch = running.batch
        if batch.status == "in_progress":
            batch.status, batch.cancelling_at = "cancelling", int(time.time())
            self._save(running)  # a router that starts before it ended ends it cancelled
            assert running.task is not None
            running.task.cancel()
        return batch.model_copy(deep=True)

    async def close(self) -> None:
        """Cancel every running batch and wait for their ends (the router stops); with a
        `directory`, stop them where they are instead, for the next router to go on with."""
        tasks = [r.task for r in self._batches.values() if r.task is not None and not r.task.done()]
        self._stopping = True
        for running in self._batches.values():
            if running.batch.status == "in_progress" and self.directory is None:
                running.batch.status, running.batch.cancelling_at = "cancelling", int(time.time())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _running(self, tenant: str, batch_id: str, messages: bool = False) -> RunningBatch:
        """The batch, OpenAI's or (`messages`) Anthropic's; 404 for one of the other kind."""
        self.files.require()
        found = self._batches.get((tenant, batch_id))
        if found is None or (found.batch.endpoint == MESSAGES) != messages:
            raise HttpError(404, f"no batch {batch_id!r}", "batch_id")
        return found

    def _keep(self, running: RunningBatch) -> None:
        """Add a batch; beyond MAX_ENDED ended ones, the oldest ended is forgotten."""
        self._batches[(running.tenant, running.batch.id)] = running
        self.places.add(running.tenant, running.batch.id)
        self._prune()

    def _prune(self) -> None:
        """Beyond MAX_ENDED ended batches, forget the oldest ended of the tenant with the most
        ended (the oldest such on a tie): a tenant running many pushes out its own, not
        another's. An Anthropic batch goes with its files, which nothing else reaches."""
        ended = [key for key, r in self._batches.items() if r.batch.status in ENDED]
        if len(ended) <= MAX_ENDED:
            return
        counts = Counter(tenant for tenant, _ in ended)
        for _ in range(len(ended) - MAX_ENDED):
            most = max(counts.values())
            key = next(key for key in ended if counts[key[0]] == most)
            ended.remove(key)
            counts[key[0]] -= 1
            self._forget(key[0], self._batches.pop(key).batch, own_files=False)

    def _forget(self, tenant: str, batch: Batch, own_files: bool) -> None:
        """Let go of a batch: on disk, and its files if they are its own (`own_files`, or an
        Anthropic batch's, which the Files API does not reach)."""
        self.places.remove(tenant, batch.id)
        if self.directory is not None:  # forgotten here: forgotten by the next router too
            remove(self._object_path(batch.id), self.directory / f"{batch.id}.answers.jsonl")
        if not (own_files or batch.endpoint == MESSAGES):
            return
        for file_id in (batch.input_file_id, batch.output_file_id, batch.error_file_id):
            if file_id is not None and self.files.find(tenant, file_id) is not None:
                self.files.delete(tenant, file_id)

    # -- running it ------------------------------------------------------------------------
    async def _run(self, running: RunningBatch) -> None:
        """Send the requests (`BatchRunner.run`), then end the batch; with a directory, a
        router that stops or drains leaves it to the next one instead."""
        stopped = False
        try:  # a cancel from the first await on still ends the batch (`_finish`)
            stopped = await self.runner.run(
                running.batch.id,
                running.lines,
                running.answers,
                running.batch.endpoint,
                running.headers,
                lambda *answered: self._record(running, *answered),
            )
        finally:
            if not ((self._stopping or stopped) and self.directory is not None):
                await self._finish(running, stopped)

    def _record(
        self,
        running: RunningBatch,
        line: BatchLine,
        request_id: str,
        status: int | None,
        body: Any,
        failure: str | None,
    ) -> None:
        response = None if status is None else {"status_code": status, "request_id": request_id}
        if response is not None:
            response["body"] = body
        error = None if failure is None else {"code": "request_failed", "message": failure}
        answer = {
            "id": request_id,
            "custom_id": line.custom_id,
            "response": response,
            "error": error,
        }
        running.answers[line.number] = answer
        _tally(running.batch, answer)
        if self.directory is not None:
            try:
                append_line(self._answers(running), {"line": line.number, "answer": answer})
            except OSError:  # it runs again if the router restarts before the batch ends
                log.exception(
                    "batch %s: line %d's answer not written", running.batch.id, line.number
                )

    async def _finish(self, running: RunningBatch, stopped: bool) -> None:
        """Write the output and error files (the input's order), end the batch, and let go of
        its requests, answers and credentials. `stopped`: the router drained before every
        request was sent."""
        batch = running.batch
        if stopped:
            batch.status, batch.cancelling_at = "cancelling", int(time.time())
            message = "the router drained before every request ran"
            batch.errors = BatchErrors(data=[BatchError(code="router_draining", message=message)])
        if batch.status != "cancelling":
            batch.status, batch.finalizing_at = "finalizing", int(time.time())
        good, bad = await asyncio.to_thread(_encoded, running)
        if good:
            batch.output_file_id = await self._output(running, "output", good)
        if bad:
            batch.error_file_id = await self._output(running, "errors", bad)
        now = int(time.time())
        if batch.status == "cancelling":
            batch.status, batch.cancelled_at = "cancelled", now
        else:
            batch.status, batch.completed_at = "completed", now
        self._ended(running)
        if self._save(running) and self.directory is not None:  # else it ends again, the same
            remove(self._answers(running))
        self._prune()

    async def _output(self, running: RunningBatch, kind: str, content: bytes) -> str:
        """An output or error file kept (and written to the state directory: if that fails it
        is kept in memory all the same, and logged). Its id is the batch's, so a batch ended
        again after a restart (the router stopped while it ended) replaces it."""
        batch_id = running.batch.id.removeprefix("batch_")
        card = self.files.keep(
            running.tenant,
            f"{running.batch.id}_{kind}.jsonl",
            INPUT_PURPOSE if running.batch.endpoint == MESSAGES else OUTPUT_PURPOSE,
            content,
            file_id=f"file-{batch_id}-{kind}",
        )
        await self.files.save(running.tenant, card.id, refuse=False)
        return card.id

    def reading(self, tenant: str, file_id: str) -> str | None:
        """The batch still running that reads the file (its lines are read from it again
        after a restart), if any."""
        for (owner, _), running in self._batches.items():
            batch = running.batch
            if owner == tenant and batch.input_file_id == file_id and batch.status not in ENDED:
                return batch.id
        return None

    # -- outliving a restart (module docstring) ---------------------------------------------
    def _object_path(self, batch_id: str) -> Path:
        assert self.directory is not None
        return self.directory / f"{batch_id}.json"

    def _answers(self, running: RunningBatch) -> Path:
        assert self.directory is not None
        return self.directory / f"{running.batch.id}.answers.jsonl"

    def _save(self, running: RunningBatch) -> bool:
        """Write the batch's object as it stands (with the credentials its requests carry,
        while it runs); False when that failed (logged)."""
        if self.directory is None:
            return False
        saved = {
            "batch": running.batch.model_dump(mode="json"),
            "tenant": running.tenant,
            "headers": running.headers,
        }
        try:
            write_json(self._object_path(running.batch.id), saved)
        except OSError:
            log.exception("batch %s not written to router.state_dir", running.batch.id)
            return False
        return True

    async def resume(self) -> None:
        """Read back the batches a router before this one wrote, oldest first, and go on with
        those that had not ended (the router's HTTP app attached: their requests need it)."""
        if self.directory is None:
            return
        found = []
        for partial in self.directory.glob("*.partial"):  # a write a crash cut short
            remove(partial)
        for path in chain(
            self.directory.glob("batch_*.json"), self.directory.glob("msgbatch_*.json")
        ):
            try:
                saved = json.loads(path.read_bytes())
                batch = Batch.model_validate(saved["batch"])
                found.append((batch, str(saved["tenant"]), dict(saved["headers"])))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                log.error("batch %s left out: %s", path.stem, err)
        for batch, tenant, headers in sorted(found, key=lambda f: (f[0].created_at, f[0].id)):
            running = RunningBatch(batch, tenant, headers, [])
            self._keep(running)
            if batch.status not in ENDED:
                await self._go_on(running)
        self._drop_orphans()

    def _drop_orphans(self) -> None:
        """What no batch read back refers to: a journal whose object was never written or
        was removed, and an Anthropic batch's file (a crash between writing it and the batch's
        object, or an object left out): nothing could reach them."""
        assert self.directory is not None
        for answers in self.directory.glob("*.answers.jsonl"):
            batch_id = answers.name.removesuffix(".answers.jsonl")
            if not self._object_path(batch_id).exists():
                remove(answers)
        referred = {
            (tenant, file_id)
            for (tenant, _), r in self._batches.items()
            for file_id in (r.batch.input_file_id, r.batch.output_file_id, r.batch.error_file_id)
        }
        for tenant, card in self.files.every():
            if card.purpose == INPUT_PURPOSE and (tenant, card.id) not in referred:
                log.warning("file %s of no message batch removed", card.id)
                self.files.delete(tenant, card.id)

    async def _go_on(self, running: RunningBatch) -> None:
        """A batch that had not ended: its answered lines as they were, the rest run."""
        batch = running.batch
        source = self.files.find(running.tenant, batch.input_file_id)
        if source is None:  # deleted before the router stopped: nothing left to run
            batch.status, batch.failed_at = "failed", int(time.time())
            message = f"its input file {batch.input_file_id!r} is gone"
            batch.errors = BatchErrors(data=[BatchError(code="input_file_gone", message=message)])
            self._ended(running)
            if self._save(running):
                remove(self._answers(running))
            return
        running.lines, _ = await asyncio.to_thread(read_lines, source.content, batch.endpoint)
        counts, batch.usage = batch.request_counts, None
        counts.completed = counts.failed = 0
        numbers = {line.number for line in running.lines}
        for entry in journal(self._answers(running)):
            if not _answer_entry(entry, numbers):
                log.error("batch %s: a journal line left out: %.200r", batch.id, entry)
                continue
            running.answers[entry["line"]] = entry["answer"]
            _tally(batch, entry["answer"])
        # written again whole: the next answers start on a line of their own, not after a
        # line a crash cut short
        rows = [{"line": k, "answer": a} for k, a in sorted(running.answers.items())]
        try:
            write_lines(self._answers(running), rows)
        except OSError:
            log.exception("batch %s: its journal could not be written again", batch.id)
        if batch.status == "in_progress":
            running.task = asyncio.ensure_future(self._run(running))
        else:  # cancelling: ended with what was answered
            running.task = asyncio.ensure_future(self._finish(running, False))

    @staticmethod
    def _ended(running: RunningBatch) -> None:
        running.lines, running.answers, running.headers = [], {}, {}


def _encoded(running: RunningBatch) -> tuple[bytes, bytes]:
    """The output file's and the error file's JSON Lines, in the input's order."""
    good: list[str] = []
    bad: list[str] = []
    for line in running.lines:
        answer = running.answers.get(line.number)
        if answer is not None:
            response = answer["response"]
            ok = response is not None and response["status_code"] == 200
            (good if ok else bad).append(json.dumps(answer, ensure_ascii=False) + "\n")
    return "".join(good).encode(), "".join(bad).encode()


def _answer_entry(entry: Any, numbers: set[int]) -> bool:
    """Whether a journal line is an answer of one of the batch's lines."""
    if not isinstance(entry, dict) or entry.get("line") not in numbers:
        return False
    answer = entry.get("answer")
    if not isinstance(answer, dict):
        return False
    response = answer.get("response")
    return response is None or isinstance(response, dict)


def _tally(batch: Batch, answer: dict[str, Any]) -> None:
    """Count an answered line in the batch's counts, and a completed one's usage."""
    response = answer.get("response") or {}
    ok = response.get("status_code") == 200
    batch.request_counts.completed += ok
    batch.request_counts.failed += not ok
    if ok and isinstance(response.get("body"), dict):
        _add_usage(batch, response["body"].get("usage"))


def _add_usage(batch: Batch, usage: Any) -> None:
    """Add a completed request's usage (the chat and completions APIs' names, or the Responses
    API's) to the batch's."""
    if not isinstance(usage, dict):
        return
    total = batch.usage = batch.usage or BatchUsage()
    prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
    output = usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    reasoning = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
    total.input_tokens += prompt
    total.output_tokens += output
    total.total_tokens += prompt + output
    total.input_tokens_details.cached_tokens += details.get("cached_tokens", 0) or 0
    total.output_tokens_details.reasoning_tokens += reasoning.get("reasoning_tokens", 0) or 0
