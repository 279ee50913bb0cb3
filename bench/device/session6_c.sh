#!/usr/bin/env bash
# Session 6, run C: the combine's copy chunks with a small first chunk (the sum starts when the first chunk lands),
# 20 SMs, replayed; dispatch copy share 1.0.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 300 python3 bench/ep.py --comm-sms 20 --reps 20 --transports nvlink_copy_engine --copy-shares 1.0 \
  --combine-chunks 0.4,0.7,0.9,1 0.1,0.4,0.7,0.9,1 0.15,0.45,0.75,1 0.05,0.25,0.5,0.75,0.9,1 0.1,0.3,0.55,0.8,1 \
  --concurrent-sms 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -9
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
