#!/usr/bin/env bash
# sm_split with the TMA copy (second run), MoE overlap with the device transports.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 bench/sm_split.py --copy-method tma 2>&1 | tee "$OUT/sm_split_tma_run2.log" | grep -E "green|grid|wrote" | tail -12
cp bench/results/sm_split_tma.json "$OUT/sm_split_tma_run2.json" 2>/dev/null
timeout 300 python3 bench/moe_overlap.py --transports nvlink copy_engine --comm-sms 16 24 --iters 3 2>&1 | tee "$OUT/moe_overlap_device.log" | grep -v -i warn | grep -v symm_mem | tail -15
cp bench/results/moe_overlap.json "$OUT/moe_overlap_device_transports.json" 2>/dev/null
