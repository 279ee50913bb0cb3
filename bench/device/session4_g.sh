#!/usr/bin/env bash
# Copy engine: one copy vs the same bytes in pieces (individual calls / one batch), both directions and one.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 120 python3 bench/nvlink_link.py --only-pieces 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/pieces.log" | tail -5
