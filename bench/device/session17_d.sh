#!/usr/bin/env bash
# Session 17 (2 H200), main with the started-together timing merged: the full EP benchmark (every transport, 8-32
# comm SMs, one call / 5 queued / started together), full output to the log, ep.json back under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=src
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout -s KILL 540 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 50 --chunks 4 --copy-shares 1.0 \
  > "$OUT/ep_full_session17.log" 2>&1
echo "rc $?"
cp bench/results/ep.json "$OUT/ep.json"
grep -v -i "warn\|symm_mem" "$OUT/ep_full_session17.log" | tail -40
