#!/usr/bin/env bash
# The whole GPU check on a CUDA machine: the GPU tests, the benchmark of every placement, and the
# server end-to-end check with the panel against nvidia-smi. Results go to ${1:-gpu-results}/.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pytest -q -m "gpu or multi_gpu" tests/test_gpu.py -rA 2>&1 | tee "$out/gpu-tests.log"
python3 benchmarks/bench.py --steps "${STEPS:-40}" --json "$out/bench.json" 2>&1 | tee "$out/bench.log"
map=balanced
[ "$(nvidia-smi -L | wc -l)" -lt 2 ] && map=cuda
python3 benchmarks/app_check.py --device-map "$map" --steps "${STEPS:-40}" --json "$out/app-check.json" 2>&1 \
  | tee "$out/app-check.log"
