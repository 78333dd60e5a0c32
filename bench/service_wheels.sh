#!/usr/bin/env bash
# Wheels of the service dependencies, into .whl/ (git-ignored), for a GPU machine whose image
# lacks them and has no network: copy .whl/ along and lab/gpu_session.sh installs them into
# /tmp/site. The gRPC plugins are pinned to that image's grpcio (1.84): newer generated code
# refuses an older grpcio at import. Python 3.12, x86_64 manylinux; about 10 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl "$@"; }
mkdir -p .whl
dl "grpcio-health-checking==1.84.0" "grpcio-reflection==1.84.0" "grpcio-tools==1.84.0"
dl opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc \
  opentelemetry-exporter-otlp-proto-common opentelemetry-proto opentelemetry-semantic-conventions \
  googleapis-common-protos fastapi starlette pydantic pydantic-core annotated-types typing-inspection \
  uvicorn h11 httpx httpcore anyio sniffio prometheus-client gguf pytest-asyncio pytest-timeout \
  openai jiter distro importlib-metadata zipp typing-extensions click
du -sh .whl
