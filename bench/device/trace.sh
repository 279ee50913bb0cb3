#!/usr/bin/env bash
# Device call (1 GPU): sm_split again (its traced round) and `smsplit trace`.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 bench/sm_split.py > "$OUT/sm_split.log" 2>&1; tail -13 "$OUT/sm_split.log"
timeout 60 python3 -m smsplit trace --out /tmp/trace > "$OUT/trace.log" 2>&1; tail -2 "$OUT/trace.log"
tar czf "$OUT/results.tgz" bench/results/sm_split.json bench/figures/sm_split_* -C /tmp trace 2>/dev/null
