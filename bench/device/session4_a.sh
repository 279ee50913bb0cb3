#!/usr/bin/env bash
# Verify the GPU suite after last session's refactors; measure SM (ld/st, TMA) and copy-engine NVLink rates.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 bench/nvlink_link.py 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/nvlink_link.log" | tail -30
cp bench/results/nvlink_link.json "$OUT/" 2>/dev/null
timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -x --durations=15 2>&1 | tee "$OUT/pytest_gpu.log" | tail -30
