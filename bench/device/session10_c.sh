#!/usr/bin/env bash
# Session 10: the eager host profile again, sorted by cumulative time (60 functions), both NVLink transports, 20 SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for transport in nvlink nvlink_copy_engine; do
  timeout 90 python3 bench/ep_profile.py --transport $transport --sms 20 --host-profile --host-sort cumulative \
    --host-lines 60 --out "$OUT/prof_$transport" 2>&1 | grep -v -i "warn\|symm_mem" > "$OUT/host_cumulative_$transport.log"
  rm -f "$OUT"/prof_$transport/trace_*.json
done
