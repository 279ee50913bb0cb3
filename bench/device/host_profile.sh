#!/usr/bin/env bash
# Where the host time of an eager cached dispatch + combine goes (cProfile over 20 calls, rank 0's top 25 by own
# time), for the SM-push and the copy-engine NVLink transports at 20 SMs: the eager calls are host-bound
# (BENCHMARKS.md §2, host-time table: 180-400 us per call).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for transport in nvlink nvlink_copy_engine; do
  timeout 90 python3 bench/ep_profile.py --transport $transport --sms 20 --host-profile --out "$OUT/prof_$transport" \
    2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/host_profile_$transport.log"
  grep -A32 "Ordered by" "$OUT/host_profile_$transport.log" | head -34
  rm -f "$OUT"/prof_$transport/trace_*.json
done
