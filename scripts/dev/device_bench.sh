#!/usr/bin/env bash
# On the GPU machine: the GPU tests, step profiles, then the offline benchmarks at real shapes (each workload REPEAT
# times on one engine, with the worker's step timeline), optionally a py-spy profile of every engine process;
# everything in $OUT/results.tgz, and FlashInfer's JIT cache in $OUT/fic.* (gzip, split at 15 MB) for the next run:
#   from the checkout root, with .gpu-bundle/:  bash scripts/dev/device_bench.sh
#   afterwards:  cat fic.* > .gpu-bundle/flashinfer-cache.tar   (setup.sh restores it)
# MODELS (default "qwen3-0.6b qwen3-8b"), BENCH_ARGS (extra bench_offline flags), REPEAT (default 3), TESTS=0 (skip
# the GPU tests: without a JIT cache they spend minutes compiling kernels), PROFILE=0 (skip the step profiles) and
# SPY=1 (py-spy the first model's nano run; needs the static py-spy binary copied to .gpu-bundle/py-spy) adjust it.
# TESTS="tests/a.py tests/b.py" runs only those GPU test files; with TEST_GPU=N (a machine of several GPUs) they run
# on GPU N alongside the benchmarks (which then keep to CUDA_VISIBLE_DEVICES as given, e.g. 0), TESTS_TIMEOUT seconds.
set -uo pipefail
source scripts/dev/device_env.sh
OUT=${OUT:-/tmp/flotilla-out}
R=$OUT/results
mkdir -p "$R"
# triton's JIT cache from an earlier run (minutes of compiling on a bare machine): .gpu-bundle/triton-cache.tar
[ -f .gpu-bundle/triton-cache.tar ] && mkdir -p ~/.triton && tar -xzf .gpu-bundle/triton-cache.tar -C ~/.triton
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
tests=${TESTS:-1}
[ "$tests" = 1 ] && tests=tests/
test_pid=
if [ "$tests" != 0 ]; then
  run_tests() { timeout "${TESTS_TIMEOUT:-400}" python3 -m pytest -m gpu $tests -v -p no:cacheprovider --durations=5 \
                  > "$R/gpu-tests.log" 2>&1; }
  if [ -n "${TEST_GPU:-}" ]; then
    CUDA_VISIBLE_DEVICES=$TEST_GPU run_tests & test_pid=$!
  else
    run_tests
    grep -E "FAILED|ERROR|passed|failed" "$R/gpu-tests.log" | tail -25
  fi
fi
first=1
for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do
  if [ "${PROFILE:-1}" = 1 ]; then
    # kernels (torch.profiler) and host functions (cProfile) in separate runs: each profiler slows the other side
    timeout 240 python3 -m flotilla.scripts.dev.profile_step --model "$m" --batch 1,64,256 --steps 30 --torch-profile \
      --prefill 8192x512 --mixed 256x1000+8192x512 > "$R/profile-$m.log" 2>&1
    timeout 150 python3 -m flotilla.scripts.dev.profile_step --model "$m" --batch 1,256 --steps 30 --cprofile \
      > "$R/cprofile-$m.log" 2>&1
    grep '^{' "$R/profile-$m.log" | cut -c1-300 || tail -3 "$R/profile-$m.log"
  fi
  timeout 300 python3 -m flotilla.scripts.dev.bench_offline --model "$m" --step-trace "$R/trace-$m.jsonl" \
    --workload both --repeat "${REPEAT:-3}" ${BENCH_ARGS:-} --json "$R/flotilla-$m.json" > "$R/bench-$m.log" 2>&1
  tail -1 "$R/bench-$m.log"
  python3 -m flotilla.actors.step_trace "$R/trace-$m.jsonl"
  if [ "${SPY:-0}" = 1 ] && [ "$first" = 1 ] && [ -x .gpu-bundle/py-spy ]; then
    timeout 120 .gpu-bundle/py-spy record --nonblocking --subprocesses --threads -r 250 --format raw -o "$R/spy-$m.txt" \
      -- python3 -m flotilla.scripts.dev.bench_offline --model "$m" --workload nano ${BENCH_ARGS:-} > "$R/spy-$m.log" 2>&1
    gzip -f "$R/spy-$m.txt"
  fi
  first=0
done
if [ -n "$test_pid" ]; then
  wait "$test_pid"
  grep -E "FAILED|ERROR|passed|failed" "$R/gpu-tests.log" | tail -25
fi
tar -czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$R"
tar -czf - -C ~/.cache flashinfer | split -b 15M - "$OUT/fic."
# for the next run:  cat tc.* > .gpu-bundle/triton-cache.tar
tar -czf - -C ~/.triton cache 2>/dev/null | split -b 15M - "$OUT/tc."
