#!/usr/bin/env bash
# The GPU suite (`pytest -m gpu`, every file) on the GPU machine, as many shards as fit in one device call: the
# bundle set up as the other device scripts do it, then gpu_suite.py with its state in .gpu-suite. Each call runs
# the shards still to run; repeat it until the summary says none are left (a call after that begins a new run).
#   device run, carry [".gpu-bundle", ".gpu-suite"], timeout_s 600:  bash scripts/dev/gpu_suite.sh [gpu_suite.py options]
#   then, here:  mkdir -p .gpu-suite && cp FILES_AT/* .gpu-suite/   (summary.md, suite.json, suite.log, jit-*.tgz.NN)
# BUDGET: the seconds this command may take in all (default 570, within the device's 600); gpu_suite.py gets what
# is left of it after the bundle's setup.
set -uo pipefail
T0=$(date +%s)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/dev/device_env.sh
mkdir -p .gpu-suite
python3 -m flotilla.scripts.dev.gpu_suite --cache-dir .gpu-suite --out "${OUT:-/tmp/gpu-suite-out}" \
  --budget-s $(( ${BUDGET:-570} - ($(date +%s) - T0) )) "$@"
