#!/usr/bin/env bash
# Decode yielding to a prefill on its GPU, in one device call, most wanted first: pd_system 8B
# with decode's --prefill-yield-ratio 0 and 6, the admission bench (lab/gpu_admission.sh) with
# 6 and 0, pd_system 1B with 0 and 6, then the VMM owner-kill test (50 kills). A stage starts
# only while BUDGET_S (default 560) seconds have not passed. Usage: OUT=... bash lab/gpu_yield.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lab/results}
T0=$(date +%s)
left() { [ $(( $(date +%s) - T0 )) -lt "${BUDGET_S:-560}" ]; }
OUT=$OUT MODELS=dummy:llama-3.1-8b YIELD_RATIOS="0 6" PD_TAIL=${PD_TAIL:-24} bash lab/gpu_system.sh pd
for r in 6 0; do
  left || break
  mkdir -p "$OUT/adm_y$r"
  echo "== admission, prefill yield ratio $r"
  SPLITSERVE_PREFILL_YIELD_RATIO=$r OUT=$OUT/adm_y$r bash lab/gpu_admission.sh 2>&1 | tail -4
done
left && OUT=$OUT MODELS=dummy:llama-3.2-1b YIELD_RATIOS="0 6" PD_TAIL=${PD_TAIL:-24} bash lab/gpu_system.sh pd
left && OUT=$OUT VMM_KILLS=50 bash lab/gpu_system.sh vmm
echo "== total $(( $(date +%s) - T0 )) s"
