#!/usr/bin/env bash
# Wide expert parallelism on 4 or 8 GPUs, in stages:
#   1. the expert all-to-all of one DeepSeek-V3 MoE layer at world size GPUS (scripts/dev/bench_ep.py: dispatch and
#      combine over NCCL, per layer, at several tokens per rank; deep_ep is not built, so NCCL it is), and the same
#      layer's all-gather / reduce-scatter (--all2all-backend allgather_reducescatter);
#   2. a DeepSeek-V3-shaped model (FP8 random weights, all 256 routed experts, LAYERS layers) through bench_offline's
#      fixed workload (REQUESTS prompts of 2,000 tokens, 256 output tokens each, all at once): decode tok/s per GPU
#      and the experts' and ranks' load imbalance, at DP=GPUS x EP (attention data-parallel, experts split) and at
#      TP=GPUS on the same GPUs; then DP x EP again with allgather_reducescatter (stage dpep-gather), if time is left.
#   on a machine with 8 GPUs (or 4, GPUS=4), from the checkout root, with .gpu-bundle/:  bash scripts/dev/device_wide_ep.sh
#   afterwards: tar -xzf wide-ep.tgz
# Every stage runs under its own timeout, capped by what is left of BUDGET (default 560 s). Adjust with: GPUS
# (default: as many as nvidia-smi lists), LAYERS (default 5 per GPU: with EP each GPU holds 1/GPUS of each layer's
# 11 GB of FP8 experts), REQUESTS (default 128 per GPU), FIXED_IN / FIXED_OUT (2000 / 256), EP_TOKENS (bench_ep's
# tokens per rank, "16,64,256"), STAGES (default "a2a dpep tp dpep-gather"), MODEL_DIR (a folder instead of the shape), ARGS
# (extra bench_offline flags for both setups), EP_ARGS (extra bench_ep flags).
# CPU smoke run (gloo, no GPU), on a tiny MoE written first with
#   python3 -c "import sys; sys.path.insert(0, 'tests'); from helpers_tiny_models import write_tiny_moe_model as w; \
#     w('/tmp/tinymoe')"
#   NO_BUNDLE=1 GPUS=2 MODEL_DIR=/tmp/tinymoe REQUESTS=6 FIXED_IN=20 FIXED_OUT=6 EP_TOKENS=0,4 \
#     EP_ARGS="--device cpu --experts 8 --top-k 2 --hidden 32 --dtype float32 --iters 3" \
#     ARGS="--device cpu --dtype float32 --vocab 200 --kv-cache-blocks 200 --skip-tokenizer-init" bash scripts/dev/device_wide_ep.sh
# Results in $OUT/wide-ep.tgz: ep-<backend>.json / .log, flotilla-dpep.json, flotilla-dpep-gather.json, flotilla-tp.json and their logs, summary.txt.
set -uo pipefail
RESULTS=wide-ep
source scripts/dev/device_common.sh
STAGES=${STAGES:-a2a dpep tp dpep-gather}
GPUS=${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)}
[ "$GPUS" -ge 2 ] 2>/dev/null || { echo "GPUS=$GPUS: wide EP needs at least two"; exit 1; }
LAYERS=${LAYERS:-$(( 5 * GPUS ))}
MODEL_ARG=${MODEL_DIR:-deepseek-v3-${LAYERS}l}   # bench_offline takes a built-in shape's name or a folder
REQUESTS=${REQUESTS:-$(( 128 * GPUS ))}

want() { [[ " $STAGES " == *" $1 "* ]]; }
command -v nvidia-smi > /dev/null && nvidia-smi topo -m > "$R/topo.txt" 2>&1

if want a2a; then
  stage "expert all-to-all, world size $GPUS"
  # shellcheck disable=SC2086
  for how in all_to_all allgather_reducescatter; do
    # shellcheck disable=SC2086
    timeout "$(cap 90)" python3 -m flotilla.scripts.dev.bench_ep --world-size "$GPUS" --tokens "${EP_TOKENS:-16,64,256}" \
      --all2all-backend $how ${EP_ARGS:-} --json "$R/ep-$how.json" > "$R/ep-$how.log" 2>&1
    echo "$how: exit $?"; grep '"ep_all_to_all"' "$R/ep-$how.log" | cut -c1-300
  done
fi

run() {  # label, extra bench_offline flags...
  local label=$1; shift
  stage "$label: $MODEL_ARG, $REQUESTS x ${FIXED_IN:-2000} in / ${FIXED_OUT:-256} out, $*"
  # shellcheck disable=SC2086
  timeout "$(cap 260)" python3 -m flotilla.scripts.dev.bench_offline --model "$MODEL_ARG" --workload fixed \
    --num-requests "$REQUESTS" --fixed-in "${FIXED_IN:-2000}" --fixed-out "${FIXED_OUT:-256}" "$@" ${ARGS:-} \
    --json "$R/flotilla-$label.json" > "$R/flotilla-$label.log" 2>&1
  echo "exit $?"; tail -1 "$R/flotilla-$label.log" | cut -c1-500
}

want dpep && run dpep --data-parallel-size "$GPUS" --enable-expert-parallel
want tp && run tp --tensor-parallel-size "$GPUS"
want dpep-gather && run dpep-gather --data-parallel-size "$GPUS" --enable-expert-parallel \
  --all2all-backend allgather_reducescatter

stage "summary"
python3 - "$R" <<'PY' | tee "$R/summary.txt"
import json, pathlib, sys
r = pathlib.Path(sys.argv[1])
for path in sorted(r.glob("flotilla-*.json")):
    d = json.loads(path.read_text())
    print(f"{path.stem.removeprefix('flotilla-'):>5}: {d.get('gpus')} GPUs, decode {d.get('fixed_decode_tok_per_s')} tok/s "
          f"({d.get('fixed_decode_tok_per_s_per_gpu')} per GPU), all {d.get('fixed_out_tok_per_s')} out tok/s, "
          f"prefill {d.get('fixed_prefill_s')} s of {d.get('fixed_s')} s; expert imbalance "
          f"{d.get('expert_imbalance_mean')} (worst layer {d.get('expert_imbalance_max')}), rank imbalance "
          f"{d.get('rank_imbalance_mean')}")
for path in sorted(r.glob("ep-*.json")):
    for rec in json.loads(path.read_text()):
        if rec.get("bench") == "ep_all_to_all":
            print(f"{rec['all2all_backend']}, {rec['tokens_per_rank']} tokens per rank: {rec['layer_ms']} ms per layer "
                  f"(dispatch {rec['dispatch_ms']}, combine {rec['combine_ms']}), {rec['gbps']} GB/s")
PY
tar -czf "$OUT/wide-ep.tgz" -C "$OUT" wide-ep
exit 0
