#!/usr/bin/env bash
# NIXL on GPU memory, both processes on one GPU: bench.kv_transfer's nixl rows with the KV on
# cuda:0 under several UCX transport sets, and host memory for comparison. Carry .whl_nixl
# (nixl_cu13 + grpcio_health_checking wheels). Usage: OUT=... bash lab/gpu_nixl.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lab/results}
python -m pip install -q --no-deps .whl_nixl/*.whl 2>&1 | tail -2
# the service wheels (grpc_reflection, ...) that lab/gpu_system.sh put in /tmp/site on this machine
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python -c "from kvtransfer.backends.nixl_probe import nixl_api; nixl_api(); print('nixl imports')" || exit 1
python -c "import nixl_cu13, os; print(os.path.dirname(nixl_cu13.__file__))" 2>/dev/null
for tls in "" "cuda_ipc,cuda_copy,sm,self" "cuda_copy,sm,self" "cuda_copy,tcp,self"; do
  echo "== UCX_TLS=${tls:-(unset)}"
  if [ -n "$tls" ]; then export UCX_TLS=$tls; else unset UCX_TLS; fi
  timeout 150 python -m bench.kv_transfer --tokens 128 2048 8192 --backends nixl \
    --nixl-device cuda:0 $([ -z "$tls" ] && echo cpu) --repeats 5 2>&1 | grep -v "^\s*$" | tail -25
  echo "rc=$?"
done
unset UCX_TLS
cp bench/results/kv_transfer-*.json "$OUT"/ 2>/dev/null
