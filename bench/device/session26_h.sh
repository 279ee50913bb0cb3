#!/usr/bin/env bash
# Session 26 (2 H200), main with bench/device/session26_h.patch applied to the device copy (a measurement only: an FP8
# dispatch that leaves out its own rows, or the peers' rows; its results are wrong on purpose). At 20 SMs the pushed
# FP8 dispatch moves its peer rows at the rate plain 16-byte pushes reach from 20 programs (~13 GB/s per SM): if what
# bounds an SM is all its stores in flight, not only those into the peer, the dispatch without its own rows is faster
# (then: own rows written after the peers', or by other means); if not, it is not. ep.py at 20 and 22 SMs, skip 0 / 1
# / 2, both orders.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
patch -p1 --forward < bench/device/session26_h.patch > "$OUT/patch_session26_h.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session26_h.log"; exit 1; }
for order in "0 1 2" "2 1 0"; do
  tag=${order// /_}
  timeout -s KILL 120 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 22 --reps 50 \
    --copy-shares 1.0 --concurrent-sms --skip-rows $order > "$OUT/ep_skip_rows_${tag}_session26.log" 2>&1
  echo "ep $order rc $?"; grep -o "own rows skipped\|peer rows skipped\|P=[ 0-9]*: dispatch bf16\|queued: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*\|together: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*" \
    "$OUT/ep_skip_rows_${tag}_session26.log" | tr '\n' ' ' | sed 's/ P=/\nP=/g'; echo
  reap
done
