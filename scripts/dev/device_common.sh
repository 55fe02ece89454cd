# What the staged GPU-machine scripts (device_pd.sh, device_moe_x2.sh, device_wide_ep.sh) share; each sources it
# after setting RESULTS (its results folder under $OUT) and, if it needs more than 20 s to pack them, PACK_S.
# Sets T0, BUDGET (default 560 s), OUT, R (= $OUT/$RESULTS, created); defines stage (a timestamped heading) and cap.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s)
BUDGET=${BUDGET:-560}
[ -n "${NO_BUNDLE:-}" ] || source scripts/dev/device_env.sh   # NO_BUNDLE=1: a machine with flotilla installed (CPU smoke runs)
OUT=${OUT:-/tmp/flotilla-out}
R=$OUT/$RESULTS
mkdir -p "$R"

stage() { echo "== +$(( $(date +%s) - T0 ))s $*"; }
cap() {  # the smaller of $1 and what is left of the budget (less PACK_S to pack the results), at least 1
  local left=$(( BUDGET - ($(date +%s) - T0) - ${PACK_S:-20} ))
  [ "$left" -lt "$1" ] && echo $(( left > 1 ? left : 1 )) || echo "$1"
}
