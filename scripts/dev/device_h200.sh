#!/usr/bin/env bash
# One-GPU measurements other than the flotilla-against-vLLM comparisons (device_compare.sh and device_serving.sh run
# those), as stages of one run, named in SETUPS (default "peer tests mtp kernels profile_ds"):
#   peer         copy the vLLM peer's xz parts carried with the checkout (.vllm-peer/vllm.tar.xz.part-*) to /tmp/vp/,
#                where device_compare.sh's install finds them (a part is 50-55 MiB: a run carries one, with .gpu-lite,
#                the bundle without flashinfer, beside it)
#   tests        the GPU tests in TESTS (default: the FP8, MoE, triton kernel and speculative-decoding tests), for at
#                most TESTS_S seconds (default 200), those matching TESTS_K (pytest -k, spaces allowed), with pytest's
#                TESTS_ARGS ("-s" keeps the actors' stderr, and the stacks they print 15 s before the limit, in the
#                log of a run the limit cuts)
#   dg_diag      the DeepGEMM FP8 experts' xfail test with -s: relative errors of the layer and of each grouped GEMM
#   mtp          bench_mtp on DeepSeek-V3-4L with its MTP layer, 1-3 speculative tokens at forced acceptance
#   kernels      bench_kernels --quick over fp8_gemm, moe, fp8_moe and routing, small sizes also in CUDA graphs, with
#                the tile variants in FP8_TILES and MOE_TILES
#   profile_ds   profile_step --torch-profile on DeepSeek-V3-4L at batch 1 and 64 (FlashMLA, graphs)
#   profile_q30  the same on Qwen3-30B-A3B (needs the full .gpu-bundle: flashinfer)
#   ds_deepgemm  bench_offline on DeepSeek-V3-4L with --fp8-backend deep_gemm (DeepGEMM's dense FP8 linears)
#   bench_q30    bench_offline on Qwen3-30B-A3B (Q30_WORKLOAD, default both: the nano workload and batch-1 decode,
#                Q30_NANO_REPEAT runs, default 1; the worker's step trace summed up by batch size; FLOTILLA_LOG_JIT=1:
#                triton compiles logged), once per variant in Q30_ATTN (default "auto"): an attention backend, with
#                "+cublas" FLOTILLA_GEMV=0 (one-row linears on cuBLAS), "+ds" FLOTILLA_MOE_TILES=ds=1 (the small
#                experts' per-slot down pass), "+pga" --prefill-cuda-graphs all (prefill graphs for GQA models);
#                else the engine's defaults
#   q30_b1       bench_offline's batch-1 decode alone on Qwen3-30B-A3B, once per variant in Q30_B1 (default
#                "auto"), Q30_REPEAT runs each (default 3); "+nopdl" (any stage's variants): FLOTILLA_PDL=0
#   q30_tiles    q30_b1's runs once per FLOTILLA_MOE_TILES value in Q30_TILES (space-separated; "-" the defaults) and
#                per FLOTILLA_GEMV_BLOCK_K value in GEMV_K (default none), files numbered in that order
#   profile_q30_triton  profile_q30 with the triton attention kernels instead of flashinfer's
#   profile_q30_var   profile_q30 once per variant in Q30_PROFILE (default "auto"), the same notation
#   profile_q30_long  profile_q30 at 2,048-token prompts, once per variant in Q30_ATTN
#   profile_q30_big  profile_step on Qwen3-30B-A3B at the nano workload's large decode batches (BIG_BATCH, default
#                192, at BIG_LEN context, default 800) and one eager 8,192-token prompt step, per variant in
#                Q30_PROFILE
#   gemv         bench_kernels --only gemv: the one-row linear kernel against cuBLAS, with GEMV_TILES variants
#   ds_b1        bench_offline's batch-1 decode on DeepSeek-V3-4L, once per MLA backend in DS_ATTN (default "auto";
#                "+eg": --prefill-cuda-graphs off, eager prefill), with the worker's step trace summarized (ms per step,
#                time waiting for plans)
#   profile_ds_var  profile_ds once per MLA backend in DS_PROFILE (default "auto triton")
#   host_ds      profile_step on DeepSeek-V3-4L at batch 1 with --cprofile and no torch profiler: the host's time per
#                step (launch_host_ms) and the functions it goes to
#   moe_small    bench_kernels' moe bench at 1-16 tokens: the small-batch experts against the sorted ones (t=0) and
#                the small path's tile variants in SMALL_TILES
#   moe_large    the same bench at LARGE_TOKENS (default 64-8,192 tokens) over the sorted GEMMs' tile variants in
#                LARGE_TILES (after vLLM's tuned configs for E=128, N=768: BLOCK_N halved, since flotilla's gate_up
#                programs hold gate and up; pn/pk/pw/ps tile the down pass on its own)
# Stages run in this file's order whatever SETUPS's order (tests and kernel benches first, the larger sweeps last).
# Carry ".gpu-bundle", or ".gpu-lite" beside one of the vLLM peer's parts.
# Each stage has its own timeout, capped by what is left of BUDGET (default 560 s). Results in $OUT/h200.tgz.
# CPU smoke run (stages that need no GPU model): NO_BUNDLE=1 SETUPS="peer" bash scripts/dev/device_h200.sh
set -uo pipefail
RESULTS=h200
source scripts/dev/device_common.sh
SETUPS=${SETUPS:-peer tests mtp kernels profile_ds}
want() { [[ " $SETUPS " == *" $1 "* ]]; }
# triton's JIT cache from an earlier run (its tc.* parts, joined): unchanged kernels do not compile again
[ -f .gpu-bundle/triton-cache.tar ] && mkdir -p ~/.triton && tar -xzf .gpu-bundle/triton-cache.tar -C ~/.triton

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
  TESTS=${TESTS:-tests/test_fp8_quant_triton.py tests/test_moe_masked.py tests/test_spec_decode.py tests/test_spec_graphs.py \
tests/test_deep_gemm_fp8_experts.py tests/test_fp8.py tests/test_moe.py tests/test_fp8_moe.py tests/test_kernels_triton.py}
  stage "tests: $TESTS"
  # shellcheck disable=SC2086
  limit=$(cap "${TESTS_S:-200}")
  # 15 s before the limit, every flotilla actor process still up prints its threads' stacks (SIGUSR1: faulthandler,
  # flotilla/__main__.py) into the log: a test that hangs says where
  ( sleep $((limit > 30 ? limit - 15 : limit)); pkill -USR1 -f -- "-m flotilla .*actor" ) &
  dumper=$!
  timeout "$limit" python3 -m pytest -m gpu $TESTS -v -rfEX -p no:cacheprovider --durations=15 ${TESTS_ARGS:-} \
    ${TESTS_K:+-k "$TESTS_K"} \
    > "$R/gpu-tests.log" 2>&1
  echo "exit $?"; kill "$dumper" 2>/dev/null
  grep -E "FAILED|ERROR|XPASS|passed|failed|^[0-9.]+s (call|setup)" "$R/gpu-tests.log" | tail -24
