# syntax=docker/dockerfile:1
# evalbus-exporter image. The exporter: sends judged cases to their sinks (jsonl under EXPORTER_EXPORT_DIR).
#
# Build from the workspace root (the context is the whole workspace; the lock is shared):
#   docker build -f deploy/docker/exporter.Dockerfile -t evalbus/exporter:dev .
#
# Two layers of dependencies: the third-party packages, synced from uv.lock alone (rebuilt only
# when the lock or a manifest changes), then the workspace packages this service needs.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ghcr.io/astral-sh/uv:0.13.9 AS uv

FROM ${PYTHON_IMAGE} AS build
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_DOWNLOADS=never \
    UV_PROJECT_ENVIRONMENT=/opt/evalbus
WORKDIR /src

# 1. Third-party layer: the lock and every workspace member's manifest (uv resolves the workspace
#    from them), no sources.
COPY uv.lock pyproject.toml ./
COPY libs/api/pyproject.toml libs/api/
COPY libs/contracts/pyproject.toml libs/contracts/
COPY libs/grading/pyproject.toml libs/grading/
COPY libs/runtime/pyproject.toml libs/runtime/
COPY libs/traces/pyproject.toml libs/traces/
COPY services/collector/pyproject.toml services/collector/
COPY services/dispatcher/pyproject.toml services/dispatcher/
COPY services/exporter/pyproject.toml services/exporter/
COPY services/gateway/pyproject.toml services/gateway/
COPY services/judge/pyproject.toml services/judge/
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-install-workspace --package evalbus-exporter

# 2. The workspace: the shared libraries and this service, installed (not editable) into the same
#    environment.
COPY libs libs
COPY services/exporter services/exporter
RUN --mount=type=cache,target=/root/.cache/uv \
    uv sync --frozen --no-dev --no-editable --package evalbus-exporter

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 evalbus \
 && useradd --system --uid 10001 --gid evalbus --home-dir /var/lib/evalbus --create-home evalbus
COPY --from=build /opt/evalbus /opt/evalbus
ENV PATH=/opt/evalbus/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    EVALBUS_STATE_DIR=/var/lib/evalbus \
    HTTP_HOST=0.0.0.0 \
    HTTP_PORT=8080
WORKDIR /var/lib/evalbus
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["python", "-m", "evalbus_exporter"]
