#!/usr/bin/env bash
# One device call for the system on one GPU: VMM pool tests (two processes, owner kills), the
# pool handoff bench, then bench.pd_system (engine alone vs the whole system) for the models in
# MODELS. Logs and JSON go to $OUT. Usage: OUT=... bash lab/gpu_system.sh [vmm] [pool] [pd]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lab/results}
export PYTHONUNBUFFERED=1 SPLITSERVE_BENCH_DIR=$OUT
export SPLITSERVE_COMMIT=${SPLITSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
for s in ${*:-vmm pool pd}; do
  t0=$(date +%s)
  case $s in
    vmm)
      SPLITSERVE_VMM_KILLS=${VMM_KILLS:-50} timeout 300 python3 -m pytest -q -s -p no:cacheprovider \
        tests/gpu/test_vmm_pool.py 2>&1 | tee "$OUT/vmm.log" | grep -E "vmm:|passed|failed|Error" ;;
    pool)
      timeout 120 python3 -m bench.kv_pool --device cuda:0 2>&1 | tee "$OUT/kv_pool.log" | tail -9 ;;
    pd)
      for m in ${MODELS:-dummy:llama-3.2-1b dummy:llama-3.1-8b}; do
        for r in ${YIELD_RATIOS:-default}; do  # decode's --prefill-yield-ratio (default: its own)
          [ "$r" = default ] && unset SPLITSERVE_PREFILL_YIELD_RATIO || export SPLITSERVE_PREFILL_YIELD_RATIO=$r
          echo "== $m, prefill yield ratio $r"
          timeout 280 python3 -m bench.pd_system --model "$m" --device cuda ${PD_ARGS:-} 2>&1 \
            | tee "$OUT/pd_$(echo "$m" | tr -c 'a-z0-9\n' '_')_y$r${PD_TAG:-}.log" | grep -v "^\[\|splitserve\." | tail -${PD_TAIL:-30}
        done
      done ;;
  esac
  echo "== $s: $(( $(date +%s) - t0 )) s"
done
