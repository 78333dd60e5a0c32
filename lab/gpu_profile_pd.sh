#!/usr/bin/env bash
# py-spy on the decode service and the gateway while bench.pd_system runs MODEL (default 1B)
# on one GPU: collapsed stacks to $OUT (py-spy from .whl/bin). Usage: OUT=... bash lab/gpu_profile_pd.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lab/results}
SPY=$PWD/.whl/bin/py-spy
MODEL=${MODEL:-dummy:llama-3.2-1b}
(PD_TAG=_prof OUT=$OUT MODELS=$MODEL bash lab/gpu_system.sh pd > "$OUT/prof_pd.log" 2>&1) &
BG=$!
for i in $(seq 240); do
  d=$(pgrep -f -- "-m decode_svc" | head -1); g=$(pgrep -f -- "-m gateway" | head -1)
  [ -n "$d" ] && [ -n "$g" ] && break; sleep 0.5
done
echo "decode pid $d gateway pid $g"
$SPY record --nonblocking --rate 250 -d ${PROF_S:-30} --format raw -o "$OUT/prof_decode.txt" --pid "$d" --threads > "$OUT/spy_d.log" 2>&1 &
$SPY record --nonblocking --rate 1000 --gil -d ${PROF_S:-30} --format raw -o "$OUT/prof_decode_gil.txt" --pid "$d" --threads > "$OUT/spy_dg.log" 2>&1 &
$SPY record --nonblocking --rate 250 --idle -d ${PROF_S:-30} --format raw -o "$OUT/prof_decode_idle.txt" --pid "$d" --threads > "$OUT/spy_di.log" 2>&1 &
$SPY record --nonblocking --rate 250 -d ${PROF_S:-30} --format raw -o "$OUT/prof_gateway.txt" --pid "$g" > "$OUT/spy_g.log" 2>&1 &
wait $BG
wait
grep -E "tok/s|TPOT median|ITL" "$OUT/prof_pd.log"; for f in "$OUT"/spy_*.log; do tail -n 2 "$f"; done; ls -la "$OUT"
