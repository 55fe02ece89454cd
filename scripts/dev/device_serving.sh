#!/usr/bin/env bash
# Serving curves on the GPU machine: `flotilla serve` on a built-in shape (random bf16 weights, no tokenizer: the
# prompts are token ids), then bench_serving at several Poisson request rates; with VLLM=1 (after the vLLM peer's
# install, scripts/dev/device_compare.sh) `vllm serve` on the same shape and the same requests. One PNG per model:
#   from the checkout root, with .gpu-bundle/ (and the vLLM peer's paths for VLLM=1):  bash scripts/dev/device_serving.sh
# `vllm serve` needs prometheus_fastapi_instrumentator, which the peer's bundle (make.sh) lacks: before the peer's
# install, `pip download --no-deps -d .vllm-peer/wheels/cli prometheus-fastapi-instrumentator==8.1.0
# prometheus-client==0.26.0` (its install.sh installs wheels/cli/*). Without it vLLM's API server dies at start.
# MODEL (default qwen3-8b), RATES (default 1,2,4,8,16,inf), PROMPTS per rate (default 200), INPUT_LEN / OUTPUT_LEN
# (default 1024 / 128), MODEL_DIR (a model folder instead of the shape; a CPU smoke run: NO_BUNDLE=1 MODEL_DIR=tiny
# DTYPE=float32 PROMPTS=4 RATES=inf INPUT_LEN=16 OUTPUT_LEN=8 VOCAB=300). Results in $OUT/serving.tgz: serve-flotilla.json, serve-vllm.json, serving-MODEL.png.
set -uo pipefail
[ -n "${NO_BUNDLE:-}" ] || source scripts/dev/device_env.sh   # NO_BUNDLE=1: a machine with flotilla installed (CPU smoke runs)
OUT=${OUT:-/tmp/flotilla-out}
R=$OUT/serving
mkdir -p "$R"
# triton's JIT cache from an earlier run (minutes of compiling on a bare machine): .gpu-bundle/triton-cache.tar
[ -f .gpu-bundle/triton-cache.tar ] && mkdir -p ~/.triton && tar -xzf .gpu-bundle/triton-cache.tar -C ~/.triton
M=${MODEL:-qwen3-8b}
DIR=${MODEL_DIR:-$(python3 -c "from flotilla.scripts.dev.bench_shapes import shape_dir; print(shape_dir('$M'))")}
BENCH=(python3 -m flotilla.scripts.dev.bench_serving --num-prompts "${PROMPTS:-200}" --input-len "${INPUT_LEN:-1024}"
       --output-len "${OUTPUT_LEN:-128}" --request-rate "${RATES:-1,2,4,8,16,inf}" --request-timeout 300 --vocab-size "${VOCAB:-10000}")

wait_ready() {  # until GET $1/health answers 200, at most 300 s
  python3 - "$1" <<'PY'
import sys, time, httpx
for _ in range(600):
    try:
        if httpx.get(sys.argv[1] + "/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(0.5)
sys.exit(1)
PY
}

run_engine() {  # label, port, command...
  local label=$1 port=$2; shift 2
  "$@" > "$R/server-$label.log" 2>&1 &
  local pid=$!
  if wait_ready "http://127.0.0.1:$port"; then
    timeout 420 "${BENCH[@]}" --base-url "http://127.0.0.1:$port" --json "$R/serve-$label.json" > "$R/bench-$label.log" 2>&1
    tail -12 "$R/bench-$label.log"
  else
    echo "$label did not become ready"; tail -20 "$R/server-$label.log"
  fi
  kill "$pid"; wait "$pid" 2>/dev/null
}

run_engine flotilla 8000 python3 -m flotilla serve "$DIR" --port 8000 --load-format dummy --skip-tokenizer-init \
  --dtype "${DTYPE:-bfloat16}" --max-model-len "${MAX_LEN:-4096}" --no-enable-prefix-caching
plots=("flotilla=$R/serve-flotilla.json")
vllm_serve() {  # vLLM's server in its own environment: only the peer's site, not flotilla's bundle, on its path
  # (with the bundle's flashinfer importable vLLM's warm-up calls flashinfer's autotune() with an argument flashinfer
  # 0.6.6 lacks and the engine core dies; the bench client still runs in flotilla's environment)
  exec env -u PYTHONPATH bash -c 'source /tmp/vp/env.sh && exec python3 -m vllm.entrypoints.cli.main serve "$@"' vllm "$@"
}
if [ "${VLLM:-0}" = 1 ] && [ -f /tmp/vp/env.sh ]; then
  run_engine vllm 8001 vllm_serve "$DIR" --port 8001 --load-format dummy --skip-tokenizer-init --dtype bfloat16 \
    --max-model-len "${MAX_LEN:-4096}" --no-enable-prefix-caching
  [ -f "$R/serve-vllm.json" ] && plots+=("vLLM 0.26.0=$R/serve-vllm.json")
fi
[ -f "$R/serve-flotilla.json" ] && python3 -m flotilla.scripts.dev.plot_serving "${plots[@]}" "$R/serving-$M.png"
tar -czf "$OUT/serving.tgz" -C "$OUT" serving
# for the next run:  cat tc.* > .gpu-bundle/triton-cache.tar
tar -czf - -C ~/.triton cache 2>/dev/null | split -b 15M - "$OUT/tc."
