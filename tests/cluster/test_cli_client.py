"""`radixmesh generate`, `chat` and `stats` as a user runs them: subprocesses against a server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.local_cluster import LocalCluster, start_cluster
from tests.worker.thinking_fixtures import thinking_model
from worker.loader import load_model
from worker.tiny_model import build_tiny_checkpoint

SCRIPT = shutil.which("radixmesh", path=str(Path(sys.executable).parent))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    running = start_cluster(load_model(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))))
    yield running
    running.close()


def run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    assert SCRIPT is not None
    return subprocess.run(
        [SCRIPT, *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def test_generate_streams_the_answer_and_reports_the_cache(cluster: LocalCluster) -> None:
    args = ["generate", "The router", "--target", cluster.target, "--max-tokens", "12"]
    first, second = run(*args, "--raw"), run(*args, "--raw")
    assert first.returncode == 0 and first.stdout.strip()
    assert first.stdout == second.stdout  # greedy
    assert "0 from cache" in first.stderr and "worker-" in first.stderr
    chat = run(*args)  # through the chat template
    assert chat.returncode == 0 and chat.stdout.strip()


def test_generate_with_a_prediction_answers_the_same_and_says_what_it_was_worth(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    args = ["generate", "The router", "--target", cluster.target, "--max-tokens", "24", "--raw"]
    plain = run(*args)
    assert plain.returncode == 0 and "prediction" not in plain.stderr
    (tmp_path / "prediction.txt").write_text(plain.stdout.removesuffix("\n"))
    predicted = run(*args, "--prediction", str(tmp_path / "prediction.txt"))
    assert predicted.returncode == 0 and predicted.stdout == plain.stdout
    said = " ".join(predicted.stderr.split())  # the console may wrap the line
    counts = re.search(r"prediction: (\d+) tokens accepted, (\d+) rejected", said)
    assert counts is not None and int(counts[1]) > 0, predicted.stderr
    missing = run(*args, "--prediction", str(tmp_path / "none.txt"))
    assert missing.returncode == 2 and "--prediction" in missing.stderr


def test_generate_answers_in_the_shape_asked(cluster: LocalCluster, tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"tier": {"enum": ["device", "host", "disk"]}},
        "required": ["tier"],
        "additionalProperties": False,
    }
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    common = ["--target", cluster.target, "--max-tokens", "60", "--temperature", "1", "--seed", "7"]
    out = run("generate", "Which tier?", *common, "--json-schema", str(tmp_path / "schema.json"))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tier"] in ("device", "host", "disk")
    out = run("generate", "Pick", *common, "--choice", "red", "--choice", "blue")
    assert out.returncode == 0 and out.stdout.strip() in ("red", "blue"), out
    out = run("generate", "Code?", *common, "--regex", "[0-9]{4}")
    assert out.returncode == 0 and re.fullmatch(r"[0-9]{4}", out.stdout.strip()), out
    bad = run("generate", "x", *common, "--regex", "a(b")
    assert bad.returncode == 1 and "sampling.structured.regex: does not compile" in bad.stderr
    missing = run("generate", "x", *common, "--json-schema", str(tmp_path / "none.json"))
    assert missing.returncode == 2 and "--json-schema" in missing.stderr


def test_chat_keeps_the_conversation_and_hits_the_cache(cluster: LocalCluster) -> None:
    out = run("chat", "--target", cluster.target, "--max-tokens", "8", stdin="Hello\nAnd then?\n\n")
    assert out.returncode == 0
    reports = [line for line in out.stderr.splitlines() if "from cache" in line]
    assert len(reports) == 2
    assert "0 from cache" not in reports[1]  # the second turn resends the first


def test_a_refused_chat_turn_is_reported_and_the_chat_goes_on(cluster: LocalCluster) -> None:
    """A turn too long for the context is refused with its status and left out; the next
    turn is answered, without it, and the exit status says a turn failed."""
    too_long = "word " * 600  # the tiny model's context is 512 tokens
    out = run("chat", "--target", cluster.target, "--max-tokens", "8", stdin=f"{too_long}\nHi\n")
    assert out.returncode == 1, out.stderr
    assert "INVALID_ARGUMENT" in out.stderr and "leave no room" in out.stderr
    assert "(turn left out)" in out.stderr
    reports = [line for line in out.stderr.splitlines() if "prompt tokens" in line]
    assert len(reports) == 1 and int(reports[0].split(": ")[1].split()[0]) < 100, reports


def test_a_chat_outgrowing_the_context_drops_its_oldest_exchanges(cluster: LocalCluster) -> None:
    """Turns of 150 words into a 512-token context: every turn is answered, the oldest
    exchanges making room (it used to be refused, then every turn after it)."""
    turns = "".join(f"{i} " + "word " * 150 + "\n" for i in range(4))
    out = run("chat", "--target", cluster.target, "--max-tokens", "8", stdin=turns)
    assert out.returncode == 0, out.stderr
    assert "(the oldest exchange was dropped to fit the context)" in out.stderr
    reports = [line for line in out.stderr.splitlines() if "prompt tokens" in line]
    assert len(reports) == 4, out.stderr
    assert all(int(line.split(": ")[1].split()[0]) <= 512 - 8 for line in reports), reports


def test_stats_prints_every_worker(cluster: LocalCluster) -> None:
    run("generate", "warm", "--target", cluster.target, "--max-tokens", "2", "--raw")
    out = run("stats", "--target", cluster.target)
    assert out.returncode == 0
    assert "worker-0" in out.stdout and "worker-1" in out.stdout and "routed" in out.stdout
    shared = next(line for line in out.stdout.splitlines() if "(shared)" in line)
    assert int(shared.split("│")[2]) >= 1, out.stdout  # the calls of no tenant, counted


def test_errors_are_reported_with_their_status(cluster: LocalCluster) -> None:
    out = run("generate", "x", "--target", cluster.target, "--temperature", "-1")
    assert out.returncode == 1
    assert "INVALID_ARGUMENT" in out.stderr and "temperature" in out.stderr
    down = run("stats", "--target", "127.0.0.1:1")
    assert down.returncode == 1 and "UNAVAILABLE" in down.stderr


def test_generate_with_a_thinking_model_answers_on_stdout_and_reasons_on_stderr(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tiny = load_model(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))
    thinking = thinking_model(tiny, tmp_path_factory.mktemp("thinking") / "model")
    cluster = start_cluster(thinking, workers=1)
    try:
        args = ["generate", "Which city?", "--target", cluster.target, "--max-tokens", "40"]
        out = run(*args, "--choice", "it rains</think>Paris")
        assert out.returncode == 0, out.stderr
        assert out.stdout == "Paris\n"
        assert "it rains" in out.stderr and "</think>" not in out.stderr + out.stdout
        # the random model never closes its reasoning by itself: the budget makes it answer
        args = ["generate", "Which city?", "--target", cluster.target, "--max-tokens", "12"]
        unbounded = run(*args)
        bounded = run(*args, "--thinking-budget", "3")
        assert unbounded.returncode == bounded.returncode == 0, bounded.stderr
        assert unbounded.stdout == "\n" and bounded.stdout.strip()
        refused = run(*args, "--thinking-budget", "-1")
        assert refused.returncode != 0 and "thinking_token_budget" in refused.stderr
        too_big = run(*args, "--thinking-budget", str(2**31))
        assert too_big.returncode == 2 and "does not fit in 32 bits" in too_big.stderr
    finally:
        cluster.close()


def test_embed_prints_a_json_line_per_text_and_the_second_reads_the_first_from_the_cache(
    cluster: LocalCluster,
) -> None:
    text = "A cache-aware router sends each prompt to the worker holding its prefix."
    out = run("embed", text, text + " Again.", "--target", cluster.target, "--dimensions", "8")
    assert out.returncode == 0, out.stderr
    first, second = (json.loads(line) for line in out.stdout.splitlines())
    assert [first["index"], second["index"]] == [0, 1]
    assert len(first["embedding"]) == 8
    assert sum(v * v for v in first["embedding"]) == pytest.approx(1, abs=1e-5)
    assert first["cached_tokens"] == 0 < second["cached_tokens"]
    assert second["worker"] == first["worker"]
    raw = run("embed", text, "--target", cluster.target, "--no-normalize")
    assert raw.returncode == 0, raw.stderr
    assert sum(v * v for v in json.loads(raw.stdout)["embedding"]) != pytest.approx(1, abs=1e-2)
    bad = run("embed", text, "--target", cluster.target, "--dimensions", "100000")
    assert bad.returncode == 1 and "dimensions" in bad.stderr
