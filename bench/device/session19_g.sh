#!/usr/bin/env bash
# Session 19 (2 H200), main after the header-stream merge against main before it (variants/before): eager Buffer
# calls one at a time (bench/ep_buffer.py, nvlink and nvlink_copy_engine, 20 SMs), alternating, two rounds each:
# did waiting for an event instead of the stream and the header stream change a call's time?
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for round in 1 2; do
  for v in before after; do
    src=src; [ $v = before ] && src=variants/before/src
    PYTHONPATH=$src timeout -s KILL 90 python3 bench/ep_buffer.py --comm-sms 20 --backends nvlink nvlink_copy_engine \
      --profile-top 10 > "$OUT/ep_buffer_g_${v}_${round}_session19.log" 2>&1
    echo "$v round $round rc $?"; grep " P=20: " "$OUT/ep_buffer_g_${v}_${round}_session19.log" | cut -c1-420
    pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; sleep 1
  done
done
