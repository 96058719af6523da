"""The `radixmesh` command line: serve a cluster, and talk to one.

radixmesh serve [--config FILE]          run the cluster until SIGTERM / Ctrl-C
radixmesh generate "text" [--image PATH ...]
                                         stream one completion to the terminal
radixmesh embed "text" ... [--dimensions N]
                                         each text's embedding, a JSON line each
radixmesh chat [...]                     an interactive conversation (each turn hits the cache)
radixmesh stats [...]                    per-worker counters and page usage
radixmesh adapters list|load NAME PATH|unload NAME [...]
                                         LoRA adapters on every worker (Admin RPCs)
radixmesh ray-token FILE                 a Ray token file for `ray start` and its clients
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path

import grpc
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from cluster.client import DEFAULT_TARGET, Client, text_request
from cluster.client_auth import add_token_argument
from cluster.client_tls import TlsOptionsError, add_tls_arguments, tls_from_args
from cluster.loadtest.cli import add_arguments as add_loadtest_arguments
from cluster.loadtest.cli import main as loadtest_main
from cluster.ray_token import create_token_file
from protos.radixmesh.v1 import serving_pb2
from worker.error_details import refusal_of
from worker.errors import ContextOverflow

console = Console(stderr=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixmesh", description="A cache-aware LLM serving cluster on Ray."
    )
    parser.add_argument("--version", action="version", version=f"radixmesh {version('radixmesh')}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the cluster until SIGTERM / Ctrl-C")
    serve.add_argument(
        "--config", default=None, help="YAML file (default: SmolLM2 on 2 CPU workers)"
    )
    for name, text in (
        ("generate", "stream one completion"),
        ("chat", "an interactive conversation"),
        ("embed", "the embedding of each text, a JSON line each"),
        ("stats", "per-worker counters"),
        ("adapters", "LoRA adapters: list, load NAME PATH, unload NAME (every worker)"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--target", default=DEFAULT_TARGET, help="router host:port")
        add_token_argument(sub)
        add_tls_arguments(sub)
        if name in ("generate", "chat"):
            sub.add_argument("--max-tokens", type=int32, default=128)
            sub.add_argument("--temperature", type=float, default=0.0)
            sub.add_argument("--seed", type=int64, default=None)
            sub.add_argument("--tenant", default="")
            sub.add_argument("--system", default=None, help="a system message")
            sub.add_argument("--adapter", default="", help="a LoRA adapter's name")
            sub.add_argument(
                "--priority",
                type=int32,
                default=0,
                help="lower is served earlier (a cluster with scheduling_policy: priority)",
            )
            sub.add_argument(
                "--thinking-budget",
                type=int32,
                default=None,
                metavar="N",
                help="a thinking model closes its reasoning after N tokens",
            )
    adapters = commands.choices["adapters"]
    adapters.add_argument("action", choices=("list", "load", "unload"))
    adapters.add_argument("name", nargs="?", default=None)
    adapters.add_argument("path", nargs="?", default=None, help="load: a PEFT directory")
    token = commands.add_parser(
        "ray-token", help="create a Ray token file (owner-only, random) unless one is there"
    )
    token.add_argument("file", help="e.g. the RAY_AUTH_TOKEN_PATH given to `ray start`")
    loadtest_parser = commands.add_parser("loadtest", help="drive a cluster with a workload")
    add_loadtest_arguments(loadtest_parser)
    embed = commands.choices["embed"]
    embed.add_argument("text", nargs="+")
    embed.add_argument("--dimensions", type=int, default=None, help="keep the first N values")
    embed.add_argument(
        "--no-normalize", action="store_true", help="the hidden state's own scale, not unit norm"
    )
    embed.add_argument("--tenant", default="")
    embed.add_argument("--adapter", default="", help="a LoRA adapter's name")
    commands.choices["generate"].add_argument("text")
    commands.choices["generate"].add_argument(
        "--raw", action="store_true", help="complete the text as is (no chat template)"
    )
    commands.choices["generate"].add_argument(
        "--suffix",
        metavar="TEXT",
        help="fill in the middle: what comes after the answer, the text being what comes "
        "before it (completed as is, as with --raw); for a model with fill-in-the-middle tokens",
    )
    shape = commands.choices["generate"].add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema", metavar="FILE", help="answer in JSON that this JSON Schema file accepts"
    )
    shape.add_argument("--json", action="store_true", help="answer in a JSON object")
    shape.add_argument("--regex", metavar="PATTERN", help="answer with text the pattern matches")
    shape.add_argument(
        "--choice", action="append", metavar="TEXT", help="answer with one of these; repeatable"
    )
    commands.choices["generate"].add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image file (PNG, JPEG, WebP) for a vision model; repeatable. In a chat the "
        'images come before the text; with --raw the text places each at an "<image>"',
    )
    commands.choices["generate"].add_argument(
        "--prediction",
        metavar="FILE",
        help="a text file the answer is expected to repeat, mostly (OpenAI's predicted outputs: "
        "decoding verifies it as drafts; the answer does not change)",
    )
    return parser


def _stream(client: Client, request: serving_pb2.GenerateRequest) -> tuple[str, object]:
    began, first, text, last = time.perf_counter(), None, [], None
    predicted = [0, 0]  # a prediction's accepted and rejected tokens
    try:
        for response in client.generate(request):
            if first is None:
                first = time.perf_counter() - began
            predicted[0] += response.accepted_prediction_tokens
            predicted[1] += response.rejected_prediction_tokens
            if response.reasoning_text:  # a thinking model's, dimmed on stderr: stdout answers
                console.print(escape(response.reasoning_text), style="dim", end="")
            sys.stdout.write(response.text)
            sys.stdout.flush()
            text.append(response.text)
            last = response
    except BaseException:  # an answer cut off ends its line before the error is told
        if text:
            sys.stdout.write("\n")
            sys.stdout.flush()
        raise
    sys.stdout.write("\n")
    if last is not None:
        prediction = (
            f"; prediction: {predicted[0]} tokens accepted, {predicted[1]} rejected"
            if request.sampling.prediction
            else ""
        )
        console.print(
            f"[dim]{last.worker}: {last.prompt_tokens} prompt tokens, "
            f"{last.cached_prompt_tokens} from cache; TTFT {1000 * (first or 0):.0f} ms; "
            f"{last.finish_reason}{prediction}[/]"
        )
    return "".join(text), last


def generate(args: argparse.Namespace, client: Client) -> int:
    if args.system is not None and (args.raw or args.suffix is not None):
        flag = "--raw" if args.raw else "--suffix"  # the text is completed as is: no messages
        console.print(f"[red]--system: not with {flag} (no chat template)[/]", soft_wrap=True)
        return 2
    try:
        images = [Path(path).read_bytes() for path in args.image]
    except OSError as err:
        console.print(f"[red]--image: {escape(str(err))}[/]", soft_wrap=True)
        return 2
    try:
        prediction = Path(args.prediction).read_text() if args.prediction else ""
    except (OSError, UnicodeDecodeError) as err:
        console.print(f"[red]--prediction: {escape(str(err))}[/]", soft_wrap=True)
        return 2
    common = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        tenant=args.tenant,
        adapter=args.adapter,
        images=images,
        priority=args.priority,
    )
    try:
        structured = _structured(args)
    except (OSError, UnicodeDecodeError) as err:
        console.print(f"[red]--json-schema: {escape(str(err))}[/]", soft_wrap=True)
        return 2
    if args.raw or args.suffix is not None:
        request = text_request(args.text, **common)
        request.suffix = args.suffix or ""
    else:
        chat = ([("system", args.system)] if args.system else []) + [("user", args.text)]
        request = text_request(chat=chat, **common)
        request.sampling.separate_reasoning = True
    _budget(args, request)
    request.sampling.prediction = prediction
    if structured is not None:
        request.sampling.structured.CopyFrom(structured)
    _stream(client, request)
    return 0


def embed(args: argparse.Namespace, client: Client) -> int:
    """One JSON line per text: its embedding, the prompt's tokens and how many of them the
    worker read from its cache, and which worker that was."""
    pooling = serving_pb2.PoolingParams(normalize=not args.no_normalize)
    if args.dimensions is not None:
        if not 1 <= args.dimensions < 2**32:
            console.print(f"[red]--dimensions: {args.dimensions} is out of range[/]")
            return 2
        pooling.dimensions = args.dimensions
    for index, text in enumerate(args.text):
        request = text_request(text, tenant=args.tenant, adapter=args.adapter)
        request.pooling.CopyFrom(pooling)
        (*_, last) = client.generate(request)
        line = {
            "index": index,
            "prompt_tokens": last.prompt_tokens,
            "cached_tokens": last.cached_prompt_tokens,
            "worker": last.worker,
            "embedding": list(last.embedding),
        }
        sys.stdout.write(json.dumps(line) + "\n")
    return 0


def int32(text: str) -> int:
    """An argument the wire carries in an int32 (the server judges its range further)."""
    value = int(text)
    if not -(2**31) <= value < 2**31:
        raise argparse.ArgumentTypeError(f"{value} does not fit in 32 bits")
    return value


def int64(text: str) -> int:
    """An argument the wire carries in an int64 (a seed)."""
    value = int(text)
    if not -(2**63) <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{value} does not fit in 64 bits")
    return value


def _budget(args: argparse.Namespace, request: serving_pb2.GenerateRequest) -> None:
    """`--thinking-budget`, as SamplingParams.thinking_token_budget (the server judges it)."""
    if args.thinking_budget is not None:
        request.sampling.thinking_token_budget = args.thinking_budget


def _structured(args: argparse.Namespace) -> serving_pb2.StructuredOutput | None:
    """The structured output the flags ask for (the server judges the schema and pattern)."""
    if args.json_schema is not None:
        return serving_pb2.StructuredOutput(json_schema=Path(args.json_schema).read_text())
    if args.json:
        return serving_pb2.StructuredOutput(json_object=True)
    if args.regex is not None:
        return serving_pb2.StructuredOutput(regex=args.regex)
    if args.choice:
        return serving_pb2.StructuredOutput(choice=serving_pb2.Choices(values=args.choice))
    return None


def chat(args: argparse.Namespace, client: Client) -> int:
    """A conversation until an empty line, end of input or Ctrl-C: 0, or 1 when a turn failed.
    When the conversation outgrows the model's context, its oldest exchanges are dropped until
    the turn fits. A turn the server refuses otherwise, or cuts off, is told with its status
    and left out, and the conversation goes on; a refused token or tenant ends it."""
    history: list[tuple[str, str]] = [("system", args.system)] if args.system else []
    console.print("[dim]Chat with the cluster; an empty line or Ctrl-D ends it.[/]")
    failed = False
    try:
        while line := _read_turn():
            history.append(("user", line))
            answer = _answer_turn(args, client, history)
            if answer is None:
                history.pop()
                failed = True
            else:
                history.append(("assistant", answer))
    except grpc.RpcError as err:  # the server refuses the caller: every turn would fail alike
        console.print(f"[red]{err.code().name}[/]: {escape(err.details() or '')}", soft_wrap=True)
        return 1
    except KeyboardInterrupt:
        return 130
    return 1 if failed else 0


def _read_turn() -> str:
    """The next line the user types; empty at the end of input."""
    try:
        return input("you> ").strip()
    except EOFError:
        return ""


CALLER_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def _answer_turn(
    args: argparse.Namespace, client: Client, history: list[tuple[str, str]]
) -> str | None:
    """The answer to the conversation's last turn, streamed; None, told, when the server
    refuses it or cuts it off. Raises on a refused token or tenant."""
    while True:
        request = text_request(
            chat=history,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            tenant=args.tenant,
            adapter=args.adapter,
            priority=args.priority,
        )
        request.sampling.separate_reasoning = True  # the history keeps the answers alone
        _budget(args, request)
        try:
            return _stream(client, request)[0]
        except grpc.RpcError as err:
            if err.code() in CALLER_REFUSED:
                raise
            if _too_long(err) and _drop_oldest_exchange(history):
                console.print("[dim](the oldest exchange was dropped to fit the context)[/]")
                continue
            details = escape(err.details() or "")
            console.print(f"[red]{err.code().name}[/]: {details} (turn left out)", soft_wrap=True)
            return None


def _too_long(err: grpc.RpcError) -> bool:
    """Whether the server refused a prompt for leaving no room in the context (or less room
    than max_tokens asks), as the call's rich status says (worker/error_details.py)."""
    return refusal_of(err)[1] == ContextOverflow.reason


