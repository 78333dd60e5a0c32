#!/usr/bin/env bash
# Issue 24 in one short device call: `splitserve up` (8B split on one GPU) and bench.serve at
# RATES with the SLO sent (admission), one run per rate; prints the table, the steady-load
# prediction errors and lab/admission_replay.py's replay of each rate's rows.
# Usage: OUT=... RATES=61.79,123.58 DURATION=12 bash lab/gpu_admission.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lab/results}
export PYTHONUNBUFFERED=1 SPLITSERVE_BENCH_DIR=$OUT OTEL_TRACES_EXPORTER=none
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m splitserve_cli up --model ${MODEL:-dummy:llama-3.1-8b} --dtype bf16 --prefill-gpu 0 --decode-gpu 0 \
  --kv-cache-bytes=12884901888 --http-port 18000 --grpc-port 0 --prefill-port 0 --decode-port 0 \
  --metrics-ports 0,0 ${UP_ARGS:-} > "$OUT/up.log" 2>&1 &
UP=$!
for i in $(seq 150); do curl -sf http://127.0.0.1:18000/v1/models > /dev/null && break; sleep 1; done
python3 -m bench.serve --url http://127.0.0.1:18000 --preset chat --rates ${RATES:-61.79,123.58} \
  --duration ${DURATION:-12} --ttft-ms 500 --tpot-ms 50 --name serve-8b-admission --timeout 60 \
  --no-plots 2>&1 | grep -v "^\(admission\|serve\|run\) .*\[" | tail -12
python3 - "$OUT" <<'PY'
import glob, json, sys
doc = json.load(open(sorted(glob.glob(sys.argv[1] + "/serve-8b-admission-*.json"))[-1]))
for r in doc["results"]["runs"]:
    s = r["summary"]
    print(f"rate {r.get('rate')}: goodput {s['goodput_rps']:.2f} att_adm {s['slo_attainment_admitted']:.3f} "
          f"ttft APE all {s['ttft_prediction_ape_median']:.3f} steady {s['ttft_prediction_ape_median_steady']:.3f} "
          f"tpot APE steady {s['tpot_prediction_ape_median_steady']:.3f} rejected {s['rejected']}/{s['requests']}")
PY
# the TTFT estimators replayed on the run's own rows (the fit's steps ahead are logged now)
RUN=$(ls -t "$OUT"/serve-8b-admission-*.json | head -1)
RL=${RATES:-61.79,123.58}
for R in ${RL//,/ }; do python3 -m lab.admission_replay "$RUN" --rate "$R"; done
kill -INT $UP; wait $UP
