#!/usr/bin/env bash
# Final: the whole GPU suite, then the EP benchmark (nvlink, nvlink + copy engines, copy-engine transport).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -8
timeout 230 python3 bench/ep.py --comm-sms 8 16 20 24 32 --reps 20 --chunks 4 --copy-shares 1.0 0.7 2>&1 | grep -v -i warn | grep -v symm_mem | tee "$OUT/ep.log" | tail -50
cp bench/results/ep.json "$OUT/ep.json" 2>/dev/null
