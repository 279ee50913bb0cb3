#!/usr/bin/env bash
# Session 27 (2 H200), measurement: what the copy stream's start costs, by part (tree: session27_unfenced_reset.patch
# plus an env switch): SMSPLIT_COPY_START=main (wait for the peer's word, then reset it with a fenced write),
# nofence (the reset without the memory fence: CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER), waitonly, none (unsafe;
# every timed call here starts after a barrier). 20 SMs, alternating, twice each.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for v in main nofence waitonly none nofence main none waitonly; do
  log="$OUT/ep_copy_start_${v}_$SECONDS.log"
  SMSPLIT_COPY_START=$v timeout -s KILL 120 python3 bench/ep.py --transports nvlink_copy_engine --comm-sms 20 \
    --reps 30 --copy-shares 1.0 --concurrent-sms > "$log" 2>&1
  echo "$v rc $? $(grep -o 'together: .*' "$log" | grep -o 'dispatch_bf16 [0-9.]*\|combine [0-9.]*' | tr '\n' ' ')"
  pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
done