def _drop_oldest_exchange(history: list[tuple[str, str]]) -> bool:
    """Remove the oldest user turn and the answer to it (never the system message or the turn
    being asked); False when there is none."""
    users = [i for i, (role, _) in enumerate(history[:-1]) if role == "user"]
    if not users:
        return False
    end = users[1] if len(users) > 1 else len(history) - 1
    del history[users[0] : end]
    return True


def stats(args: argparse.Namespace, client: Client) -> int:
    response = client.stats()
    table = Table(title=f"radixmesh at {args.target}: policy {response.policy}")
    names = max((len(w.worker) for w in response.workers), default=6)
    table.add_column("worker", no_wrap=True, min_width=names)  # squeeze the numbers first
    for column in ("ok", "reqs", "prompt", "cached", "gen", "run", "queue", "free pg",
                   "cached pg", "priv pg", "evicted", "preempt", "host pg", "down/up",
                   "host hit", "disk hit/skip/spill", "peer read/fail"):  # fmt: skip
        table.add_column(column, justify="right", no_wrap=True)
    for w in response.workers:
        table.add_row(
            w.worker, "yes" if w.healthy else "NO", str(w.requests_finished), str(w.prompt_tokens),
            str(w.cached_prompt_tokens), str(w.generated_tokens), str(w.running), str(w.waiting),
            f"{w.free_pages}/{w.total_pages}", str(w.cached_pages), str(w.private_pages),
            str(w.evicted_pages), str(w.preemptions),
            f"{w.host_cached_pages}/{w.host_total_pages}" if w.host_total_pages else "-",
            f"{w.demoted_pages}/{w.promoted_pages}", str(w.host_hit_tokens),
            f"{w.disk_hit_tokens}/{w.disk_skipped_tokens}/{w.disk_spilled_pages}",
            f"{w.peer_read_tokens}/{w.peer_read_failures}",
        )  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    print(
        f"routed {response.requests_routed}, retried {response.requests_retried}, in flight "
        f"{response.requests_in_flight}; cached tokens predicted {response.predicted_cached_tokens}"
        f", served {response.actual_cached_tokens}; router index {response.index_bytes} bytes"
    )
    t = response.text_index
    print(
        f"text index ({t.mode}): {t.prompts} prompts, {t.reused_chars} of {t.prompt_chars} "
        f"characters reused, {t.backoff_tokens} tokens of back-off; holds {t.chars} characters "
        f"in {t.nodes} nodes, {t.evicted_chars} evicted"
    )
    _tenant_table(response)
    return 0


