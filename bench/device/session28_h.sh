#!/usr/bin/env bash
# Session 28 (2 H200): why the pushed FP8 dispatch gets slower with more SMs (BENCHMARKS.md §2: ~9.0 us a round of
# 16-token steps at 20 SMs, 15.9 at 32; 126-136 us at 32 SMs against 114-117 at 20). Session 26's measurement-only
# patch rebased (session28_h.patch: an FP8 dispatch that leaves out its own rows, 1, or the peers' rows, 2; results
# wrong on purpose) at 20 and 32 SMs: if leaving out the peer rows takes most of the 32-SM time away, many programs
# storing into the peer at once are what slows each one.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
patch -p1 --forward < bench/device/session28_h.patch > "$OUT/patch_session28_h.log" 2>&1 || { echo "patch failed"; cat "$OUT/patch_session28_h.log"; exit 1; }
timeout -s KILL 200 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 32 --reps 30 \
  --copy-shares 1.0 --concurrent-sms --skip-rows 0 2 1 > "$OUT/ep_skip_rows_session28.log" 2>&1
echo "ep rc $?"
grep -o "own rows skipped\|peer rows skipped\|P=[ 0-9]*: dispatch bf16\|together: dispatch_bf16 [0-9.]*, dispatch_fp8 [0-9.]*" \
  "$OUT/ep_skip_rows_session28.log" | tr '\n' ' ' | sed 's/ P=/\nP=/g'; echo
