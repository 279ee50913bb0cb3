#!/usr/bin/env bash
# First call of the session on 2 GPUs: the whole GPU test suite, then the copy-engine probe.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 bench/copy_engine.py 2>&1 | tee "$OUT/copy_engine.log" | tail -30
timeout 330 python3 -m pytest -q -m gpu -x -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
cp bench/results/copy_engine.json "$OUT/" 2>/dev/null
