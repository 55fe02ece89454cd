#!/usr/bin/env bash
# flotilla and vLLM 0.26.0 side by side on one machine. ../shared/gpu/vllm-peer/make.sh builds .vllm-peer/, whose
# two xz parts device_h200.sh's peer stage copies to /tmp/vp/; this script installs vLLM there, then runs, per model,
# vLLM's peer_bench.py and flotilla's bench_offline on the same workloads (the nano-vllm recipe with random.seed(0),
# and batch-1 decode):
#   with .vllm-peer/wheels, .vllm-peer/install.sh, .vllm-peer/peer_bench.py and .gpu-bundle/ (without py-spy and
#   triton-cache.tar: the machine keeps ~/.triton from earlier runs):  bash scripts/dev/device_compare.sh
# MODELS (default "qwen3-0.6b qwen3-8b"; a shape peer_bench.py does not know, e.g. qwen3.5-35b-a3b or
# qwen3-vl-30b-a3b, runs bench_offline --engine vllm instead; qwen3.5 shapes with the bundle's flashinfer importable,
# which vLLM's delta-net layers import), WORKLOAD (bench_offline's, default both), REPEAT (flotilla's --repeat, default
# 2) and VLLM_OPTIONS (bench_offline's --vllm-options, e.g. '{"gdn_prefill_backend": "triton"}': vLLM's FlashInfer
# delta-net prefill is built by FlashInfer's JIT on first use, minutes on a bare machine) adjust it; the JSON lands in
# $OUT/compare.tgz (peer-*.json and flotilla-*.json: python -m flotilla.scripts.dev.plot_performance reads them).
# A later run on the same machine skips the install (/tmp/vp/site stays); TESTS="tests/a.py ..." first runs
# those GPU tests (pytest -m gpu).
set -uo pipefail
OUT=${OUT:-/tmp/flotilla-out}
R=$OUT/compare
mkdir -p "$R" /tmp/vp
# triton's JIT cache from an earlier run (minutes of compiling on a bare machine): .gpu-bundle/triton-cache.tar
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
[ -d /tmp/site ] || (source scripts/dev/device_env.sh >/dev/null 2>&1)   # the bundle's packages in /tmp/site
for m in ${MODELS:-qwen3-0.6b qwen3-8b}; do
  # vLLM's environment stays in its subshell: it must not leak into flotilla's run
  # (deepseek-v3-4l: VLLM_DEEP_GEMM_WARMUP=skip, or vLLM's warm-up compiles for ~50 minutes)
  case "$m" in
    qwen3-8b|qwen3-0.6b|qwen3-30b-a3b|deepseek-v3-4l)
      (source /tmp/vp/env.sh && export VLLM_DEEP_GEMM_WARMUP=skip && OUT=$R timeout "${PEER_TIMEOUT:-300}" python3 .vllm-peer/peer_bench.py "$m") \
        > "$R/peer-$m.log" 2>&1 ;;
    *)  # a shape peer_bench.py does not know: bench_offline's own workloads on vLLM (the checkout importable; of the
        # bundle, only its flashinfer for Qwen3.5, after vLLM's own packages)
      extra=""; [[ "$m" == qwen3.5* ]] && extra=":/tmp/site"
      (source /tmp/vp/env.sh && export VLLM_DEEP_GEMM_WARMUP=skip && mkdir -p /tmp/flotilla-path \
        && ln -sfn "$(pwd)" /tmp/flotilla-path/flotilla && PYTHONPATH=/tmp/flotilla-path:${PYTHONPATH:-}$extra \
        timeout "${PEER_TIMEOUT:-300}" python3 -m flotilla.scripts.dev.bench_offline --engine vllm --model "$m" \
        --workload "${WORKLOAD:-both}" --vllm-options "${VLLM_OPTIONS:-{\}}" --json "$R/peer-$m.json") \
        > "$R/peer-$m.log" 2>&1 ;;
  esac
  tail -2 "$R/peer-$m.log"
  (source scripts/dev/device_env.sh && timeout "${FLOTILLA_TIMEOUT:-240}" python3 -m flotilla.scripts.dev.bench_offline --model "$m" \
    --workload "${WORKLOAD:-both}" --repeat "${REPEAT:-2}" --json "$R/flotilla-$m.json") > "$R/flotilla-$m.log" 2>&1
  tail -1 "$R/flotilla-$m.log"
done
tar -czf "$OUT/compare.tgz" -C "$OUT" compare
tar -czf - -C ~/.cache flashinfer 2>/dev/null | split -b 15M - "$OUT/fic."
# for the next run:  cat tc.* > .gpu-bundle/triton-cache.tar
tar -czf - -C ~/.triton cache 2>/dev/null | split -b 15M - "$OUT/tc."
