#!/usr/bin/env bash
# Interleaved calibration and validation rounds for the CPU colocated planner check (issue 27).
# Each round: closed loops at 1 and 8 clients (calibration: fit only) and open loops at 2.8 and
# 4.2 req/s (validation only), close in time so one round sees one machine speed; odd rounds
# run the closed loops first, even rounds the open loops first. Every run goes through
# lab.other_cpu (other processes' CPU) and logs the 1-minute load average at its start.
#
#   UP_PID=<pid of splitserve up> ROUNDS="1 2 3" SEED0=300 lab/cpu_plan_rounds.sh LOG
#
# A round starts once the 1-minute load average is below LOAD_MAX (0.8) or after 180 s.
# COSTS=1: each round first measures the engine alone (bench.engine_costs, ~1.5 min, the server
# idle), renamed engine_costs_r{r}-<stamp>.json, so the engine's speed is calibrated in the round
# too (ENGINE_DIR: the tree to run it from, e.g. the server's; default here).
set -u
LOG=${1:?log file}
: "${UP_PID:?pid of the running splitserve up}"
ROUNDS=${ROUNDS:-"1 2 3"}
SEED0=${SEED0:-300}
LOAD_MAX=${LOAD_MAX:-0.8}
DUR=${DUR:-45}
URL=${URL:-http://127.0.0.1:18400}
export SPLITSERVE_BENCH_DIR=${SPLITSERVE_BENCH_DIR:-$(pwd)/bench/results}
TRACE=(--input-len lognormal:64,0.6 --output-len lognormal:32,0.5 --ttft-ms 1000 --tpot-ms 150
       --no-send-slo --no-plots)

load1() { cut -d' ' -f1 /proc/loadavg; }

one() {  # round tag seed args...
  local round=$1 tag=$2 seed=$3; shift 3
  echo "=== round $round $tag seed $seed start $(date -u +%H:%M:%S) load1 $(load1)" | tee -a "$LOG"
  python -m lab.other_cpu --pids "$UP_PID" -- python -m bench.serve --url "$URL" "${TRACE[@]}" \
    --seed "$seed" "$@" 2>&1 | grep -E "^wrote|other_cpu|Traceback|Error" | tee -a "$LOG"
}

COSTS=${COSTS:-0}
ENGINE_DIR=${ENGINE_DIR:-$(pwd)}

costs() {  # round
  echo "=== round $1 engine_costs start $(date -u +%H:%M:%S) load1 $(load1)" | tee -a "$LOG"
  local out
  out=$(cd "$ENGINE_DIR" && PYTHONPATH="$ENGINE_DIR" python -m lab.other_cpu --pids "$UP_PID" -- \
        python -m bench.engine_costs --device cpu --threads 2 --prefill 16,32,64,128,256 \
        --batches 1,4,8,16,24,32,48 --contexts 32,128 --mixed "" --reps 3 2>&1)
  echo "$out" | grep -E "other_cpu|Traceback|Error" | tee -a "$LOG"
  local path
  path=$(echo "$out" | sed -n 's/^wrote //p')
  [ -n "$path" ] && mv "$path" "$(dirname "$path")/engine_costs_r$1-${path##*engine_costs-}" &&
    echo "costs $(dirname "$path")/engine_costs_r$1-${path##*engine_costs-}" | tee -a "$LOG"
}

for r in $ROUNDS; do
  waited=0
  while awk -v l="$(load1)" -v m="$LOAD_MAX" 'BEGIN{exit !(l >= m)}' && [ $waited -lt 180 ]; do
    sleep 10; waited=$((waited + 10))
  done
  s=$((SEED0 + 10 * r))
  [ "$COSTS" = 1 ] && costs "$r"
  cal() {
    one "$r" c1 $((s + 1)) --name "serve_r${r}_c1" --concurrency 1 --num-requests 20
    one "$r" c8 $((s + 2)) --name "serve_r${r}_c8" --concurrency 8 --num-requests 80
  }
  val() {
    one "$r" rate2.8 $((s + 3)) --name "serve_r${r}_rate" --rate 2.8 --duration "$DUR"
    one "$r" rate4.2 $((s + 4)) --name "serve_r${r}_rate" --rate 4.2 --duration "$DUR"
  }
  if [ $((r % 2)) -eq 1 ]; then cal; val; else val; cal; fi
done
echo "=== done $(date -u +%H:%M:%S)" | tee -a "$LOG"
