#!/usr/bin/env bash
# Prefill-decode disaggregation on a machine with two GPUs, in stages:
#   1. the two-GPU tests of the torch_dist KV backend (NCCL), of the KV-migration actors and of TP=2 decode graphs;
#   2. KV migration bandwidth cuda:0 -> cuda:1 at Qwen3-8B's KV shape (scripts/dev/bench_migration.py: the actors'
#      path, the engine's send/recv, raw NCCL and a plain peer copy);
#   3. serving on the Qwen3-8B shape (random weights, token-id prompts): 1P1D (`--engines prefill,decode`,
#      torch_dist KV over NCCL; the fleet gives engine k GPU k) against two colocated engines (`--engines both,both`,
#      the router balancing them), the same bench_serving requests and rates against each.
#   from the checkout root, with .gpu-bundle/:  bash scripts/dev/device_pd.sh
#   afterwards: tar -xzf pd.tgz; for the next run: cat tc.* > .gpu-bundle/triton-cache.tar
#   and cat fic.* > .gpu-bundle/flashinfer-cache.tar (setup.sh restores both)
# Every stage runs under its own timeout, each capped by what is left of BUDGET (default 560 s) so the script ends
# within it and still packs its results. Adjust with: MODEL (default qwen3-8b), MODEL_DIR (a model folder instead),
# RATES (default 2,4), PROMPTS per rate (48), INPUT_LEN / OUTPUT_LEN / RANGE (3072 / 96 / 0.33: prompts of
# 2058-4086 tokens, outputs of 64-128), MAX_LEN (4608), MIG_ARGS (bench_migration's flags; default
# "--round-blocks 64,256 --poll-caps 0.0001"), SERVE_ARGS (extra `flotilla serve` flags for both setups), STAGES (default
# "tests migration pd dp"), READY_S (how long a server may take to start, 240), KV_BACKEND (torch_dist; cuda_ipc for
# two engines on one GPU), PD_ARGS (flags of the 1P1D server only, e.g. "--gpu-memory-utilization 0.45" when both
# engines share a GPU), DP_ENGINES (the colocated setup's engines, default both,both; "both" on one GPU),
# BENCH_ARGS (bench_serving flags replacing the random workload's, e.g. the mixed dataset's).
# CPU smoke run at toy size (no GPU; gloo instead of NCCL), on a tiny random model written first with
#   python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from helpers_engine import \
#     write_tiny_engine_model as w; w(Path('/tmp/tiny'))"
#   NO_BUNDLE=1 MODEL_DIR=/tmp/tiny DTYPE=float32 PROMPTS=4 RATES=inf INPUT_LEN=24 OUTPUT_LEN=8 VOCAB=300 MAX_LEN=128 \
#     MIG_ARGS="--device cpu --layers 2 --blocks 64 --poll-caps 0.0001" SERVE_ARGS="--block-size 4 --kv-cache-blocks 160" \
#     bash scripts/dev/device_pd.sh
# Results in $OUT/pd.tgz: gpu-tests.log, migration.{json,log}, serve-{pd,dp}.json, bench-*.log, server-*.log,
# metrics-*.txt (the servers' /metrics after the run: KV bytes migrated, requests routed per engine).
set -uo pipefail
RESULTS=pd
PACK_S=25
source scripts/dev/device_common.sh
STAGES=${STAGES:-tests migration pd dp}

want() { [[ " $STAGES " == *" $1 "* ]]; }

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader \
  && nvidia-smi topo -m > "$R/topo.txt" 2>&1
M=${MODEL:-qwen3-8b}
DIR=${MODEL_DIR:-$(python3 -c "from flotilla.scripts.dev.bench_shapes import shape_dir; print(shape_dir('$M'))")}

if want tests; then
  stage "two-GPU tests"
  timeout "$(cap 150)" python3 -m pytest -m gpu tests/test_kv_transfer_torch.py tests/test_kv_migration.py \
    tests/test_tp_graphs.py -k "two_gpus or nccl or tp2" -v -p no:cacheprovider > "$R/gpu-tests.log" 2>&1
  echo "exit $?"; grep -E "PASSED|SKIPPED|FAILED|ERROR|passed|failed" "$R/gpu-tests.log" | tail -8
fi

if want migration; then
  stage "KV migration bandwidth"
  # shellcheck disable=SC2086
  timeout "$(cap 150)" python3 -m flotilla.scripts.dev.bench_migration ${MIG_ARGS:---round-blocks 64,256 --poll-caps 0.0001} \
    --json "$R/migration.json" > "$R/migration.log" 2>&1
  echo "exit $?"; tail -12 "$R/migration.log"
