#!/usr/bin/env bash
# Session 21 (2 H200): eager Buffer calls queued back to back (DeepEP's way of timing: bench/ep_buffer.py's new
# *_queued columns, 10 calls between two events) on main, and on variants/nosync (measurement only: main whose
# NVLink status check skips the wait for the last call's kernels while they run), alternating, two rounds.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
reap() { pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1; }
for round in 1 2; do
  for v in main nosync; do
    src=src; [ $v = nosync ] && src=variants/nosync/src
    echo "=== round $round" >> "$OUT/ep_buffer_queued_${v}_session21.log"
    PYTHONPATH=$src timeout -s KILL 130 python3 bench/ep_buffer.py --comm-sms 20 \
      --backends nvlink nvlink_copy_engine copy_engine --profile-calls 10 --profile-top 12 > /tmp/ep_buffer_run.log 2>&1
    echo "$v round $round rc $?"; cat /tmp/ep_buffer_run.log >> "$OUT/ep_buffer_queued_${v}_session21.log"
    cp bench/results/ep_buffer.json "$OUT/ep_buffer_queued_${v}_r${round}_session21.json"
    grep " P=20: " /tmp/ep_buffer_run.log | cut -c1-900; reap
  done
done
