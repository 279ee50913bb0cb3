#!/usr/bin/env bash
# Session 19 (2 H200), main: what an eager Buffer call costs against its transport call, and where rank 0's host
# time goes in cached dispatches + combines through the Buffer (bench/ep_buffer.py), 20 comm SMs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 240 python3 bench/ep_buffer.py --comm-sms 20 > "$OUT/ep_buffer_session19.log" 2>&1
echo "ep_buffer.py rc $?"; cp bench/results/ep_buffer.json "$OUT/" 2>/dev/null
grep -v "^ *$" "$OUT/ep_buffer_session19.log" | cut -c1-200 | head -150