fi

if want dg_diag; then
  stage "dg_diag: where the DeepGEMM FP8 experts depart (the xfail test's printed relative errors)"
  timeout "$(cap 120)" python3 -m pytest -m gpu tests/test_deep_gemm_fp8_experts.py -s -q -p no:cacheprovider \
    > "$R/dg-diag.log" 2>&1
  echo "exit $?"; grep -E "^\[tokens=|passed|failed" "$R/dg-diag.log" | cut -c1-700
fi

if want mtp; then
  stage "mtp: bench_mtp deepseek-v3-4l-mtp"
  timeout "$(cap 240)" python3 -m flotilla.scripts.dev.bench_mtp --model deepseek-v3-4l-mtp --num-speculative-tokens 1,2,3 \
    --json "$R/mtp.json" > "$R/mtp.log" 2>&1
  echo "exit $?"; grep -E '^\{|warning' "$R/mtp.log" | cut -c1-400
fi

if want kernels; then
  stage "kernels: bench_kernels --quick"
  timeout "$(cap 300)" python3 -m flotilla.scripts.dev.bench_kernels --only fp8_gemm,moe,fp8_moe,routing --quick \
    --fp8-tiles "${FP8_TILES:-q=1;n=128,sk=1;q=1,n=128,sk=1}" \
    --moe-tiles "${MOE_TILES:-k=128;n=32,k=128;n=32,k=128,s=4;n=128,k=128,w=8}" \
    --json "$R/kernels.json" > "$R/kernels.log" 2>&1
  echo "exit $?"; grep '"summary"' "$R/kernels.log"
fi

