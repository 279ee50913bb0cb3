#!/usr/bin/env bash
# Session 28: the full run (session28_b.sh) measured the nvlink_copy_engine concurrent GEMM's slowdown at +5.9%
# (rounds +5.9, +5.9, -0.7, +6.0) against session 26's +3.2%, after session 28's reset stream was merged. Main against
# main without the reset stream (session28_reset_beside_revert.patch), alternating, 6 rounds each, the concurrent
# measurement only for nvlink_copy_engine (plus its 20-SM graph figures).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P=bench/device/session28_reset_beside_revert.patch
for state in main revert main revert main revert; do
  if [ $state = revert ]; then patch -s -p1 < $P; fi
  log="$OUT/ep_concurrent_${state}_$SECONDS.log"
  timeout -s KILL 100 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 --reps 20 --copy-shares 1.0 \
    --concurrent-sms 20 --concurrent-rounds 6 > "$log" 2>&1
  echo "$state rc $? $(grep -o 'together: .*' "$log" | grep -o 'dispatch_bf16 [0-9.]*\|combine [0-9.]*' | tr '\n' ' ')"
  grep "concurrent" "$log" | grep -o "GEMM full.*"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
  if [ $state = revert ]; then patch -s -R -p1 < $P; fi
done
