# syntax=docker/dockerfile:1
# The API and beat image: `treadle-server api`, `treadle-server beat`, `treadle-server migrate`
# and `treadle-server admin ...`. No engine: the worker extra (torch, transformers, peft) is not
# installed, and the build fails if torch is importable or gets loaded by the control plane.
#
#   docker build -f infra/docker/api.Dockerfile -t treadle-api:0.1.0 .   (from the repository root;
#   the tag is the version in pyproject.toml, which the Helm chart pulls)

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/treadle
WORKDIR /src
# The SDK first: it changes less often than the server, so its layer is reused.
COPY sdk/ sdk/
RUN /opt/treadle/bin/pip install ./sdk
COPY pyproject.toml README.md ./
COPY api/ api/
COPY billing/ billing/
COPY core/ core/
COPY gpu_worker/ gpu_worker/
COPY migrations/ migrations/
COPY scheduler/ scheduler/
# The server without extras: no torch in this image.
RUN /opt/treadle/bin/pip install . \
    && ! /opt/treadle/bin/python -c "import torch" 2>/dev/null \
    && cd / && /opt/treadle/bin/python -c "import sys, api.app, api.cli, scheduler.beat; \
assert 'torch' not in sys.modules, 'the control plane imported torch'"

FROM ${PYTHON_IMAGE}
# One uid for every Treadle image, so api and worker containers share the artifact volume.
RUN groupadd --system --gid 10001 treadle \
    && useradd --system --uid 10001 --gid treadle --home-dir /var/lib/treadle --create-home \
        --shell /usr/sbin/nologin treadle \
    && mkdir -p /var/lib/treadle/artifacts \
    && chown -R treadle:treadle /var/lib/treadle
COPY --from=build /opt/treadle /opt/treadle
ENV PATH=/opt/treadle/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/var/lib/treadle \
    TREADLE_DATA_DIR=/var/lib/treadle \
    TREADLE_ARTIFACT_URL=/var/lib/treadle/artifacts \
    TREADLE_HOST=0.0.0.0 \
    TREADLE_PORT=8000
USER 10001:10001
WORKDIR /var/lib/treadle
EXPOSE 8000
ENTRYPOINT ["treadle-server"]
CMD ["api"]