fi

wait_ready() {  # until GET $1/health answers 200, at most $2 s, and only while process $3 (the server) lives
  python3 - "$1" "$2" "$3" <<'PY'
import os, sys, time, httpx
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    try:
        if httpx.get(sys.argv[1] + "/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    try:
        os.kill(int(sys.argv[3]), 0)
    except ProcessLookupError:
        sys.exit(1)  # the server exited: it will not become ready
    time.sleep(0.5)
sys.exit(1)
PY
}

save_metrics() {  # $1 base URL, $2 file
  python3 - "$1" "$2" <<'PY'
import sys, httpx
try:
    text = httpx.get(sys.argv[1] + "/metrics", timeout=10).text
except httpx.HTTPError as e:
    text = f"# /metrics failed: {e}\n"
open(sys.argv[2], "w").write(text)
print("".join(l + "\n" for l in text.splitlines()
              if l.startswith(("flotilla_kv_migration_bytes_total", "flotilla_engine_requests_routed_total"))), end="")
PY
}

# shellcheck disable=SC2206
BENCH=(python3 -m flotilla.scripts.dev.bench_serving ${BENCH_ARGS:---input-len "${INPUT_LEN:-3072}" --output-len \
       "${OUTPUT_LEN:-96}" --range-ratio "${RANGE:-0.33}"} --vocab-size "${VOCAB:-10000}" --request-timeout 120)

serve() {  # label, port, engines, extra flags: start `flotilla serve`, warm it up, benchmark it, stop it
  local label=$1 port=$2 engines=$3 extra=${4:-} url="http://127.0.0.1:$2" pid
  stage "serving $label (--engines $engines)"
  # shellcheck disable=SC2086
  setsid timeout "$(cap 900)" python3 -m flotilla serve "$DIR" --port "$port" --engines "$engines" \
    --kv-transfer-backend "${KV_BACKEND:-torch_dist}" --load-format dummy --skip-tokenizer-init \
    --dtype "${DTYPE:-bfloat16}" --max-model-len "${MAX_LEN:-4608}" --no-enable-prefix-caching ${SERVE_ARGS:-} $extra \
    > "$R/server-$label.log" 2>&1 &
  pid=$!
  if wait_ready "$url" "$(cap "${READY_S:-240}")" "$pid"; then
    stage "$label ready"
    grep -E "registered|ready:" "$R/server-$label.log" | cut -c1-300
    # a short burst first: kernels that compile on their first use do not land in the measured TTFTs
    timeout "$(cap 60)" "${BENCH[@]}" --base-url "$url" --num-prompts 4 --request-rate inf --output-len 8 \
      --seed 1 > "$R/warm-$label.log" 2>&1
    timeout "$(cap 240)" "${BENCH[@]}" --base-url "$url" --num-prompts "${PROMPTS:-48}" \
      --request-rate "${RATES:-2,4}" --json "$R/serve-$label.json" > "$R/bench-$label.log" 2>&1
    echo "bench exit $?"; tail -8 "$R/bench-$label.log"
    save_metrics "$url" "$R/metrics-$label.txt"
  else
    echo "$label did not become ready"; tail -25 "$R/server-$label.log"
  fi
  kill -TERM "$pid" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL -- "-$pid" 2>/dev/null  # the process group setsid made: anything left of this server
  wait "$pid" 2>/dev/null
  grep -E "Traceback|ERROR|failed" "$R/server-$label.log" | head -5
}

want pd && serve pd 8000 prefill,decode "${PD_ARGS:-}"
want dp && serve dp 8001 "${DP_ENGINES:-both,both}"
if [ -f "$R/serve-pd.json" ] && [ -f "$R/serve-dp.json" ]; then
  python3 - "$R/serve-pd.json" "$R/serve-dp.json" <<'PY'
import json, sys
for label, path in zip(("1P1D", "2 x colocated"), sys.argv[1:]):
    for r in json.load(open(path))["results"]:
        print(f"{label:>14} rate {r['request_rate']}: " + ", ".join(
            f"{k} {r[k]:.1f}" if isinstance(r.get(k), float) else f"{k} {r.get(k)}"
            for k in ("completed", "failed", "mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                      "output_throughput")))
PY
fi

stage "packing"
tar -czf "$OUT/pd.tgz" -C "$OUT" pd && rm -rf "$R"
[ -d ~/.triton/cache ] && tar -czf - -C ~/.triton cache | split -b 15M - "$OUT/tc."
[ -d ~/.cache/flashinfer ] && tar -czf - -C ~/.cache flashinfer | split -b 15M - "$OUT/fic."
ls -la "$OUT"
stage done
