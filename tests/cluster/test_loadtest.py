"""`radixmesh loadtest` against a real local cluster (tiny model, loopback gRPC), and its parts."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cluster.loadtest.cli import add_arguments, main
from cluster.loadtest.grpc_api import to_proto
from cluster.loadtest.trace import MOONCAKE_BLOCK, BlockExpander
from cluster.loadtest.workloads import WorkloadOptions, build, with_text_match
from cluster.policies import build_policy
from protos.radixmesh.v1 import serving_pb2
from tests.cluster.local_cluster import LocalCluster, start_cluster
from worker.loader import load_model
from worker.tiny_model import build_tiny_checkpoint

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    running = start_cluster(load_model(build_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))))
    yield running
    running.close()


def loadtest(cluster: LocalCluster, out: Path, *extra: str) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--target", cluster.target, "--output-dir", str(out), "--max-tokens", "6", *extra]
    code = main(parser.parse_args(argv))
    report = json.loads((out / "report.json").read_text()) if code == 0 else {}
    return code, report


def consistent(run: dict) -> dict:
    summary = run["summary"]
    counts = summary["requests"]
    assert counts["sent"] == counts["completed"] + counts["errored"] == len(run["requests"])
    assert counts["errored"] == sum(summary["errors"].values())
    return summary


def trace_file(path: Path) -> Path:
    records = [
        {
            "timestamp": 10 * i,
            "input_length": 600 + 100 * (i % 3),
            "output_length": 40,
            "hash_ids": [0, 1, 2 + i % 2],
        }
        for i in range(8)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "workload", ["shared-prefix", "multi-turn", "plain-multi-turn", "few-shot", "random", "trace"]
)
def test_each_workload_runs_and_counts_add_up(
    cluster: LocalCluster,
    tmp_path: Path,
    workload: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    extra = ["--workload", workload, "--num-requests", "8", "--concurrency", "3"]
    if workload == "trace":
        extra += [
            "--trace",
            str(trace_file(tmp_path / "trace.jsonl")),
            "--arrival",
            "trace",
            "--time-scale",
            "10",
        ]  # 100 ms apart, so each finds the ones before it cached (0.1 ms apart, all 8 ran at once)
    code, report = loadtest(cluster, tmp_path / "out", *extra)
    assert code == 0
    (run,) = report["runs"]
    summary = consistent(run)
    assert summary["requests"]["sent"] == 8 and summary["requests"]["completed"] == 8
    if workload in ("shared-prefix", "multi-turn", "plain-multi-turn", "trace"):
        assert summary["hit_rate"] > 0
    if workload == "random":
        assert summary["hit_rate"] < 0.05
    for name in ("cdf.png", "timeline.png"):
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 5000
    assert "| prefix hit rate |" in (tmp_path / "out" / "summary.md").read_text()
    # stderr is no terminal here, as in a job's log: the progress comes as plain lines
    assert "requests: 8/8 (100 %)" in capsys.readouterr().err
    cluster.wait_idle()


def test_compare_runs_both_policies_from_cold_caches(cluster: LocalCluster, tmp_path: Path) -> None:
    # Three users on two workers: round robin cannot pin a conversation to a worker by accident
    # (with two users it alternates in step with them and routes each chat to one worker).
    code, report = loadtest(
        cluster, tmp_path, "--workload", "multi-turn", "--num-requests", "24", "--turns", "4",
        "--concurrency", "3", "--compare", "cache_aware", "round_robin",
    )  # fmt: skip
    assert code == 0
    aware, robin = (consistent(run) for run in report["runs"])
    assert [run["label"] for run in report["runs"]] == ["cache_aware", "round_robin"]
    assert aware["hit_rate"] > robin["hit_rate"]
    assert "x |" in (tmp_path / "summary.md").read_text()  # ratios between the two
    cluster.loop.run(cluster.links.replace_policy(build_policy(cluster.config)))  # as before


def test_text_match_modes_run_in_turn_and_are_reported_side_by_side(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    code, report = loadtest(
        cluster, tmp_path, "--workload", "plain-multi-turn", "--num-requests", "8", "--turns",
        "4", "--concurrency", "2", "--warmup", "2", "--text-match", "exact", "anchored",
    )  # fmt: skip
    assert code == 0
    runs = report["runs"]
    assert [run["label"] for run in runs] == ["text_match=exact", "text_match=anchored"]
    assert [run["settings"]["text_match"] for run in runs] == ["exact", "anchored"]
    for run in runs:
        summary = consistent(run)
        assert summary["requests"]["completed"] == 8 and summary["hit_rate"] > 0
    texts = cluster.service.text_prompts
    assert texts is not None and texts.counters.outcomes.get("extend", 0) > 0  # anchored's
    assert "| text_match=exact | text_match=anchored |" in (tmp_path / "summary.md").read_text()
    cluster.wait_idle()


def test_plain_turns_append_the_answer_and_the_next_message_without_a_separator() -> None:
    session, *_ = build("plain-multi-turn", WorkloadOptions(requests=6, turns=3))
    first = session.request(0, None)
    assert first.text is not None and first.chat is None and first.text.endswith("Answer: ")
    second = session.request(1, "an answer")
    assert second.text == first.text + "an answer" + session.questions[1]
    assert to_proto(second, session, "r").text_match == serving_pb2.TEXT_MATCH_DEFAULT
    (marked,) = with_text_match([session], "anchored", "Run 2.\n")
    spec = marked.request(0, None)
    assert spec.text == "Run 2.\n" + first.text
    assert to_proto(spec, marked, "r").text_match == serving_pb2.TEXT_MATCH_ANCHORED


def test_sweep_plots_load_against_latency(cluster: LocalCluster, tmp_path: Path) -> None:
    code, report = loadtest(
        cluster, tmp_path, "--workload", "random", "--num-requests", "6", "--sweep", "1,3"
    )
    assert code == 0
    assert [run["offered_load"] for run in report["runs"]] == [1.0, 3.0]
    assert (tmp_path / "sweep.png").read_bytes().startswith(PNG)


def test_tenants_are_reported_apart(cluster: LocalCluster, tmp_path: Path) -> None:
    code, report = loadtest(
        cluster,
        tmp_path,
        "--workload",
        "shared-prefix",
        "--num-requests",
        "10",
        "--tenants",
        "acme=1,globex=1",
    )
    assert code == 0
    tenants = report["runs"][0]["summary"]["tenants"]
    assert set(tenants) == {"acme", "globex"}


def test_an_unreachable_target_ends_quickly_with_a_clear_message(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    code = main(parser.parse_args(["--target", "127.0.0.1:1", "--output-dir", str(tmp_path)]))
    assert code == 2
    assert "cannot reach 127.0.0.1:1" in capsys.readouterr().err
    assert not (tmp_path / "report.json").exists()


@given(
    ids=st.lists(st.integers(0, 2**40), min_size=1, max_size=6),
    other=st.lists(st.integers(0, 2**40), min_size=1, max_size=6),
    block=st.sampled_from([4, 16, 32]),
    cut=st.integers(1, 200),
)
def test_equal_hash_ids_expand_to_equal_blocks(
    ids: list[int], other: list[int], block: int, cut: int
) -> None:
    expander = BlockExpander(block, vocab=512)
    a, b = expander.prompt(ids, cut), BlockExpander(block, vocab=512).prompt(ids, cut)
    assert a == b and len(a) == min(cut, block * len(ids))
    assert all(0 <= t < 512 for t in a)
    shared = 0
    while shared < min(len(ids), len(other)) and ids[shared] == other[shared]:
        shared += 1
    c = expander.prompt(other, block * len(other))
    assert a[: min(cut, block * shared)] == c[: min(cut, block * shared)]


def test_trace_lengths_are_scaled_and_capped(tmp_path: Path) -> None:
    path = trace_file(tmp_path / "trace.jsonl")
    sessions = build(
        "trace",
        WorkloadOptions(
            requests=8, trace=path, vocab_size=512, max_model_len=30, trace_time_scale=0.5
        ),
    )
    assert [s.arrival_s for s in sessions] == [0.005 * i for i in range(8)]
    for s in sessions:
        spec = s.request(0, None)
        assert spec.token_ids is not None and len(spec.token_ids) + spec.max_tokens < 30
    assert BlockExpander(32).scaled(MOONCAKE_BLOCK * 3) == 96


def test_the_harness_outpaces_a_stub_server(capsys) -> None:  # type: ignore[no-untyped-def]
    """The self-benchmark runs and reports consistent counts (its speed is a benchmark's job)."""
    from benchmarks.loadtest_harness import main as harness

    assert harness(["--requests", "40", "--tokens", "8", "--concurrency", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["requests"] == {"sent": 40, "completed": 40, "errored": 0}
    assert result["streamed_tokens"] == result["messages"] == 320
