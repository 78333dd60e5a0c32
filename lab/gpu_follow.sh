#!/usr/bin/env bash
# Reserve overlap (tickets that follow their Prefill) and the yield gap on one GPU, one device
# call: STAGES from "auto off wide kills" (default "auto wide"):
#   auto  pd_system 8B, defaults (--reserve-overlap auto, yield ratio 12, gap cap 50 ms)
#   off   pd_system 8B with SPLITSERVE_RESERVE_OVERLAP=off, a short load (the TTFT A/B)
#   auto1 the same short load with overlap on (pairs with off, same machine)
#   wide  pd_system 8B with decode's yield ratio 24 and gap cap 150 ms
#   kills the VMM owner-kill test (50 kills)
#   mps0  pd_system 8B under an MPS daemon (both processes' kernels run side by side instead of
#         time-slicing), decode's yield off; mps: the same with the yield at its default;
#         mpsD: MPS, yield off, decode limited to MPS_PCT (default 40) % of the SMs
#   1b    pd_system 1B, defaults
#   hops  pd_system 1B with the clients in 1 and CLIENT_PROCS (4) processes, 8B with 4: where
#         the gaps open (decode's and the gateway's ITL beside the client's)
#   skinny lab.skinny_default_ab, 1B then 8B: the untuned default (fused at one row, cuBLAS
#         above) against the fused heuristic up to 16 rows (on an H200: --no-table)
#   adp   lab.async_decode_probe on the 1B: Engine.step() alone vs AsyncEngine's thread + loop
#   gw    pd_system 1B with GW_WORKERS (1 2 4) gateway workers, clients in 4 processes x 4 connections
#         (GW_API=rest: OpenAI SSE clients instead of gRPC),
#         then lab.host_profile (py-spy on every process) with the most workers (GW_PROF=0: not)
#   gil   pd_system 1B with 4 gateway workers and decode's --gil-switch-interval-ms GIL_MS (5 1 0.25)
#   plan8b lab.plan_gpu for the 8B (issue 27's validation, at this tree: the TTFT parts per request)
#   sweep1b  lab.serve_sweep for the 1B (SLO 250 / 25 ms): issue 24's sweep, the whole call
#   lean  the admission run at 61.79 req/s, then pd_system 1B once (little device time left)
#   verify the decode loop and the TTFT correction since 0ff17d1: pd_system 1B three times, 8B
#         once, then lab/gpu_admission.sh at 61.79 req/s (read with python -m lab.admission_replay)
# A stage starts only while BUDGET_S (default 560) seconds have not passed. Usage: OUT=... bash lab/gpu_follow.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lab/results}
T0=$(date +%s)
left() { [ $(( $(date +%s) - T0 )) -lt "${BUDGET_S:-560}" ]; }
MPS_DIR=/tmp/splitserve-mps
mps_on() {  # start an MPS control daemon once (user space; the GPU's compute mode is left as is)
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && return 0
  command -v nvidia-cuda-mps-control >/dev/null || { echo "nvidia-cuda-mps-control: not installed"; return 1; }
  mkdir -p $MPS_DIR/pipe $MPS_DIR/log
  export CUDA_MPS_PIPE_DIRECTORY=$MPS_DIR/pipe CUDA_MPS_LOG_DIRECTORY=$MPS_DIR/log
  if ! nvidia-cuda-mps-control -d; then echo "MPS daemon did not start"; unset CUDA_MPS_PIPE_DIRECTORY; return 1; fi
  sleep 1; echo "== MPS daemon up"; nvidia-smi --query-gpu=compute_mode --format=csv,noheader
}
mps_off() { [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && { echo quit | nvidia-cuda-mps-control; sleep 2; tail -5 $MPS_DIR/log/control.log 2>/dev/null; }; }
trap mps_off EXIT
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
    1b) PD_TAG=_auto OUT=$OUT MODELS=dummy:llama-3.2-1b YIELD_RATIOS=default PD_TAIL=${PD_TAIL:-30} bash lab/gpu_system.sh pd ;;
    verify)
      [ "${VERIFY_ADM_FIRST:-0}" = 1 ] && OUT=$OUT RATES=61.79 DURATION=12 timeout 200 bash lab/gpu_admission.sh
      for i in $(seq ${VERIFY_N:-3}); do PD_TAG=_verify$i OUT=$OUT MODELS=dummy:llama-3.2-1b PD_TAIL=${PD_TAIL:-30} bash lab/gpu_system.sh pd; done
      [ "${VERIFY_8B:-1}" = 1 ] && PD_TAG=_verify OUT=$OUT MODELS=dummy:llama-3.1-8b PD_TAIL=${PD_TAIL:-30} bash lab/gpu_system.sh pd
      [ "${VERIFY_ADM_FIRST:-0}" = 1 ] || OUT=$OUT RATES=61.79 DURATION=12 timeout 200 bash lab/gpu_admission.sh ;;
    skinny)
      NT=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo --no-table)
      SPLITSERVE_BENCH_DIR=$OUT timeout 240 python3 -m lab.skinny_default_ab --rounds 3 $NT 2>&1 | grep -v "^\[" | tail -12
      left && SPLITSERVE_BENCH_DIR=$OUT timeout 300 python3 -m lab.skinny_default_ab --model dummy:llama-3.1-8b \
        --batches 1,4,8,16 --rounds 2 $NT 2>&1 | grep -v "^\[" | tail -10 ;;
    adp) PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site timeout 200 python3 -m lab.async_decode_probe \
           --model dummy:llama-3.2-1b --device cuda --rounds ${ADP_ROUNDS:-3} 2>&1 | grep -v "^\[" | tail -12 ;;
    hops)  # 1B with the client in one process, then spread over CLIENT_PROCS; 8B spread
      for cp in ${HOPS_CPS:-1 ${CLIENT_PROCS:-4}}; do
        PD_TAG=_cp$cp PD_ARGS="--client-procs $cp" OUT=$OUT MODELS=dummy:llama-3.2-1b PD_TAIL=${PD_TAIL:-34} bash lab/gpu_system.sh pd
      done
      [ "${HOPS_8B:-1}" = 1 ] && PD_TAG=_cp${CLIENT_PROCS:-4} PD_ARGS="--client-procs ${CLIENT_PROCS:-4}" OUT=$OUT \
        MODELS=dummy:llama-3.1-8b PD_TAIL=${PD_TAIL:-34} bash lab/gpu_system.sh pd
      if [ "${HOPS_PROF:-0}" = 1 ] && left; then  # py-spy on each service under the 1B load
        PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site timeout 150 python3 -m lab.host_profile \
          --model dummy:llama-3.2-1b --device cuda --clients 64 --prompt-len 512 --window 8 \
          --out "$OUT/hprof-1b" 2>&1 | grep -v "^\[" | tail -75
      fi ;;
    gw)  # gateway workers (up --gateway-workers): 1B pd_system, clients in CLIENT_PROCS processes
      # of 4 connections each, GW_WORKERS gateway processes in turn on the same machine
      for w in ${GW_WORKERS:-1 2 4}; do
        left || break
        PD_TAG=_gw$w${GW_API:+_$GW_API} PD_ARGS="--client-procs ${CLIENT_PROCS:-4} --client-channels 4 --gateway-workers $w --api ${GW_API:-grpc}" \
          OUT=$OUT MODELS=${GW_MODELS:-dummy:llama-3.2-1b} PD_TAIL=${PD_TAIL:-34} bash lab/gpu_system.sh pd
      done
      if [ "${GW_PROF:-1}" = 1 ] && left; then  # py-spy on every process with the most workers
        w=$(echo ${GW_WORKERS:-1 2 4} | tr ' ' '\n' | sort -n | tail -1)
        PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site timeout 150 python3 -m lab.host_profile \
          --model dummy:llama-3.2-1b --device cuda --clients 64 --prompt-len 512 --window 8 --channels 16 \
          --out "$OUT/hprof-gw$w" -- --gateway-workers $w 2>&1 | grep -v "^\[" | grep -E "^load|^== |^  [a-z]|^ +[0-9]" | head -90
      fi ;;
    gil)  # decode's GIL switch interval with GW_MAX (4) gateway workers: GIL_MS (5 1 0.25) ms in turn
      for g in ${GIL_MS:-5 1 0.25}; do
        left || break
        PD_TAG=_gil$g PD_ARGS="--client-procs ${CLIENT_PROCS:-4} --client-channels 4 --gateway-workers ${GW_MAX:-4} \
          --up-arg=--decode-arg=--gil-switch-interval-ms=$g" OUT=$OUT MODELS=dummy:llama-3.2-1b \
          PD_TAIL=${PD_TAIL:-34} bash lab/gpu_system.sh pd
      done ;;
    plan8b)
      [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      SPLITSERVE_BENCH_DIR=$OUT OTEL_TRACES_EXPORTER=none timeout 420 python3 -m lab.plan_gpu \
        --model dummy:llama-3.1-8b --kv-cache-bytes 12884901888 --batches 1,8,32,64 --out $OUT --deadline-s ${PLAN_DEADLINE_S:-400} \
        2>&1 | grep -v "^\[" | tail -30 ;;
    sweep1b)  # issue 24's sweep for the 1B (0.25x-3x of its searched peak, with and without
      # admission, the mixed trace split / auto, colocated): a whole call
      [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
      SPLITSERVE_BENCH_DIR=$OUT OTEL_TRACES_EXPORTER=none timeout 590 python3 -m lab.serve_sweep \
        --model dummy:llama-3.2-1b --ttft-ms ${SWEEP_TTFT_MS:-250} --tpot-ms ${SWEEP_TPOT_MS:-25} \
        --deadline-s ${SWEEP_DEADLINE_S:-560} 2>&1 | grep -v "^\[" | tail -40 ;;
    lean)  # the admission run first (the live TTFT error), then the 1B once
      OUT=$OUT RATES=61.79 DURATION=12 timeout 200 bash lab/gpu_admission.sh
      PD_TAG=_lean OUT=$OUT MODELS=dummy:llama-3.2-1b PD_TAIL=${PD_TAIL:-30} bash lab/gpu_system.sh pd ;;
    mps0|mps|mpsD)
      if ! mps_on; then echo "== $s: no MPS"; continue; fi
      y=0; [ $s = mps ] && y=default
      if [ $s = mpsD ]; then export LAB_MPS_SERVICE=decode_svc LAB_MPS_PCT=${MPS_PCT:-40}; fi
      PD_TAG=_$s OUT=$OUT MODELS=${MPS_MODELS:-dummy:llama-3.1-8b} YIELD_RATIOS=$y PD_TAIL=${PD_TAIL:-30} \
        PYTHONPATH=$PWD/lab/mps_site${PYTHONPATH:+:$PYTHONPATH} bash lab/gpu_system.sh pd
      unset LAB_MPS_SERVICE LAB_MPS_PCT ;;
  esac
done
echo "== total $(( $(date +%s) - T0 )) s"