if want gemv; then
  stage "gemv: bench_kernels --only gemv"
  timeout "$(cap 90)" python3 -m flotilla.scripts.dev.bench_kernels --only gemv --target-s 0.05 \
    --gemv-tiles "${GEMV_TILES:-n=4,k=2048;n=16,k=512;n=8,k=2048;n=8,k=512,w=4}" --json "$R/gemv.json" > "$R/gemv.log" 2>&1
  echo "exit $?"; grep '"summary"' "$R/gemv.log"
fi

if want moe_small; then
  stage "moe_small: bench_kernels --only moe at 1-16 tokens"
  timeout "$(cap 150)" python3 -m flotilla.scripts.dev.bench_kernels --only moe --moe-tokens 1,2,4,8,16 --target-s 0.05 \
    --moe-tiles "${SMALL_TILES:-t=0;t=16;sn=8;sn=32;sk=256;sn=8,sk=256;w=8}" --json "$R/moe-small.json" \
    > "$R/moe-small.log" 2>&1
  echo "exit $?"; grep '"summary"' "$R/moe-small.log"
fi

profile() {  # label, model, more profile_step options
  stage "$1: profile_step --model $2 ${*:3}"
  timeout "$(cap 180)" python3 -m flotilla.scripts.dev.profile_step --model "$2" --batch 1,64 --steps 30 --torch-profile \
    "${@:3}" > "$R/$1.log" 2>&1
  echo "exit $?"; grep '^{' "$R/$1.log" | cut -c1-600
}
want profile_ds && profile profile_ds deepseek-v3-4l
if want profile_ds_var; then
  for attn in ${DS_PROFILE:-auto triton}; do profile "profile_ds_$attn" deepseek-v3-4l --attention-backend "$attn"; done
fi
if want host_ds; then
  stage "host_ds: profile_step --model deepseek-v3-4l --batch 1 --cprofile (no torch profiler)"
  timeout "$(cap 120)" python3 -m flotilla.scripts.dev.profile_step --model deepseek-v3-4l --batch 1 --steps 60 --cprofile \
    > "$R/host_ds.log" 2>&1
  echo "exit $?"; grep '^{' "$R/host_ds.log" | cut -c1-600
fi
want profile_q30 && profile profile_q30 qwen3-30b-a3b
want profile_q30_triton && profile profile_q30_triton qwen3-30b-a3b --attention-backend triton
gemv_of() { [[ $1 == *+cublas* ]] && echo 0 || echo 1; }  # variant "backend[+cublas][+ds]" -> FLOTILLA_GEMV
# tiles_of: a variant's FLOTILLA_MOE_TILES ("+pn128": the sorted down pass on 128-column tiles)
tiles_of() { local t=${FLOTILLA_MOE_TILES:-}; [[ $1 == *+ds* ]] && t="ds=1,$t"; [[ $1 == *+pn128* ]] && t="pn=128,$t"; echo "$t"; }
backend_of() { local b=${1%%+*}; echo "$b"; }  # the attention backend of a variant
label_of() { echo "${1//+/_}"; }  # a variant in file names (result files with "+" in their names do not come back)
pg_of() { [[ $1 == *+pga* ]] && echo all || echo auto; }  # "+pga": --prefill-cuda-graphs all (GQA prefill graphs)
# variant_env: the environment variables a variant's suffixes set (any stage's variants).
# "+nopdl": FLOTILLA_PDL=0 (no programmatic dependent launch); "+fiN": FLOTILLA_FLASHINFER_DECODE_ABOVE=N
# (flashinfer_triton's decode on triton's kernel up to N sequences); else the defaults
variant_env() {
  local fi; fi=$(grep -o '+fi[0-9]*' <<< "$1" | tr -d '+fi')
  [ -n "$fi" ] && echo "FLOTILLA_FLASHINFER_DECODE_ABOVE=$fi"
  echo "FLOTILLA_PDL=$([[ $1 == *+nopdl* ]] && echo 0 || echo 1)"
}
if want profile_q30_var; then
  for v in ${Q30_PROFILE:-auto}; do
    # shellcheck disable=SC2046
    (export $(variant_env "$v"); FLOTILLA_GEMV=$(gemv_of "$v") FLOTILLA_MOE_TILES=$(tiles_of "$v") \
      profile "profile_q30_$(label_of "$v")" qwen3-30b-a3b --attention-backend "$(backend_of "$v")")
  done
