#!/usr/bin/env bash
# One-GPU measurements that are not flotilla-against-vLLM comparisons (device_compare.sh and device_serving.sh do
# those), as stages of one device call, named in SETUPS (default "peer tests mtp kernels profile_ds"):
#   peer         copy the vLLM peer's xz parts carried in this call (.vllm-peer/vllm.tar.xz.part-*) to /tmp/vp/, where
#                device_compare.sh's install finds them: a part is 50-55 MiB, so calls 1 and 2 carry one each, with
#                .gpu-lite (the bundle without flashinfer) beside it
#   tests        the GPU tests in TESTS (default: the ones changed since the last device session)
#   mtp          bench_mtp on DeepSeek-V3-4L with its MTP layer, 1-3 speculative tokens at forced acceptance (issue 9)
#   kernels      bench_kernels --quick over fp8_gemm, moe, fp8_moe and routing, small sizes also in CUDA graphs, with
#                the tile variants in FP8_TILES and MOE_TILES
#   profile_ds   profile_step --torch-profile on DeepSeek-V3-4L at batch 1 and 64 (FlashMLA, graphs)
#   profile_q30  the same on Qwen3-30B-A3B (needs the full .gpu-bundle: flashinfer)
#   ds_deepgemm  bench_offline on DeepSeek-V3-4L with --fp8-backend deep_gemm (DeepGEMM's dense FP8 linears)
# The next session's plan (docs/performance.md) runs, on a warm nvidia-h200:
#   1) carry [".vllm-peer/vllm.tar.xz.part-aa", ".gpu-lite"]: SETUPS="peer tests mtp" bash scripts/device_h200.sh
#   2) carry [".vllm-peer/vllm.tar.xz.part-ab", ".gpu-lite"]: SETUPS="peer kernels profile_ds" bash scripts/device_h200.sh
#   3) the peer's third call (device_compare.sh's header), then SETUPS="ds_deepgemm profile_q30" in the same command
# Each stage has its own timeout, capped by what is left of BUDGET (default 560 s). Results in $OUT/h200.tgz.
# CPU smoke run (stages that need no GPU model): NO_BUNDLE=1 SETUPS="peer" bash scripts/device_h200.sh
set -uo pipefail
RESULTS=h200
source scripts/device_common.sh
SETUPS=${SETUPS:-peer tests mtp kernels profile_ds}
want() { [[ " $SETUPS " == *" $1 "* ]]; }

if want peer; then
  VP=${VP_DIR:-/tmp/vp}   # device_compare.sh's install reads /tmp/vp (a test points this elsewhere)
  stage "peer: the vLLM bundle's parts to $VP"
  mkdir -p "$VP"
  found=0
  for part in .vllm-peer/vllm.tar.xz.part-*; do
    [ -f "$part" ] || continue
    cp "$part" "$VP/" && found=$((found + 1))
  done
  echo "copied $found part(s); $VP holds: $(cd "$VP" && ls vllm.tar.xz.part-* 2>/dev/null | tr '\n' ' ')"
fi

if want tests; then
  TESTS=${TESTS:-tests/test_fp8_quant_triton.py tests/test_moe_masked.py tests/test_spec_decode.py \
tests/test_deep_gemm_fp8_experts.py tests/test_fp8.py tests/test_moe.py tests/test_fp8_moe.py tests/test_kernels_triton.py}
  stage "tests: $TESTS"
  # shellcheck disable=SC2086
  timeout "$(cap 200)" python3 -m pytest -m gpu $TESTS -v -rfEX -p no:cacheprovider > "$R/gpu-tests.log" 2>&1
  echo "exit $?"; grep -E "FAILED|ERROR|XPASS|passed|failed" "$R/gpu-tests.log" | tail -12
fi

if want mtp; then
  stage "mtp: bench_mtp deepseek-v3-4l-mtp"
  timeout "$(cap 240)" python3 -m flotilla.scripts.bench_mtp --model deepseek-v3-4l-mtp --num-speculative-tokens 1,2,3 \
    --json "$R/mtp.json" > "$R/mtp.log" 2>&1
  echo "exit $?"; grep -E '^\{|warning' "$R/mtp.log" | cut -c1-400
fi

if want kernels; then
  stage "kernels: bench_kernels --quick"
  timeout "$(cap 300)" python3 -m flotilla.scripts.bench_kernels --only fp8_gemm,moe,fp8_moe,routing --quick \
    --fp8-tiles "${FP8_TILES:-q=1;n=128,sk=1;q=1,n=128,sk=1}" \
    --moe-tiles "${MOE_TILES:-k=128;n=32,k=128;n=32,k=128,s=4;n=128,k=128,w=8}" \
    --json "$R/kernels.json" > "$R/kernels.log" 2>&1
  echo "exit $?"; grep '"summary"' "$R/kernels.log"
fi

profile() {  # label, model
  stage "$1: profile_step --model $2"
  timeout "$(cap 180)" python3 -m flotilla.scripts.profile_step --model "$2" --batch 1,64 --steps 30 --torch-profile \
    > "$R/$1.log" 2>&1
  echo "exit $?"; grep '^{' "$R/$1.log" | cut -c1-600
}
want profile_ds && profile profile_ds deepseek-v3-4l
want profile_q30 && profile profile_q30 qwen3-30b-a3b

if want ds_deepgemm; then
  stage "ds_deepgemm: bench_offline deepseek-v3-4l --fp8-backend deep_gemm"
  timeout "$(cap 200)" python3 -m flotilla.scripts.bench_offline --model deepseek-v3-4l --repeat 1 --fp8-backend deep_gemm \
    --json "$R/flotilla-deepseek-v3-4l-deepgemm.json" > "$R/ds_deepgemm.log" 2>&1
  echo "exit $?"; tail -1 "$R/ds_deepgemm.log" | cut -c1-500
fi

stage "pack"
tar -czf "$OUT/h200.tgz" -C "$OUT" h200
# for the next call:  cat FILES_AT/tc.* > .gpu-bundle/triton-cache.tar
[ -d ~/.triton/cache ] && tar -czf - -C ~/.triton cache 2>/dev/null | split -b 15M - "$OUT/tc."
exit 0
