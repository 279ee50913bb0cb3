#!/usr/bin/env bash
# Next session (2 H200), wip/store-width: SM pushes into the peer with 8-byte against 16-byte stores (the pushed FP8
# dispatch stores 8-byte halves), with and without this rank's own copy, 20 and 24 programs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PYTHONPATH=src timeout -s KILL 120 python3 bench/nvlink_store_width.py --programs 20 24 > "$OUT/nvlink_store_width_session24.log" 2>&1
echo "rc $?"; grep -E "^P=|Error" "$OUT/nvlink_store_width_session24.log"
cp bench/results/nvlink_store_width.json "$OUT/" 2>/dev/null
pkill -9 -f "multiprocessing[.]spawn" 2>/dev/null; true