fi
if want bench_q30; then
  for v in ${Q30_ATTN:-auto}; do
    stage "bench_q30: bench_offline qwen3-30b-a3b, variant $v"
    # shellcheck disable=SC2046
    # the worker's step trace (both workloads, every repeat): decode ms per step by batch size, the prompt steps
    env $(variant_env "$v") FLOTILLA_GEMV=$(gemv_of "$v") FLOTILLA_MOE_TILES=$(tiles_of "$v") FLOTILLA_LOG_JIT=1 \
      timeout "$(cap 240)" python3 -m flotilla.scripts.dev.bench_offline --model qwen3-30b-a3b --repeat "${Q30_NANO_REPEAT:-1}" \
      --workload "${Q30_WORKLOAD:-both}" --prefill-cuda-graphs "$(pg_of "$v")" \
      --step-trace "$R/bench_q30_$(label_of "$v").trace.jsonl" \
      --attention-backend "$(backend_of "$v")" --json "$R/flotilla-qwen3-30b-a3b-$(label_of "$v").json" \
      > "$R/bench_q30_$(label_of "$v").log" 2>&1
    echo "exit $?"; tail -1 "$R/bench_q30_$(label_of "$v").log" | cut -c1-500
    python3 -m flotilla.actors.step_trace "$R/bench_q30_$(label_of "$v").trace.jsonl" | cut -c1-1500
  done
fi

if want q30_b1; then
  for v in ${Q30_B1:-auto}; do
    stage "q30_b1: bench_offline qwen3-30b-a3b --workload decode1, variant $v"
    # shellcheck disable=SC2046
    env $(variant_env "$v") FLOTILLA_GEMV=$(gemv_of "$v") FLOTILLA_MOE_TILES=$(tiles_of "$v") \
      timeout "$(cap 120)" python3 -m flotilla.scripts.dev.bench_offline --model qwen3-30b-a3b --workload decode1 \
      --repeat "${Q30_REPEAT:-3}" --attention-backend "$(backend_of "$v")" --prefill-cuda-graphs "$(pg_of "$v")" \
      --json "$R/flotilla-q30-b1-$(label_of "$v").json" > "$R/q30_b1_$(label_of "$v").log" 2>&1
    echo "exit $?"; tail -1 "$R/q30_b1_$(label_of "$v").log" | cut -c1-500
  done
fi

if want q30_tiles; then
  i=0
  for t in ${Q30_TILES:--}; do
    i=$((i + 1)); [ "$t" = - ] && t=""
    stage "q30_tiles $i: bench_offline qwen3-30b-a3b --workload decode1, FLOTILLA_MOE_TILES=$t"
    FLOTILLA_MOE_TILES=$t timeout "$(cap 90)" python3 -m flotilla.scripts.dev.bench_offline --model qwen3-30b-a3b \
      --workload decode1 --repeat "${Q30_REPEAT:-3}" --json "$R/flotilla-q30-tiles-$i.json" > "$R/q30_tiles_$i.log" 2>&1
    echo "exit $?"; tail -1 "$R/q30_tiles_$i.log" | grep -o '"b1_decode_tok_per_s_runs": \[[^]]*\]'
  done
  for k in ${GEMV_K:-}; do
    stage "q30_tiles: bench_offline qwen3-30b-a3b --workload decode1, FLOTILLA_GEMV_BLOCK_K=$k"
    FLOTILLA_GEMV_BLOCK_K=$k timeout "$(cap 90)" python3 -m flotilla.scripts.dev.bench_offline --model qwen3-30b-a3b \
      --workload decode1 --repeat "${Q30_REPEAT:-3}" --json "$R/flotilla-q30-gemvk-$k.json" > "$R/q30_gemvk_$k.log" 2>&1
    echo "exit $?"; tail -1 "$R/q30_gemvk_$k.log" | grep -o '"b1_decode_tok_per_s_runs": \[[^]]*\]'
  done
fi

