#!/usr/bin/env bash
# MoE on two GPUs: the same workloads (bench_offline: the nano-vllm workload and batch-1 decode) on one GPU, at TP=2
# (eager, and with --tp-cuda-graphs if tests/test_tp_graphs.py passes first), and at DP2 x EP2 (attention
# data-parallel, experts split over the two ranks' all-to-alls; dp2ep2g: the same with --all2all-backend
# allgather_reducescatter, no host sync per MoE layer; dp2ep2gg: that with decode graphs, --ep-cuda-graphs, if
# tests/test_ep_graphs.py passes first).
#   on a machine with two GPUs, from the checkout root, with .gpu-bundle/:  bash scripts/dev/device_moe_x2.sh
#   afterwards: tar -xzf moe-x2.tgz; for the next run: cat tc.* > .gpu-bundle/triton-cache.tar
# Every run has its own timeout, capped by what is left of BUDGET (default 560 s), so the script ends within it and
# still packs its results. Adjust with: MODEL (default qwen3-30b-a3b), MODEL_DIR (a folder instead of the shape),
# SETUPS (default "tests 1gpu dp2ep2 tp2 dp2ep2g dp2ep2gg tp2g"; at the 30B shape they take more than one BUDGET:
# a second run with SETUPS="tests a2a dp2ep2g dp2ep2gg tp2g" finishes them; a2a: bench_ep's layer cost at world size
# 2, both --all2all-backend values), ARGS (extra bench_offline flags for every setup), EP_ARGS (extra bench_ep flags).
# CPU smoke run (gloo, no GPU), on a tiny MoE written first with
#   python3 -c "import sys; sys.path.insert(0, 'tests'); from helpers_tiny_models import write_tiny_moe_model as w; \
#     w('/tmp/tinymoe')"
#   NO_BUNDLE=1 MODEL_DIR=/tmp/tinymoe SETUPS="1gpu dp2ep2 tp2" ARGS="--device cpu --dtype float32 --num-requests 8 \
#     --min-len 8 --max-len 24 --decode-in 8 --decode-out 8 --vocab 200 --kv-cache-blocks 200 --skip-tokenizer-init" \
#     bash scripts/dev/device_moe_x2.sh
# Results in $OUT/moe-x2.tgz: flotilla-SETUP.json and .log per setup, gpu-tests.log, summary.txt.
set -uo pipefail
RESULTS=moe-x2
source scripts/dev/device_common.sh
SETUPS=${SETUPS:-tests 1gpu dp2ep2 tp2 dp2ep2g dp2ep2gg tp2g}
M=${MODEL:-qwen3-30b-a3b}
MODEL_ARG=${MODEL_DIR:-$M}   # bench_offline takes a built-in shape's name or a folder

want() { [[ " $SETUPS " == *" $1 "* ]]; }
TP_GRAPHS_OK=0
EP_GRAPHS_OK=0

if want tests; then
  stage "the TP=2 and DP2 x EP2 graph tests"
  timeout "$(cap 150)" python3 -m pytest -m gpu tests/test_tp_graphs.py tests/test_ep_graphs.py -v -p no:cacheprovider \
    > "$R/gpu-tests.log" 2>&1
  rc=$?; echo "exit $rc"; grep -E "PASSED|SKIPPED|FAILED|ERROR|passed|failed" "$R/gpu-tests.log" | tail -4
  grep -q "test_tp2_decode_graphs_give_the_eager_tokens PASSED" "$R/gpu-tests.log" && TP_GRAPHS_OK=1
  grep -q "test_dp2_ep2_decode_graphs_give_the_eager_tokens PASSED" "$R/gpu-tests.log" && EP_GRAPHS_OK=1
fi

run() {  # label, extra bench_offline flags...
  local label=$1; shift
  stage "$label: $*"
  # shellcheck disable=SC2086
  timeout "$(cap 200)" python3 -m flotilla.scripts.dev.bench_offline --model "$MODEL_ARG" --repeat 1 "$@" ${ARGS:-} \
    --json "$R/flotilla-$label.json" > "$R/flotilla-$label.log" 2>&1
  echo "exit $?"; tail -1 "$R/flotilla-$label.log" | cut -c1-400
}

if want a2a; then  # the MoE layer's token exchange alone, Qwen3-30B-A3B's shape, both ways
  for how in all_to_all allgather_reducescatter; do
    stage "bench_ep, world size 2, $how"
    timeout "$(cap 60)" python3 -m flotilla.scripts.dev.bench_ep --world-size 2 --experts 128 --top-k 8 --hidden 2048 \
      --tokens 1,16,64,256,1024 --all2all-backend $how ${EP_ARGS:-} --json "$R/ep-$how.json" > "$R/ep-$how.log" 2>&1
    echo "exit $?"; grep '"ep_all_to_all"' "$R/ep-$how.log" | cut -c1-260
  done
fi

want 1gpu && run 1gpu
want dp2ep2 && run dp2ep2 --data-parallel-size 2 --enable-expert-parallel
want tp2 && run tp2 --tensor-parallel-size 2
want dp2ep2g && run dp2ep2g --data-parallel-size 2 --enable-expert-parallel --all2all-backend allgather_reducescatter
if want dp2ep2gg; then  # the same with decode graphs
  if [ "$EP_GRAPHS_OK" = 1 ]; then run dp2ep2gg --data-parallel-size 2 --enable-expert-parallel \
    --all2all-backend allgather_reducescatter --ep-cuda-graphs
  else echo "dp2ep2gg skipped: tests/test_ep_graphs.py did not pass here"; fi
fi
if want tp2g; then
  if [ "$TP_GRAPHS_OK" = 1 ]; then run tp2g --tensor-parallel-size 2 --tp-cuda-graphs
  else echo "tp2g skipped: tests/test_tp_graphs.py did not pass here"; fi
fi

stage "summary"
python3 - "$R" <<'PY' | tee "$R/summary.txt"
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("flotilla-*.json")):
    r = json.loads(path.read_text())
    print(f"{path.stem.removeprefix('flotilla-'):>8}: nano {r.get('nano_workload_out_tok_per_s')} out tok/s, "
          f"batch-1 {r.get('b1_decode_tok_per_s')} tok/s, start {r.get('engine_start_s')} s, {r.get('attention')}")
PY
tar -czf "$OUT/moe-x2.tgz" -C "$OUT" moe-x2
# for the next run:  cat tc.* > .gpu-bundle/triton-cache.tar
[ -d ~/.triton ] && tar -czf - -C ~/.triton cache 2>/dev/null | split -b 15M - "$OUT/tc."
exit 0
