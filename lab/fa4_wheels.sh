#!/usr/bin/env bash
# FlashAttention-4 for the lent GPU (Python 3.12, CUDA 13, no network there), in carry-sized
# parts: its CUDA-13 CuTe-DSL library wheel is 92 MB, over one call's 64 MiB carry, so it is
# unpacked and re-packed as tar.xz (~55 MB, part 1); the other wheels (~9 MB) are part 2.
#   bash lab/fa4_wheels.sh                      # writes .fa4/part1, .fa4/part2 (git-ignored)
#   run carry [".fa4/part1"]:  mkdir -p /tmp/fa4 && cp .fa4/part1/* /tmp/fa4/
#   run carry [".fa4/part2", ...]: bash lab/gpu_session.sh fa4   (installs, tests, benchmarks)
# nvidia-cutlass-dsl also names its CUDA-12 library wheel as a plain dependency; with the
# CUDA-13 one present it is left out (installs use --no-deps).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
dl() { "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform any -d "$1" "${@:2}"; }
rm -rf .fa4 && mkdir -p .fa4/part1 .fa4/part2 .fa4/part3 .fa4/tmp
dl .fa4/part2 flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 \
  apache-tvm-ffi quack-kernels torch-c-dlpack-ext einops
dl .fa4/part3 "cuda-bindings>=13,<14" cuda-pathfinder  # installed only where the image lacks it
dl .fa4/tmp nvidia-cutlass-dsl-libs-cu13==4.8.1
(cd .fa4/tmp && mkdir x && cd x && unzip -q ../*.whl && tar -cf - . | xz -6 -T0 > ../../part1/cutlass_dsl_libs_cu13.tar.xz)
rm -rf .fa4/tmp
du -sh .fa4/part1 .fa4/part2 .fa4/part3