if want profile_q30_big; then  # the nano workload's large decode batches at long contexts, and one prompt step
  for v in ${Q30_PROFILE:-auto}; do
    # shellcheck disable=SC2046
    (export $(variant_env "$v"); f="profile_q30_big_$(label_of "$v")"
     stage "$f: profile_step qwen3-30b-a3b --batch ${BIG_BATCH:-192} --prompt-len ${BIG_LEN:-800} --prefill 8192x512"
     FLOTILLA_GEMV=$(gemv_of "$v") FLOTILLA_MOE_TILES=$(tiles_of "$v") timeout "$(cap 200)" \
       python3 -m flotilla.scripts.dev.profile_step --model qwen3-30b-a3b --batch "${BIG_BATCH:-192}" \
       --prompt-len "${BIG_LEN:-800}" --steps 10 --torch-profile --prefill 8192x512 \
       --attention-backend "$(backend_of "$v")" > "$R/$f.log" 2>&1
     echo "exit $?"; grep '^{' "$R/$f.log" | cut -c1-900)
  done
fi

if want profile_q30_long; then
  for v in ${Q30_ATTN:-auto}; do
    FLOTILLA_GEMV=$(gemv_of "$v") FLOTILLA_MOE_TILES=$(tiles_of "$v") \
      profile "profile_q30_long_$(label_of "$v")" qwen3-30b-a3b \
      --attention-backend "$(backend_of "$v")" \
      --prompt-len 2048 --steps 20
  done
fi

if want moe_large; then
  stage "moe_large: bench_kernels --only moe at ${LARGE_TOKENS:=64,128,256,512,1024,2048,4096,8192} tokens"
  timeout "$(cap 150)" python3 -m flotilla.scripts.dev.bench_kernels --only moe --moe-tokens "$LARGE_TOKENS" --target-s 0.05 \
    --moe-tiles "${LARGE_TILES:-m=32,n=128,k=128,w=4,s=2;m=64,n=128,k=64,w=4,s=3;m=128,n=128,k=64,w=8,s=4;m=64,n=128,k=64,w=8,s=4;m=16,n=128,k=128,w=4,s=3}" \
    --json "$R/moe-large.json" > "$R/moe-large.log" 2>&1
  echo "exit $?"; grep '"summary"' "$R/moe-large.log"
fi

if want ds_b1; then
  for attn in ${DS_ATTN:-auto}; do  # a variant "backend[+eg]": +eg with --prefill-cuda-graphs off
    stage "ds_b1: bench_offline deepseek-v3-4l --workload decode1, variant $attn"
    # the worker's per-step timeline (actors/step_trace.py): ms per decode step and the time it waited for plans
    pg=$([[ $attn == *+eg* ]] && echo off || echo auto)
    f=$(label_of "$attn")
    # shellcheck disable=SC2046
    env $(variant_env "$attn") timeout "$(cap 150)" python3 -m flotilla.scripts.dev.bench_offline \
      --model deepseek-v3-4l --workload decode1 --repeat "${DS_REPEAT:-2}" --attention-backend "$(backend_of "$attn")" \
      --prefill-cuda-graphs "$pg" --step-trace "$R/ds_b1_$f.trace.jsonl" \
      --json "$R/flotilla-ds-b1-$f.json" > "$R/ds_b1_$f.log" 2>&1
    echo "exit $?"; tail -1 "$R/ds_b1_$f.log" | cut -c1-400
    python3 -m flotilla.actors.step_trace "$R/ds_b1_$f.trace.jsonl" | cut -c1-400
  done
fi

if want ds_deepgemm; then
  stage "ds_deepgemm: bench_offline deepseek-v3-4l --fp8-backend deep_gemm"
  timeout "$(cap 200)" python3 -m flotilla.scripts.dev.bench_offline --model deepseek-v3-4l --repeat 1 --fp8-backend deep_gemm \
    --json "$R/flotilla-deepseek-v3-4l-deepgemm.json" > "$R/ds_deepgemm.log" 2>&1
  echo "exit $?"; tail -1 "$R/ds_deepgemm.log" | cut -c1-500
fi

stage "pack"
tar -czf "$OUT/h200.tgz" -C "$OUT" h200
# for the next run:  cat tc.* > .gpu-bundle/triton-cache.tar
[ -d ~/.triton/cache ] && tar -czf - -C ~/.triton cache 2>/dev/null | split -b 15M - "$OUT/tc."
# and FlashInfer's:  cat fic.* > .gpu-bundle/flashinfer-cache.tar  (setup.sh restores it; SAVE_FI=0: not)
[ "${SAVE_FI:-1}" = 1 ] && [ -d ~/.cache/flashinfer ] && tar -czf - -C ~/.cache flashinfer | split -b 15M - "$OUT/fic."
exit 0
