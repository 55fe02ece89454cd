#!/usr/bin/env bash
# flotilla and vLLM 0.26.0 side by side in one device session: the third of the vLLM peer's three calls
# (../shared/gpu/vllm-peer/make.sh builds .vllm-peer/; calls 1 and 2 copy its two xz parts to /tmp/vp/ on a warm
# machine, no more than 30 s apart). This call installs vLLM there, then runs, per model, vLLM's peer_bench.py and
# flotilla's bench_offline on the same workloads (the nano-vllm recipe with random.seed(0), and batch-1 decode):
#   device run, carry [".vllm-peer/wheels", ".vllm-peer/install.sh", ".vllm-peer/peer_bench.py", ".gpu-bundle"],
#   timeout 600:  bash scripts/dev/device_compare.sh
# The carried paths must stay under the 64 MiB limit: move py-spy and triton-cache.tar out of .gpu-bundle for this
# call (the wheels are 19 MiB, the rest of the bundle 37 MiB; a warm machine keeps ~/.triton from earlier calls).
# MODELS (default "qwen3-0.6b qwen3-8b") and REPEAT (flotilla's --repeat, default 2) adjust it; the JSON lands in
# $OUT/compare.tgz (peer-*.json and flotilla-*.json: python -m flotilla.scripts.dev.plot_performance reads them).
# A later call on the same warm machine skips the install (/tmp/vp/site stays); TESTS="tests/a.py ..." first runs
# those GPU tests (pytest -m gpu).
set -uo pipefail
OUT=${OUT:-/tmp/flotilla-out}
R=$OUT/compare
mkdir -p "$R" /tmp/vp
# triton's JIT cache from an earlier call (~100 s of compiling on a bare machine): .gpu-bundle/triton-cache.tar
[ -f .gpu-bundle/triton-cache.tar ] && mkdir -p ~/.triton && tar -xzf .gpu-bundle/triton-cache.tar -C ~/.triton
if [ ! -f /tmp/vp/env.sh ] || [ ! -d /tmp/vp/site/vllm ]; then
  cp -r .vllm-peer/wheels .vllm-peer/install.sh /tmp/vp/
  bash /tmp/vp/install.sh /tmp/vp/site > "$R/vllm-install.log" 2>&1 || { tail -20 "$R/vllm-install.log"; exit 1; }
fi
if [ -n "${TESTS:-}" ]; then
  (source scripts/dev/device_env.sh && timeout "${TESTS_TIMEOUT:-240}" python3 -m pytest -m gpu $TESTS -p no:cacheprovider -q) \
    > "$R/gpu-tests.log" 2>&1
  grep -E "FAILED|ERROR|passed|failed" "$R/gpu-tests.log" | tail -15
fi
for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do
  # vLLM's environment stays in its subshell: it must not leak into flotilla's run
  # (deepseek-v3-4l: VLLM_DEEP_GEMM_WARMUP=skip, or vLLM's warm-up compiles for ~50 minutes)
  (source /tmp/vp/env.sh && export VLLM_DEEP_GEMM_WARMUP=skip && OUT=$R timeout "${PEER_TIMEOUT:-300}" python3 .vllm-peer/peer_bench.py "$m") \
    > "$R/peer-$m.log" 2>&1
  tail -2 "$R/peer-$m.log"
  (source scripts/dev/device_env.sh && timeout "${FLOTILLA_TIMEOUT:-240}" python3 -m flotilla.scripts.dev.bench_offline --model "$m" \
    --repeat "${REPEAT:-2}" --json "$R/flotilla-$m.json") > "$R/flotilla-$m.log" 2>&1
  tail -1 "$R/flotilla-$m.log"
done
tar -czf "$OUT/compare.tgz" -C "$OUT" compare
tar -czf - -C ~/.cache flashinfer 2>/dev/null | split -b 15M - "$OUT/fic."
# for the next call:  cat FILES_AT/tc.* > .gpu-bundle/triton-cache.tar
tar -czf - -C ~/.triton cache 2>/dev/null | split -b 15M - "$OUT/tc."
