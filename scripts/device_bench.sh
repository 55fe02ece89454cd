#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests, a step profile, then the offline benchmarks at real shapes;
# results in $OUT.
#   device run, carry [".gpu-bundle"], timeout 600:  bash scripts/device_bench.sh
# MODELS (default "qwen3-0.6b qwen3-8b"), BENCH_ARGS (extra bench_offline flags) and TESTS=0 (skip the
# GPU tests: without a flashinfer JIT cache they spend ~5 min compiling kernels) adjust it.
set -uo pipefail
source .gpu-bundle/setup.sh
OUT=${OUT:-/tmp/flotilla-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout 450 python3 -m pytest -m gpu tests/test_overlap.py tests/test_engine.py tests/test_kernels_flashinfer.py \
    tests/test_kernels_triton.py tests/test_sampling.py -v -p no:cacheprovider --durations=5 > "$OUT/gpu-tests.log" 2>&1
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu-tests.log" | tail -25
fi
for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do
  timeout 150 python3 -m flotilla.scripts.profile_step --model "$m" --batch 1,64 --steps 30 > "$OUT/profile-$m.log" 2>&1
  grep '^{' "$OUT/profile-$m.log" || tail -3 "$OUT/profile-$m.log"
  timeout 200 python3 -m flotilla.scripts.bench_offline --model "$m" --workload both ${BENCH_ARGS:-} \
    --json "$OUT/flotilla-$m.json" > "$OUT/bench-$m.log" 2>&1
  tail -1 "$OUT/bench-$m.log"
done
