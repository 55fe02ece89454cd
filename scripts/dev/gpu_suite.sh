#!/usr/bin/env bash
# The GPU suite (`pytest -m gpu`, every file) on the GPU machine, as many shards as fit in BUDGET seconds: the
# bundle set up as the other device scripts do it, then gpu_suite.py with its state in .gpu-suite. Each run runs
# the shards still to run; repeat it until the summary says none are left (a run after that begins a new run).
#   on the GPU machine, from a checkout with .gpu-bundle, .gpu-suite and (optional, see device_env.sh) .gpu-extra:
#                bash scripts/dev/gpu_suite.sh [gpu_suite.py options]
#   then, in your checkout: copy what it wrote to $OUT (summary.md, suite.json, suite.log, jit-*.txz.NN) into
#                .gpu-suite, and  python3 -m flotilla.scripts.dev.gpu_suite --prune   (drops the archives suite.json no
#                longer names, so that .gpu-suite keeps the current caches only). The machine's own .gpu-suite is
#                kept up to date as well: a next run there goes on from it if it is not replaced by a carried one.
# The bundle carries what every test module imports beyond the image: build it with
#   EXTRA_WHEELS="openai==2.54.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
#     distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 typing-extensions==4.16.0 redis==8.1.0 xgrammar==0.2.9 pillow==11.3.0" \
#     bash ../shared/gpu/make-bundle.sh
# (openai 2.x: its 3.x client needs httpx2, httpcore2 and truststore, which the image lacks; the image has httpx,
# httpcore, h11, anyio, idna, certifi and tqdm. No GPU test needs a redis-server.) Without them the tests that use
# them skip, saying so.
# BUDGET: the seconds this command may take in all (default 580); gpu_suite.py gets what
# is left of it after the bundle's setup.
set -uo pipefail
T0=$(date +%s)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
source scripts/dev/device_env.sh
mkdir -p .gpu-suite
python3 -m flotilla.scripts.dev.gpu_suite --cache-dir .gpu-suite --out "${OUT:-/tmp/gpu-suite-out}" \
  --budget-s $(( ${BUDGET:-580} - ($(date +%s) - T0) )) "$@"