def _tenant_table(response: serving_pb2.GetStatsResponse) -> None:
    """What each tenant the token may see used ("(shared)": no tenant)."""
    if not response.tenants and not response.uncounted_tenant_requests:
        return
    table = Table(title="tenants")
    table.add_column("tenant", no_wrap=True)
    for column in ("calls", "prompt", "cached", "from cache", "gen"):
        table.add_column(column, justify="right", no_wrap=True)
    for t in response.tenants:
        share = f"{t.cached_tokens / t.prompt_tokens:.1%}" if t.prompt_tokens else "-"
        table.add_row(
            t.tenant or "(shared)", str(t.requests), str(t.prompt_tokens), str(t.cached_tokens),
            share, str(t.generated_tokens),
        )  # fmt: skip
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    if response.uncounted_tenant_requests:
        print(
            f"{response.uncounted_tenant_requests} calls of tenants past metrics.max_tenants, "
            "not counted by name"
        )


def adapters(args: argparse.Namespace, client: Client) -> int:
    wanted = {"list": 0, "unload": 1, "load": 2}[args.action]
    given = [a for a in (args.name, args.path) if a is not None]
    if len(given) != wanted:
        usage = {"list": "list", "unload": "unload NAME", "load": "load NAME PATH"}[args.action]
        console.print(f"[red]radixmesh adapters {usage}[/]")
        return 2
    if args.action == "load":
        loaded = client.load_adapter(args.name, args.path).adapters
        workers = ", ".join(info.worker for info in loaded)
        print(f"loaded {args.name} ({loaded[0].identity if loaded else '-'}) on {workers}")
        return 0
    if args.action == "unload":
        answer = client.unload_adapter(args.name)
        print(f"unloaded {args.name} from {answer.workers} worker(s), {answer.pages_freed} pages")
        return 0
    table = Table(title=f"LoRA adapters at {args.target}")
    for column in ("name", "identity", "rank", "modules", "worker", "resident", "path"):
        table.add_column(column, no_wrap=column != "path")
    for info in client.list_adapters().adapters:
        table.add_row(
            info.name,
            info.identity,
            str(info.rank),
            ",".join(m.removesuffix("_proj") for m in info.target_modules),
            info.worker,
            "yes" if info.resident else "host",
            info.path,
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def ray_token(file: str) -> int:
    """Print the token file's path (never the token), creating it if missing; 2, with one
    line, when it cannot be made or read."""
    try:
        print(create_token_file(Path(file)))
    except (OSError, UnicodeDecodeError) as err:  # a directory it cannot make, a file it
        message = f"cannot use {file}: {err}"  # cannot write, one there that is not a token
        console.print(f"[red]radixmesh ray-token:[/] {escape(message)}", soft_wrap=True)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from cluster.serve import main as serve_main  # noqa: PLC0415 - client commands skip Ray and torch

        return serve_main(args.config)
    if args.command == "loadtest":
        return loadtest_main(args)
    if args.command == "ray-token":
        return ray_token(args.file)
    try:
        client = Client(args.target, args.token, tls_from_args(args))
    except TlsOptionsError as err:
        console.print(f"[red]{escape(str(err))}[/]", soft_wrap=True)
        return 2
    try:
        commands = {
            "generate": generate,
            "embed": embed,
            "chat": chat,
            "stats": stats,
            "adapters": adapters,
        }
        return commands[args.command](args, client)
    except grpc.RpcError as err:
        console.print(f"[red]{err.code().name}[/]: {escape(err.details() or '')}", soft_wrap=True)
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    raise SystemExit(main())
