#!/usr/bin/env bash
# Where the time of a dispatch + combine goes: nvlink vs nvlink with copy-engine bulk (torch profiler timelines).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for t in nvlink nvlink_copy_engine; do
  timeout 120 python3 bench/ep_profile.py --transport $t --sms 20 --out "$OUT/prof" 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/profile_$t.log" | tail -40
done
rm -f "$OUT"/prof/trace_*.json
