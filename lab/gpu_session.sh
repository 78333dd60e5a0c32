#!/usr/bin/env bash
# One device call: GPU correctness tests, then the benchmarks. Logs and JSON go to $OUT
# (or lab/results when OUT is unset). Usage: bash lab/gpu_session.sh [tests|ktests|gtests|fa4|overlap|engine|sweep|candidate|variants|profile|ab|services ...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-lab/results}
export PYTHONUNBUFFERED=1 SPLITSERVE_BENCH_DIR=$OUT
# NOTE: on the lent GPU the working tree arrives with stale git metadata (HEAD may be an older
# commit): pass SPLITSERVE_COMMIT=<sha> in the device command to record the right one.
export SPLITSERVE_COMMIT=${SPLITSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
steps=${*:-tests engine sweep}
if [ -d .whl ]; then  # service deps the GPU image lacks: bash bench/service_wheels.sh, then run with carry [".whl"]
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
for s in $steps; do
  t0=$(date +%s)
  case $s in
    overlap)  # the overlapped engine on the GPU: its tests, then the serving loop with arrivals
      timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_engine.py -k overlap 2>&1 \
        | tee "$OUT/gpu_overlap.log" | tail -6
      timeout 300 python3 -m bench.decode_loop --arrivals ${LOOP_ARGS:-} 2>&1 | tee "$OUT/decode_loop.log" \
        | grep -v "splitserve\." | tail -8 ;;
    fa4)  # FlashAttention-4 (lab/fa4_wheels.sh): install from /tmp/fa4 + .fa4/part2, test, compare
      if [ -f /tmp/fa4/cutlass_dsl_libs_cu13.tar.xz ] && [ -d .fa4/part2 ]; then
        mkdir -p /tmp/site && tar -xJf /tmp/fa4/cutlass_dsl_libs_cu13.tar.xz -C /tmp/site \
          && python3 -c "import sys, zipfile; [zipfile.ZipFile(w).extractall('/tmp/site') for w in sys.argv[1:]]" \
            .fa4/part2/*.whl \
          && export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
        python3 -c "import cuda.bindings" 2>/dev/null || { [ -d .fa4/part3 ] \
          && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .fa4/part3/*.whl; }
      fi  # wheels unzipped, not pip --target: three of them share nvidia_cutlass_dsl/, which pip
      # --target skips once it exists; dsl_packages on PYTHONPATH: their .pth does not run from there
      python3 -c "import flash_attn.cute as f; print('flash_attn.cute', f.__version__)" 2>&1 | tail -3
      timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_flash_attention.py 2>&1 \
        | tee "$OUT/gpu_fa4.log" | tail -12
      timeout 260 python3 -m bench.attention_backends_gpu 2>&1 | tee "$OUT/attention_backends.log" | tail -20 ;;
    gtests)
      timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_gtests.log" | tail -8 ;;
    ktests)
      SPLITSERVE_KERNEL_TESTS_GPU=1 timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
        tests/engine/kernels/test_skinny_gemm.py tests/engine/kernels/test_model_skinny.py \
        tests/engine/kernels/test_decode_attention.py tests/engine/kernels/test_attention_triton.py tests/gpu 2>&1 | tee "$OUT/gpu_ktests.log" | tail -8 ;;
    ab)
      timeout 400 python3 -m lab.decode_ab ${AB_ARGS:-} 2>&1 | tee "$OUT/decode_ab.log" | tail -40 ;;
    tests)
      SPLITSERVE_KERNEL_TESTS_GPU=1 timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
        tests/engine/kernels tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    engine)
      timeout 260 python3 -m bench.engine_gpu 2>&1 | tee "$OUT/engine_gpu.log" | grep -v "splitserve\." | tail -60 ;;
    sweep)
      timeout 330 python3 -m lab.skinny_gemm_sweep ${SWEEP_ARGS:-} 2>&1 | tee "$OUT/sweep.log" | tail -80 ;;
    candidate)  # sweep into a candidate table, then check it against the shipped one in whole steps
      timeout 330 python3 -m lab.skinny_gemm_sweep ${SWEEP_ARGS:-} --write-table --table-out "$OUT/candidate_table.json" 2>&1 \
        | tee "$OUT/sweep.log" | tail -30
      timeout 300 python3 -m lab.decode_ab --table-ab "$OUT/candidate_table.json" ${AB_ARGS:-} 2>&1 \
        | tee "$OUT/decode_ab.log" | tail -20 ;;
    variants)  # step A/B of table variants: VARIANTS="SPEC SPEC|SPEC|..." (groups split by |,
      # each group one candidate table: lab.table_variant --set SPEC ...; see its docstring)
      i=0; cands=""
      IFS='|' read -ra groups <<< "${VARIANTS:?set VARIANTS}"
      for g in "${groups[@]}"; do
        i=$((i + 1)); sets=""
        for spec in $g; do sets="$sets --set $spec"; done
        python3 -m lab.table_variant "$OUT/variant_$i.json" $sets || continue
        cands="$cands${cands:+,}$OUT/variant_$i.json"
      done
      timeout 400 python3 -m lab.decode_ab --table-ab "$cands" ${AB_ARGS:-} 2>&1 \
        | tee "$OUT/decode_ab.log" | tail -24 ;;
    profile)
      timeout 200 python3 -m lab.step_profile ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log" | tail -120 ;;
    services)
      SPLITSERVE_TEST_DEVICE=cuda:0 timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
        tests/services ${SERVICE_TEST_ARGS:-} 2>&1 | tee "$OUT/services.log" | tail -25 ;;
    *) echo "unknown step $s" ;;
  esac
  echo "== step $s took $(( $(date +%s) - t0 ))s"
done
