#!/usr/bin/env bash
# Admission's TTFT model live on CPU: `splitserve up --topology split` (SmolLM2, shm) with
# --admission-ttft-model queue and fit, ROUNDS interleaved pairs, bench.serve open loop at RATE
# req/s with the SLO sent; prints each run's steady TTFT prediction error and attainment.
# Usage: RATE=1.5 DURATION=60 ROUNDS=2 bash lab/cpu_admission_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export SPLITSERVE_BENCH_DIR=${SPLITSERVE_BENCH_DIR:-$PWD/lab/results} OTEL_TRACES_EXPORTER=none
for r in $(seq ${ROUNDS:-2}); do
  seed=$((${SEED0:-600} + r))  # one trace per round: both models see the same requests
  for m in queue fit; do
    SPLITSERVE_ADMISSION_TTFT_MODEL=$m setsid python -m splitserve_cli up --topology split \
      --http-port 18500 --grpc-port 18501 --prefill-port 18502 --decode-port 18503 \
      --metrics-ports 0,0 > /tmp/cpu_adm_up.log 2>&1 &
    UP=$!
    for i in $(seq 120); do curl -sf http://127.0.0.1:18500/v1/models > /dev/null && break; sleep 1; done
    echo "== round $r, ttft model $m, seed $seed, load $(cut -d' ' -f1 /proc/loadavg)"
    python -m bench.serve --url http://127.0.0.1:18500 --rate ${RATE:-1.5} --duration ${DURATION:-60} \
      --input-len lognormal:64,0.6 --output-len lognormal:32,0.5 --ttft-ms ${TTFT_MS:-1500} \
      --tpot-ms ${TPOT_MS:-200} --seed $seed --name cpu_adm_$m --no-plots > /tmp/cpu_adm_bench.log 2>&1
    python - "$SPLITSERVE_BENCH_DIR" $m <<'PY'
import glob, json, sys
doc = json.load(open(sorted(glob.glob(f"{sys.argv[1]}/cpu_adm_{sys.argv[2]}-*.json"))[-1]))
for run in doc["results"]["runs"]:
    s = run["summary"]
    print(f"  {sys.argv[2]}: ttft APE steady {s['ttft_prediction_ape_median_steady']:.3f} (all "
          f"{s['ttft_prediction_ape_median']:.3f}), attainment admitted {s['slo_attainment_admitted']:.3f}, "
          f"goodput {s['goodput_rps']:.2f}, rejected {s['rejected']}/{s['requests']}")
PY
    kill -- -$UP 2>/dev/null; wait $UP 2>/dev/null; sleep 2
  done
done
