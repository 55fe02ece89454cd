#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests, step profiles, then the offline benchmarks at real shapes with the
# worker's step timeline; everything in $OUT/results.tgz (the device returns only a few files per call).
#   device run, carry [".gpu-bundle"], timeout 600:  bash scripts/device_bench.sh
# MODELS (default "qwen3-0.6b qwen3-8b"), BENCH_ARGS (extra bench_offline flags), TESTS=0 (skip the GPU tests:
# without a flashinfer JIT cache they spend ~5 min compiling kernels) and PROFILE=0 (skip the step profiles)
# adjust it.
set -uo pipefail
source .gpu-bundle/setup.sh
OUT=${OUT:-/tmp/flotilla-out}
R=$OUT/results
mkdir -p "$R"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${TESTS:-1}" = 1 ]; then
  timeout 450 python3 -m pytest -m gpu tests/ -v -p no:cacheprovider --durations=5 > "$R/gpu-tests.log" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$R/gpu-tests.log" | tail -25
fi
for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do
  if [ "${PROFILE:-1}" = 1 ]; then
    # kernels (torch.profiler) and host functions (cProfile) in separate runs: each profiler slows the other side
    timeout 150 python3 -m flotilla.scripts.profile_step --model "$m" --batch 1,64,256 --steps 30 --torch-profile \
      --prefill 8192x512 > "$R/profile-$m.log" 2>&1
    timeout 120 python3 -m flotilla.scripts.profile_step --model "$m" --batch 1,256 --steps 30 --cprofile \
      > "$R/cprofile-$m.log" 2>&1
    grep '^{' "$R/profile-$m.log" | cut -c1-300 || tail -3 "$R/profile-$m.log"
  fi
  FLOTILLA_STEP_TRACE="$R/trace-$m.jsonl" timeout 200 python3 -m flotilla.scripts.bench_offline --model "$m" \
    --workload both ${BENCH_ARGS:-} --json "$R/flotilla-$m.json" > "$R/bench-$m.log" 2>&1
  tail -1 "$R/bench-$m.log"
  python3 -m flotilla.actors.step_trace "$R/trace-$m.jsonl"
done
tar -czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$R"
