#!/usr/bin/env bash
# Reserve overlap (tickets that follow their Prefill) and the yield gap on one GPU, one device
# call: STAGES from "auto off wide kills" (default "auto wide"):
#   auto  pd_system 8B, defaults (--reserve-overlap auto, yield ratio 12, gap cap 50 ms)
#   off   pd_system 8B with SPLITSERVE_RESERVE_OVERLAP=off, a short load (the TTFT A/B)
#   auto1 the same short load with overlap on (pairs with off, same machine)
#   wide  pd_system 8B with decode's yield ratio 24 and gap cap 150 ms
#   kills the VMM owner-kill test (50 kills)
# A stage starts only while BUDGET_S (default 560) seconds have not passed. Usage: OUT=... bash lab/gpu_follow.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lab/results}
T0=$(date +%s)
left() { [ $(( $(date +%s) - T0 )) -lt "${BUDGET_S:-560}" ]; }
SHORT="--clients 16 --max-tokens 32 --lp-batch 2 --reps 9"
for s in ${STAGES:-auto wide}; do
  left || break
  case $s in
    auto) PD_TAG=_auto OUT=$OUT MODELS=dummy:llama-3.1-8b YIELD_RATIOS=default PD_TAIL=${PD_TAIL:-30} bash lab/gpu_system.sh pd ;;
    off) PD_TAG=_off SPLITSERVE_RESERVE_OVERLAP=off OUT=$OUT MODELS=dummy:llama-3.1-8b YIELD_RATIOS=default \
           PD_ARGS="$SHORT" PD_TAIL=12 bash lab/gpu_system.sh pd ;;
    auto1) PD_TAG=_auto1 SPLITSERVE_RESERVE_OVERLAP=auto OUT=$OUT MODELS=dummy:llama-3.1-8b YIELD_RATIOS=default \
           PD_ARGS="$SHORT" PD_TAIL=12 bash lab/gpu_system.sh pd ;;
    wide) PD_TAG=_wide SPLITSERVE_PREFILL_YIELD_MAX_MS=150 OUT=$OUT MODELS=dummy:llama-3.1-8b YIELD_RATIOS=24 \
           PD_TAIL=${PD_TAIL:-30} bash lab/gpu_system.sh pd ;;
    kills) OUT=$OUT VMM_KILLS=50 bash lab/gpu_system.sh vmm ;;
  esac
done
echo "== total $(( $(date +%s) - T0 )) s"
